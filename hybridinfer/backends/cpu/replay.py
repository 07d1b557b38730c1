"""A decode step recorded once and replayed as one native call (DecodeReplay; BatchReplay for B sequences;
RowsReplay for a verify step of several sequences).

`SimdLib.bind` checks a call's arguments once and returns a `Bound`: the C entry point and its converted
arguments. The CPU backend records a decode step's operations at the first step of a sequence (a list of
Bound calls, in order, and a Python callable for what has no native twin: the token's embedding row);
`Steps` packs runs of Bound calls into arrays of `hi_step` (native/simd/hi_simd.h) that `hi_replay_run` runs
back to back, so later steps return to Python once per run instead of once per operation. The arrays hold
addresses: a Steps keeps every array it points at alive (through the Bound calls' references).
"""

from __future__ import annotations

import weakref
from bisect import bisect_right
from functools import partial

import numpy as np

from ...models.mrope import shift_at
from ..state import DecoderState
from .simd_native import _check_rc

# entry points whose argument at this index (after the context) is the token's position: a Bound of them is
# called with the position, and a step of them gets it from hi_replay_run
POS_ARGS = {"attn_step": 13, "attn_rows": 15}  # attn_rows: the offset added to its recorded positions
POS_ARRAYS = {"attn_rows": 14}  # entry points whose argument at this index is an array of a position a sequence


class Bound:
    """A native call with its arguments checked and converted once (SimdLib.bind). Call it with no argument,
    or with the position for the calls in POS_ARGS (their recorded position is replaced)."""

    __slots__ = ("fn", "cargs", "name", "keep", "pos_arg")

    def __init__(self, fn, cargs: tuple, name: str, keep: tuple):
        self.fn, self.cargs, self.name, self.keep = fn, cargs, name, keep
        self.pos_arg = POS_ARGS.get(name)

    def __call__(self, pos: int | None = None) -> None:
        cargs = self.cargs
        if self.pos_arg is not None:
            if pos is None:
                raise TypeError(f"{self.name} needs the token's position")
            j = 1 + self.pos_arg
            cargs = cargs[:j] + (int(pos),) + cargs[j + 1 :]
        rc = self.fn(*cargs)
        if rc:
            _check_rc(rc, self.name)


