"""The prefix cache wired into the Engine and the CLI: a warm start equals a cold one bit for bit on the CPU
backend, chat turns process only their new tokens, and separate processes share an on-disk store."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa  # at the ISA level HYBRIDINFER_ISA forces: re-run at each (.ci/run)
BLOCK = 16


def _cpu(path, **kw):
    return Engine.load(str(path), backend="cpu", n_ctx=512, isa=os.environ.get("HYBRIDINFER_ISA"), **kw)


def _cold(eng, ids):
    st = eng.new_state()
    lg = eng.prefill(ids, st)[-1].copy()
    return lg, st


def _states_equal(a, b) -> None:
    assert a.pos == b.pos
    assert np.array_equal(a.token_ids, b.token_ids)
    for x, y in zip((*a.conv, *a.ssm), (*b.conv, *b.ssm), strict=True):
        assert (x is None and y is None) or np.array_equal(x, y)
    for x, y in zip((*a.k, *a.v), (*b.k, *b.v), strict=True):
        assert (x is None and y is None) or np.array_equal(x[: a.pos], y[: a.pos])


@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen35", "llama"])
def test_warm_start_equals_cold_bit_for_bit(arch, pooled, oracle_gguf, monkeypatch):
    path = oracle_gguf(arch, "q8_0")
    cold_eng = _cpu(path)
    warm_eng = _cpu(path, prefix_cache={"block_size": BLOCK}, snapshot_stride=32)
    pooled_copies, saved_by_backend = [], []
    if pooled:  # every restore's copy split over the thread pool (CPUModel.copy_into), as a large state's is
        import hybridinfer.backends.cpu.backend as cpu_backend

        monkeypatch.setattr(cpu_backend, "COPY_POOLED", 0)
        simd, be = warm_eng.backend.simd, warm_eng.backend
        real, real_copied = simd.copy_many, be.copied
        monkeypatch.setattr(simd, "copy_many", lambda d, x: pooled_copies.append(len(d)) or real(d, x))
        # a snapshot's arrays (3-D K/V and S, unlike logits) copied by the backend, through the pool as well
        monkeypatch.setattr(be, "copied", lambda arrs: saved_by_backend.append(max(a.ndim for a in arrs) >= 3)
                            or real_copied(arrs))
    rng = np.random.default_rng(3)
    base = [int(x) for x in rng.integers(0, cold_eng.args.n_vocab, 140)]
    warm_eng.start(base, warm_eng.new_state())  # snapshots at 32, 64, 96, 128 and 140 (with its logits)
    cases = {
        "same prompt": base,
        "longer": base + [5, 6, 7],
        "diverges inside a block": base[:75] + [int(x) for x in rng.integers(0, 50, 20)],
        "diverges at a snapshot": base[:64] + [1, 2, 3],
        "diverges at position 0": [(base[0] + 1) % cold_eng.args.n_vocab] + base[1:50],
        "a prefix shorter than the first snapshot": base[:20],
    }
    expect_reuse = {"same prompt": 140, "longer": 140, "diverges inside a block": 64, "diverges at a snapshot": 64,
                    "diverges at position 0": 0, "a prefix shorter than the first snapshot": 0}
    for name, ids in cases.items():
        want, st_cold = _cold(cold_eng, ids)
        st = warm_eng.new_state()
        got, stats = warm_eng.start(ids, st)
        print(f"{arch} {name}: reused {stats['reused_tokens']} of {len(ids)}")
        assert stats["reused_tokens"] == expect_reuse[name], name
        assert stats["prefilled_tokens"] == len(ids) - stats["reused_tokens"]
        assert np.array_equal(np.asarray(got), want), name
        _states_equal(st, st_cold)
    s = warm_eng.prefix_cache.stats
    assert s["hits"] >= 4 and s["reused_tokens"] >= 140 + 140 + 64 + 64
    assert bool(pooled_copies) == pooled  # the restores went through the pool's copy (or numpy's)
    assert any(saved_by_backend) == pooled  # and the snapshots' copies


def test_generate_twice_reuses_and_agrees(smollm_path):
    eng = _cpu(smollm_path, prefix_cache=True)
    ids = eng.tokenize("Once upon a time, in a small village by the sea, there lived an old fisherman who " * 4)[:90]
    r1 = eng.generate(ids, max_tokens=12, temperature=0)
    r2 = eng.generate(ids, max_tokens=12, temperature=0)
    n = len(ids)
    assert r1.timings["reused_tokens"] == 0 and r1.timings["prefilled_tokens"] == n
    assert r2.timings["reused_tokens"] == n and r2.timings["prefilled_tokens"] == 0
    assert r1.tokens == r2.tokens
    # the end-of-generation snapshot: prompt + reply is a cached prefix of the continuation
    r3 = eng.generate(ids + r1.tokens + [3, 4], max_tokens=4, temperature=0)
    assert r3.timings["reused_tokens"] >= n + len(r1.tokens) - 1


def test_chat_turns_process_only_new_tokens(smollm_path):
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, prefix_cache=True)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}]
    r1 = eng.generate(msgs, max_tokens=8, temperature=0)
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And a fruit?"}]
    r2 = eng.generate(msgs, max_tokens=8, temperature=0)
    ids2 = eng.encode_prompt(msgs)
    hist1 = eng._encode_chat(msgs[:2], None, add_generation_prompt=False)
    print(f"turn 2: {r2.timings['prompt_tokens']} prompt tokens, reused {r2.timings['reused_tokens']}")
    assert r2.timings["reused_tokens"] >= len(hist1)
    assert r2.timings["prefilled_tokens"] == len(ids2) - r2.timings["reused_tokens"]
    # the new tokens are this turn's: the reply's closing tokens, the user message and the generation prompt
    new = eng.tokenize("<|im_end|>\n<|im_start|>user\nAnd a fruit?<|im_end|>\n<|im_start|>assistant\n",
                       add_bos=False)
    assert r2.timings["prefilled_tokens"] <= len(new) + 2


def test_second_conversation_restores_the_system_prompt(smollm_path):
    """A chat's system messages end in a snapshot: another conversation with that system prompt re-processes only
    its own messages, from the first conversation on (no stride snapshots: only that one can serve)."""
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=1024, prefix_cache=True, snapshot_stride=0)
    system = {"role": "system", "content": "You answer questions about geography. " * 20}
    r1 = eng.generate([system, {"role": "user", "content": "Name a river."}], max_tokens=2, temperature=0)
    assert r1.timings["reused_tokens"] == 0
    msgs = [system, {"role": "user", "content": "Name a mountain."}]
    r2 = eng.generate(msgs, max_tokens=2, temperature=0)
    end_sys = len(eng._encode_chat(msgs[:1], None, add_generation_prompt=False))
    assert end_sys > 100 and r2.timings["reused_tokens"] == end_sys
    assert r2.timings["prefilled_tokens"] == len(eng.encode_prompt(msgs)) - end_sys


def _cli(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "hybridinfer", *args], capture_output=True, text=True,
                          input=stdin, timeout=600)


def test_cli_run_shares_a_disk_store_between_processes(tmp_path):
    d = tmp_path / "snaps"
    cmd = ["run", "--backend", "cpu", "-p", "Tell me about the sea.", "-n", "6", "--stats",
           "--prefix-cache-dir", str(d)]
    a, b = _cli(*cmd), _cli(*cmd)
    assert a.returncode == 0 and b.returncode == 0, a.stderr + b.stderr
    assert "reused 0," in a.stderr
    assert "reused 0," not in b.stderr and "prefilled 0 " in b.stderr, b.stderr
    assert a.stdout == b.stdout
    assert any(d.iterdir())


def test_cli_chat_multi_turn(tmp_path):
    r = _cli("chat", "--backend", "cpu", "-n", "6", "--stats", stdin="Hi there.\n/stats\nWhat is 2+2?\n/exit\n")
    assert r.returncode == 0, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("[prompt")]
    assert len(lines) == 2
    reused = [int(x.split("reused ")[1].split(",")[0]) for x in lines]
    assert reused[0] == 0 and reused[1] > 0
    assert "hits" in r.stderr  # /stats printed the cache's counters


def test_shared_system_prompt_gets_its_own_snapshot(oracle_gguf):
    """Prompts sharing a system prompt: the second snapshots where it leaves the first, so the third and later
    re-process only their own question (stride snapshots off, so only that snapshot can serve)."""
    eng = _cpu(oracle_gguf("qwen35moe", "q8_0"), prefix_cache={"block_size": BLOCK}, snapshot_stride=0)
    rng = np.random.default_rng(5)
    system = [int(x) for x in rng.integers(0, eng.args.n_vocab, 6 * BLOCK)]
    done = []
    for _ in range(4):
        q = [int(x) for x in rng.integers(0, eng.args.n_vocab, 9)]
        _, s = eng.start(system + q, eng.new_state())
        done.append(s["prefilled_tokens"])
    assert done == [len(system) + 9, len(system) + 9, 9, 9]


def test_bench_prefix_workloads(oracle_gguf, tmp_path):
    """`hybridinfer bench prefix` on a tiny model (our engine; llama.cpp's server is not part of CI)."""
    from hybridinfer.tools.benchmarks import prefix

    rows, meta = prefix.run(str(oracle_gguf("qwen35", "q8_0")), n_prompts=3, threads=2,
                            cache_dir=str(tmp_path / "disk"))
    got = {r.workload: r for r in rows}
    print(prefix.markdown(rows, meta))
    assert got["a"].reprocessed == 947 and got["a"].warm_ttft_ms < got["a"].cold_ttft_ms
    assert got["b"].reprocessed == 900 + 47
    assert got["c"].turns == [40] * 10
    # the second prompt re-processes from the last stride snapshot (1792) and snapshots where it leaves the
    # first (2000); the third re-processes only its question
    assert got["d"].reprocessed == 2030 + (2030 - 1792) + 30
    assert all(r.ram_bytes > 0 and r.disk_bytes > 0 for r in rows)
    assert prefix.plot(rows, str(tmp_path / "p.png"))
