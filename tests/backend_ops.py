"""The op-test harness (as llama.cpp's test-backend-ops): every op of the vocabulary (models/graph.OPS) on every
backend (BACKENDS), against the reference backend's RefOps, on one block of a tiny oracle model.

A backend takes part by having `graph_ops(i, state, T)` on its model (an ops object pointed at block i for calls of
T rows, with `from_host` / `to_host` for numpy arrays); an op takes part by having a case in CASES. The test files
tests/test_ops_<family>.py run the cases of their family; test_ops_registry.py checks that every op has a case, a
family file and a method on every backend's ops class, so a new op or backend is covered by construction."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

# backend -> (pytest marks, the reference's options it is compared with): the CPU's products round activations
# to Q8 as llama.cpp does (so does the reference with act_quant), the card's multiply float32 activations
BACKENDS = {"cpu": ((), {"act_quant": True}), "gpu": ((pytest.mark.gpu,), {})}
GPU_TOL = 2e-3  # the card's float order (tiles, fast exp) against numpy's: the prefill tests' logit tolerance
OPS_CLASSES = {"reference": "hybridinfer.backends.reference:RefOps", "cpu": "hybridinfer.backends.cpu.graph_ops:CPUOps",
               "gpu": "hybridinfer.backends.gpu.graph_ops:GPUOps"}


def backend_params():
    return [pytest.param(b, marks=m, id=b) for b, (m, _) in BACKENDS.items()]


@dataclass
class Case:
    """One op called on block `layer_kind` of model `arch`: `make(args, rng, T)` gives its array arguments (numpy)
    and keyword arguments; it is called once per T of `steps` on the same state (stateful ops see their history).
    `tol`: the largest max|got - want| / max|want| allowed (on the GPU at least GPU_TOL unless `exact`)."""

    arch: str
    layer_kind: str  # "attention" | "gdn" (the block the op runs in)
    make: object
    steps: tuple = (6, 1)
    tol: float = 2e-3
    exact: bool = False  # a copy: equal on every backend


def _r(rng, *shape, scale=1.0):
    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _qkv(a, rng, T):
    hd = a.head_dim
    return [_r(rng, T, a.n_head, hd), _r(rng, T, a.n_head_kv * hd), _r(rng, T, a.n_head_kv * hd)]


def _gdn_in(a, rng, T):
    return [_r(rng, T, a.ssm_conv_channels), _r(rng, T, a.ssm_n_v_heads * a.ssm_d_v), _r(rng, T, a.ssm_n_v_heads),
            _r(rng, T, a.ssm_n_v_heads, scale=2.0)]


GDN_T = dict(conv="ssm_conv1d", a="ssm_a", dt_bias="ssm_dt.bias", norm="ssm_norm")
MOE_T = dict(router="ffn_gate_inp", experts=("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
             shared=("ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp"), shared_gate="ffn_gate_inp_shexp")

CASES: dict[str, list[Case]] = {
    "linears": [Case("qwen35moe", "gdn", lambda a, rng, T: ([_r(rng, T, a.n_embd), "attn_qkv", "attn_gate",
                                                             "ssm_beta", "ssm_alpha"], {})),
                Case("llama", "attention", lambda a, rng, T: ([_r(rng, T, a.n_embd), "attn_q", "attn_k", "attn_v"],
                                                              {}))],
    "linear": [Case("qwen35", "gdn", lambda a, rng, T: ([_r(rng, T, a.ssm_n_v_heads * a.ssm_d_v), "ssm_out"], {})),
               Case("llama", "attention", lambda a, rng, T: ([_r(rng, T, a.n_ff), "ffn_down"], {}))],
    "swiglu": [Case("qwen35", "gdn", lambda a, rng, T: ([_r(rng, T, a.n_ff, scale=3.0), _r(rng, T, a.n_ff)], {}),
                    tol=1e-5)],
    "sigmoid_gate": [Case("qwen35", "attention", lambda a, rng, T: ([_r(rng, T, a.n_head * a.head_dim),
                                                                     _r(rng, T, a.n_head * a.head_dim, scale=3.0)], {}),
                          tol=1e-5)],
    "split_gate": [Case("qwen35", "attention", lambda a, rng, T: ([_r(rng, T, 2 * a.n_head * a.head_dim)], {}),
                        tol=0.0, exact=True)],
    "head_norm": [Case("qwen35", "attention", lambda a, rng, T: ([_r(rng, T, a.n_head, a.head_dim, scale=2.0),
                                                                  "attn_q_norm"], {}), tol=1e-5)],
    "attention": [Case("qwen35", "attention", lambda a, rng, T: (_qkv(a, rng, T), {}), steps=(7, 1, 3), tol=1e-4),
                  Case("llama", "attention", lambda a, rng, T: (_qkv(a, rng, T), {}), steps=(7, 1, 3), tol=1e-4)],
    "gdn": [Case("qwen35moe", "gdn", lambda a, rng, T: (_gdn_in(a, rng, T), GDN_T), steps=(7, 1, 3), tol=1e-4)],
    "moe": [Case("qwen35moe", "gdn", lambda a, rng, T: ([_r(rng, T, a.n_embd)], MOE_T), steps=(9, 1), tol=2e-3)],
}


def engine(oracle_gguf, arch: str, backend: str, cache: dict, **opts):
    from hybridinfer.engine.api import Engine

    key = (arch, backend, tuple(sorted(opts.items())))
    if key not in cache:
        cache[key] = Engine.load(str(oracle_gguf(arch, "q8_0")), backend=backend, n_ctx=64, **opts)
    return cache[key]


def _host(ops, y):
    if isinstance(y, list | tuple):
        return [_host(ops, t) for t in y]
    return np.array(ops.to_host(y), np.float32)


def run_case(op: str, case: Case, backend: str, oracle_gguf, cache: dict) -> None:
    """The op on `backend` and on the reference (BACKENDS: with the backend's activation rounding), step by step
    on a fresh state each; asserts every output within the case's tolerance."""
    ref = engine(oracle_gguf, case.arch, "reference", cache, **BACKENDS[backend][1])
    eng = engine(oracle_gguf, case.arch, backend, cache)
    be = getattr(eng.backend, "gpu", eng.backend) if backend == "gpu" else getattr(eng.backend, "cpu", eng.backend)
    a = ref.args
    i = a.layer_types.index(case.layer_kind)
    tol = case.tol if backend != "gpu" or case.exact else max(case.tol, GPU_TOL)
    rng = np.random.default_rng(sum(map(ord, op + case.arch)))
    st_ref, st = ref.new_state(), eng.new_state()
    for T in case.steps:
        args, kw = case.make(a, rng, T)
        r_ops, b_ops = ref.backend.graph_ops(i, st_ref, T), be.graph_ops(i, st, T)
        want = _host(r_ops, getattr(r_ops, op)(*[r_ops.from_host(x) if isinstance(x, np.ndarray) else x
                                                   for x in args], **kw))
        got = _host(b_ops, getattr(b_ops, op)(*[b_ops.from_host(x) if isinstance(x, np.ndarray) else x
                                                for x in args], **kw))
        if not isinstance(want, list):
            want, got = [want], [got]
        for w, g in zip(want, got, strict=True):
            g = g.reshape(w.shape)
            err = float(np.abs(g - w).max()) / max(float(np.abs(w).max()), 1e-30)
            assert err <= tol, (op, case.arch, backend, T, err)
        for s in (st_ref, st):
            s.pos += T  # the op's rows are the sequence's next positions


def family_test(family: str):
    """The test of one op family (test_ops_<family>.py binds it as `test_op_matches_reference`): each of the
    family's ops and cases on every backend against the reference, the engines shared within the family's file."""
    from hybridinfer.models.graph import OPS

    cache: dict = {}
    here = [(op, j) for op, info in OPS.items() if info.family == family for j in range(len(CASES[op]))]

    @pytest.mark.parametrize("backend", backend_params())
    @pytest.mark.parametrize("op,case", here, ids=[f"{op}-{j}" for op, j in here])
    def test_op_matches_reference(op, case, backend, oracle_gguf):
        run_case(op, CASES[op][case], backend, oracle_gguf, cache)

    return test_op_matches_reference
