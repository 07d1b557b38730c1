"""Each mixer kind's per-sequence state is declared once (models/state_kinds.py) and everything else is derived
from it: no module outside models/ branches on a kind's name; DecoderState, the scheduler's byte budget, the
prefix-cache layout, the GPU's card buffers and its hand-off to the host all hold exactly the declared arrays.

The GPU hand-off runs here against a numpy stand-in for the card (FakeCard below: device arrays are numpy arrays,
asynchronous copies happen at once), which checks which rows go where; the real card runs it in tests/test_gpu_*."""

from __future__ import annotations

import ast
import math
import sys
import types
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from hybridinfer.backends.state import DecoderState
from hybridinfer.engine.prefix.layout import StateLayout, check_snapshot
from hybridinfer.engine.prefix.snapshot import from_state, recurrent_bytes, row_bytes
from hybridinfer.engine.scheduler import state_bytes
from hybridinfer.models import model_args
from hybridinfer.models.state_kinds import ARRAYS, KINDS, kind_of, layer_arrays, sequence_layer_types
from hybridinfer.tools.shape_model import ShapeModel

ROOT = Path(__file__).resolve().parents[1]
_BASE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, ssm_d_state=64, ssm_n_group=2,
             ssm_dt_rank=4)
TINY = dict(_BASE, n_ff=512)
TINY_MOE = dict(_BASE, n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256)


# ---- no branching on a kind's name ----------------------------------------------------------------------------