class Steps:
    """Bound calls packed for hi_replay_run; run(pos) runs them all at the token position pos. With `ns` set to
    an int64 array of len(calls) (benchmarks), each run adds every call's nanoseconds to it."""

    def __init__(self, simd, calls: list[Bound]):
        ffi = simd._ffi
        self._ffi, self._lib, self._simd = ffi, simd._lib, simd
        self.calls = calls
        self._arr = ffi.new("hi_step[]", len(calls))
        self._own: list = []  # C arrays made here from list arguments
        self._failed = ffi.new("int64_t *")
        self.ns = None
        # where addresses sit (for a replay's rebind): (step, argument, value) of each pointer argument, and (step,
        # argument, C array, the list it was made from) of each list argument
        self.ptrs: list[tuple] = []
        self.lists: list[tuple] = []
        for k, (s, b) in enumerate(zip(self._arr, calls, strict=True)):
            self._pack(s, b, k)

    def _pack(self, s, b: Bound, k: int = 0) -> None:
        ffi = self._ffi
        s.op = getattr(self._lib, "HI_OP_" + b.name.upper())
        s.pos_arg = -1 if b.pos_arg is None else b.pos_arg
        params = ffi.typeof(ffi.addressof(self._lib, "hi_" + b.name)).args[1:]
        cargs = b.cargs[1:]
        if len(cargs) != len(params) or len(params) > len(s.a):
            raise ValueError(f"{b.name}: {len(cargs)} arguments for {len(params)} parameters")
        for j, (t, v) in enumerate(zip(params, cargs, strict=True)):
            if t.kind == "pointer":
                if isinstance(v, list | tuple):  # cffi converted it per call: one array now, kept
                    items, v = v, ffi.new(ffi.getctype(t.item, "[]"), v)
                    self._own.append(v)
                    self.lists.append((k, j, v, items))
                else:
                    self.ptrs.append((k, j, v))
                s.a[j].p = ffi.cast("void *", v)
            elif t.kind == "primitive" and t.cname in ("float", "double"):
                s.a[j].f = float(v)
            elif t.kind in ("primitive", "enum"):
                s.a[j].i = int(v)
            else:
                raise TypeError(f"{b.name}: parameter {j} of C type {t.cname} cannot be recorded")
        if b.pos_arg is not None:
            s.a[b.pos_arg].i = 0  # hi_replay_run adds the position

    def run(self, pos: int) -> None:
        ns = self._ffi.NULL
        if self.ns is not None:
            if self.ns.dtype != np.int64 or self.ns.shape != (len(self.calls),) or not self.ns.flags.c_contiguous:
                raise ValueError(f"Steps.ns must be a contiguous int64 array of {len(self.calls)}, got "
                                 f"{self.ns.dtype} {self.ns.shape}")
            ns = self._ffi.from_buffer("int64_t[]", self.ns)
        rc = self._lib.hi_replay_run(self._simd._c, self._arr, len(self.calls), int(pos), self._failed, ns)
        if rc:
            _check_rc(rc, self.calls[self._failed[0]].name)

    def lighten(self, where) -> tuple | None:
        """Let go of the Bound calls (and so of the sequences' arrays they reference), keeping alive everything else
        the packed steps point at. where: a _Where over the recorded sequences' arrays. Returns the sites to patch
        (direct: [(step, argument, sequence, array)], listed: [(C array, index, sequence, array)], positions: [(C
        array, sequence)]), or None, nothing changed, where an argument cannot be patched (an address inside a
        sequence's array, not at its start)."""
        ffi = self._ffi
        direct, listed, positions = [], [], []
        try:
            for k, j, v in self.ptrs:
                if POS_ARRAYS.get(self.calls[k].name) == j:  # a C array of the positions (its own memory)
                    positions += [(v, i) for i in range(len(v))]
                    continue
                at = where.at(int(ffi.cast("uintptr_t", v)))
                if at is not None:
                    direct.append((k, j, *at))
            for _, _, arr, items in self.lists:
                if ffi.typeof(arr).item.kind != "pointer":
                    continue  # numbers (a rope shift a sequence): rebind requires the recorded ones
                for i, v in enumerate(items):
                    at = where.at(int(ffi.cast("uintptr_t", v)))
                    if at is not None:
                        listed.append((arr, i, *at))
        except LookupError:
            return None
        hold = []  # what the Bound calls kept alive, but the sequences' arrays (those go with their sequences)
        for b in self.calls:
            hold += [y for y in _flat((*b.cargs, *b.keep)) if not where.holds(y, ffi)]
        self._hold = hold
        self.calls = [_Name(b.name) for b in self.calls]
        self.ptrs, self.lists = [], []  # their values referenced the arrays too
        return direct, listed, positions

    def patch(self, sites, address, positions: list[int]) -> None:
        """Point lighten's sites at address(sequence, array), the recorded positions at `positions` (a sequence's)."""
        ffi = self._ffi
        direct, listed, pos = sites
        for k, j, seq, a in direct:
            self._arr[k].a[j].p = ffi.cast("void *", address(seq, a))
        for arr, i, seq, a in listed:
            arr[i] = ffi.cast(ffi.typeof(arr).item, address(seq, a))
        for arr, seq in pos:
            arr[seq] = positions[seq]


