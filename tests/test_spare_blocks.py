"""Released states' buffers reused (backends/state.SpareBlocks, Engine.new_state / release) and a step's prompt
work priced with its restores and snapshots (chunk_cost.size_chunk, the scheduler's restore budget)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.state import DecoderState, SpareBlocks
from hybridinfer.engine.api import Engine
from hybridinfer.engine.chunk_cost import ChunkCost, size_chunk
from hybridinfer.models.state_kinds import state_bytes


def _fresh(eng) -> DecoderState:
    return eng.backend.new_state(eng.n_ctx)


def test_a_new_state_adopts_a_released_ones_blocks_zeroed_where_it_must_be(oracle_gguf):
    """A released state's blocks go to the next new state: its recurrent arrays zero (a fresh sequence's start),
    every array at its place in the same block; the old state is emptied (unusable)."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=64, prefix_cache=False)
    st = eng.new_state()
    eng.prefill(list(range(5, 25)), st)
    assert all(b.any() for b in st.blocks)
    where = [b.ctypes.data for b in st.blocks]  # addresses, not references: a reference would keep them out
    eng.release(st)
    assert len(eng.spares) == 1 and st.blocks == () and all(a is None for v in st.arrays.values() for a in v)
    new = eng.new_state()
    assert [b.ctypes.data for b in new.blocks] == where and len(eng.spares) == 0
    assert not any(a.any() for _, _, a in new.held(per_token=False))
    ref = _fresh(eng)
    for name, arrs in new.arrays.items():
        for a, b in zip(arrs, ref.arrays[name], strict=True):
            assert (a is None) == (b is None)
            if a is not None:
                assert a.shape == b.shape and a.dtype == b.dtype and any(a.base is c for c in new.blocks)
    # the same logits from the reused buffers as from fresh ones
    ids = list(range(30, 45))
    assert np.array_equal(eng.prefill(ids, new, all_logits=True), eng.prefill(ids, ref, all_logits=True))


def test_blocks_still_viewed_elsewhere_are_not_reused(oracle_gguf):
    """A view of the state's buffers held past its release (here a slice kept by the caller) keeps the blocks out
    of the spares: nothing else's data is ever overwritten."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=64, prefix_cache=False)
    st = eng.new_state()
    eng.prefill(list(range(5, 15)), st)
    kept = next(a for _, _, a in st.held(per_token=False))[:1]
    before = kept.copy()
    eng.release(st)
    assert len(eng.spares) == 0
    other = eng.new_state()
    eng.prefill(list(range(40, 50)), other)
    assert np.array_equal(kept, before)


def test_spares_are_bounded_in_count_and_by_the_state_budget(oracle_gguf):
    """At most max_seqs sets are kept, and under a state budget the kept sets hold at most what the admitted
    sequences leave of it (the scheduler trims them at each admission and release)."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=64, prefix_cache=False, max_seqs=2)
    states = [eng.new_state() for _ in range(3)]
    for st in states:
        eng.prefill(list(range(5, 15)), st)
        eng.release(st)
    assert len(eng.spares) == 2 and eng.spares.kept_bytes > 0
    eng.trim_spares(eng.spares.kept_bytes - 1)
    assert len(eng.spares) == 1
    one = state_bytes(eng.args, 32)
    budgeted = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=64, prefix_cache=False,
                           max_seqs=4, state_budget=3 * one)
    hs = [budgeted.submit(list(range(5, 15)), max_tokens=4, temperature=0) for _ in range(4)]
    for h in hs:
        h.result(timeout=60)
    sched = budgeted.scheduler
    assert sched._reserved + budgeted.spares.kept_bytes <= 3 * one and len(budgeted.spares) >= 1
    budgeted.close()
    assert len(budgeted.spares) == 0


def test_spare_blocks_take_only_their_own_layout():
    """A set goes only to a state whose blocks have the same sizes (DecoderState.adopt); adopt refuses others."""
    a = DecoderState(n_ctx=4, layer_types=("gdn",), tokens=np.zeros(4, np.int32))
    a.blocks = (np.ones(64, np.uint8), np.ones(128, np.uint8))
    sp = SpareBlocks(2)
    assert sp.give(a) and len(sp) == 1 and sp.kept_bytes == 0
    b = DecoderState(n_ctx=4, layer_types=("gdn",), tokens=np.zeros(4, np.int32))
    b.blocks = (np.zeros(64, np.uint8), np.zeros(256, np.uint8))
    assert not sp.take(b) and len(sp) == 1
    with pytest.raises(ValueError, match="same layout|own layout"):
        b.adopt((np.zeros(64, np.uint8), np.zeros(128, np.uint8)))
    sp.trim(None)
    assert len(sp) == 0


