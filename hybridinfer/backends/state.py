"""DecoderState: everything one sequence owns, in one layout shared by every backend.

Per layer:  the arrays its mixer kind declares (models/state_kinds.py), as `state.<array name>[layer]` (None in the
            layers of other kinds). GDN: conv (K-1, C) float32, the last K-1 pre-conv projections u, oldest first
            (zeros before the first token), and ssm (H_v, d_k, d_v) float32, S in GGUF head order. Attention: k, v
            (n_ctx, H_kv, hd) in the K / V cache type (float32, float16, or (n_ctx, H_kv, bytes) of a quantized
            type's blocks: StateArray.storage), rows < pos valid; K is stored after k_norm and RoPE, V raw.
pos:        the number of tokens consumed; the next token has position `pos`.
tokens:     (n_ctx,) int32; tokens[:pos] produced this state.
images:     the sequence's images (models/mrope.ImageSpan, by row): their rows take the encoder's embeddings and
            multimodal rotary positions, and a text row after one is at a rotary position below its row. The layout
            is the request's: restoring a snapshot leaves it as it is.

All buffers are allocated once, at `new()`; prefill and decode write into them.
"""

from __future__ import annotations

import contextlib
import mmap
import sys
import weakref
from dataclasses import dataclass, field

import numpy as np

from ..errors import ContextLengthError
from ..models.state_kinds import ARRAYS, layer_arrays

HUGE_BLOCK = 4 << 20  # blocks from this size ask for huge pages (as numpy's own allocations do)


def _mapped_zeros(n: int) -> np.ndarray:
    """n zero bytes on fresh anonymous pages, mapped lazily. Not np.zeros: glibc serves a calloc below its mmap
    threshold (which grows to 32 MiB as large blocks are freed) from the heap and then zeroes it whole, so a new
    state's 20 MB recurrent block sometimes cost 44 ms on a 2-core VM, inside a scheduler step. Blocks of
    HUGE_BLOCK and more ask for huge pages, so the first write of a 60 MB recurrent state (a GPU prefill's hand-off)
    faults 2 MiB pages, not 15,000 small ones. The pages go back to the system with the last view."""
    if n <= 0:
        return np.zeros(0, np.uint8)
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE)  # private, as the heap is (fd -1: anonymous); not shared memory
    if n >= HUGE_BLOCK and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # a kernel without transparent huge pages
            m.madvise(mmap.MADV_HUGEPAGE)
    return np.frombuffer(m, np.uint8)


