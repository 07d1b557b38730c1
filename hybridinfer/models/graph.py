"""The op vocabulary every architecture's forward is written in, and what every backend implements.

An architecture module (llama.py, qwen35.py, qwen35moe.py) describes its model once:

- `EMBED`: the token embedding's tensor; `head(a)`: the output norm's and the LM head's tensors;
- `layer(a, i)`: block i as residual branches, `h += branch.fn(ops, a, rms_norm(h) * branch.norm)`, in order;
- the branch functions (attention, gdn, swiglu_ffn, moe): the ops they call and the GGUF tensors they take, by
  their names inside the block (`"attn_q"` is `blk.i.attn_q.weight`, `"ssm_a"` is `blk.i.ssm_a`, `"ssm_dt.bias"`
  is `blk.i.ssm_dt.bias`; `tensor_name` is the rule). Every backend holds a block's tensors by these names in a
  `BlockTensors`.

A backend walks the branches (`branches(a)`) with its own loop (the reference token-parallel over the call, the CPU
recording a decode step into its native plan as it walks, the GPU layer-major over chunks of a prompt with streamed
weights) and an `ops` object implementing `Ops` over its own arrays. The residual adds and branch norms are the
walker's (each backend fuses them as it likes); everything inside a branch is the description's.

Op vocabulary (`Ops`; `OPS` below names each op's reference maths, CPU bindings and GPU launchers):
    linears(x, *names)             x @ W.T for each matrix (one input, several products); flat (T, rows) outputs
    linear(x, name)                one product whose output returns to the residual width
    split_gate(qg)                 heads stored [query(hd), gate(hd)] -> (queries (T, H, hd), gates (T, H*hd))
    head_norm(x, name)             RMSNorm of every head_dim-wide head of x with the vector `name`
    attention(q, k, v)             RoPE of q and k at the call's positions, k and v into the block's cache,
                                   causal softmax attention over the cache; (T, H*hd)
    sigmoid_gate(o, gate)          o * sigmoid(gate)
    swiglu(g, u)                   SiLU(g) * u
    gdn(u, z, beta, alpha, conv=, a=, dt_bias=, norm=)
                                   the Gated DeltaNet layer between its projections (docs/gguf-qwen35.md §3 steps 2-8)
    moe(x, router=, experts=, shared=, shared_gate=)
                                   softmax-top-k routed SwiGLU experts plus an optional sigmoid-gated shared expert
The multi-token-prediction block (`mtp(a)`, an `MTP`, None where the model has none) is one more part of the
description: its input is the trunk's final-norm output h_t (what the head reads, llama.cpp's h_nextn) and the
embedding of token t+1, x = eh_proj(concat(rms_norm(e) * enorm, rms_norm(h) * hnorm)), then its branches over its
own per-sequence state (`mtp_state_args`: one attention layer's K/V, state_kinds), then its head. The walkers are
the backends' `mtp` methods.

A new layer type is a branch function in its architecture module and any new op in each backend's ops class (with
the op's own work buffers: CPU Workspace.op_<op>, GPU Buffers.op_<op>); a new mixer kind also declares the state it
keeps per sequence in state_kinds.py (one entry). A new architecture is one module with EMBED, head and layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Branch:
    """h += fn(ops, args, rms_norm(h) * norm): `norm` the block's norm vector (a short tensor name)."""

    norm: str
    fn: Callable[..., Any]
    kind: str  # what the branch is, for profiles and for backends that schedule kinds differently: "mixer" | "ffn"


class Ops(Protocol):
    """What a backend implements; each method is one op of the vocabulary above, over the backend's arrays.
    Tensor names are short names inside the block being walked."""

    def linears(self, x, *names: str) -> list: ...
    def linear(self, x, name: str): ...
    def split_gate(self, qg) -> tuple: ...
    def head_norm(self, x, name: str): ...
    def attention(self, q, k, v): ...
    def sigmoid_gate(self, o, gate): ...
    def swiglu(self, g, u): ...
    def gdn(self, u, z, beta, alpha, *, conv: str, a: str, dt_bias: str, norm: str): ...
    def moe(self, x, *, router: str, experts: tuple[str, str, str], shared: tuple[str, str, str] | None,
            shared_gate: str | None): ...


@dataclass(frozen=True)
class OpInfo:
    """Where one op lives. The rule: each backend's ops class (reference.RefOps, cpu.graph_ops.CPUOps,
    gpu.graph_ops.GPUOps) has a method of the op's name; beneath it, the reference's maths (module:function under
    hybridinfer), the CPU's SimdLib methods (native/simd) and the GPU's launchers (module:function under
    hybridinfer, native/cuda_sm20) it calls. tests/test_ops_<family>.py runs every backend's method against
    RefOps'."""

    reference: tuple[str, ...]
    cpu: tuple[str, ...]
    gpu: tuple[str, ...]
    family: str  # the test file covering it: tests/test_ops_<family>.py


