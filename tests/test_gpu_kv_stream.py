"""GPU prefill with the K/V streamed through the card (issue 31: a prompt whose K/V does not fit beside the weights):
each attention layer's cached rows go up from the host state into one slot before the layer and its new rows come
down after it (Buffers kv_stream, walker.py). Against passes that keep every layer's K/V on the card: the same logits
and host rows, for one prompt, its continuation, several prompts in one pass, a prompt longer than a pass's rows (in
passes of n_rows) with snapshots inside and at the cut, and the automatic choice under a budget too small for a long
pass's K/V."""

from __future__ import annotations

import numpy as np
import pytest
from gpu_profile import PROFILE

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.gpu


def _gpu(path, budget=None, **kw):
    return Engine.load(str(path), backend="gpu", n_ctx=256, vram_budget=budget, gpu_chunk=32, card_profile=PROFILE,
                       **kw)


def _ids(n_vocab, n, seed):
    return [int(x) for x in np.random.default_rng(seed).integers(0, n_vocab, n)]


def _same(got, want, what):
    """Bit for bit: the same kernels read the same rows, only from another place on the card."""
    d = float(np.abs(got - want).max())
    print(f"{what}: max|d| {d:.3g} of {float(np.abs(want).max()):.3g}")
    assert np.array_equal(got, want), what


def _same_rows(s1, s2, n):
    for name in ("k", "v"):
        for x, y in zip(s1.arrays[name], s2.arrays[name], strict=True):
            if x is not None:
                assert np.array_equal(x[:n], y[:n]), name


def _kv_budget(path, rows: int) -> int:
    """A VRAM budget whose passes keep their K/V on the card up to `rows` tokens (pass_tokens_fitting's rule)."""
    from hybridinfer.backends.gpu.backend import Buffers
    from hybridinfer.backends.gpu.placement import HOST_ONLY, staged, weights_of
    from hybridinfer.format.gguf_model import GGUFModel
    from hybridinfer.models import model_args
    from hybridinfer.tools.card_plan import vector_bytes

    gm = GGUFModel(str(path))
    a = model_args(gm)
    layers: dict = {}
    for w in weights_of(gm, a, matrices_only=True):
        if w.name not in HOST_ONLY:
            layers[w.layer] = layers.get(w.layer, 0) + staged(w)
    fixed = Buffers.nbytes(a, 32, 0)
    return vector_bytes(gm, a) + 2 * max(layers.values()) + fixed + 2 * (Buffers.nbytes(a, 32, rows) - fixed)


@pytest.mark.parametrize("kt", ["f32", "q8_0"])
def test_streamed_kv_equal_kept_kv(oracle_gguf, kt):
    """kv_stream=True (as -nkvo): a 72-token prompt, 40 more tokens continuing it (the cached rows go up layer by
    layer), and three prompts in one pass give the logits and K/V rows of passes that keep the K/V on the card."""
    from hybridinfer.backends.gpu.multi import forward_many

    path = oracle_gguf("qwen35moe", "q8_0")
    kept = _gpu(path, cache_type_k=kt, cache_type_v=kt)
    streamed = _gpu(path, cache_type_k=kt, cache_type_v=kt, kv_stream=True)
    g = streamed.backend.gpu
    assert g.n_res == 0 and not kept.backend.gpu.buf.kv_stream
    nv = kept.args.n_vocab
    s1, s2 = kept.new_state(), streamed.new_state()
    for j, n in enumerate((72, 40)):
        ids = _ids(nv, n, seed=j)
        want, got = kept.prefill(ids, s1, all_logits=True), streamed.prefill(ids, s2, all_logits=True)
        assert g.buf.kv_stream and got.shape == want.shape
        _same(got, want, f"{kt} part {j}")
    _same_rows(s1, s2, 112)
    runs = []
    for eng in (kept, streamed):
        sts = [eng.new_state() for _ in range(3)]
        eng.backend.cpu.forward(_ids(nv, 9, seed=5), sts[1])  # one continues a state
        lgs = forward_many(eng.backend.gpu, [(_ids(nv, n, seed=10 + n), st, (), None)
                                             for n, st in zip((20, 30, 7), sts, strict=True)])
        runs.append((sts, lgs))
    assert g.last_timing["prompts"] == 3  # one pass
    for k in range(3):
        _same_rows(runs[0][0][k], runs[1][0][k], runs[0][0][k].pos)
        _same(runs[1][1][k], runs[0][1][k], f"{kt} many {k}")


def test_a_pass_too_long_for_the_card_streams_in_passes(oracle_gguf):
    """Under a budget that keeps K/V on the card for 100 tokens (n_ctx 256): a 72-token prompt keeps them there; a
    200-token one streams them, in two passes of 100 rows, with snapshots inside a pass and at the cut equal to those
    of a pass that keeps them; a short prompt after it is back on the card."""
    path = oracle_gguf("qwen35moe", "q8_0")
    kept = _gpu(path)
    small = _gpu(path, _kv_budget(path, 100))
    g = small.backend.gpu
    assert (g.n_res, g.n_rows, g.n_ctx) == (100, 100, 256)
    nv = kept.args.n_vocab
    s1, s2 = kept.new_state(), small.new_state()
    _same(small.prefill(_ids(nv, 72, 1), s2, all_logits=True), kept.prefill(_ids(nv, 72, 1), s1, all_logits=True),
           "72 on the card")
    assert not g.buf.kv_stream
    snaps: dict = {"kept": {}, "small": {}}

    def keep(which):
        def cb(st, logits):
            snaps[which][st.pos] = [x.copy() for x in st.arrays["ssm"] if x is not None]
        return cb

    ids = _ids(nv, 200, 2)
    s1, s2 = kept.new_state(), small.new_state()
    want = kept.prefill(ids, s1, all_logits=True, snapshot_at=[50, 100, 200], on_snapshot=keep("kept"))
    got = small.prefill(ids, s2, all_logits=True, snapshot_at=[50, 100, 200], on_snapshot=keep("small"))
    assert g.buf.kv_stream and g.last_timing["tokens"] == 100  # the second of two passes
    _same(got, want, "200 streamed in two passes")
    _same_rows(s1, s2, 200)
    ref = Engine.load(str(path), backend="reference", n_ctx=256).logits(ids)
    d, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    print(f"streamed vs reference: max|d| {d:.3g} of {scale:.3g}")
    assert d <= 5e-3 * scale and np.mean(got.argmax(-1) == ref.argmax(-1)) >= 0.97
    assert set(snaps["small"]) == set(snaps["kept"]) == {50, 100, 200}
    for p in (50, 100, 200):
        for a, b in zip(snaps["small"][p], snaps["kept"][p], strict=True):
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max(), p
    s1, s2 = kept.new_state(), small.new_state()
    _same(small.prefill(_ids(nv, 40, 3), s2, all_logits=True), kept.prefill(_ids(nv, 40, 3), s1, all_logits=True),
           "40 on the card again")
    assert not g.buf.kv_stream