def _kind_strings(node) -> set[str]:
    """The kind names a constant (or a literal tuple / list / set of constants) spells."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value} & set(KINDS)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return set().union(*(_kind_strings(e) for e in node.elts)) if node.elts else set()
    return set()


def kind_branches(source: str) -> list[tuple[int, str]]:
    """(line, kind) of each place `source` decides by a mixer kind's name: a comparison with it (==, !=, in, not
    in), a dict literal keyed by it and indexed at once, or a count / index of it in a sequence."""
    hits = []
    for n in ast.walk(ast.parse(source)):
        if isinstance(n, ast.Compare):
            for side in (n.left, *n.comparators):
                hits += [(n.lineno, k) for k in _kind_strings(side)]
        elif isinstance(n, ast.Subscript) and isinstance(n.value, ast.Dict):
            hits += [(n.lineno, k) for key in n.value.keys if key is not None for k in _kind_strings(key)]
        elif isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr in ("count", "index"):
            hits += [(n.lineno, k) for arg in n.args for k in _kind_strings(arg)]
        elif isinstance(n, ast.MatchValue):
            hits += [(n.lineno, k) for k in _kind_strings(n.value)]
    return hits


def test_the_scan_finds_every_way_of_branching_on_a_kind():
    branching = {
        'if kind == "gdn": pass': 1,
        'x = [i for i, t in enumerate(a.layer_types) if t != "gdn"]': 1,
        'if "attention" in a.layer_types: pass': 1,
        'ok = kind in ("attention", "other")': 1,
        'p = "".join({"gdn": "G", "attention": "A"}[k] for k in ts)': 2,
        'n = a.layer_types.count("gdn")': 1,
        'match k:\n    case "gdn":\n        pass': 1,
    }
    for src, n in branching.items():
        assert len(kind_branches(src)) == n, src
    for src in ('w.add("gdn", i, f)', 'FAMILY = "attention"', 'call(("gdn", i), "gdn_rows")', 'x == "gemm"',
                'if kind_of(t).letter == "G": pass'):
        assert kind_branches(src) == [], src


def test_no_module_outside_models_branches_on_a_mixer_kind():
    found = []
    for p in sorted((ROOT / "hybridinfer").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("hybridinfer/models/"):
            continue  # the architectures name their layers' kinds; state_kinds.py declares them
        found += [f"{rel}:{line} decides by the kind name {k!r}" for line, k in kind_branches(p.read_text())]
    assert found == [], "\n".join(found)


# ---- derived from the declarations ------------------------------------------------------------------------------

def _args():
    yield model_args(ShapeModel("qwen35", TINY))
    yield model_args(ShapeModel("qwen35moe", TINY_MOE))
    yield SimpleNamespace(layer_types=("attention",) * 3, n_head_kv=2, head_dim=8)  # a llama's layers


def test_every_architecture_uses_declared_kinds_only(smollm_path):
    from hybridinfer.format.gguf_model import GGUFModel

    seen = set()
    with_mtp = replace(model_args(ShapeModel("qwen35", TINY)), mtp_norm="output_norm.weight")  # a file with the block
    for a in (*_args(), model_args(GGUFModel(smollm_path)), with_mtp):
        for t in sequence_layer_types(a):  # the trunk's layers, and the MTP block's rows where it has one
            kind_of(t)  # raises for an undeclared kind
            seen.add(t)
    assert seen == set(KINDS)
    assert sequence_layer_types(with_mtp, mtp_rows=False) == with_mtp.layer_types
    with pytest.raises(ValueError, match="'mamba' is not declared"):
        kind_of("mamba")


@pytest.mark.parametrize("n", [0, 1, 37])
def test_decoder_state_holds_the_declared_arrays_and_the_budget_counts_them(n):
    for a in _args():
        st = DecoderState.new(a, 64)
        want = {(s.name, i): s.full_shape(a, 64) for i, s in layer_arrays(a.layer_types)}
        got = {(name, i): arr.shape for name in ARRAYS for i, arr in enumerate(st.arrays[name]) if arr is not None}
        assert got == want
        assert all(getattr(st, name) is st.arrays[name] for name in ARRAYS)
        st.pos = n
        assert st.nbytes() == state_bytes(a, n) == sum(kind_of(t).nbytes(a, n) for t in a.layer_types)
        # the prefix cache's per-snapshot sizes are the same arrays: recurrent whole, one row per token
        assert recurrent_bytes(st) + n * (row_bytes(st) - 4) == state_bytes(a, n)


def test_snapshot_layout_and_parts_follow_the_declarations():
    a = next(_args())
    st = DecoderState.new(a, 32)
    rng = np.random.default_rng(0)
    for arr in st.buffers()[1:]:
        if arr is not None:  # K/V rows of a quantized cache type: random bytes
            arr[...] = (rng.standard_normal(arr.shape, dtype=np.float32) if arr.dtype.kind == "f"
                        else rng.integers(0, 256, arr.shape, dtype=np.uint8))
    st.pos = 9
    lay = StateLayout.of_state(st, a.n_vocab)
    assert {(name, i) for name, i, _, _ in lay.shapes} == {(s.name, i) for i, s in layer_arrays(a.layer_types)}
    snap = from_state(st, key=b"k", block_key=b"b", tail=(), parent=None, kv_from=2, seg_blocks=())
    check_snapshot(snap, a.layer_types, lay)
    for i, s in layer_arrays(a.layer_types):
        want = st.arrays[s.name][i][2:9] if s.per_token else st.arrays[s.name][i]
        assert np.array_equal(snap.parts[s.name][i], want)
    assert snap.nbytes == 4 * 7 + recurrent_bytes(st) + 7 * (row_bytes(st) - 4)


# ---- the GPU's copy of the state, on a numpy stand-in for the card --------------------------------------------

class FakeArray:
    """A device array: a numpy array, its own device pointer."""

    def __init__(self, a: np.ndarray):
        self.a = a

    shape = property(lambda self: self.a.shape)
    dtype = property(lambda self: self.a.dtype)
    size = property(lambda self: self.a.size)
    nbytes = property(lambda self: self.a.nbytes)
    gpudata = property(lambda self: self)

    def __getitem__(self, k):
        return FakeArray(self.a[k])

    def set(self, x):
        self.a[...] = x

    def get(self, ary=None, stream=None):
        return self.a.copy()


class FakeEvent:
    def record(self, stream=None):
        pass

    def wait_for_event(self, ev):  # as a stream
        pass

    def query(self):
        return True

    def synchronize(self):
        pass


@pytest.fixture
def fake_card(monkeypatch):
    """pycuda's gpuarray and driver as far as Buffers and StateHandoff use them; new device memory is NaN (or -1)
    so that what is read without being written shows."""
    gpuarray = types.ModuleType("pycuda.gpuarray")
    gpuarray.empty = lambda shape, dt: FakeArray(np.full(shape, {"f": np.nan, "u": 0xFF}.get(np.dtype(dt).kind, -1),
                                                          dt))
    drv = types.ModuleType("pycuda.driver")
    drv.pagelocked_empty = lambda shape, dt: np.full(shape, np.nan if np.dtype(dt).kind == "f" else 0xFF, dt)
    drv.Event = FakeEvent
    drv.Stream = lambda flags=0: FakeEvent()

    def dtoh(host, src, stream=None):
        host[...] = src.a

    def memset(dst, value, n, stream=None):
        assert n == dst.size
        dst.a.view(np.uint32)[...] = value

    drv.memcpy_dtoh_async, drv.memset_d32_async = dtoh, memset
    pycuda = types.ModuleType("pycuda")
    pycuda.gpuarray, pycuda.driver = gpuarray, drv
    for name, mod in (("pycuda", pycuda), ("pycuda.gpuarray", gpuarray), ("pycuda.driver", drv)):
        monkeypatch.setitem(sys.modules, name, mod)
    return drv


def _random_state(a, n_ctx: int, pos: int, seed: int) -> DecoderState:
    st = DecoderState.new(a, n_ctx)
    rng = np.random.default_rng(seed)
    for arr in st.buffers()[1:]:
        if arr is not None:  # K/V rows of a quantized cache type: random bytes
            arr[...] = (rng.standard_normal(arr.shape, dtype=np.float32) if arr.dtype.kind == "f"
                        else rng.integers(0, 256, arr.shape, dtype=np.uint8))
    st.pos = pos
    return st


def test_card_buffers_hold_the_declared_state(fake_card):
    from hybridinfer.backends.gpu.backend import MAX_SNAPS, Buffers

    for a in list(_args())[:2]:
        b = Buffers(a, 16, 64)
        assert {k: v.shape for k, v in b.state.items()} == \
            {(s.name, i): s.full_shape(a, 64) for i, s in layer_arrays(a.layer_types)}
        assert {k: v.shape for k, v in b.snap.items()} == \
            {s.name: (MAX_SNAPS, *s.full_shape(a, 0)) for _, s in layer_arrays(a.layer_types) if not s.per_token}
        arrays = [x for v in vars(b).values() for x in (v.values() if isinstance(v, dict) else [v])
                  if isinstance(x, FakeArray)]
        assert sum(x.nbytes for x in arrays) == Buffers.nbytes(a, 16, 64)
        kv_rows = sum(math.prod(s.full_shape(a, 64)) for i, s in layer_arrays(a.layer_types) if s.per_token)
        assert kv_rows == 2 * a.layer_types.count("attention") * 64 * a.n_head_kv * a.head_dim


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q8_0", "f16"), ("q4_0", "q8_0")])
@pytest.mark.parametrize("p0,T", [(0, 5), (7, 5), (3, 40)])  # T > chunk: the rows come straight from the card
def test_state_handoff_moves_exactly_the_declared_arrays(fake_card, p0, T, kv):
    """Also for K/V cache types: the card's rows and the pinned mirrors take the state's storage (fp16 values, or a
    quantized type's blocks as bytes) and move unchanged."""
    from hybridinfer.backends.gpu.backend import Buffers
    from hybridinfer.backends.gpu.handoff import StateHandoff
    from hybridinfer.models.state_kinds import with_cache_types

    a = next(_args())
    if a.head_dim % 32:
        a = replace(a, head_dim=64)
    a = with_cache_types(a, *kv)
    n_ctx, chunk = 64, 16
    b = Buffers(a, chunk, n_ctx)
    h = StateHandoff(b, chunk)
    st = _random_state(a, n_ctx, p0, seed=1)
    h.upload(st, None)
    for (name, i), card in b.state.items():
        host = st.arrays[name][i]
        if ARRAYS[name].per_token:
            assert np.array_equal(card.a[:p0], host[:p0])
        else:
            assert np.array_equal(card.a, host if p0 else np.zeros_like(host))
    # the pass: new recurrent state and rows [p0, p0 + T) on the card
    rng = np.random.default_rng(2)
    for (name, _), card in b.state.items():
        rows = card.a[p0 : p0 + T] if ARRAYS[name].per_token else card.a
        assert card.a.dtype == st.arrays[name][_].dtype
        rows[...] = (rng.standard_normal(rows.shape, dtype=np.float32) if rows.dtype.kind == "f"
                     else rng.integers(0, 256, rows.shape, dtype=np.uint8))
    before = {(name, i): arr.copy() for name in ARRAYS for i, arr in enumerate(st.arrays[name]) if arr is not None}
    h.begin(st, p0, T)
    for i in range(a.n_layer):
        h.layer_done(i, None)
        h.drain(wait_through=i - 2)
    h.drain(wait_through=a.n_layer - 1)  # between layers, every layer drained is down whole: none is left to the end
    for (name, j), card in b.state.items():
        got = st.arrays[name][j][p0 : p0 + T] if ARRAYS[name].per_token else st.arrays[name][j]
        assert np.array_equal(got, card.a[p0 : p0 + T] if ARRAYS[name].per_token else card.a), (name, j)
    h.finish()
    for (name, i), card in b.state.items():
        host, old = st.arrays[name][i], before[name, i]
        if ARRAYS[name].per_token:
            assert np.array_equal(host[p0 : p0 + T], card.a[p0 : p0 + T])
            assert np.array_equal(host[:p0], old[:p0]) and np.array_equal(host[p0 + T :], old[p0 + T :])
        else:
            assert np.array_equal(host, card.a)


def test_several_prompts_load_and_save_their_own_recurrent_state(fake_card):
    from hybridinfer.backends.gpu import walker
    from hybridinfer.backends.gpu.backend import Buffers

    a = next(_args())
    b = Buffers(a, 16, 64)
    m = SimpleNamespace(buf=b, drv=fake_card)
    pinned = walker.pinned_states(m, 2)
    assert [set(p) for p in pinned] == [{k for k in b.state if not ARRAYS[k[0]].per_token}] * 2
    fresh, restored = DecoderState.new(a, 64), _random_state(a, 64, 5, seed=3)
    for i, s in layer_arrays(a.layer_types):
        if s.per_token:
            continue
        walker.load_recurrent(fake_card, b, i, fresh, None)
        assert not b.state[s.name, i].a.any()
        walker.load_recurrent(fake_card, b, i, restored, None)
        assert np.array_equal(b.state[s.name, i].a, restored.arrays[s.name][i])
        walker.save_recurrent(fake_card, b, i, pinned[1], None)
        assert np.array_equal(pinned[1][s.name, i], restored.arrays[s.name][i])
        assert np.isnan(pinned[0][s.name, i]).all()


def test_several_prompts_states_come_down_during_the_pass(fake_card):
    """walker.ManyStates: a layer's mirrors go on into the prompts' host states between later layers, on copier
    threads, before the pass ends, each prompt its own; down() leaves every one complete, and a failed pass's
    abort() leaves no copier running."""
    import threading

    from hybridinfer.backends.gpu import walker
    from hybridinfer.backends.gpu.backend import Buffers

    a = next(_args())
    b = Buffers(a, 16, 64)
    m = SimpleNamespace(buf=b, drv=fake_card, stream=None)
    sts = [DecoderState.new(a, 64) for _ in range(3)]
    moves = walker.ManyStates(m, [walker.Item(np.arange(4), st) for st in sts])
    rng, want = np.random.default_rng(7), {}
    for i in range(a.n_layer):
        for j in range(len(sts)):  # the card computes prompt j's layer i, which goes down into its mirror
            for (name, layer), card in b.state.items():
                if layer == i and not ARRAYS[name].per_token:
                    card.a[...] = rng.standard_normal(card.a.shape, dtype=np.float32)
                    want[j, name, i] = card.a.copy()
            moves.after(j, i)()
        moves.layer_done(i)
        moves.drain(i)
        for job in list(moves._jobs):
            job.result()
        for (j, name, layer), w in want.items():  # two layers back and before: in the host state already
            if layer <= i - 2:
                assert np.array_equal(sts[j].arrays[name][layer], w), (i, j, name, layer)
    assert any(layer < a.n_layer - 2 for _, _, layer in want)
    moves.down()
    for (j, name, layer), w in want.items():
        assert np.array_equal(sts[j].arrays[name][layer], w), (j, name, layer)
    failed = walker.ManyStates(m, [walker.Item(np.arange(4), DecoderState.new(a, 64))])
    first = min(layer for _, _, layer in want)
    failed.after(0, first)()
    failed.layer_done(first)
    failed.drain(first + 2)  # handed on to a copier
    failed.abort()
    assert not any(t.name.startswith("hybridinfer-state-down") and t.is_alive() for t in threading.enumerate())


@pytest.mark.parametrize("kv", [("f32", "f32"), ("q8_0", "q4_0")])
def test_streamed_kv_pass_through_one_slot(fake_card, kv):
    """Buffers kv_stream: no layer keeps K/V on the card, one slot per per-token array takes n_ctx rows and the hidden
    rows n_rows; kv_up puts each prompt's cached rows of a layer at its base in the slot, kv_down takes the pass's new
    rows of that layer back into each host state and nothing else."""
    from hybridinfer.backends.gpu.backend import Buffers
    from hybridinfer.backends.gpu.handoff import kv_down, kv_up
    from hybridinfer.models.state_kinds import with_cache_types

    def htod(dst, host, stream=None):
        dst.a[...] = host

    fake_card.memcpy_htod_async = htod
    a = next(_args())
    if a.head_dim % 32:
        a = replace(a, head_dim=64)
    a = with_cache_types(a, *kv)
    b = Buffers(a, 16, 64, kv_stream=True, n_rows=20)
    assert b.h.shape[0] == 20 and b.pos.shape == (20,)
    assert not any(ARRAYS[name].per_token for name, _ in b.state) and set(b.slot) == {"k", "v"}
    assert {k: v.shape for k, v in b.state.items()} == \
        {(s.name, i): s.full_shape(a, 64) for i, s in layer_arrays(a.layer_types) if not s.per_token}
    arrays = [x for v in vars(b).values() for x in (v.values() if isinstance(v, dict) else [v])
              if isinstance(x, FakeArray)]
    assert sum(x.nbytes for x in arrays) == Buffers.nbytes(a, 16, 64, True, 20) < Buffers.nbytes(a, 16, 64)
    sts = [_random_state(a, 64, p, seed=10 + p) for p in (7, 0, 5)]
    prompts = [(sts[0], 0, 4), (sts[1], 11, 6), (sts[2], 17, 3)]  # bases: the cached and new rows before each
    rng = np.random.default_rng(4)
    for i, s in layer_arrays(a.layer_types):
        if not s.per_token:
            continue
        assert b.kv(s.name, i) is b.slot[s.name]
        kv_up(fake_card, b, i, prompts, None)
        slot = b.slot[s.name].a
        for st, base, _ in prompts:
            assert np.array_equal(slot[base : base + st.pos], st.arrays[s.name][i][: st.pos])
        slot[...] = (rng.standard_normal(slot.shape, dtype=np.float32) if slot.dtype.kind == "f"
                     else rng.integers(0, 256, slot.shape, dtype=np.uint8))  # the pass writes the rows
        before = [st.arrays[s.name][i].copy() for st in sts]
        kv_down(fake_card, b, i, prompts, None)
        for (st, base, T), old in zip(prompts, before, strict=True):
            host, p = st.arrays[s.name][i], st.pos
            assert np.array_equal(host[p : p + T], slot[base + p : base + p + T])
            assert np.array_equal(host[:p], old[:p]) and np.array_equal(host[p + T :], old[p + T :])
