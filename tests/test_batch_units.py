"""hybridinfer.serving.batch without a model: input lines, output records and their resumption, the prefix order,
shards."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("pydantic")

from hybridinfer.serving.batch.guard import BatchOutputError  # noqa: E402
from hybridinfer.serving.batch.jobfile import (  # noqa: E402
    LineError,
    line_error_record,
    line_number,
    ok_record,
    parse_shard,
    read_line,
    shard_key,
    shard_of,
)
from hybridinfer.serving.batch.order import shared_prefix_tokens, trie_order, windows  # noqa: E402
from hybridinfer.serving.batch.output import Done, Output, scan, sort_records  # noqa: E402


def test_protocol_imports_no_http_and_no_batch():
    code = ("import sys, hybridinfer.serving.protocol.openai, hybridinfer.serving.protocol.anthropic, "
            "hybridinfer.serving.protocol.grammar; "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('fastapi', 'starlette', 'uvicorn') "
            "or m.startswith(('hybridinfer.serving.serve', 'hybridinfer.serving.batch'))]; print(bad)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
    code = ("import sys, hybridinfer.serving.batch, hybridinfer.cli.batch; "
            "print([m for m in sys.modules if m.startswith('hybridinfer.serving.serve') "
            "or m.split('.')[0] == 'fastapi'])")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"


@pytest.mark.parametrize("raw, code", [
    (b"not json", "invalid_json"), (b"[1, 2]", "invalid_request"), (b'{"prompt": "x"}', "missing_custom_id"),
    (b'{"custom_id": 5, "prompt": "x"}', "missing_custom_id"),
    (b'{"custom_id": "a", "method": "GET", "url": "/v1/completions", "body": {}}', "invalid_method"),
    (b'{"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {}}', "invalid_url"),
    (b'{"custom_id": "a", "temperature": 0}', "invalid_request"),
    (b'{"custom_id": "a", "prompt": "x", "messages": []}', "invalid_request"),
])
def test_bad_lines(raw, code):
    with pytest.raises(LineError) as e:
        read_line(7, raw, "m")
    assert e.value.code == code and "line 7" in e.value.message
    rec = line_error_record(7, e.value)
    assert rec["response"] is None and rec["error"]["code"] == code and line_number(rec) == 7


def test_plain_and_batch_forms():
    line = read_line(1, b'{"custom_id": "a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}', "m")
    assert line.url == "/v1/chat/completions" and line.body["model"] == "m" and "custom_id" not in line.body
    line = read_line(2, b'{"custom_id": "b", "prompt": "x", "model": "other"}', "m")
    assert line.url == "/v1/completions" and line.body["model"] == "other"
    line = read_line(3, b'{"custom_id": "c", "method": "POST", "url": "/v1/messages", "body": {"a": 1}}', "m")
    assert (line.url, line.body, line.custom_id) == ("/v1/messages", {"a": 1}, "c")


def test_shards_partition_the_input():
    lines = [(n, json.dumps({"custom_id": f"req-{n}", "prompt": "x"}).encode()) for n in range(1, 400)]
    lines += [(400, b"not json"), (401, b'{"custom_id": "req-7", "prompt": "dup"}')]
    for n in (1, 2, 3, 4, 7, 16, 64):
        owner = {num: [i for i in range(n) if shard_of(shard_key(num, raw), n) == i] for num, raw in lines}
        assert all(len(v) == 1 for v in owner.values()), n  # every line in exactly one shard
        assert owner[401] == owner[7]  # a duplicate custom_id lands where the first is, so it is found there
        if n > 1:
            sizes = [sum(1 for v in owner.values() if v == [i]) for i in range(n)]
            assert min(sizes) > 0
    assert shard_of("id:x", 5) == shard_of("id:x", 5)  # stable: no per-process hash seed
    assert parse_shard("2/4") == (2, 4)
    for bad in ("4/4", "-1/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError):
            parse_shard(bad)


def test_trie_order_groups_shared_prefixes():
    sys_a, sys_b = list(range(100, 140)), list(range(200, 240))
    keys = [sys_a + [1, 2], sys_b + [5], sys_a + [3], [7, 8], sys_b + [4, 4], sys_a + [1, 3]]
    order = trie_order(keys)
    grouped = [keys[i] for i in order]
    assert [k[:40] == sys_a for k in grouped].count(True) == 3
    firsts = [k[0] for k in grouped]
    assert firsts == sorted(firsts)  # each prefix's prompts are contiguous
    assert shared_prefix_tokens(grouped) >= 2 * 40 + 40 + 1
    assert shared_prefix_tokens(grouped) > shared_prefix_tokens(keys)
    assert list(windows(range(5), 2)) == [[0, 1], [2, 3], [4]]


def test_done_lines_keep_their_custom_id():
    s = Done()
    for n, cid in ((1, "a"), (9, None), (1_000_000, "z"), (9, None)):
        s.add(n, cid)
    assert len(s) == 3 and 9 in s and 1_000_000 in s and 8 not in s and 2_000_000 not in s and -1 not in s
    assert s.matches(1, "a") and not s.matches(1, "b") and not s.matches(1, None)
    assert s.matches(9, None) and not s.matches(9, "a") and not s.matches(8, None)


def _rec(n):
    return ok_record(n, f"c{n}", {"x": n})


def test_output_resumes_and_truncates_a_torn_line(tmp_path):
    p = str(tmp_path / "out.jsonl")
    out = Output(p, sync_every=2)
    for n in (3, 1, 2):
        out.write(_rec(n))
    out.close()
    whole = open(p, "rb").read()
    with open(p, "ab") as f:
        f.write(b'{"id":"batch_req_4","custom_id":"c4","resp')  # killed mid-line
    out = Output(p)
    assert out.torn_bytes > 0 and open(p, "rb").read() == whole
    assert {1, 2, 3} == {n for n in range(10) if n in out.done} and out.done_before == 3
    out.write(_rec(4))
    out.close()
    assert [line_number(json.loads(x)) for x in open(p, "rb")] == [3, 1, 2, 4]
    sort_records(p)
    assert [line_number(json.loads(x)) for x in open(p, "rb")] == [1, 2, 3, 4]
    # a whole line that is no record, at the end (a power cut's garbage): torn too
    with open(p, "ab") as f:
        f.write(b"\x00\x00\x00\n")
    done, good, torn = scan(p)
    assert len(done) == 4 and torn == 4


def test_output_refuses_a_foreign_file(tmp_path):
    p = tmp_path / "notes.jsonl"
    p.write_bytes(b'{"hello": 1}\n' + json.dumps(_rec(1)).encode() + b"\n")
    with pytest.raises(BatchOutputError, match="not the output of a batch job"):
        Output(str(p))
