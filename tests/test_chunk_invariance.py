"""A prompt's logits do not depend on how the CPU backend is given it: one pass, chunks of any size, or a restore
from a snapshot taken every 4 tokens give the same bits, on every ISA unit this CPU runs. (The AVX units used to
take llama.cpp's multi-token float orders for prompt chunks, tinyBLAS and the repacked and tiled K-quant kernels,
which change with the token count: logits moved by up to 6e-2 between chunk sizes, and a cache-on greedy answer
could differ from a cache-off one. Every product and attention row now takes the one-token order, GGML_DECODE_ROWS;
tests/test_simd_decode_rows.py holds the kernels to it.)

Models: SmolLM2 (llama; Q4_1 and Q8_0 products, F32 attention) and small synthetic Qwen3.5 dense and MoE files
(Q4_K_M: repacked Q4_K, Q6_K, GDN layers, routed experts), and an F16 llama (tinyBLAS's F16 products)."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.backends.cpu.simd import supported_isas
from hybridinfer.engine.api import Engine

ISAS = supported_isas()
_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
# row lengths multiples of 256 (K-quants without fallbacks) and of 8 rows (Q4_K repacked as llama.cpp does)
SHAPES = {
    "qwen35": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512, **_GDN),
    "qwen35moe": dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=4,
                      n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, **_GDN),
    "llama": dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512),
}
MODELS = ["smollm2", "qwen35:q4_k_m", "qwen35moe:q4_k_m", "llama:f16"]
CHUNKS = (1, 4, 7)  # one token (the decode order of old), a K-quant group's half, an odd cut


@pytest.fixture(scope="module")
def model(tmp_path_factory, smollm_path):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("invariance")
    made: dict[str, str] = {"smollm2": smollm_path}

    def get(name: str) -> str:
        if name not in made:
            arch, quant = name.split(":")
            made[name] = str(d / f"{arch}_{quant}.gguf")
            synth_model(made[name], arch, SHAPES[arch], quant, seed=1)
        return made[name]

    return get


def _ids(eng: Engine, n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, eng.args.n_vocab, n)]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("isa", ISAS)
def test_prefill_chunk_size_changes_no_bit(model, name, isa):
    eng = Engine.load(model(name), backend="cpu", n_ctx=64, isa=isa, n_threads=2)
    ids = _ids(eng, 24, 5)  # past 16 positions: attention sums over more cache rows than two vectors' lanes
    one = eng.logits(ids)  # one pass (prefill_chunk 512)
    for chunk in CHUNKS:
        eng.prefill_chunk = chunk
        got = eng.logits(ids)
        assert np.array_equal(got, one), (name, isa, chunk, float(np.abs(got - one).max()))


@pytest.mark.parametrize("name", MODELS[1:])  # SmolLM2 kept these prompts' bits before the fix too
@pytest.mark.parametrize("isa", ISAS)
def test_restore_at_stride_4_equals_cold(model, name, isa):
    """Snapshots every 4 tokens (cache blocks of 4): a warm start resumes from whichever restore point the prompt
    reaches, which cuts the prompt where a cold prefill does not; its logits and greedy answer are a cold run's."""
    path = model(name)
    cold = Engine.load(path, backend="cpu", n_ctx=96, isa=isa, n_threads=2)
    warm = Engine.load(path, backend="cpu", n_ctx=96, isa=isa, n_threads=2, snapshot_stride=4,
                       prefix_cache={"block_size": 4, "ram_bytes": 64 << 20})
    base = _ids(cold, 23, 7)
    warm.start(base, warm.new_state())  # snapshots at 4, 8, .., 20 and at 23
    other = _ids(cold, 6, 8)
    # restored at 23 then one token; at 16 then 6 (a cut a cold pass does not make); at 4 then one
    prompts = [base + other[:1], base[:18] + other, base[:5]]
    for ids in prompts:
        want = cold.prefill(ids, cold.new_state())
        got, stats = warm.start(ids, warm.new_state())
        assert stats["reused_tokens"] > 0, len(ids)
        assert np.array_equal(np.asarray(got), want[-1]), (name, isa, len(ids), stats["reused_tokens"])
    ids = base[:21] + other  # a greedy answer, restored at 20
    assert warm.generate(ids, max_tokens=4, temperature=0).tokens == cold.generate(ids, max_tokens=4,
                                                                                  temperature=0).tokens


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("isa", ISAS)
def test_prompts_sharing_a_pass_change_no_bit(model, name, isa):
    """Several sequences' prompt chunks in one pass (CPUModel.forward_many: every product over all their rows,
    attention and GDN per sequence), at fresh states and mid-prompt, give each sequence the bits of its own pass."""
    eng = Engine.load(model(name), backend="cpu", n_ctx=64, isa=isa, n_threads=2)
    be = eng.backend
    heads = [_ids(eng, n, 20 + n) for n in (9, 3, 17)]  # already in each state before the shared pass
    tails = [_ids(eng, n, 40 + n) for n in (6, 1, 11)]
    alone, shared = [], [eng.new_state() for _ in heads]
    for h, t, st in zip(heads, tails, shared, strict=True):
        own = eng.new_state()
        eng.prefill(h, own)
        alone.append(np.array(be.forward(t, own, all_logits=False)[-1]))
        eng.prefill(h, st)
    got = be.forward_many([(t, st) for t, st in zip(tails, shared, strict=True)])
    assert got.shape == (3, eng.args.n_vocab)
    for j, st in enumerate(shared):
        assert st.pos == len(heads[j]) + len(tails[j])
        assert np.array_equal(got[j], alone[j]), (name, isa, j, float(np.abs(got[j] - alone[j]).max()))
    # the states go on as their own passes' would: one more decode token each
    nxt = [int(np.argmax(g)) for g in got]
    assert np.array_equal(be.decode_batch(nxt, shared)[0], eng.logits(heads[0] + tails[0] + nxt[:1])[-1])
