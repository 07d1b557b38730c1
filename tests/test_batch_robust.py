"""A batch job with SmolLM2 never loses, doubles or hangs: another file named as its output is refused untouched, an
edited input or another job's output is refused, a failed write stops the job naming the line (never a hang), a
custom_id UTF-8 cannot carry is answered and read back, a line over the length limit is an error line, and any
request that fails on its own (at submit, in generation, in making its body) is its error line while the job goes
on. Every job runs in a thread joined with a timeout, so a hang fails the test instead of stalling the suite."""

from __future__ import annotations

import json
import threading

import pytest
from batch_records import FullDisk, records, write_job

pytest.importorskip("pydantic")

from hybridinfer.engine.api import Engine  # noqa: E402
from hybridinfer.engine.scheduler import Handle  # noqa: E402
from hybridinfer.errors import HybridInferError  # noqa: E402
from hybridinfer.serving.batch import output as output_mod  # noqa: E402
from hybridinfer.serving.batch import run_job  # noqa: E402

G = {"max_tokens": 3, "temperature": 0}
TIMEOUT = 120


@pytest.fixture(scope="module")
def engine(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=512, max_seqs=4)
    yield eng
    eng.close()



def _lines(n: int, tag: str = "q") -> list[dict]:
    return [{"custom_id": f"{tag}{i}", "prompt": f"Number {i} is", **G} for i in range(n)]


