"""The multi-token-prediction (MTP, "nextn") block: synth writes it in the layout llama.cpp's converter writes
(conversion/qwen.py's _QwenMtpMixin, read by src/models/qwen35.cpp load_block_mtp and graph_mtp), the models read
it, and the CPU backend's MTP forward equals the numpy reference's at every position."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.errors import MTPUnavailableError
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.models import graph, model_args
from hybridinfer.models.state_kinds import state_bytes

pytestmark = pytest.mark.isa  # CPU against the reference at the ISA level HYBRIDINFER_ISA forces
ISA = os.environ.get("HYBRIDINFER_ISA")

_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
SHAPES = {
    "qwen35": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, **_GDN),
    "qwen35moe": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=4,
                      n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, **_GDN),
}


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("mtp")
    cache: dict = {}

    def get(arch: str, quant: str = "f32", mtp: bool = True) -> str:
        key = (arch, quant, mtp)
        if key not in cache:
            cache[key] = str(d / f"{arch}-{quant}-{int(mtp)}.gguf")
            synth_model(cache[key], arch, SHAPES[arch], quant, seed=3, mtp=mtp)
        return cache[key]

    return get


@pytest.mark.parametrize("arch", list(SHAPES))
def test_synth_writes_the_converters_layout(made, arch):
    gm = GGUFModel(made(arch))
    n, D = 4, 256
    assert gm.meta(f"{arch}.block_count") == n + 1
    assert gm.meta(f"{arch}.nextn_predict_layers") == 1
    assert list(gm.meta(f"{arch}.attention.recurrent_layers")) == [True, True, True, False, False]
    shapes = {name: tuple(t.ne) for name, t in gm.tensors.items() if name.startswith(f"blk.{n}.")}
    # llama.cpp's load_block_mtp: eh_proj {2D, D} (the concat [enorm(e), hnorm(h)] is its input), the norms {D}
    assert shapes[f"blk.{n}.nextn.eh_proj.weight"] == (2 * D, D)
    for k in ("enorm", "hnorm", "shared_head_norm"):
        assert shapes[f"blk.{n}.nextn.{k}.weight"] == (D,)
    # the converter writes no shared_head_head / embed_tokens for Qwen3.5 (the main head and embedding serve)
    assert f"blk.{n}.nextn.shared_head_head.weight" not in shapes
    assert shapes[f"blk.{n}.attn_q.weight"] == (D, 2 * 4 * 64)
    assert f"blk.{n}.attn_qkv.weight" not in shapes  # an attention block, never a GDN one
    ffn = "ffn_gate_exps.weight" if arch == "qwen35moe" else "ffn_gate.weight"
    assert f"blk.{n}.{ffn}" in shapes
    a = model_args(gm)
    assert (a.n_layer, a.n_layer_mtp, a.has_mtp) == (n, 1, True)
    assert a.mtp_norm == f"blk.{n}.nextn.shared_head_norm.weight" and a.mtp_out == "output.weight"
    blk = graph.mtp(a)
    assert blk.block == n and [b.norm for b in blk.branches] == ["attn_norm", "post_attention_norm"]
    # the MTP block's rows count in a sequence's bytes: its K/V and its note (h and a row count)
    plain = model_args(GGUFModel(made(arch, mtp=False)))
    kv = 2 * 4 * 2 * 64 * 100  # K and V, f32, H_kv x hd per token, 100 tokens
    assert state_bytes(a, 100) - state_bytes(plain, 100) == kv + 4 * (D + 1)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_file_without_the_block_keeps_working(made, arch):
    path = made(arch, mtp=False)
    gm = GGUFModel(path)
    assert gm.meta(f"{arch}.nextn_predict_layers") == 0 and not any(".nextn." in t for t in gm.tensors)
    with Engine.load(path, backend="cpu", n_ctx=64, isa=ISA, n_threads=2) as eng:
        assert not eng.args.has_mtp and graph.mtp(eng.args) is None
        with pytest.raises(MTPUnavailableError):
            eng.backend.new_mtp_state(64)
        assert len(eng.generate([5, 6, 7], max_tokens=3, temperature=0).tokens) == 3


def _mtp_rows(eng, ids, one_by_one: bool = False):
    """The trunk's final-norm rows of ids, then the MTP block over (h_t, ids[t+1]) for every t."""
    st = eng.new_state()
    h = eng.backend.hidden(ids, st)
    ms = eng.backend.new_mtp_state(eng.n_ctx)
    if not one_by_one:
        return eng.backend.mtp(h[:-1], ids[1:], ms), ms
    parts = [eng.backend.mtp(h[t : t + 1], ids[t + 1 : t + 2], ms) for t in range(len(ids) - 1)]
    return (np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])), ms