OPS: dict[str, OpInfo] = {
    "linears": OpInfo(("reference:Weights.mm",), ("quantize", "matmul_many"), ("gpu.k_gemm:gemm",), "linear"),
    "linear": OpInfo(("reference:Weights.mm",), ("quantize", "matmul"), ("gpu.k_gemm:gemm",), "linear"),
    "swiglu": OpInfo(("reference_ops:silu",), ("swiglu",), ("gpu.k_elementwise:swiglu",), "elementwise"),
    "sigmoid_gate": OpInfo(("reference_ops:sigmoid",), ("sigmoid_gate",), ("gpu.k_elementwise:sigmoid_mul",),
                           "elementwise"),
    "split_gate": OpInfo((), ("split_qgate",), ("gpu.k_elementwise:rms_norm",), "attention"),
    "head_norm": OpInfo(("reference_ops:rms_norm",), ("rms_norm",), ("gpu.k_elementwise:rms_norm",), "attention"),
    "attention": OpInfo(("reference_ops:rope", "reference_ops:causal_attention"), ("split_qgate", "attn_step",
                        "attn_rows"), ("gpu.k_elementwise:rope_neox", "gpu.k_attention:kv_append",
                                       "gpu.k_attention:attention_prefill"), "attention"),
    "gdn": OpInfo(("reference_ops:causal_conv", "reference_ops:l2_norm", "reference_ops:delta_rule"),
                  ("gdn_layer", "gdn_rows"), ("gpu.k_gdn:gdn_prefill",), "gdn"),
    "moe": OpInfo(("reference_ops:moe_route",), ("moe_route", "moe_gate_up", "moe_down", "moe_rows", "moe_combine"),
                  ("gpu.k_moe:route", "gpu.k_moe:group", "gpu.k_gemm:gemm_grouped", "gpu.k_moe:combine"), "moe"),
}


def tensor_name(has: Callable[[str], bool], i: int, short: str) -> str:
    """The GGUF name of block i's tensor `short`: `blk.i.<short>.weight` where the file has it, else
    `blk.i.<short>` (ssm_a, ssm_dt.bias)."""
    p = f"blk.{i}.{short}"
    return p + ".weight" if has(p + ".weight") else p


def block_names(names, i: int) -> dict[str, str]:
    """Block i's tensors among the GGUF `names`, by short name: `blk.i.` and a `.weight` suffix dropped (the inverse
    of tensor_name): {"attn_q": "blk.i.attn_q.weight", "ssm_dt.bias": "blk.i.ssm_dt.bias", ...}."""
    p = f"blk.{i}."
    return {n[len(p) :].removesuffix(".weight"): n for n in names if n.startswith(p)}


class BlockTensors:
    """Block i's tensors by short name, `L["attn_q"]`, `L["ssm_dt.bias"]` (the names the descriptions pass to the
    ops), each in the form its backend computes with: the reference's float32 arrays, the CPU's Mats and float32
    vectors, the GPU's DeviceWeights and vectors on the card. `get(gguf_name)` gives that form; `names` maps each
    short name to its GGUF name (block_names)."""

    def __init__(self, i: int, names: dict[str, str], get: Callable[[str], Any]):
        self.i, self.names, self._get = i, names, get

    def name(self, short: str) -> str:
        """The GGUF name of tensor `short` (a KeyError naming the block's tensors when it has none)."""
        try:
            return self.names[short]
        except KeyError:
            raise KeyError(f"block {self.i} has no tensor {short!r} (it has {', '.join(sorted(self.names))})") from None

    def __getitem__(self, short: str):
        return self._get(self.name(short))

    def __contains__(self, short: str) -> bool:
        return short in self.names


@dataclass(frozen=True)
class MTP:
    """The MTP block: `block` its index in the file (the trunk's n_layer); enorm, hnorm, eh_proj short names in that
    block; `branches` as a layer's; `norm`, `out` the GGUF names of its head's norm and matrix (its hidden output,
    the norm's, feeds the next draft step in place of h)."""

    block: int
    enorm: str
    hnorm: str
    eh_proj: str
    branches: tuple[Branch, ...]
    norm: str
    out: str


def mtp(args) -> MTP | None:
    """The architecture's MTP block, None where the model has none."""
    fn = getattr(arch_of(args), "mtp", None)
    return None if fn is None else fn(args)


def mtp_state_args(args):
    """ModelArgs whose DecoderState is the MTP block's own per-sequence state (its layer 0: the attention kind's
    K/V rows), in args' cache types."""
    from dataclasses import replace

    return replace(args, n_layer=len(args.mtp_layer_types), layer_types=tuple(args.mtp_layer_types))


def arch_of(args):
    """The architecture module describing args' model."""
    from . import arch_module

    return arch_module(args.arch)


def branches(args) -> list[tuple[Branch, ...]]:
    """Every block's residual branches, in order (the model's description, walked by each backend)."""
    mod = arch_of(args)
    return [mod.layer(args, i) for i in range(args.n_layer)]


def head(args) -> tuple[str, str]:
    """(output norm, LM head matrix) tensor names."""
    return arch_of(args).head(args)
