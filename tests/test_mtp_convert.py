"""The MTP block against llama.cpp's own converter: a tiny random Qwen3.5 HF checkpoint with the block under the names
Qwen's checkpoints use (`mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`, `mtp.layers.0.*`, `mtp.norm`;
config `mtp_num_hidden_layers: 1`) goes through `convert_hf_to_gguf.py` (conversion/qwen.py's _QwenMtpMixin). The file
it writes loads here, `synth` writes the same names, shapes, types and block metadata, and the block's logits on the
converted file equal a numpy computation of the block written from the HF tensors (transformers has no MTP module;
llama.cpp's Python binding cannot feed its MTP context the trunk's hidden states, so it is not run here)."""

from __future__ import annotations

import os

import numpy as np
import pytest

pytestmark = pytest.mark.oracle

VOCAB = 512  # synth's byte-level vocabulary needs more than 256 ids; the same here so every shape compares
SHAPE = dict(n_embd=64, n_layer=4, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=VOCAB, ssm_d_state=16,
             ssm_n_group=2, ssm_dt_rank=6, rope_frac=0.5)
EPS = 1e-6


def _checkpoint(d: str, seed: int = 0) -> dict:
    """A tiny Qwen3_5ForCausalLM saved in d with an MTP block of random weights added under Qwen's names; returns
    every tensor (numpy) of the checkpoint."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen3_5ForCausalLM

    try:
        import oracle_models as om
    except ImportError:
        from tests import oracle_models as om
    cfg = om.tiny_config("qwen35")
    cfg.vocab_size = VOCAB
    cfg.mtp_num_hidden_layers = 1  # Qwen's config key; transformers keeps it and ignores mtp.* tensors
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(cfg).to(torch.float32).eval()
    om._randomize(model, "qwen35", seed)
    model.save_pretrained(d)
    path = os.path.join(d, "model.safetensors")
    sd = load_file(path)
    g = torch.Generator().manual_seed(seed + 1)
    D = cfg.hidden_size
    attn = "model.layers.3."  # a full-attention layer: the block's tensors have its names and shapes
    for k, v in list(sd.items()):
        if k.startswith(attn):
            scale = 0.2 if k.endswith("norm.weight") else 1.0 / v.shape[-1] ** 0.5
            sd["mtp.layers.0." + k[len(attn):]] = scale * torch.randn(v.shape, generator=g)
    sd["mtp.fc.weight"] = torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        sd[f"mtp.{n}.weight"] = 0.2 * torch.randn(D, generator=g)  # zero-centred: the scale is 1 + w
    save_file(sd, path, metadata={"format": "pt"})
    return {"model": model, "sd": {k: v.numpy().astype(np.float32) for k, v in sd.items()}, "cfg": cfg}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    try:
        import llama_src
    except ImportError:
        from tests import llama_src
    src = llama_src.source_dir()
    if src is None:
        pytest.skip("llama.cpp's converter source is not available (HYBRIDINFER_LLAMA_CPP_SRC or pip download)")
    d = tmp_path_factory.mktemp("mtpconv")
    hf = str(d / "hf")
    ck = _checkpoint(hf)
    out = {}
    for t in ("f32", "f16"):
        out[t] = str(d / f"conv-{t}.gguf")
        llama_src.convert(src, hf, out[t], t)
    return ck, out, d


def _layout(path: str) -> tuple[dict, dict]:
    from gguf import GGUFReader

    r = GGUFReader(path)
    tensors = {t.name: (t.tensor_type.name, tuple(int(x) for x in t.shape)) for t in r.tensors}
    f = r.fields
    meta = {k.split(".", 1)[1]: [f[k].parts[i].tolist() for i in f[k].data]
            for k in ("qwen35.block_count", "qwen35.nextn_predict_layers", "qwen35.attention.recurrent_layers")}
    return tensors, meta


@pytest.mark.parametrize("outtype", ["f32", "f16"])
def test_synth_writes_the_converters_layout(converted, outtype):
    """Every tensor name, ggml type and shape, and the block's metadata (block_count counting it,
    nextn_predict_layers, recurrent_layers false for it) of synth's file are those of llama.cpp's converter on an HF
    checkpoint of the same shape."""
    from hybridinfer.tools.synth import synth_model

    _, out, d = converted
    mine = str(d / f"synth-{outtype}.gguf")
    synth_model(mine, "qwen35", SHAPE, outtype, seed=1, mtp=True)
    (got, got_meta), (want, want_meta) = _layout(mine), _layout(out[outtype])
    assert any(".nextn.eh_proj" in n for n in want)  # the converter wrote the block (the test is about something)
    assert sorted(got) == sorted(want)
    assert {n: got[n] for n in got if got[n] != want[n]} == {}
    assert got_meta == want_meta
    assert want_meta["nextn_predict_layers"] == [[1]] and want_meta["block_count"] == [[5]]


def _rms(x, w):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * (1.0 + w)


def _block_numpy(sd: dict, cfg, h: np.ndarray, nxt: list[int]) -> np.ndarray:
    """The MTP block from the HF tensors (Qwen3.5's MTP as vLLM and llama.cpp run it): row t reads the trunk's final
    normed hidden state h_t and token t+1's embedding, x = fc(concat(norm_e(e), norm_h(h))), then a full-attention
    decoder layer at positions 0..T-1 over its own rows (gated attention: per head [query, gate] from q_proj, q/k
    RMSNorm before a NEOX RoPE of the first rotary dims, GQA by division, sigmoid gate), then mtp.norm and lm_head."""
    p = "mtp.layers.0."
    W = lambda n: sd[n].astype(np.float64)  # noqa: E731
    H, Hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rp = cfg.rope_parameters
    n_rot = int(hd * rp["partial_rotary_factor"])
    T = len(nxt)
    e = W("model.embed_tokens.weight")[nxt]
    x = np.concatenate([_rms(e, W("mtp.pre_fc_norm_embedding.weight")),
                        _rms(h, W("mtp.pre_fc_norm_hidden.weight"))], -1) @ W("mtp.fc.weight").T
    y = _rms(x, W(p + "input_layernorm.weight"))
    qg = (y @ W(p + "self_attn.q_proj.weight").T).reshape(T, H, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, H * hd)
    k = (y @ W(p + "self_attn.k_proj.weight").T).reshape(T, Hkv, hd)
    v = (y @ W(p + "self_attn.v_proj.weight").T).reshape(T, Hkv, hd)
    q, k = _rms(q, W(p + "self_attn.q_norm.weight")), _rms(k, W(p + "self_attn.k_norm.weight"))
    inv = float(rp["rope_theta"]) ** (-np.arange(0, n_rot, 2) / n_rot)
    ang = np.arange(T)[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]

    def rope(a):
        a = a.copy()
        x1, x2 = a[..., : n_rot // 2].copy(), a[..., n_rot // 2 : n_rot].copy()
        a[..., : n_rot // 2], a[..., n_rot // 2 : n_rot] = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        return a

    q, k = rope(q), rope(k)
    o = np.empty((T, H, hd))
    mask = np.tril(np.ones((T, T), bool))
    for hh in range(H):
        kv = hh // (H // Hkv)
        s = np.where(mask, q[:, hh] @ k[:, kv].T / np.sqrt(hd), -np.inf)
        pr = np.exp(s - s.max(-1, keepdims=True))
        o[:, hh] = (pr / pr.sum(-1, keepdims=True)) @ v[:, kv]
    a = (o.reshape(T, H * hd) / (1.0 + np.exp(-gate))) @ W(p + "self_attn.o_proj.weight").T
    x = x + a
    y = _rms(x, W(p + "post_attention_layernorm.weight"))
    g = y @ W(p + "mlp.gate_proj.weight").T
    x = x + ((g / (1.0 + np.exp(-g))) * (y @ W(p + "mlp.up_proj.weight").T)) @ W(p + "mlp.down_proj.weight").T
    return (_rms(x, W("mtp.norm.weight")) @ W("lm_head.weight").T).astype(np.float32)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_block_on_the_converted_file_equals_the_hf_tensors(converted, backend):
    """The converted F32 file loads with its block (has_mtp, the converter's names), the trunk's final-norm rows equal
    transformers' (the block's input), and the block's logits at every position equal the numpy block on the HF
    tensors, over the same h (so only the block is compared) to 1e-4 of the largest logit, with the same top-1."""
    import torch

    from hybridinfer.engine.api import Engine

    ck, out, _ = converted
    ids = [int(x) for x in np.random.default_rng(8).integers(0, VOCAB, 30)]
    with torch.no_grad():
        h_hf = ck["model"].model(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
    want = _block_numpy(ck["sd"], ck["cfg"], h_hf[:-1].astype(np.float64), ids[1:])
    opts = dict(n_threads=2, isa=os.environ.get("HYBRIDINFER_ISA")) if backend == "cpu" else {}
    with Engine.load(out["f32"], backend=backend, n_ctx=64, **opts) as eng:
        assert eng.args.has_mtp and eng.args.n_layer == 4
        h = eng.backend.hidden(ids, eng.new_state())
        assert float(np.abs(h - h_hf).max()) <= 1e-4 * float(np.abs(h_hf).max())
        got, _ = eng.backend.mtp(h[:-1], ids[1:], eng.backend.new_mtp_state(64))
    scale = float(np.abs(want).max())
    assert float(np.abs(got - want).max()) <= 1e-4 * scale
    assert (got.argmax(-1) == want.argmax(-1)).all()
    # the comparison can fail: the block without its own K/V history (each row alone) is far from it
    alone = np.concatenate([_block_numpy(ck["sd"], ck["cfg"], h_hf[t : t + 1].astype(np.float64), ids[t + 1 : t + 2])
                            for t in range(len(ids) - 1)])
    assert float(np.abs(alone - want).max()) > 1e-2 * scale
