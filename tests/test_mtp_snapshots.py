"""The MTP block's rows are part of a drafting sequence's state (state_kinds.MTP_ROWS): snapshots and the prefix cache
keep them (in the K/V cache type), a restore brings them back, so a restored sequence drafts exactly as one that
never stopped: the same drafts at every step, the same accepted counts, the same greedy tokens, the block's K rows
the same bits."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.engine import spec as sp
from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa
ISA = os.environ.get("HYBRIDINFER_ISA")
SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, ssm_d_state=64,
             ssm_n_group=2, ssm_dt_rank=4)


def mtp_model(folder, seed: int) -> str:
    """A tiny qwen35 synth with its MTP block, q8_0 (also test_mtp_gpu_prefill's)."""
    from hybridinfer.tools.synth import synth_model

    p = str(folder / "qwen35-q8_0.gguf")
    synth_model(p, "qwen35", SHAPE, "q8_0", seed=seed, mtp=True)
    return p


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return mtp_model(tmp_path_factory.mktemp("mtpsnap"), seed=3)


def _engine(path, kv="f32", **kw) -> Engine:
    eng = Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2, cache_type_k=kv, cache_type_v=kv, **kw)
    if eng.spec is not None:
        eng.spec = sp.Speculator(eng.spec.drafter, 3, adaptive=False)
    return eng


def record_drafts(eng, prompt, n: int):
    """Greedy generation of n tokens with every step's drafts recorded: (the Generation, [(position, drafts)], and
    per observed step (the block's first row's trunk position, its complete rows, a copy of its K rows there))."""
    d, log, seen = eng.spec.drafter, [], []
    propose, observe = d.propose_seq, d.observe

    def rec(s, k):
        out = propose(s, k)
        log.append((s.state.pos, out))
        return out

    def obs(s, drafting=True):
        observe(s, drafting)
        m = d.seqs[id(s.state)]
        seen.append((m.base, m.true, np.array(m.ms.k[0][: m.true], copy=True)))

    d.propose_seq, d.observe = rec, obs
    try:
        g = eng.generate(prompt, max_tokens=n, temperature=0)
    finally:
        d.propose_seq, d.observe = propose, observe
    return g, log, seen


def _run(eng, prompt, n: int = 12):
    """(tokens, [(position, drafts)], accepted, the block's K rows of the sequence's accepted positions at its last
    step, its first row's trunk position, reused tokens)."""
    g, log, seen = record_drafts(eng, prompt, n)
    base, _, k_rows = seen[-1]
    return g.tokens, log, g.timings["draft_n_accepted"], k_rows, base, g.timings["reused_tokens"]


def _prompts():
    rng = np.random.default_rng(11)
    p1 = [int(x) for x in rng.integers(3, 512, 14)]
    return p1, p1[:10] + [int(x) for x in rng.integers(3, 512, 3)]


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_restored_sequence_drafts_as_the_uninterrupted_one(path, kv):
    """Restored at the prompt's end (no prefill: the block's next row comes from the kept h), at a mid-prompt stride
    snapshot (the rest prefilled), and from the end-of-reply snapshot (rows written during decode): the drafts,
    accepted counts, tokens and the block's K rows equal a run without a cache, and the rows start at position 0."""
    p1, p2 = _prompts()
    with _engine(path, kv, spec_type="none") as plain:
        greedy1 = plain.generate(p1, max_tokens=12, temperature=0).tokens
    with _engine(path, kv) as cold:
        want1 = _run(cold, p1)
        p3 = p1 + want1[0] + [5, 6]
        want2, want3 = _run(cold, p2), _run(cold, p3)
    assert want1[0] == greedy1  # drafting changes no output
    assert sum(len(d) for _, d in want1[1]) >= 12 and want1[4] == 0
    with _engine(path, kv, prefix_cache=True, snapshot_stride=4) as warm:
        first = _run(warm, p1)
        again, mid, turn = _run(warm, p1), _run(warm, p2), _run(warm, p3)
    assert (first[5], again[5], mid[5]) == (0, len(p1), 8)
    assert turn[5] >= len(p1) + len(want1[0]) - 1
    for want, got in ((want1, first), (want1, again), (want2, mid), (want3, turn)):
        assert got[0] == want[0]  # tokens
        assert got[1] == want[1]  # every step's drafts
        assert got[2] == want[2]  # accepted
        assert got[4] == 0 and np.array_equal(got[3], want[3])  # the block's rows from position 0, the same bits


def test_snapshots_count_and_store_the_rows(path, tmp_path):
    """The prefix cache's per-row and recurrent byte counts include the block's K/V row and its note; a disk
    snapshot written by one engine restores the block's rows in another; an engine that does not draft keeps no
    block rows, and its snapshots are keyed apart from a drafting engine's (another state layout)."""
    from hybridinfer.engine.prefix.snapshot import recurrent_bytes, row_bytes

    p1, _ = _prompts()
    disk = dict(disk_dir=str(tmp_path / "cache"))
    with _engine(path) as cold:
        want = _run(cold, p1)
    with _engine(path, prefix_cache=disk, snapshot_stride=4) as a:
        with_rows = a.new_state()
        _run(a, p1)
    with _engine(path, spec_type="none", prefix_cache=disk, snapshot_stride=4) as plain:
        without = plain.new_state()
        g = plain.generate(p1, max_tokens=12, temperature=0)
        assert g.timings["reused_tokens"] == 0 and g.tokens == want[0]
    assert row_bytes(with_rows) - row_bytes(without) == 2 * 2 * 64 * 4  # K and V of one attention layer, f32
    assert recurrent_bytes(with_rows) - recurrent_bytes(without) == 4 * (256 + 1)
    assert len(with_rows.layer_types) == len(without.layer_types) + 1
    with _engine(path, prefix_cache=disk, snapshot_stride=4) as b:
        got = _run(b, p1)
    assert got[5] == len(p1)
    assert got[:3] == want[:3] and got[4] == 0 and np.array_equal(got[3], want[3])
