"""Several prompts in one streamed GPU pass (hybridinfer/backends/gpu/multi.py) against one pass per prompt: fresh and
restored states, interior snapshots, resident and streamed under a small budget; and the pure grouping of prompts
into passes (no GPU)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from gpu_profile import PROFILE

from hybridinfer.backends.gpu.multi import plan_groups
from hybridinfer.engine.api import Engine

LENGTHS = [5, 40, 17, 90, 33]  # with chunks of 32: one, two and three chunks inside a layer
PREFIX = {1: 12, 3: 30}  # prompts 1 and 3 continue a state already at that position (a restored prefix)


def test_plan_groups_fit_the_buffers():
    assert plan_groups([(0, 10), (0, 20), (5, 30)], 65) == [[0, 1, 2]]
    assert plan_groups([(0, 10), (0, 20), (5, 30)], 64) == [[0, 1], [2]]  # 65 cache rows
    assert plan_groups([(0, 40), (0, 30)], 64) == [[0], [1]]  # 70 new rows
    assert plan_groups([(30, 10), (20, 10)], 64) == [[0], [1]]  # 40 + 30 cache rows
    groups = plan_groups([(p, t) for p, t in zip([0, 3, 9, 0, 60, 1], [7, 9, 30, 64, 4, 2], strict=True)], 64)
    assert sorted(j for g in groups for j in g) == list(range(6))
    for g in groups:
        assert sum(t for p, t in [[(0, 7), (3, 9), (9, 30), (0, 64), (60, 4), (1, 2)][j] for j in g]) <= 64
    # K/V streamed (a slot of 256 cached rows, 32 new rows a pass): groups by new rows; a longer prompt alone
    assert plan_groups([(0, 10), (100, 20), (5, 30), (0, 200), (0, 8)], 256, 32) == [[0, 1], [2], [3], [4]]


def _states(eng, rng):
    prompts, sts = [], []
    for j, n in enumerate(LENGTHS):
        st = eng.new_state()
        if j in PREFIX:
            eng.backend.cpu.forward([int(t) for t in rng.integers(0, eng.args.n_vocab, PREFIX[j])], st)
        sts.append(st)
        prompts.append([int(t) for t in rng.integers(0, eng.args.n_vocab, n)])
    return prompts, sts


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen35", "qwen35moe"])
@pytest.mark.parametrize("mode", ["resident", "streamed"])
def test_one_pass_equals_a_pass_per_prompt(arch, mode, oracle_gguf):
    from test_gpu_prefill import _streaming_budget

    path = oracle_gguf(arch, "q8_0")
    budget = _streaming_budget(path) if mode == "streamed" else None
    eng = Engine.load(str(path), backend="gpu", n_ctx=256, vram_budget=budget, gpu_chunk=32, card_profile=PROFILE)
    be = eng.backend
    prompts, alone = _states(eng, np.random.default_rng(3))
    together = [st.copy() for st in alone]
    snaps_alone, snaps_together = [], []
    at = [(), (int(alone[1].pos) + 20,), (), (int(alone[3].pos) + 31, int(alone[3].pos) + 64), (7,)]
    want = []
    for ids, st, a in zip(prompts, alone, at, strict=True):
        want.append(be.gpu.forward(ids, st, all_logits=False, snapshot_at=a,
                                   on_snapshot=lambda s, _: snaps_alone.append(s.copy()))[-1:].copy())
    bytes_one = be.gpu.last_timing["bytes_h2d"]
    got = be.prefill_many([(ids, st, a, lambda s, _: snaps_together.append(s.copy()))
                           for ids, st, a in zip(prompts, together, at, strict=True)])
    scale = max(float(np.abs(w).max()) for w in want)
    for w, g in zip(want, got, strict=True):
        assert float(np.abs(w - g).max()) <= 1e-5 * scale
        assert int(w.argmax()) == int(g.argmax())
    for x, y in zip(alone, together, strict=True):
        assert x.pos == y.pos and np.array_equal(x.token_ids, y.token_ids)
        for p, q in zip((*x.conv, *x.ssm, *x.k, *x.v), (*y.conv, *y.ssm, *y.k, *y.v), strict=True):
            if p is not None:
                assert np.abs(p[: x.pos] - q[: x.pos]).max() <= 1e-5 * max(1.0, float(np.abs(p[: x.pos]).max()))
    assert sorted(s.pos for s in snaps_alone) == sorted(s.pos for s in snaps_together) and len(snaps_alone) == 4
    for s in snaps_alone:
        (t,) = [u for u in snaps_together if u.pos == s.pos]
        for p, q in zip((*s.conv, *s.ssm), (*t.conv, *t.ssm), strict=True):
            if p is not None:
                assert np.abs(p - q).max() <= 1e-5 * max(1.0, float(np.abs(p).max()))
    # the weights crossed the bus once for all five prompts, as for one
    assert be.gpu.last_timing["prompts"] == 5 and be.gpu.last_timing["bytes_h2d"] == bytes_one
    if mode == "streamed":
        assert bytes_one == be.gpu.placement.stream_bytes_per_pass > 0
    # CPU decode goes on from either state alike
    for x, y in zip(alone, together, strict=True):
        t = 5
        for _ in range(3):
            lx = be.forward([t], x, all_logits=False)[-1]
            ly = be.forward([t], y, all_logits=False)[-1]
            assert int(lx.argmax()) == int(ly.argmax())
            t = int(lx.argmax())


@pytest.mark.gpu
def test_scheduler_admits_prompts_into_one_pass(oracle_gguf):
    """generate_batch on the gpu backend: the admitted prompts share a pass, and each answer equals its own."""
    eng = Engine.load(str(oracle_gguf("qwen35moe", "q8_0")), backend="gpu", n_ctx=256, max_seqs=4,
                      card_profile=PROFILE)
    rng = np.random.default_rng(5)
    reqs = [[int(t) for t in rng.integers(0, eng.args.n_vocab, n)] for n in (9, 30, 4, 51)]
    want = [eng.generate(r, max_tokens=5, temperature=0).tokens for r in reqs]
    passes = []
    real = eng.backend.prefill_many
    eng.backend.prefill_many = lambda prompts: passes.append(len(prompts)) or real(prompts)
    got = eng.generate_batch(reqs, max_tokens=5, temperature=0)
    assert [g.tokens for g in got] == want
    assert passes == [4]
    with warnings.catch_warnings(record=True) as caught:  # the card's buffers, made on the worker thread, go now
        warnings.simplefilter("always")
        eng.close()
    assert not [w for w in caught if "could not be cleaned up" in str(w.message)], [str(w.message) for w in caught]


@pytest.mark.gpu
def test_a_gpu_engine_left_open_is_closed_at_exit(oracle_gguf, tmp_path):
    """A program that generates on the gpu backend (the card's buffers made on the scheduler's worker) and exits
    without close(): the exit hook closes the engine, the card's buffers freed inside their context (a hook
    registered before the engine runs after it and sees it closed), and the process exits 0 with nothing PyCUDA
    could not clean up."""
    import os
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    model = str(oracle_gguf("qwen35moe", "q8_0"))
    prog.write_text(
        "import atexit\n"
        "from hybridinfer.engine.api import Engine\n"
        "box = []\n"
        "atexit.register(lambda: print('at exit:', 'closed' if box[0].backend is None else 'open', flush=True))\n"
        f"e = Engine.load({model!r}, backend='gpu', n_ctx=128, card_profile={PROFILE!r})\n"
        "box.append(e)\n"
        "print(len(e.generate([5, 6, 7, 8], max_tokens=2, temperature=0).tokens) > 0, flush=True)\n")
    r = subprocess.run([sys.executable, "-W", "always", str(prog)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["True", "at", "exit:", "closed"], r.stdout
    assert "could not be cleaned up" not in r.stderr, r.stderr[-2000:]