@pytest.mark.parametrize("arch", list(SHAPES))
def test_cpu_mtp_equals_reference(made, arch):
    """F32 weights (no activation rounding): the CPU's MTP logits at 23 positions against the reference's, held to
    the tolerance of test_cpu_backend's F32 test; row by row (drafting) the same bits as all rows in one call."""
    path = made(arch)
    ids = [int(x) for x in np.random.default_rng(5).integers(0, 512, 24)]
    with Engine.load(path, backend="reference", n_ctx=64) as ref:
        (want, want_h), ms = _mtp_rows(ref, ids)
        assert ms.pos == len(ids) - 1 and ms.layer_types == ("attention",)
    with Engine.load(path, backend="cpu", n_ctx=64, isa=ISA, n_threads=2) as cpu:
        (got, got_h), _ = _mtp_rows(cpu, ids)
        (rows, rows_h), _ = _mtp_rows(cpu, ids, one_by_one=True)
    assert got.shape == (len(ids) - 1, 512) and got_h.shape == (len(ids) - 1, 256)
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-4 * scale
    assert (got.argmax(-1) == want.argmax(-1)).all()
    assert float(np.abs(got_h - want_h).max()) <= 1e-4 * float(np.abs(want_h).max())
    assert np.array_equal(rows, got) and np.array_equal(rows_h, got_h)


def test_mtp_attends_over_its_own_rows(made):
    """The block's K/V is its own: the same (h, token) row gives other logits after other rows than first."""
    path = made("qwen35")
    with Engine.load(path, backend="reference", n_ctx=64) as ref:
        ids = [3, 9, 27, 81, 243]
        h = ref.backend.hidden(ids, ref.new_state())
        first, _ = ref.backend.mtp(h[-2:-1], ids[-1:], ref.backend.new_mtp_state(64))
        (after, _), _ = _mtp_rows(ref, ids)
        assert not np.allclose(first[0], after[-1])


@pytest.mark.parametrize("arch", list(SHAPES))
@pytest.mark.parametrize("ctk", ["f32", "f16", "q8_0", "lm3"])
def test_mtp_write_writes_the_rows_mtp_writes(made, arch, ctk):
    """The drafter's catch-up (Backend.mtp_write: the block's K/V rows alone, no query, attention, FFN or head) writes
    the same cache bytes as the whole block, in any K/V type, over rows given in one call or in pieces."""
    ids = [int(x) for x in np.random.default_rng(8).integers(0, 512, 20)]
    with Engine.load(made(arch, "q4_k_m"), backend="cpu", n_ctx=64, isa=ISA, n_threads=2, cache_type_k=ctk,
                     cache_type_v=ctk) as eng:
        be = eng.backend
        h = be.hidden(ids, eng.new_state())
        whole, parts = be.new_mtp_state(64), be.new_mtp_state(64)
        be.mtp(h[:-1], ids[1:], whole, head=False)
        be.mtp_write(h[:7], ids[1:8], parts)
        be.mtp_write(h[7:-1], ids[8:], parts)
        n = len(ids) - 1
        assert whole.pos == parts.pos == n
        assert np.array_equal(whole.tokens[:n], parts.tokens[:n])
        for name in ("k", "v"):
            want, got = getattr(whole, name)[0][:n], getattr(parts, name)[0][:n]
            assert np.any(want != 0) and np.array_equal(got, want), name
            assert not np.any(getattr(parts, name)[0][n:]), name  # nothing past its rows


