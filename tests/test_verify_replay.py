"""A verify step of several sequences on the CPU (cpu/verify.forward_rows) is recorded the first time those sequences
verify together with a split of rows and replayed after (replay.RowsReplay), each attention call at its own
sequence's position: its rows' logits, the states it leaves and their rollback are bit-identical to one-token decode
steps of each sequence alone, whether the step was walked or replayed."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.backends.cpu.graph_ops import Segments
from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa
ISA = os.environ.get("HYBRIDINFER_ISA")
SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=4, n_expert_used=2,
             n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
SPLITS = [(3, 2, 4), (3, 2, 4), (1, 3, 2), (3, 2, 4), (1, 3, 2), (2, 1, 1)]


def _same_state(a, b) -> None:
    assert a.pos == b.pos and np.array_equal(a.tokens[: a.pos], b.tokens[: b.pos])
    for (s, i, x), (_, _, y) in zip(a.held(per_token=False), b.held(per_token=False), strict=True):
        assert np.array_equal(x, y), (s.name, i)
    for (s, i, x), (_, _, y) in zip(a.held(per_token=True), b.held(per_token=True), strict=True):
        assert np.array_equal(x[: a.pos], y[: b.pos]), (s.name, i)


@pytest.mark.parametrize("kv", ["f32", "q8_0"])
def test_several_sequences_verify_replayed_bit_identical_to_decode_steps(tmp_path, kv):
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "moe.gguf")
    synth_model(path, "qwen35moe", SHAPE, "q8_0", seed=9, mtp=False)
    rng = np.random.default_rng(1)
    with Engine.load(path, backend="cpu", n_ctx=96, isa=ISA, n_threads=2, spec_type="none", cache_type_k=kv,
                     cache_type_v=kv) as eng:
        be = eng.backend
        walks = []
        forward = be._forward

        def counted(ids, state, ws, *a, **k):
            if isinstance(state, Segments):
                walks.append(tuple(b - r for _, r, b in state))
            return forward(ids, state, ws, *a, **k)

        be._forward = counted
        states = [eng.new_state() for _ in range(3)]
        for st, n in zip(states, (7, 12, 5), strict=True):
            be.forward([int(x) for x in rng.integers(3, 512, n)], st, all_logits=False)
        refs = [st.copy() for st in states]
        for split in SPLITS:
            ids = [[int(x) for x in rng.integers(3, 512, n)] for n in split]
            keep = [int(rng.integers(1, n + 1)) for n in split]  # the rows each sequence accepts
            rows, undos = be.forward_rows(list(zip(ids, states, strict=True)), undo=True)
            for st, ref, t, r, u, m in zip(states, refs, ids, rows, undos, keep, strict=True):
                assert r.shape == (len(t), 512)
                tail = None
                for row in range(len(t)):  # every row is a decode step's; the rejected ones' on a copy
                    if row == m:
                        tail = ref.copy()
                    want = be.forward([t[row]], ref if row < m else tail, all_logits=False)[-1]
                    assert np.array_equal(r[row], want), (split, row)
                u(m)
                _same_state(st, ref)
        # recorded once per split while the same three sequences go on together; replayed at every repeat
        assert walks == [(3, 2, 4), (1, 3, 2), (2, 1, 1)]
        # each rollback's GDN calls bound once per state, pass and row count, and let go with the state
        again = be.again_steps
        assert set(again) <= {id(st) for st in states} and sum(map(len, again.values())) >= 1
        for st in states:
            eng.release(st)
        assert not be.again_steps


def test_verify_without_undo_commits_and_a_stale_rollback_raises(tmp_path):
    """The GDN state after a verify pass waits in buffers that the next pass reuses: without `undo` it is copied in
    at once (the state equals one-token decode steps'); a rollback run after another pass raises, never restores
    from buffers that another pass rewrote."""
    from hybridinfer.tools.synth import synth_model

    path = str(tmp_path / "moe.gguf")
    synth_model(path, "qwen35moe", SHAPE, "q8_0", seed=4, mtp=False)
    with Engine.load(path, backend="cpu", n_ctx=64, isa=ISA, n_threads=2, spec_type="none") as eng:
        be = eng.backend
        a, b, c = (eng.new_state() for _ in range(3))
        for st in (a, b, c):
            be.forward([5, 9, 11, 30], st, all_logits=False)
        for several in (False, True):
            rows = be.forward_rows([([40, 41, 42], a)] + ([([7], c)] if several else []))
            for t, row in zip([40, 41, 42], rows[0], strict=True):
                assert np.array_equal(row, be.forward([t], b, all_logits=False)[-1])
            _same_state(a, b)
        _, (u1,) = be.forward_rows([([50, 51], a)], undo=True)
        _, (u2,) = be.forward_rows([([60, 61], c)], undo=True)
        with pytest.raises(RuntimeError, match="another verify pass"):
            u1(1)
        u2(1)