def _run(engine, job, out, **kw):
    """run_job in a thread: its summary, or the exception it raised; a job still running after TIMEOUT fails."""
    got = {}

    def go():
        try:
            got["summary"] = run_job(engine, str(job), str(out), **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            got["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(TIMEOUT)
    assert not t.is_alive(), f"the job hangs (still running after {TIMEOUT} s)"
    return got.get("summary"), got.get("error")


def test_a_file_that_is_no_batch_output_is_refused_untouched(engine, tmp_path):
    job, notes = tmp_path / "job.jsonl", tmp_path / "notes.jsonl"
    write_job(job, _lines(3))
    data = b"".join(json.dumps({"note": i, "text": "remember the milk " * 5}).encode() + b"\n" for i in range(400))
    notes.write_bytes(data)
    s, err = _run(engine, job, notes)
    assert isinstance(err, HybridInferError) and "no output of a batch job" in str(err), (s, err)
    assert notes.read_bytes() == data


def test_an_edited_input_or_another_jobs_output_is_refused(engine, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    lines = _lines(5)
    write_job(job, lines)
    s, err = _run(engine, job, out)
    assert err is None and s["done"] == 5
    data = out.read_bytes()
    # a line inserted at the top between runs: resuming by line number would skip it and answer another twice
    write_job(job, [{"custom_id": "new", "prompt": "Inserted", **G}] + lines)
    s, err = _run(engine, job, out)
    assert isinstance(err, HybridInferError) and "another input" in str(err), (s, err)
    assert out.read_bytes() == data
    # another job of the same line count pointed at this output: refused, not "nothing to do"
    other = tmp_path / "other.jsonl"
    write_job(other, _lines(5, "other"))
    s, err = _run(engine, other, out)
    assert isinstance(err, HybridInferError) and "another input" in str(err), (s, err)
    assert out.read_bytes() == data
    # the input put back as it was: the job is its own and complete
    write_job(job, lines)
    s, err = _run(engine, job, out)
    assert err is None and s["written"] == 0 and s["done"] == 5 and out.read_bytes() == data


def test_duplicate_custom_ids_are_error_lines_and_resume_keeps_them(engine, tmp_path):
    """The first line with a custom_id is run; a later one with the same id is an error line. A resumed job whose
    output lost the first's answer (killed while it ran) runs it and writes the duplicate's line no second time."""
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, [{"custom_id": "a", "prompt": "First", **G}, {"custom_id": "b", "prompt": "Second", **G},
               {"custom_id": "a", "prompt": "Again", **G}])
    s, err = _run(engine, job, out)
    assert err is None and s["by_status"] == {"200": 2, "error": 1}
    recs = records(out)
    assert recs["batch_req_3"]["error"]["code"] == "duplicate_custom_id" and recs["batch_req_3"]["custom_id"] == "a"
    first = recs["batch_req_1"]
    kept = [raw for raw in out.read_bytes().splitlines(keepends=True) if b'"batch_req_1"' not in raw]
    out.write_bytes(b"".join(kept))
    s, err = _run(engine, job, out)
    assert err is None and s["written"] == 1 and s["done"] == 3
    recs = records(out)
    assert recs["batch_req_1"]["response"]["body"]["choices"] == first["response"]["body"]["choices"]


def test_a_full_disk_stops_the_job_naming_the_line(engine, tmp_path, monkeypatch):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, _lines(10))
    monkeypatch.setattr(output_mod, "os", FullDisk(3))
    s, err = _run(engine, job, out, max_inflight=4)
    assert isinstance(err, HybridInferError) and "input line" in str(err) and "No space left" in str(err), (s, err)
    monkeypatch.undo()
    assert len(records(out)) == 3  # what was written is whole
    s, err = _run(engine, job, out)  # the disk has room again: the job goes on where it stopped
    assert err is None and s["done_before"] == 3 and s["done"] == 10 and len(records(out)) == 10


def test_a_custom_id_utf8_cannot_carry_is_answered(engine, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    # valid JSON whose custom_id is a lone surrogate (json.dumps writes it as \ud800)
    write_job(job, [{"custom_id": "bad\ud800", "prompt": "Hello", **G}] + _lines(2))
    s, err = _run(engine, job, out)
    assert err is None and s["done"] == 3 and s["by_status"] == {"200": 3}, (s, err)
    assert records(out)["batch_req_1"]["custom_id"] == "bad\ud800"
    s, err = _run(engine, job, out)  # and a resumed job finds it answered
    assert err is None and s["written"] == 0 and s["done"] == 3


def test_a_line_over_the_limit_is_an_error_line(engine, tmp_path):
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    write_job(job, _lines(1) + [{"custom_id": "big", "prompt": "x " * 600_000, **G}] + _lines(1, "z"))
    s, err = _run(engine, job, out)  # n_ctx 512: the default limit is 1 MiB
    assert err is None and s["done"] == 3 and s["by_status"] == {"200": 2, "error": 1}, (s, err)
    rec = records(out)["batch_req_2"]
    assert rec["error"]["code"] == "line_too_long" and rec["response"] is None
    assert "line 2 is 1200" in rec["error"]["message"] and f"{1 << 20} bytes" in rec["error"]["message"]
    # resumed with a higher limit: the line answered as too long (no custom_id read then) stays answered
    s, err = _run(engine, job, out, max_line_bytes=4 << 20)
    assert err is None and s["written"] == 0 and s["done"] == 3, (s, err)


def test_a_request_that_fails_alone_is_its_error_line(engine, tmp_path, monkeypatch):
    """Faults injected by max_tokens: 5 fails at submit, 6 fails in generation (its handle ends with the error),
    7 fails while its record is made; the other lines are answered and the job ends."""
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    bad = [{"custom_id": f"bad{n}", "prompt": "Fail", "max_tokens": n, "temperature": 0} for n in (5, 6, 7)]
    write_job(job, _lines(2) + bad + _lines(2, "z"))
    sched = engine.scheduler
    real = sched.submit_many

    def submit_many(reqs):
        if any(r.max_tokens == 5 for r in reqs):
            raise OverflowError("Python int too large to convert to C long (injected)")
        hs = real([r for r in reqs if r.max_tokens != 6])
        out = []
        for r in reqs:
            if r.max_tokens == 6:
                h = Handle(sched, r)
                h._finish(OverflowError("injected sampler failure"))
                out.append(h)
            else:
                out.append(hs.pop(0))
        return out

    monkeypatch.setattr(sched, "submit_many", submit_many)
    from hybridinfer.serving.batch import runner

    real_record = runner.ok_record

    def ok_record(number, custom_id, body):
        if custom_id == "bad7":
            raise RecursionError("injected failure while making the body")
        return real_record(number, custom_id, body)

    monkeypatch.setattr(runner, "ok_record", ok_record)
    s, err = _run(engine, job, out)
    assert err is None and not s["interrupted"] and s["done"] == 7, (s, err)
    recs = {r["custom_id"]: r for r in records(out).values()}
    for cid, what in (("bad5", "OverflowError"), ("bad6", "injected sampler failure"),
                      ("bad7", "injected failure while making the body")):
        resp = recs[cid]["response"]
        assert resp["status_code"] == 500 and what in resp["body"]["error"]["message"], recs[cid]
    assert all(recs[c]["response"]["status_code"] == 200 for c in ("q0", "q1", "z0"))


def test_a_top_k_past_int64_is_its_error_line(engine, tmp_path):
    """The finding: a line with top_k 2**63 made the job never end (and hang again on every resume)."""
    job, out = tmp_path / "job.jsonl", tmp_path / "out.jsonl"
    huge = {"custom_id": "huge", "prompt": "Hi", "max_tokens": 3, "top_k": 2**63}
    write_job(job, _lines(1) + [huge] + _lines(1, "z"))
    s, err = _run(engine, job, out)
    assert err is None and s["done"] == 3 and s["by_status"] == {"200": 2, "400": 1}, (s, err)
    rec = next(r for r in records(out).values() if r["custom_id"] == "huge")
    assert rec["response"]["status_code"] == 400 and "top_k" in json.dumps(rec["response"]["body"]), rec
    s, err = _run(engine, job, out)  # a resume finds every line answered
    assert err is None and s["written"] == 0 and s["done"] == 3, (s, err)