@pytest.mark.parametrize("arch", list(SHAPES))
def test_the_block_leaves_the_trunk_alone(made, arch):
    """synth writes the block after the head, so the trunk draws the same values: the trunk's logits are the same
    bits with the block in the file as without it (the block is never run by the trunk)."""
    ids = [7, 1, 300, 42, 99, 5]
    out = []
    for mtp in (True, False):
        with Engine.load(made(arch, "q8_0", mtp), backend="cpu", n_ctx=64, isa=ISA, n_threads=2) as eng:
            out.append(eng.logits(ids))
    assert np.array_equal(out[0], out[1])


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(x) for x in rng.integers(3, 512, n)] for n in (9, 14, 5)]


@pytest.mark.parametrize("arch", list(SHAPES))
def test_mtp_drafts_leave_greedy_output_unchanged(made, arch):
    """spec_type defaults to mtp on a file with the block; greedy output with its drafts (k = 1..3, one sequence and
    three) is the output without drafts."""
    from hybridinfer.engine import spec as sp
    from hybridinfer.engine.spec_mtp import MTPDrafter

    path = made(arch, "q8_0")
    prompts = _prompts()
    with Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2, spec_type="none") as base:
        assert base.spec is None
        want = [g.tokens for g in base.generate_batch(prompts, max_tokens=16, temperature=0)]
    with Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2) as eng:
        drafter = eng.spec.drafter
        assert isinstance(drafter, MTPDrafter)
        for k in (1, 2, 3):
            eng.spec = sp.Speculator(drafter, k, adaptive=False)
            assert eng.generate(prompts[0], max_tokens=16, temperature=0).tokens == want[0], k
            assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=16, temperature=0)] == want, k
            assert eng.spec.drafted >= 16, k  # drafts were made and verified on most steps


def test_mtp_kv_holds_the_trunks_rows_of_accepted_positions(made):
    """After a generation with drafts (rejected ones' rows dropped), the block's K rows of the prompt and the output
    are the bits of a fresh pass of the block over the trunk's own rows of those positions: drafts' rows never stay,
    and the first draft of each step is the block's greedy token at the sequence's last position."""
    from hybridinfer.engine import spec as sp

    path = made("qwen35", "q8_0")
    prompt = _prompts()[1]
    with Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2) as eng:
        drafter, seen = eng.spec.drafter, []
        orig = drafter.observe

        def observe(s, drafting=True):
            orig(s, drafting)
            seen.append((s.state, drafter.seqs[id(s.state)], s.state.pos))

        drafter.observe = observe
        drafter.release = lambda st: None  # the sequence is inspected after its end: the drafter keeps it
        eng.spec = sp.Speculator(drafter, 3, adaptive=False)
        eng.generate(prompt, max_tokens=24, temperature=0)
        st, m, p_obs = seen[-1]  # the last step's: the state has gone on by that step's tokens since
        assert m.base == 0 and m.true > len(prompt) + 8  # the prompt's positions too (written after its chunk)
        n = min(m.true, st.pos - 1 - m.base)  # rows whose next token the state holds
        k_rows = np.array(m.ms.k[0][:n], copy=True)
        ids = [int(t) for t in st.tokens[: st.pos]]
        h = eng.backend.hidden(ids[: m.base + n], eng.new_state())
        fresh = eng.backend.new_mtp_state(128)
        lg, _ = eng.backend.mtp(h[m.base :], ids[m.base + 1 : m.base + n + 1], fresh)
        assert np.array_equal(fresh.k[0][:n], k_rows)
        # the first draft: the block's greedy token at the last position, over the whole K/V of accepted rows
        assert m.last is not None and m.base + m.true == p_obs
        h_all = eng.backend.hidden(ids[:p_obs], eng.new_state())
        lg, _ = eng.backend.mtp(h_all[m.base :], ids[m.base + 1 : p_obs] + [m.last[1]],
                                eng.backend.new_mtp_state(128))
        before = np.array(m.ms.k[0][: m.true], copy=True)
        assert drafter.propose_seq(type("S", (), {"state": st})(), 1) == [int(np.argmax(lg[-1]))]
        assert np.array_equal(m.ms.k[0][: m.true], before)  # the last row run again: the same bits


