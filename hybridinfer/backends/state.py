"""DecoderState: everything one sequence owns, in one layout shared by every backend.

Per GDN layer:        conv (K-1, C) float32: the last K-1 pre-conv projections u, oldest first
                      (zeros before the first token); S (H_v, d_k, d_v) float32. GGUF head order.
Per attention layer:  k, v (n_ctx, H_kv, hd) float32; rows < pos are valid. K is stored after
                      k_norm and RoPE, V raw.
pos:                  the number of tokens consumed; the next token has position `pos`.
tokens:               (n_ctx,) int32; tokens[:pos] produced this state.

All buffers are allocated once, at `new()`; prefill and decode write into them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ContextLengthError


@dataclass
class DecoderState:
    n_ctx: int
    layer_types: tuple[str, ...]
    pos: int = 0
    tokens: np.ndarray = field(default=None)  # (n_ctx,) int32
    conv: list[np.ndarray | None] = field(default_factory=list)  # per layer: (K-1, C) f32 or None
    ssm: list[np.ndarray | None] = field(default_factory=list)  # per layer: (H_v, d_k, d_v) f32 or None
    k: list[np.ndarray | None] = field(default_factory=list)  # per layer: (n_ctx, H_kv, hd) f32 or None
    v: list[np.ndarray | None] = field(default_factory=list)  # per layer: (n_ctx, H_kv, hd) f32 or None

    @classmethod
    def new(cls, args, n_ctx: int) -> DecoderState:
        """Zero state for `args` (any architecture's ModelArgs) with room for `n_ctx` tokens.
        np.zeros maps pages lazily, so a long n_ctx costs only what is written. The per-layer arrays are views
        of two blocks (recurrent state, K/V): numpy asks the kernel for huge pages on blocks of 4 MiB and
        more, so the first write of a 60 MB recurrent state (a GPU prefill's hand-off) faults 2 MiB pages, not
        15,000 small ones."""
        st = cls(n_ctx=n_ctx, layer_types=tuple(args.layer_types), tokens=np.zeros(n_ctx, np.int32))
        gdn = [i for i, kind in enumerate(args.layer_types) if kind == "gdn"]
        attn = [i for i, kind in enumerate(args.layer_types) if kind != "gdn"]
        L = len(args.layer_types)
        st.conv, st.ssm, st.k, st.v = [None] * L, [None] * L, [None] * L, [None] * L
        if gdn:
            conv_shape = (args.ssm_conv_kernel - 1, args.ssm_conv_channels)
            ssm_shape = (args.ssm_n_v_heads, args.ssm_d_k, args.ssm_d_v)
            n_conv, n_ssm = int(np.prod(conv_shape)), int(np.prod(ssm_shape))
            rec = np.zeros(len(gdn) * (n_conv + n_ssm), np.float32)
            for j, i in enumerate(gdn):
                base = j * (n_conv + n_ssm)
                st.ssm[i] = rec[base : base + n_ssm].reshape(ssm_shape)
                st.conv[i] = rec[base + n_ssm : base + n_ssm + n_conv].reshape(conv_shape)
        if attn:
            kv = np.zeros((len(attn), 2, n_ctx, args.n_head_kv, args.head_dim), np.float32)
            for j, i in enumerate(attn):
                st.k[i], st.v[i] = kv[j, 0], kv[j, 1]
        return st

    def check_room(self, n_new: int) -> None:
        if self.pos + n_new > self.n_ctx:
            raise ContextLengthError(
                f"{self.pos} tokens in context + {n_new} new = {self.pos + n_new} exceeds the context "
                f"size n_ctx={self.n_ctx}")

    def reset(self) -> None:
        self.pos = 0
        for a in (*self.conv, *self.ssm):
            if a is not None:
                a.fill(0)

    @property
    def token_ids(self) -> np.ndarray:
        return self.tokens[: self.pos]

    def copy(self, n_ctx: int | None = None) -> DecoderState:
        """A deep copy (a snapshot) of the state at its current position."""
        n_ctx = self.n_ctx if n_ctx is None else n_ctx
        if n_ctx < self.pos:
            raise ContextLengthError(f"cannot copy a state at position {self.pos} into n_ctx={n_ctx}")
        st = DecoderState(n_ctx=n_ctx, layer_types=self.layer_types, pos=self.pos,
                          tokens=np.zeros(n_ctx, np.int32))
        st.tokens[: self.pos] = self.tokens[: self.pos]
        st.conv = [None if a is None else a.copy() for a in self.conv]
        st.ssm = [None if a is None else a.copy() for a in self.ssm]
        for src, dst in ((self.k, st.k), (self.v, st.v)):
            for a in src:
                if a is None:
                    dst.append(None)
                else:
                    b = np.zeros((n_ctx,) + a.shape[1:], np.float32)
                    b[: self.pos] = a[: self.pos]
                    dst.append(b)
        return st

    def restore(self, snap: DecoderState) -> None:
        """Overwrite this state's buffers with `snap` (no allocation)."""
        if snap.layer_types != self.layer_types:
            raise ValueError("snapshot belongs to a model with another layer layout")
        if snap.pos > self.n_ctx:
            raise ContextLengthError(f"snapshot at position {snap.pos} exceeds n_ctx={self.n_ctx}")
        self.pos = snap.pos
        self.tokens[: snap.pos] = snap.tokens[: snap.pos]
        for dst, src in ((self.conv, snap.conv), (self.ssm, snap.ssm)):
            for a, b in zip(dst, src, strict=True):
                if a is not None:
                    a[...] = b
        for dst, src in ((self.k, snap.k), (self.v, snap.v)):
            for a, b in zip(dst, src, strict=True):
                if a is not None:
                    a[: snap.pos] = b[: snap.pos]

    def nbytes(self) -> int:
        """Bytes of live state: recurrent buffers plus the K/V rows in use."""
        n = sum(a.nbytes for a in (*self.conv, *self.ssm) if a is not None)
        n += sum(a[: self.pos].nbytes for a in (*self.k, *self.v) if a is not None)
        return n


def check_tokens(tokens, n_vocab: int) -> np.ndarray:
    """The token ids of one forward call as int64, after checking there is at least one and each is in the
    vocabulary (a ValueError naming the first bad id)."""
    ids = np.asarray(tokens, dtype=np.int64).reshape(-1)
    if len(ids) == 0:
        raise ValueError("forward() needs at least one token")
    if ids.min() < 0 or ids.max() >= n_vocab:
        bad = int(ids[(ids < 0) | (ids >= n_vocab)][0])
        raise ValueError(f"token id {bad} is outside the vocabulary [0, {n_vocab})")
    return ids