@dataclass
class DecoderState:
    n_ctx: int
    layer_types: tuple[str, ...]
    pos: int = 0
    tokens: np.ndarray = field(default=None)  # (n_ctx,) int32
    # per declared array name (state_kinds.ARRAYS): per layer, the array or None; read as state.conv, state.k, ...
    arrays: dict[str, list[np.ndarray | None]] = field(default_factory=dict)
    images: tuple = ()  # models/mrope.ImageSpan, sorted by row
    # the byte blocks new() made (recurrent arrays, per-token rows) that the arrays view: SpareBlocks reuses them
    blocks: tuple = field(default=(), repr=False, compare=False)

    def __post_init__(self):
        L = len(self.layer_types)
        for name in ARRAYS:
            self.arrays.setdefault(name, [None] * L)

    def __getattr__(self, name: str):
        arrays = self.__dict__.get("arrays")
        if arrays is not None and name in arrays:
            return arrays[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @classmethod
    def new(cls, args, n_ctx: int, layer_types=None) -> DecoderState:
        """Zero state for `args` (any architecture's ModelArgs) with room for `n_ctx` tokens, holding the arrays of
        `layer_types` (default the trunk's; state_kinds.sequence_layer_types adds the MTP block's rows).
        The per-layer arrays are views of two blocks (recurrent state, per-token rows) of pages mapped lazily
        (_mapped_zeros), so a long n_ctx costs only what is written."""
        lt = tuple(args.layer_types if layer_types is None else layer_types)
        st = cls(n_ctx=n_ctx, layer_types=lt, tokens=np.zeros(n_ctx, np.int32))
        parts = [(i, s, s.storage(args)[0], s.full_shape(args, n_ctx)) for i, s in layer_arrays(lt)]
        blocks = []
        for per_token in (False, True):
            mine = [p for p in parts if p[1].per_token == per_token]
            # one byte block; each array starts at a multiple of 64 bytes (its dtype's alignment and a cache line)
            offs, off = [], 0
            for _, _, dt, shape in mine:
                offs.append(off)
                off += -(-dt.itemsize * int(np.prod(shape)) // 64) * 64
            block = _mapped_zeros(off)
            blocks.append(block)
            for (i, s, dt, shape), o in zip(mine, offs, strict=True):
                n = dt.itemsize * int(np.prod(shape))
                st.arrays[s.name][i] = block[o : o + n].view(dt).reshape(shape)
        st.blocks = tuple(blocks)
        return st

    def adopt(self, blocks: tuple) -> None:
        """Move this fresh state's arrays onto `blocks` (a released state's, of the same layout: SpareBlocks.take),
        each at its offset in its block; the recurrent block is zeroed, the per-token rows are left as they are
        (rows past `pos` are never read). The pages are then already mapped: a first write to fresh ones costs
        page faults (tens of ms for a 2,000-token prompt's K/V, more than copying a snapshot into them)."""
        if self.pos != 0 or [b.nbytes for b in blocks] != [b.nbytes for b in self.blocks]:
            raise ValueError("adopt() takes a fresh state and blocks of its own layout")
        for arrs in self.arrays.values():
            for i, a in enumerate(arrs):
                if a is None:
                    continue
                j = next(j for j, b in enumerate(self.blocks) if a.base is b)
                off = a.ctypes.data - self.blocks[j].ctypes.data
                arrs[i] = blocks[j][off : off + a.nbytes].view(a.dtype).reshape(a.shape)
        blocks[0].fill(0)
        self.blocks = tuple(blocks)

    def check_room(self, n_new: int) -> None:
        if self.pos + n_new > self.n_ctx:
            raise ContextLengthError(
                f"{self.pos} tokens in context + {n_new} new = {self.pos + n_new} exceeds the context "
                f"size n_ctx={self.n_ctx}")

    def held(self, per_token: bool):
        """(array spec, layer, array) of every array this state holds of one sort (per-token K/V rows, or the
        recurrent buffers a GDN layer keeps whole)."""
        for name, s in ARRAYS.items():
            if s.per_token == per_token:
                for i, a in enumerate(self.arrays[name]):
                    if a is not None:
                        yield s, i, a

    def reset(self) -> None:
        self.pos = 0
        for _, _, a in self.held(per_token=False):
            a.fill(0)

    @property
    def token_ids(self) -> np.ndarray:
        return self.tokens[: self.pos]

    def buffers(self) -> list:
        """The token ids and every per-layer array (None where a layer keeps none), in a fixed order."""
        return [self.tokens, *(a for name in ARRAYS for a in self.arrays[name])]

    def copy(self, n_ctx: int | None = None) -> DecoderState:
        """A deep copy (a snapshot) of the state at its current position."""
        n_ctx = self.n_ctx if n_ctx is None else n_ctx
        if n_ctx < self.pos:
            raise ContextLengthError(f"cannot copy a state at position {self.pos} into n_ctx={n_ctx}")
        st = DecoderState(n_ctx=n_ctx, layer_types=self.layer_types, pos=self.pos,
                          tokens=np.zeros(n_ctx, np.int32), images=self.images)
        st.tokens[: self.pos] = self.tokens[: self.pos]
        for s, i, a in self.held(per_token=False):
            st.arrays[s.name][i] = a.copy()
        for s, i, a in self.held(per_token=True):
            b = np.zeros((n_ctx,) + a.shape[1:], a.dtype)
            b[: self.pos] = a[: self.pos]
            st.arrays[s.name][i] = b
        return st

    def sharing_rows(self, pos: int) -> DecoderState:
        """A state at `pos` (within this one's tokens) that shares this state's tokens and per-token rows (rows
        before `pos` stay as they are when the state goes on) and has fresh, zero recurrent arrays: a GPU pass
        writes the recurrent state of a snapshot in the middle of its prompt into them (those it does not write,
        the MTP block's, stay zero: none of the block's rows; zero pages cost nothing until written)."""
        st = DecoderState(n_ctx=self.n_ctx, layer_types=self.layer_types, pos=pos, tokens=self.tokens,
                          images=self.images)
        for name, s in ARRAYS.items():
            st.arrays[name] = (list(self.arrays[name]) if s.per_token else
                               [None if a is None else np.zeros_like(a) for a in self.arrays[name]])
        return st

    def restore(self, snap: DecoderState) -> None:
        """Overwrite this state's buffers with `snap` (no allocation)."""
        if snap.layer_types != self.layer_types:
            raise ValueError("snapshot belongs to a model with another layer layout")
        if snap.pos > self.n_ctx:
            raise ContextLengthError(f"snapshot at position {snap.pos} exceeds n_ctx={self.n_ctx}")
        self.pos = snap.pos
        self.tokens[: snap.pos] = snap.tokens[: snap.pos]
        for s, i, a in self.held(per_token=False):
            a[...] = snap.arrays[s.name][i]
        for s, i, a in self.held(per_token=True):
            a[: snap.pos] = snap.arrays[s.name][i][: snap.pos]

    def nbytes(self) -> int:
        """Bytes of live state: recurrent arrays plus the per-token rows in use."""
        n = sum(a.nbytes for _, _, a in self.held(per_token=False))
        n += sum(a[: self.pos].nbytes for _, _, a in self.held(per_token=True))
        return n


class SpareBlocks:
    """The byte blocks of released states, kept (at most `most` sets) for the next new state to adopt, so that a
    sequence after another writes warm pages. A state gives its blocks only when nothing else still views them
    (a kernel binding, a snapshot not yet copied): then it is emptied, unusable after. `kept_bytes` is what the
    kept sets hold in touched pages (each: its recurrent arrays and its rows up to the position it ended at, plus
    RowsUndo's few draft rows), which a state budget counts (trim)."""

    SLACK_ROWS = 8  # rows a verify step writes past the final position (drafts rolled back)

    def __init__(self, most: int):
        self.most = most
        self._kept: list[tuple[tuple, int]] = []

    @property
    def kept_bytes(self) -> int:
        return sum(n for _, n in self._kept)

    def __len__(self) -> int:
        return len(self._kept)

    def give(self, state: DecoderState, rows: int | None = None) -> bool:
        """Keep `state`'s blocks if there is room and nothing but the state's own arrays views them (then the state
        is emptied); True when kept. A state whose blocks are held elsewhere is left as it was. rows: the positions
        of per-token rows written (default pos + SLACK_ROWS), which kept_bytes counts."""
        blocks = state.blocks
        if not blocks or len(self._kept) >= self.most:
            return False
        for j in range(len(blocks)):
            own = sum(1 for arrs in state.arrays.values() for a in arrs if a is not None and a.base is blocks[j])
            # the state's views, its blocks tuple and the call's argument; any more is a view held elsewhere
            if sys.getrefcount(blocks[j]) > own + 2:
                return False
        touched = self.touched(state, state.pos + self.SLACK_ROWS if rows is None else rows)
        state.arrays = {name: [None] * len(arrs) for name, arrs in state.arrays.items()}
        state.blocks, state.pos = (), 0
        self._kept.append((blocks, touched))
        return True

    @staticmethod
    def touched(state: DecoderState, rows: int) -> int:
        """Bytes of `state`'s recurrent arrays and of its first `rows` positions of per-token rows."""
        rows = min(state.n_ctx, rows)
        return sum(a.nbytes for _, _, a in state.held(False)) + sum(a[:rows].nbytes for _, _, a in state.held(True))

    def warm(self, state: DecoderState, rows: int) -> bool:
        """Keep a fresh `state`'s blocks with their pages written (its recurrent arrays and its first `rows` positions
        of per-token rows, zeros), as a released state's are: the first sequences then write warm pages too. In a
        VM a first write to a page is dear, and numpy's huge pages make a restore's few rows of each layer fault
        2 MiB each (a 2-core VM: 60-130 ms of a 21 MB restore into fresh blocks under load, against 2 ms into
        warm ones). False (nothing kept) when the set is full or the state has no blocks."""
        if not state.blocks or len(self._kept) >= self.most or state.pos:
            return False
        r = min(state.n_ctx, max(rows, 0))
        state.blocks[0].fill(0)
        for _, _, a in state.held(True):
            a[:r] = 0
        return self.give(state, r)

    def take(self, state: DecoderState) -> bool:
        """Give the fresh `state` a kept set of its layout (DecoderState.adopt); False when none is kept."""
        sizes = [b.nbytes for b in state.blocks]
        for j, (blocks, _) in enumerate(self._kept):
            if [b.nbytes for b in blocks] == sizes:
                del self._kept[j]
                state.adopt(blocks)
                return True
        return False

    def trim(self, room: int | None) -> None:
        """Let kept sets go until they hold at most `room` bytes (None: all of them)."""
        while self._kept and (room is None or self.kept_bytes > room):
            self._kept.pop()


class RowsUndo:
    """Going back inside a pass over `n` rows of one state (speculative verify): `undo(m)` leaves the state as
    after the first m rows alone (1 <= m <= n), bit for bit. K/V rows past the position are never read again, so
    only the recurrent arrays need it. Either a copy is kept after every row (`snap()`, a backend that runs the rows
    one at a time), or each GDN call's inputs are kept (`kept[layer]`: the copies the pass made of its row inputs,
    cpu/verify.py) and `again(kept, m)` runs those calls over their first m rows on the arrays as they were before
    the pass. Those arrays the pass wrote out of place (`pending`) still are; every other recurrent array is copied
    before the pass and put back."""

    def __init__(self, state: DecoderState, n: int, again=None, into: list[np.ndarray] | None = None, copy=None,
                 pending: list[tuple[np.ndarray, np.ndarray]] | None = None, current=None):
        """into: buffers of the copied arrays' shapes to copy them into (a backend reuses them from step to step:
        fresh pages cost ten times the copy). copy(dsts, srcs): the backend's copy of those arrays (the CPU's splits
        them over its threads: one thread copied a 9B's 48 MiB in 8 ms, a sixth of a decode step). pending: (the
        state's array, where the pass left its value after the n rows) for each array the pass read and left as it
        was: keeping all n rows copies those values in, fewer copies nothing. current(): whether those values are
        still there (the backend's buffers for them serve its next pass): a rollback after that raises."""
        self.state, self.n, self.pos0, self.again = state, n, state.pos, again
        self.copy = copy or copy_each
        self.pending, self.current = list(pending or ()), current
        skip = {id(a) for a, _ in self.pending}
        self.copied = [a for _, _, a in state.held(per_token=False) if id(a) not in skip]
        if into is None:
            self.saved = [a.copy() for a in self.copied]
        else:
            self.saved = into
            self.copy(into, self.copied)
        self.kept: dict[int, tuple] = {}
        self.after: list[list[np.ndarray]] = []

    def snap(self) -> None:
        self.after.append([a.copy() for a in self.copied])

    def __call__(self, m: int) -> None:
        if not 1 <= m <= self.n:
            raise ValueError(f"undo keeps 1 to {self.n} rows, got {m}")
        if self.pending and self.current is not None and not self.current():
            raise RuntimeError("this verify step's rollback comes after another verify pass, which took its buffers")
        st = self.state
        st.pos = self.pos0 + m
        if m == self.n:
            if self.pending:
                self.copy([a for a, _ in self.pending], [x for _, x in self.pending])
            return
        if self.saved:
            self.copy(self.copied, self.after[m - 1] if self.after else self.saved)
        if (self.saved or self.pending) and not self.after:
            self.again(self.kept, m)


def copy_each(dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
    """dst[...] = src for each pair, numpy's copy one at a time (Backend.copy_into's default)."""
    for d, s in zip(dsts, srcs, strict=True):
        np.copyto(d, s)


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


KEEP_ROWS = 16  # final-norm rows kept per state for the MTP drafter (Backend.hidden_rows)


def keep_rows(kept: dict, state, first: int, rows) -> None:
    """Keep a copy of the final-norm rows of positions first.. of `state` in `kept` (by id): joined to the rows kept
    before when they follow them or overwrite their tail (rows past a rollback), the last KEEP_ROWS of them (or all of
    this call's: a prompt chunk's, which the MTP drafter reads after the chunk)."""
    rows = np.asarray(rows, dtype=np.float32)
    n_new = len(rows)
    old = kept.get(id(state))
    if old is None:  # the rows go with the state (one that never reaches Backend.release too)
        weakref.finalize(state, kept.pop, id(state), None)
    if old is not None and old[0] <= first <= old[0] + len(old[1]):
        rows = np.concatenate([old[1][: first - old[0]], rows])
        first = old[0]
    cut = max(len(rows) - max(KEEP_ROWS, n_new), 0)  # never fewer than this call's rows
    kept[id(state)] = (int(first + cut), np.array(rows[cut:], copy=True))