@pytest.mark.parametrize("arch", list(SHAPES))
def test_llama_cpp_loads_the_block(made, arch):
    """llama.cpp's loader (load_block_mtp) takes the file: it counts one nextn layer, and its trunk reads the same
    model as the reference (F32: no rounding but summation order)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = made(arch)
    llm = llama_cpp.Llama(model_path=path, n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0)
    try:
        assert llama_cpp.llama_model_n_layer_nextn(llm.model) == 1
        ids = [7, 1, 300, 42, 99, 5, 11, 400]
        llm.eval(ids)
        ll = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()
    with Engine.load(path, backend="reference", n_ctx=64) as ref:
        want = ref.logits(ids)
    assert float(np.abs(want - ll).max()) <= 1e-4 * float(np.abs(ll).max())


def test_mtp_block_in_a_weight_copy(made):
    """weights="copy" copies (and on the SSSE3 unit repacks) the block's matrices with the trunk's: the same bits."""
    path = made("qwen35moe", "q4_k_m")
    ids = [7, 1, 300, 42, 99, 5]
    got = []
    for mode in ("mmap", "copy"):
        with Engine.load(path, backend="cpu", n_ctx=64, isa=ISA, n_threads=2, weights=mode) as eng:
            (lg, _), _ = _mtp_rows(eng, ids)
            if mode == "copy":  # the copy holds every matrix, the block's among them
                assert eng.backend.weights_bytes >= sum(m.raw.nbytes for m in eng.backend.mats)
            got.append(lg)
    assert np.array_equal(got[0], got[1])


def test_kept_rows_go_with_their_state(made):
    """keep_hidden's rows of a state that is dropped without Backend.release (Engine.logits' own) go with it."""
    import gc

    with Engine.load(made("qwen35", "q8_0"), backend="cpu", n_ctx=64, isa=ISA, n_threads=2) as eng:
        assert eng.backend.keep_hidden  # the default drafter (mtp) keeps them
        st = eng.new_state()
        eng.backend.forward([5, 6, 7, 8], st, all_logits=False)
        f, rows = eng.backend.hidden_rows(st)
        assert f == 0 and rows.shape == (4, 256)
        del st
        gc.collect()
        assert not eng.backend.hidden_kept


def test_mtp_drafts_leave_seeded_sampling_unchanged(made):
    """Sampled at fixed seeds (temperature, top-k/p, min-p, a penalty): the same tokens with mtp drafts as without."""
    from hybridinfer.engine import spec as sp

    path = made("qwen35moe", "q8_0")
    kw = dict(max_tokens=16, temperature=0.8, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.1)
    reqs = [dict(prompt=p, seed=21 + i) for i, p in enumerate(_prompts())]
    with Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2, spec_type="none") as base:
        want = [g.tokens for g in base.generate_batch(reqs, **kw)]
    with Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2, spec_type="mtp", draft_max=2) as eng:
        eng.spec = sp.Speculator(eng.spec.drafter, 2, adaptive=False)
        assert [g.tokens for g in eng.generate_batch(reqs, **kw)] == want
        assert eng.spec.drafted > 0