class _Name:
    """A lightened step's name (errors and profiles name a failed or timed call)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name


def segments(simd, steps: list) -> list:
    """A recorded step's operations as runs of Bound calls packed into Steps (one native call each) and the rest
    (zero-argument Python callables, or Bound subclasses such as the profiler's clocked calls) as they are."""
    out: list = []
    run: list[Bound] = []
    for f in steps + [None]:
        if type(f) is Bound:
            run.append(f)
            continue
        if run:
            out.append(Steps(simd, run))
            run = []
        if f is not None:
            out.append(f)
    return out


def run_segments(segs: list, pos: int) -> None:
    """segments() in order, at position pos (DecodeReplay: the state's; BatchReplay: the offset since recording)"""
    for s in segs:
        if type(s) is Steps:
            s.run(pos)
        elif getattr(s, "pos_arg", None) is not None:
            s(pos)
        else:
            s()


class _Where:
    """The arrays of a recorded step's sequences by address: (sequence, array index) of an array's start, and a
    LookupError for an address inside one (a view no patch can follow)."""

    def __init__(self, arrays: list[list]):
        self.start: dict[int, tuple[int, int]] = {}
        spans = []
        self.ids = set()
        for j, arrs in enumerate(arrays):
            for b, a in enumerate(arrs):
                if a is None or not a.nbytes:
                    continue
                lo = a.ctypes.data
                if lo in self.start:
                    raise LookupError(lo)  # two arrays at one address: which one a pointer meant is unknown
                self.start[lo] = (j, b)
                spans.append((lo, lo + a.nbytes))
                self.ids.add(id(a))
        spans.sort()
        self.lo, self.spans = [lo for lo, _ in spans], spans

    def at(self, addr: int) -> tuple[int, int] | None:
        hit = self.start.get(addr)
        if hit is not None:
            return hit
        i = bisect_right(self.lo, addr) - 1
        if i >= 0 and addr < self.spans[i][1]:
            raise LookupError(addr)
        return None

    def holds(self, y, ffi) -> bool:
        """whether y is one of the arrays, or a C pointer to one"""
        if isinstance(y, np.ndarray):
            return id(y) in self.ids
        if isinstance(y, ffi.CData) and ffi.typeof(y).kind in ("pointer", "array"):
            return int(ffi.cast("uintptr_t", y)) in self.start
        return False


def _flat(xs):
    for x in xs:
        yield from (x if isinstance(x, list | tuple) else (x,))


def _layout(arrays: list) -> tuple:
    return tuple(None if a is None else (a.shape, a.dtype.str) for a in arrays)


class _Rebinds:
    """What DecodeReplay and BatchReplay share to be taken over by other sequences (BatchReplay's docstring): the
    recorded sequences' arrays (`arrays`, a list per sequence) found in the packed steps once (`_lighten`), then
    rewritten for others whose arrays have the same shapes (`_repoint`)."""

    _sites: list | bool | None = None  # lightened steps' patch sites; False: cannot be rebound
    segments: list
    ffi: object

    def _lighten(self, arrays: list[list]) -> bool:
        """The steps' patch sites found once (and the Bound calls let go); False where it cannot be rebound."""
        if self._sites is None:
            self._sites = False
            # Python steps (the embedding row, an expert cache's reads) must hold none of the sequences' arrays
            if all(type(g) is Steps or type(g) is partial for g in self.segments):
                try:
                    where = _Where(arrays)
                except LookupError:
                    return False
                sites = []
                for g in self.segments:
                    if type(g) is partial and any(where.holds(y, self.ffi)
                                                  for y in _flat((*g.args, *g.keywords.values()))):
                        return False
                    if type(g) is Steps:
                        got = g.lighten(where)
                        if got is None:
                            return False
                        sites.append((g, got))
                self._sites = sites
        return self._sites is not False

    def _repoint(self, arrays: list[list], pos: list[int]) -> None:
        for g, sites in self._sites:  # type: ignore[union-attr]
            g.patch(sites, lambda j, b: arrays[j][b].ctypes.data, pos)

    @classmethod
    def rebound(cls, replays: dict, states, key):
        """A replay of the workspace taken over by `states` (the latest that can be), kept under `key`."""
        for k in reversed(list(replays)):
            rp = replays[k]
            if type(rp) is cls and rp.rebind(states):
                del replays[k]
                replays[key] = rp
                return rp
        return None


class DecodeReplay(_Rebinds):
    """A decode step's operations as recorded over one workspace for one state, replayed in order: runs of
    Bound calls as Steps (one native call each), the rest (zero-argument Python callables) as they are; the
    position comes from the state when it runs. Valid while the state holds the same arrays (the replay keeps
    them alive, so their ids cannot be reused)."""

    MAX_REPLAYS = 16  # per workspace: sequences decoded in turn over it

    def __init__(self, simd, state: DecoderState, steps: list, out):
        self.state = weakref.ref(state)
        self.shift = shift_at(state.images, state.pos)  # bound into the attention calls
        self.arrays = self._arrays(state)
        self.ids = tuple(map(id, self.arrays))
        self.layout = _layout(self.arrays)
        self.out, self.ffi = out, simd._ffi
        self.segments = segments(simd, steps)

    def detach(self) -> bool:
        """Let go of the state (it has ended); False where the replay cannot be rebound (then drop it)."""
        if not self._lighten([self.arrays]):
            return False
        self.state, self.arrays, self.ids = (lambda: None), [], ()
        return True

    def rebind(self, st: DecoderState) -> bool:
        """Point the recording at `st` when its arrays have the recorded shapes and its rope shift the recorded
        one (each call takes the position from the state when it runs); else False, nothing changed."""
        arrays = self._arrays(st)
        if (_layout(arrays) != self.layout or shift_at(st.images, st.pos) != self.shift
                or not self._lighten([self.arrays])):
            return False
        self._repoint([arrays], [st.pos])
        self.state, self.arrays, self.ids = weakref.ref(st), arrays, tuple(map(id, arrays))
        return True

    def run(self, st: DecoderState):
        run_segments(self.segments, st.pos)
        return self.out

    @staticmethod
    def _arrays(st: DecoderState) -> list:
        return st.buffers()

    def holds(self, ids: set[int]) -> bool:
        """whether it keeps any of these arrays (by id) alive"""
        return any(i in ids for i in self.ids)

    def valid_for(self, st: DecoderState) -> bool:
        return (self.state() is st and tuple(map(id, self._arrays(st))) == self.ids
                and shift_at(st.images, st.pos) == self.shift)

    @classmethod
    def keep(cls, replays: dict, simd, st: DecoderState, steps: list, out) -> None:
        replays.pop(id(st), None)
        while len(replays) >= cls.MAX_REPLAYS:
            replays.pop(next(iter(replays)))
        replays[id(st)] = cls(simd, st, steps, out)


class BatchReplay(_Rebinds):
    """One decode step of B sequences (CPUModel.decode_batch) as recorded over a workspace of B rows, replayed in
    order like DecodeReplay. Every sequence advances one position a step, so the attention call (attn_rows) keeps the
    positions it was recorded with and the replay runs at the number of steps since: the offset it adds to them.
    Valid while the same states, in the same order, hold the same arrays and have all advanced by the same number
    of steps.

    Another set of B sequences whose arrays have the same shapes takes a recording over by `rebind`: the packed
    steps' addresses of the old sequences' arrays and their positions are rewritten, which costs a small fraction
    of recording the step again through Python (on a server, sequences join and leave every few steps). A sequence
    that ends `detach`es the replays it is in: they let go of every sequence's arrays (its memory goes with it) and
    wait for a rebind."""

    MAX_REPLAYS = 8  # per workspace: sets of sequences decoded in turn over it

    def __init__(self, simd, states: list[DecoderState], steps: list, out):
        self.out, self.ffi = out, simd._ffi
        self.segments = segments(simd, steps)
        self._attach(states, [DecodeReplay._arrays(st) for st in states])
        self.layout = [_layout(a) for a in self.arrays]
        self.shifts = [shift_at(st.images, st.pos) for st in states]

    def _attach(self, states: list[DecoderState], arrays: list[list]) -> None:
        self.states = [weakref.ref(st) for st in states]
        self.arrays = arrays  # kept alive: their ids cannot be reused
        self.ids = [tuple(map(id, a)) for a in arrays]
        self.pos0 = [st.pos for st in states]

    def holds(self, ids: set[int]) -> bool:
        """whether it keeps any of these arrays (by id) alive"""
        return any(i in ids for t in self.ids for i in t)

    @staticmethod
    def key(states: list[DecoderState]) -> tuple:
        return tuple(map(id, states))

    def delta(self, states: list[DecoderState]) -> int | None:
        """steps since the recording when the replay holds for these states, else None"""
        if len(states) != len(self.states):
            return None
        d = states[0].pos - self.pos0[0]
        for ref, ids, p0, sh, st in zip(self.states, self.ids, self.pos0, self.shifts, states, strict=True):
            if (ref() is not st or st.pos - p0 != d or tuple(map(id, DecodeReplay._arrays(st))) != ids
                    or shift_at(st.images, st.pos) != sh):
                return None
        return d if d >= 0 else None

    def run(self, delta: int):
        run_segments(self.segments, delta)
        return self.out

    def detach(self) -> bool:
        """Let go of the sequences (one of them has ended); False where it cannot be rebound (then drop it)."""
        if not self._lighten(self.arrays):
            return False
        self._attach([], [])
        return True

    def rebind(self, states: list[DecoderState]) -> bool:
        """Point the recording at `states` (at their positions, offset 0), when their arrays have the recorded
        shapes and their rope shifts the recorded ones; else False, nothing changed."""
        if len(states) != len(self.layout):
            return False
        arrays = [DecodeReplay._arrays(st) for st in states]
        if ([_layout(a) for a in arrays] != self.layout
                or [shift_at(st.images, st.pos) for st in states] != self.shifts or not self._lighten(self.arrays)):
            return False
        self._repoint(arrays, [st.pos for st in states])
        self._attach(states, arrays)
        return True

    @classmethod
    def keep(cls, replays: dict, simd, states: list[DecoderState], steps: list, out) -> None:
        k = cls.key(states)
        replays.pop(k, None)
        while len(replays) >= cls.MAX_REPLAYS:
            replays.pop(next(iter(replays)))
        replays[k] = cls(simd, states, steps, out)


def at_pos(b: Bound, st: DecoderState):
    """A recorded call that runs at its own sequence's position when replayed (a verify step of several sequences,
    RowsReplay: each sequence's attention at its state's position), not at the step's one position."""
    ref = weakref.ref(st)
    return lambda: b(ref().pos)


class RowsReplay:
    """A verify step of several sequences (cpu/verify.forward_rows), rows split among them as recorded, replayed in
    order like DecodeReplay: each attention call at its own sequence's position (at_pos), so the sequences may have
    advanced by different numbers of positions since. Valid while the same states, in the same order, hold the same
    arrays (the split is the workspace's)."""

    MAX_REPLAYS = 8  # per workspace: sets of sequences verified in turn over it

    def __init__(self, simd, states: list[DecoderState], steps: list, out):
        self.states = [weakref.ref(st) for st in states]
        self.arrays = [DecodeReplay._arrays(st) for st in states]  # kept alive: their ids cannot be reused
        self.ids = [tuple(map(id, a)) for a in self.arrays]
        self.out = out
        self.segments = segments(simd, steps)

    @staticmethod
    def key(states: list[DecoderState]) -> tuple:
        return tuple(map(id, states))

    def holds(self, ids: set[int]) -> bool:
        """whether it keeps any of these arrays (by id) alive"""
        return any(i in ids for t in self.ids for i in t)

    def valid_for(self, states: list[DecoderState]) -> bool:
        return len(states) == len(self.states) and all(
            ref() is st and tuple(map(id, DecodeReplay._arrays(st))) == ids
            for ref, ids, st in zip(self.states, self.ids, states, strict=True))

    def run(self):
        run_segments(self.segments, 0)  # no call left at the step's position: each has its own (at_pos)
        return self.out

    @classmethod
    def keep(cls, replays: dict, simd, segs, steps: list, out) -> None:
        states = [st for st, _, _ in segs]
        k = cls.key(states)
        replays.pop(k, None)
        while len(replays) >= cls.MAX_REPLAYS:
            replays.pop(next(iter(replays)))
        replays[k] = cls(simd, states, steps, out)
