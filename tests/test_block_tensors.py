"""A block's tensors go by one set of names in every backend: the short GGUF names the descriptions pass to the ops
("attn_q", "ssm_dt.bias"; models/graph.block_names, the inverse of tensor_name), held in a models/graph.BlockTensors
by the reference, the CPU backend and the GPU backend alike."""

from __future__ import annotations

import numpy as np
import pytest

from hybridinfer.models.graph import BlockTensors, block_names, tensor_name


def test_block_names_invert_tensor_name():
    names = ["blk.0.attn_q.weight", "blk.0.ssm_dt.bias", "blk.0.ssm_a", "blk.1.attn_q.weight", "blk.10.ffn_up.weight",
             "output.weight"]
    got = block_names(names, 0)
    assert got == {"attn_q": "blk.0.attn_q.weight", "ssm_dt.bias": "blk.0.ssm_dt.bias", "ssm_a": "blk.0.ssm_a"}
    assert block_names(names, 1) == {"attn_q": "blk.1.attn_q.weight"}  # blk.10 is not block 1
    for short, full in got.items():
        assert tensor_name(set(names).__contains__, 0, short) == full
    L = BlockTensors(0, got, str.upper)
    assert L["ssm_dt.bias"] == "BLK.0.SSM_DT.BIAS" and "ssm_a" in L and "ssm_dt_bias" not in L
    with pytest.raises(KeyError, match=r"block 0 has no tensor 'ssm_dt_bias' \(it has attn_q, ssm_a, ssm_dt.bias\)"):
        L["ssm_dt_bias"]


def test_every_backend_holds_a_block_by_the_same_names(oracle_gguf):
    from hybridinfer.backends.cpu.backend import Mat
    from hybridinfer.backends.gpu.backend import GPUModel
    from hybridinfer.engine.api import Engine

    path = str(oracle_gguf("qwen35moe"))
    ref = Engine.load(path, backend="reference", n_ctx=32).backend
    cpu = Engine.load(path, backend="cpu", n_ctx=32, n_threads=1).backend
    gm = cpu.gm
    gpu = GPUModel.__new__(GPUModel)  # the GPU's holder without a card: matrices and vectors as placeholders
    gpu.block_names = [block_names(gm.tensors, i) for i in range(cpu.args.n_layer)]
    gpu.vec = {n: ("vector", n) for n in gm.tensors}
    for i in range(cpu.args.n_layer):
        want = block_names(gm.tensors, i)
        assert {"ssm_dt.bias", "ssm_a", "ffn_gate_exps"} <= set(want) or {"attn_q", "ffn_gate_exps"} <= set(want)
        W = {n: ("matrix", n) for n in want.values() if n.endswith("_exps.weight")}
        holders = [ref.layers[i], cpu.layers[i], gpu.block(i, W)]
        for L in holders:
            assert isinstance(L, BlockTensors) and L.i == i and L.names == want
        for short, full in want.items():
            r, c, g = (L[short] for L in holders)
            assert g == (("matrix" if full in W else "vector"), full)
            if isinstance(c, Mat):
                assert c.name == full and r.shape in ((c.rows, c.cols), (c.n_expert, c.rows, c.cols)), short
            else:  # float32 vectors (and the conv kernel), the same values in both
                assert np.array_equal(np.asarray(r, np.float32).reshape(c.shape), c), short
