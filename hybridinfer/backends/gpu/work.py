"""What one prefill pass computes and moves, counted two ways that must agree: the GPU backend adds up the work
of the kernels it launches (`Work`, in GPUModel.last_timing["work"]), and `prefill_work` computes the same from
the model's tensors and hyperparameters alone (pure; no GPU, no weights read), for the time model and the bench.

FLOPs are 2 per multiply-add of:
  gemm       dense matrix products: 2 N K per row (token) per matrix; the output head on the rows asked for
  moe        grouped expert products: 2 N K per (token, routed expert) pair: each token takes k experts, so
             T k rows in all however the router spreads them (the uniform expectation is also the exact count)
  a mixer    what its kind declares (models/state_kinds.py): attention, causal softmax(Q K^T) V, per head 2 hd
             for Q.K and 2 hd for P.V per (query, visible key) pair, a query at absolute position p seeing p + 1
             keys; gdn, the gated delta rule per token and value head over S [d_k, d_v], 7 d_k d_v, and the
             causal conv, 2 K per channel
Element-wise work (norms, RoPE, SwiGLU, routing, the shared-expert gate) is O(T D) and not counted.
Bytes: what crosses the bus per pass is Placement.stream_bytes_per_pass (weights only; the prompt's embedding
rows and the state hand-off are small and not counted).
"""

from __future__ import annotations

from ...models.state_kinds import KINDS as MIXER_KINDS
from ...models.state_kinds import attention_flops, gdn_flops, kind_of

__all__ = ["KINDS", "Work", "attention_flops", "gdn_flops", "gemm_flops", "prefill_work"]

KINDS = ("gemm", "moe", *MIXER_KINDS)  # the products, then each mixer kind (models/state_kinds.py)


class Work:
    """FLOPs by kind (`w.gemm`, `w.moe`, `w.<mixer kind>`) and by layer (the head: layer n_layer)."""

    def __init__(self):
        self.by_kind: dict[str, float] = dict.fromkeys(KINDS, 0.0)
        self.by_layer: dict[int, float] = {}
        self.cells: dict[tuple[str, int], float] = {}  # by (kind, layer)

    def __getattr__(self, name: str):
        by_kind = self.__dict__.get("by_kind")
        if by_kind is not None and name in by_kind:
            return by_kind[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def add(self, kind: str, layer: int, flops: float) -> None:
        self.by_kind[kind] += flops
        self.by_layer[layer] = self.by_layer.get(layer, 0.0) + flops
        self.cells[kind, layer] = self.cells.get((kind, layer), 0.0) + flops

    @property
    def flops(self) -> float:
        return sum(self.by_kind.values())

    def as_dict(self) -> dict:
        return {**self.by_kind, "by_layer": dict(self.by_layer), "flops": self.flops}


def gemm_flops(rows: int, n: int, k: int) -> float:
    return 2.0 * rows * n * k


def prefill_work(gm, args, T: int, pos0: int = 0, logit_rows: int = 1) -> Work:
    """The FLOPs of one GPU prefill pass of T tokens after pos0 (logit_rows: rows of the output head computed:
    1 for the last token's logits, T for all) from the tensors' shapes and the hyperparameters."""
    from .placement import HOST_ONLY, weights_of

    head = "token_embd.weight" if args.tied_output else "output.weight"
    w = Work()
    for info in weights_of(gm, args, matrices_only=True):
        if info.name in HOST_ONLY and info.name != head:
            continue  # the embedding is a lookup on the host
        ne = gm.tensor(info.name).ne
        n, k = int(ne[1]), int(ne[0])
        if info.name == head:
            w.add("gemm", args.n_layer, gemm_flops(logit_rows, n, k))
        elif info.n_expert:
            w.add("moe", info.layer, gemm_flops(T * args.n_expert_used, n, k))
        else:
            w.add("gemm", info.layer, gemm_flops(T, n, k))
    for i, kind in enumerate(args.layer_types):
        w.add(kind, i, kind_of(kind).flops(args, pos0, T))
    return w