def test_size_chunk_pays_for_the_snapshot_at_its_end():
    """With 1 ms a token: 50 ms buy 50 tokens; when the chunk would end at a snapshot position (40 here), the
    snapshot's 20 ms come off first, so it takes 30 tokens and ends short of it; a first chunk takes at least
    `least`; no measure yet (secs None): the whole budget."""
    cost = ChunkCost(a=0.001)
    cut = lambda at: lambda want: min(want, *(p - 100 for p in at if p > 100), 200)  # noqa: E731
    assert size_chunk(cost, 100, 256, 0.05, 0, 0.02, cut([]), []) == (50, 50, pytest.approx(0.0))
    want, took, left = size_chunk(cost, 100, 256, 0.05, 0, 0.02, cut([140]), [140])
    assert (want, took) == (30, 30) and left == pytest.approx(0.02)
    want, took, left = size_chunk(cost, 100, 256, 0.05, 0, 0.02, cut([120]), [120])
    assert (want, took) == (30, 20) and left == pytest.approx(0.05 - 0.02 - 0.02)
    assert size_chunk(cost, 100, 256, 0.0, 16, 0.02, cut([]), []) == (16, 16, pytest.approx(-0.016))
    assert size_chunk(cost, 100, 256, 0.0, 0, 0.02, cut([]), [])[:2] == (0, 0)
    assert size_chunk(cost, 100, 256, None, 0, 0.02, cut([]), []) == (256, 200, None)


def test_a_restore_is_paid_from_the_steps_seconds(smollm_path, monkeypatch):
    """While sequences decode, a waiting prompt's restore starts after a chunk only when the seconds left cover a
    restore as they have lately cost: with restores priced above the step's whole budget, the second admitted
    prompt is not restored in the step where the first one takes a chunk."""
    from hybridinfer.engine.scheduler import Scheduler
    from hybridinfer.tools.benchmarks.batch_api import NoEnd

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=400, max_seqs=4, prefix_cache=True)
    sched = Scheduler(eng, max_seqs=4, worker=False, step_tokens=256)
    runner = sched.submit(eng.make_request("One.", max_tokens=60, temperature=0,
                                           constraint=NoEnd([eng.tokenizer.eos_id])))
    sched.step()
    sched._decode_s, sched._cost, sched._restore_s = 0.010, ChunkCost(a=1e-6), 10.0
    monkeypatch.setattr(sched._cost, "observe", lambda chunks, seconds: None)
    import hybridinfer.engine.scheduler as sm

    monkeypatch.setattr(sm, "ema", lambda old, new, keep=0.7: old if old is not None else new)
    no_end = NoEnd([eng.tokenizer.eos_id])
    first, second = sched.submit_many([eng.make_request(list(range(300, 400)), max_tokens=8, temperature=0,
                                                        constraint=no_end),
                                       eng.make_request(list(range(500, 600)), max_tokens=8, temperature=0,
                                                        constraint=no_end)])
    sched.step()
    s1, s2 = (next(q for q in sched._running + sched._prefilling if q.handle is h) for h in (first, second))
    assert s1.restored and not s2.restored  # the first restored (nothing planned yet), the second waits
    sched._restore_s = 0.0
    sched.step()
    assert s2.restored
    runner.cancel()
    first.cancel()
    second.cancel()
    while not sched.idle():
        sched.step()


