"""What one prefill pass computes and moves, counted two ways that must agree: the GPU backend adds up the work
of the kernels it launches (`Work`, in GPUModel.last_timing["work"]), and `prefill_work` computes the same from
the model's tensors and hyperparameters alone (pure; no GPU, no weights read), for the time model and the bench.

FLOPs are 2 per multiply-add of:
  gemm       dense matrix products: 2 N K per row (token) per matrix; the output head on the rows asked for
  moe        grouped expert products: 2 N K per (token, routed expert) pair: each token takes k experts, so
             T k rows in all however the router spreads them (the uniform expectation is also the exact count)
  attention  causal softmax(Q K^T) V: per head, 2 hd for Q.K and 2 hd for P.V per (query, visible key) pair; a
             query at absolute position p sees p + 1 keys
  gdn        the gated delta rule per token and value head over S [d_k, d_v]: decay (1), S^T k (2), the rank-1
             update (2) and S^T q (2): 7 d_k d_v; the causal conv: 2 K per channel
Element-wise work (norms, RoPE, SwiGLU, routing, the shared-expert gate) is O(T D) and not counted.
Bytes: what crosses the bus per pass is Placement.stream_bytes_per_pass (weights only; the prompt's embedding
rows and the state hand-off are small and not counted).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

KINDS = ("gemm", "moe", "attention", "gdn")


@dataclass
class Work:
    gemm: float = 0.0
    moe: float = 0.0
    attention: float = 0.0
    gdn: float = 0.0
    by_layer: dict[int, float] = field(default_factory=dict)  # FLOPs per layer (the head: layer n_layer)

    def add(self, kind: str, layer: int, flops: float) -> None:
        setattr(self, kind, getattr(self, kind) + flops)
        self.by_layer[layer] = self.by_layer.get(layer, 0.0) + flops

    @property
    def flops(self) -> float:
        return self.gemm + self.moe + self.attention + self.gdn

    def as_dict(self) -> dict:
        d = asdict(self)
        d["flops"] = self.flops
        return d


def gemm_flops(rows: int, n: int, k: int) -> float:
    return 2.0 * rows * n * k


def attention_flops(n_head: int, head_dim: int, pos0: int, T: int) -> float:
    """Queries at positions pos0 .. pos0+T-1, each over the keys 0 .. its own position."""
    pairs = T * pos0 + T * (T + 1) // 2
    return 4.0 * n_head * head_dim * pairs


def gdn_flops(args, T: int) -> float:
    per_tok = 7 * args.ssm_n_v_heads * args.ssm_d_k * args.ssm_d_v + 2 * args.ssm_conv_kernel * args.ssm_conv_channels
    return float(T) * per_tok


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
        if kind == "gdn":
            w.add("gdn", i, gdn_flops(args, T))
        else:
            w.add("attention", i, attention_flops(args.n_head, args.head_dim, pos0, T))
    return w
