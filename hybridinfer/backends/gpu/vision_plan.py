"""The vision tower's card memory, pure functions of its shape (no GPU): the activation buffers one image takes, the
matrices' bytes (rows zero-padded to a multiple of K_STEP weights: the GEMM kernels step K by 32, and the MLP's
4304 is not one), and whether the weights stay resident, stream stage by stage through the encode, or the tower
runs on the CPU, in the room the text model's plan leaves on the card.

Stages, the unit a streamed tower uploads and frees: the patch embedding, each block's four products, the
merger's two. The vectors (LayerNorms and biases) stay on the card in every mode."""

from __future__ import annotations

from dataclasses import dataclass

from ...models.qwen3vl_vision import VisionArgs, matrix_names

K_STEP = 32
RESIDENT, STREAMED, CPU = "resident", "streamed", "cpu"


def padded(k: int) -> int:
    return -(-int(k) // K_STEP) * K_STEP


def matrix_shape(a: VisionArgs, name: str) -> tuple[int, int]:
    """(N, K) of product `name` (matrix_names'), K before padding."""
    c, f, m = a.n_embd, a.n_ff, a.merged_dim
    if name == "v.patch_embd":
        return c, a.prep.patch_dim
    if name == "mm.0":
        return m, m
    if name == "mm.2":
        return a.out_dim, m
    kind = name.rsplit(".", 1)[-1]
    shapes = {"attn_qkv": (3 * c, c), "attn_out": (c, c), "ffn_up": (f, c), "ffn_down": (c, f)}
    if not name.startswith("v.blk.") or kind not in shapes:
        raise KeyError(f"no vision product {name!r}")
    return shapes[kind]


def stages(a: VisionArgs) -> list[tuple[str, ...]]:
    """The products by stage, in the order the forward uses them."""
    names = matrix_names(a)
    blocks = [tuple(names[1 + 4 * i:5 + 4 * i]) for i in range(a.n_layer)]
    return [(names[0],), *blocks, tuple(names[-2:])]


def matrix_bytes(a: VisionArgs, itemsize) -> dict[str, int]:
    """Card bytes of each product's weight, rows padded; itemsize(name): 2 for F16 weights (kept as stored), 4 else."""
    out = {}
    for n in matrix_names(a):
        rows, k = matrix_shape(a, n)
        out[n] = rows * padded(k) * int(itemsize(n))
    return out


def vector_floats(a: VisionArgs) -> int:
    """The LayerNorms' weights and biases and the products' biases (the position table stays on the host)."""
    c, f = a.n_embd, a.n_ff
    block = 2 * c + 3 * c + c + 2 * c + f + c
    return a.n_layer * block + c + 2 * c + a.merged_dim + a.out_dim


def buffer_floats(a: VisionArgs, n: int) -> dict[str, int]:
    """The float32 buffers an image of n patches takes on the card (each a flat array the forward views):
    x: the residual rows, padded; h: a product's padded input (the patches, a LayerNorm's rows, the attention's
    output, the merged rows); y: a product's output; qkv: rotated q, k and v; o: the attention's output (and the
    post-LayerNorm rows); g: the GELU's padded rows (MLP, merger); rope: cos and sin of every patch."""
    c, f, hd, m, mp = a.n_embd, a.n_ff, a.head_dim, a.merged_dim, padded(a.merged_dim)
    nm = n // (a.merge_size ** 2)
    return {"x": n * padded(c), "h": max(n * padded(c), n * padded(a.prep.patch_dim), nm * mp),
            "y": max(n * 3 * c, n * f, nm * m, nm * a.out_dim), "qkv": 3 * n * c, "o": n * c,
            "g": max(n * padded(f), nm * mp), "rope": 2 * n * hd}


def max_patches(a: VisionArgs) -> int:
    """Patches of the largest image the preprocessing makes (its max_pixels)."""
    return a.prep.max_pixels // (a.patch_size ** 2)


def activation_bytes(a: VisionArgs, n: int) -> int:
    return 4 * sum(buffer_floats(a, n).values())


@dataclass(frozen=True)
class TowerPlan:
    mode: str  # RESIDENT, STREAMED or CPU
    reserve: int  # card bytes the tower may hold at once (0 on the CPU)
    weights: int  # of those, the matrices' at most
    activations: int  # and the largest image's buffers


def plan_tower(weights: dict[str, int], stage_list, vectors: int, activations: int, room: int) -> TowerPlan:
    """Resident where the vectors, every matrix and the largest image's activations fit `room` bytes; else streamed
    where the vectors, the largest stage's matrices and the activations do; else the CPU."""
    whole = sum(weights.values())
    stage = max((sum(weights[n] for n in s) for s in stage_list), default=0)
    for mode, w in ((RESIDENT, whole), (STREAMED, stage)):
        if vectors + w + activations <= room:
            return TowerPlan(mode, vectors + w + activations, w, activations)
    return TowerPlan(CPU, 0, 0, 0)


def tower_plan(a: VisionArgs, itemsize, room: int) -> TowerPlan:
    """plan_tower for the tower of `a` (itemsize as matrix_bytes') with its largest image."""
    return plan_tower(matrix_bytes(a, itemsize), stages(a), 4 * vector_floats(a), activation_bytes(a, max_patches(a)),
                      room)