def test_a_state_still_viewed_is_left_whole_at_release(oracle_gguf):
    """When something else views the state's buffers at its release (a caller inspecting it after), the state is
    left as it was: its position, tokens and rows still readable."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=64, prefix_cache=False)
    st = eng.new_state()
    eng.prefill(list(range(5, 15)), st)
    row = next(a for _, _, a in st.held(per_token=True))[:3]
    eng.release(st)
    assert len(eng.spares) == 0 and st.pos == 10 and list(st.tokens[:10]) == list(range(5, 15))
    assert np.array_equal(next(a for _, _, a in st.held(per_token=True))[:3], row)


def _minor_faults(fn) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    fn()
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def _on_fresh_pages(st: DecoderState) -> None:
    """Move `st` onto blocks of fresh anonymous pages in 4 KiB pages (no huge pages, whatever the host's setting):
    each first write of a page then faults, whatever malloc has kept mapped."""
    import mmap

    blocks = []
    for b in st.blocks:
        m = mmap.mmap(-1, b.nbytes, flags=mmap.MAP_PRIVATE)
        if hasattr(mmap, "MADV_NOHUGEPAGE"):
            m.madvise(mmap.MADV_NOHUGEPAGE)
        blocks.append(np.frombuffer(m, np.uint8))
    st.adopt(tuple(blocks))


def test_a_warm_set_faults_no_page_where_a_fresh_one_does(oracle_gguf):
    """SpareBlocks.warm writes a fresh state's recurrent arrays and first `rows` positions: a state that adopts the
    set writes them without a page fault, where the same writes into fresh pages fault; it counts those bytes."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=4096, prefix_cache=False)
    rows = 1024
    spares = SpareBlocks(2)
    st = _fresh(eng)
    _on_fresh_pages(st)
    assert spares.warm(st, rows) and spares.kept_bytes == SpareBlocks.touched(_fresh(eng), rows)

    def write(st):
        def go():
            for _, _, a in st.held(per_token=False):
                a[...] = 1
            for _, _, a in st.held(per_token=True):
                a[:rows] = 1
        return go

    warm, cold = _fresh(eng), _fresh(eng)
    assert spares.take(warm)
    _on_fresh_pages(cold)
    assert _minor_faults(write(warm)) <= 2
    assert _minor_faults(write(cold)) >= 8
    used = _fresh(eng)
    used.pos = 3
    assert not spares.warm(used, rows)  # only a fresh state's blocks
    eng.close()


def test_warm_states_keeps_max_seqs_sets_that_new_states_adopt(oracle_gguf):
    """Engine.warm_states keeps max_seqs written sets (no more on a second call); a new state adopts one, and the
    logits from it are those from fresh buffers."""
    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=4096, prefix_cache=False, max_seqs=3)
    rows = 1024
    assert eng.warm_states(rows) == 3 and len(eng.spares) == 3
    assert eng.spares.kept_bytes == 3 * SpareBlocks.touched(_fresh(eng), rows)
    assert eng.warm_states(rows) == 3
    st = eng.new_state()
    assert len(eng.spares) == 2
    ids = list(range(30, 45))
    assert np.array_equal(eng.prefill(ids, st, all_logits=True), eng.prefill(ids, _fresh(eng), all_logits=True))
    eng.close()


def test_warm_states_stay_within_the_state_budget(oracle_gguf):
    """Under a state budget, warm_states keeps only the sets it holds (here one and a half sets' bytes: one)."""
    path = oracle_gguf("qwen35", "q8_0")
    probe = Engine.load(path, backend="cpu", n_ctx=2048, prefix_cache=False)
    one = SpareBlocks.touched(_fresh(probe), 512)
    probe.close()
    eng = Engine.load(path, backend="cpu", n_ctx=2048, prefix_cache=False, max_seqs=4, state_budget=one * 3 // 2)
    assert eng.warm_states(512) == 1 and eng.spares.kept_bytes == one <= eng.state_budget
    eng.close()


def test_the_server_warms_its_states_before_serving(oracle_gguf):
    """create_app keeps the engine's max_seqs state sets warm before the first request."""
    pytest.importorskip("fastapi")
    from hybridinfer.serving.serve.app import create_app

    eng = Engine.load(oracle_gguf("qwen35", "q8_0"), backend="cpu", n_ctx=4096, prefix_cache=False, max_seqs=2)
    assert len(eng.spares) == 0
    create_app(eng)
    assert len(eng.spares) == 2
    eng.close()


def test_state_blocks_are_private_to_the_process():
    """A state's blocks (state._mapped_zeros) are private pages, as the heap's are: a forked child's write does not
    reach the parent (mmap's default, shared memory, would), and they start zero."""
    import os
    import warnings

    from hybridinfer.backends.state import _mapped_zeros

    a = _mapped_zeros(8 << 20)
    assert a.nbytes == 8 << 20 and not a[:: 1 << 16].any() and a.flags.writeable
    a[0] = 1
    with warnings.catch_warnings():  # Python 3.12 warns of fork() in a process with threads: the child only writes
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:  # the child: write and leave at once
        a[0] = 7
        a[-1] = 7
        os._exit(0)
    os.waitpid(pid, 0)
    assert a[0] == 1 and a[-1] == 0
    assert _mapped_zeros(0).nbytes == 0
