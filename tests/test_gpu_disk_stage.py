"""GPU prefill's routed experts read from the GGUF under a RAM budget (gpu/disk_stage.py, gpu/streamer.py), on a numpy
stand-in for pycuda: device memory is one numpy arena whose addresses are its real pointers, and the copy stream is
deferred (a copy runs when an event after it is waited for, reading the host buffer as it is then), so a staging
buffer written again before the card has copied it shows as wrong bytes on the card."""

from __future__ import annotations

import os
import shutil
import sys
import time
import types

import numpy as np
import pytest

from hybridinfer.backends.expert_io import ExpertReader
from hybridinfer.backends.gpu.disk_stage import PIECE, DiskStager, file_offsets, stage_plan
from hybridinfer.backends.gpu.expert_card import own_weights
from hybridinfer.backends.gpu.placement import Placement, weights_of
from hybridinfer.errors import ExpertReadError
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.models import model_args
from hybridinfer.tools.synth import synth_model

SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=16, n_expert_used=4,
             n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
PINS = {0, 5, 6, 15}  # layer 1's experts the card keeps


class DevArray(np.ndarray):
    """Device memory: a view of the arena; its device address is its pointer."""

    @property
    def gpudata(self) -> int:
        return self.__array_interface__["data"][0]


class Card:
    def __init__(self, nbytes: int = 96 << 20):
        self.mem = np.zeros(nbytes, np.uint8).view(DevArray)
        self.base, self.top = self.mem.gpudata, 0
        self.htod: list[tuple[int, int]] = []  # (device address, bytes) of every host-to-device copy run

    def alloc(self, n: int) -> DevArray:
        a = self.mem[self.top : self.top + n]
        self.top += -(-max(n, 1) // 256) * 256
        assert self.top <= self.mem.size
        return a

    def at(self, addr: int, n: int) -> np.ndarray:
        return self.mem[addr - self.base : addr - self.base + n]


class Stream:
    def __init__(self):
        self.ops: list = []
        self.ran = 0

    def run(self, upto: int) -> None:
        while self.ran < upto:
            self.ops[self.ran]()
            self.ran += 1

    def wait_for_event(self, ev) -> None:  # what this stream does next needs ev's work done
        ev.synchronize()


class Event:
    def __init__(self):
        self.stream, self.pos = None, 0

    def record(self, stream=None):
        self.stream, self.pos = stream, len(stream.ops) if stream is not None else 0

    def synchronize(self):
        if self.stream is not None:
            self.stream.run(self.pos)

    def query(self):
        return self.stream is None or self.stream.ran >= self.pos

    def time_since(self, other):
        return 0.0


@pytest.fixture
def card(monkeypatch):
    c = Card()
    drv = types.ModuleType("pycuda.driver")
    drv.Stream, drv.Event = Stream, Event
    drv.pagelocked_empty = lambda n, dt: np.full(n, 0xEE, dt)  # what is not written shows

    def htod(dst, host, stream):
        def op():
            c.at(dst, host.nbytes)[:] = host.view(np.uint8).reshape(-1)
            c.htod.append((dst, host.nbytes))
        stream.ops.append(op)

    def dtod(dst, src, n, stream):
        stream.ops.append(lambda: c.at(dst, n).__setitem__(slice(None), c.at(src, n)))

    drv.memcpy_htod_async, drv.memcpy_dtod_async = htod, dtod
    ga = types.ModuleType("pycuda.gpuarray")
    ga.empty = lambda n, dt: c.alloc(int(n) * np.dtype(dt).itemsize).view(dt)

    def to_gpu(x):
        x = np.ascontiguousarray(x)
        a = c.alloc(x.nbytes).view(x.dtype).reshape(x.shape)
        a[...] = x
        return a

    ga.to_gpu = to_gpu
    pycuda = types.ModuleType("pycuda")
    pycuda.driver, pycuda.gpuarray = drv, ga
    for name, mod in (("pycuda", pycuda), ("pycuda.driver", drv), ("pycuda.gpuarray", ga)):
        monkeypatch.setitem(sys.modules, name, mod)
    c.drv = drv
    return c


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    p = tmp_path_factory.mktemp("gpu_disk") / "moe.gguf"
    synth_model(p, "qwen35moe", SHAPE, "q8_0", seed=4)
    return str(p)


def _placement(gm, a, own=None):
    """Every matrix on the card but the routed experts of layers 0, 1 and 3 (layer 1 keeps PINS on the card; layer 2's
    are all there). own: an expert split's card, its experts [own[0], own[1]) of each layer (PINS
    then its own ids, those below its count)."""
    infos = {w.name: w for w in weights_of(gm, a, matrices_only=True)}
    pins = set(PINS)
    if own is not None:
        infos = {w.name: w for w in own_weights(infos.values(), own)}
        pins = {e for e in PINS if e < own[1] - own[0]}
    exps = {n for n, w in infos.items() if w.n_expert}
    streamed = {i: sorted(n for n in exps if infos[n].layer == i) for i in (0, 1, 3)}
    p = Placement(1 << 40, resident=set(infos) - exps | {n for n in exps if infos[n].layer == 2},
                  pinned_experts={n: set(pins) for n in streamed[1]}, streamed=streamed)
    return p, infos


def _streamer(card, path, reader=None, own=None):
    from hybridinfer.backends.gpu.streamer import Streamer

    gm = GGUFModel(path)
    a = model_args(gm)
    p, infos = _placement(gm, a, own)
    reader = reader or ExpertReader(path, "pread", 2, 5.0, max_range=PIECE)
    plan = stage_plan(p, infos, file_offsets(gm, infos))
    return Streamer(gm, p, infos, card.drv.Stream(), disk=(reader, plan)), gm, a


def _run_pass(st, gm, a):
    """As walker.walk runs the layers: each layer's weights compared with the file's bytes when the card uses them."""
    from hybridinfer.backends.gpu.streamer import file_bytes

    st.prefetch(0)
    for i in range(a.n_layer):
        st.prefetch(i + 1)
        names = [n for n in st.infos if st.infos[n].layer == i]
        W = st.weights(i, names)
        for n in names:
            want = file_bytes(gm, st.infos[n])  # the whole tensor, or an expert split's card's own experts
            assert np.array_equal(np.asarray(W[n].data), want), f"layer {i}: {n} on the card is not the file's"
        st.release(i)


def _inline(reader) -> ExpertReader:
    """Reads done as they are issued (a pool thread may start late): a buffer written again too early shows."""
    from concurrent.futures import Future

    def submit(dst, offset, after=None):
        reader.bytes_read += dst.nbytes
        f = Future()
        reader._read(dst, int(offset), after)
        f.set_result(None)
        return f

    reader.submit = submit
    return reader


def test_the_card_gets_the_files_bytes_through_two_staging_buffers(card, moe):
    st, gm, a = _streamer(card, moe, _inline(ExpertReader(moe, "pread", 2, 5.0, max_range=PIECE)))
    plan = st.disk.plan
    assert sorted(plan) == [0, 1, 3]
    assert not any(n in st.host for i in plan for n in plan[i].copies)  # no host copy of a read expert tensor
    slab = st.infos["blk.1.ffn_up_exps.weight"].slab
    assert plan[1].nbytes == 3 * (16 - len(PINS)) * slab and plan[0].nbytes == 3 * 16 * slab
    assert st.host_bytes == 2 * max(s.nbytes for s in plan.values())  # the staging alone: nothing else streams
    for _ in range(2):
        before = st.disk.reader.bytes_read
        _run_pass(st, gm, a)
        assert st.disk.reader.bytes_read - before == sum(s.nbytes for s in plan.values())  # every cold byte, once
    # a layer ahead, in turn: layer 0 of a pass is read when its upload is asked for, 1 meanwhile, 3 after 0 is copied
    assert [i for i, _ in st.disk.log] == [0, 1, 3] * 2
    bufs = [b for _, b in st.disk.log]
    assert all(x != y for x, y in zip(bufs, bufs[1:], strict=False))
    # every cold run went up in one copy from a staging buffer (layer 1: experts 1..4 and 7..14 of gate, up and down;
    # layers 0 and 3: each tensor whole), the pinned experts card to card
    for n, cs in plan[1].copies.items():
        assert [(t // slab, (t + k) // slab) for t, _, k in cs] == [(1, 5), (7, 15)], n
    assert len(card.htod) == 2 * (3 + 6 + 3)
    st.disk.reader.close()


def test_the_staged_bytes_are_the_experts_byte_ranges(card, moe):
    gm = GGUFModel(moe)
    a = model_args(gm)
    p, infos = _placement(gm, a)
    plan = stage_plan(p, infos, {n: gm.tensor(n).offset for n in infos}, piece=10_000)  # several reads an expert
    reader = ExpertReader(moe, "pread", 3, 5.0, max_range=10_000)
    try:
        stager = DiskStager(card.drv, reader, plan)
        for i in (1, 3):
            stager.start(i)
            b, buf = stager.take(i)
            for n, cs in plan[i].copies.items():
                raw = np.asarray(gm.tensor(n).raw()).view(np.uint8).reshape(-1)
                slab = infos[n].slab
                for t, h, k in cs:
                    assert t % slab == 0 and k % slab == 0
                    assert np.array_equal(buf[h : h + k], raw[t : t + k])
                    assert not any(t // slab <= e < (t + k) // slab for e in PINS) or i != 1
        assert [x for _, x in stager.log] == [0, 1]
    finally:
        reader.close()


def test_held_layers_keep_page_locked_copies_and_read_nothing(card, moe):
    st, gm, a = _streamer(card, moe)
    reader = st.disk.reader
    st.keep([0, 1])
    assert sorted(st.kept) == [0, 1] and sorted(st.disk.plan) == [3]
    assert st.host_bytes == st.kept[0][1].nbytes + st.kept[1][1].nbytes + 2 * st.disk.plan[3].nbytes
    _run_pass(st, gm, a)
    assert reader.bytes_read == st.disk.plan[3].nbytes
    st.keep([3])
    assert st.disk is None
    _run_pass(st, gm, a)
    assert reader.bytes_read == st.kept[3][0].nbytes  # nothing more read
    reader.close()


def test_an_expert_split_cards_reads_and_copies_are_its_own_experts(card, moe):
    """A card owning experts 8..15 of each layer (expert_gpu.ExpertCard, several cards under a RAM budget): its
    staging reads and its held copies are the file's bytes of those experts, not of experts 0..7."""
    from hybridinfer.backends.gpu.streamer import file_bytes

    st, gm, a = _streamer(card, moe, _inline(ExpertReader(moe, "pread", 2, 5.0, max_range=PIECE)), own=(8, 16))
    w = st.infos["blk.0.ffn_up_exps.weight"]
    assert (w.first_expert, w.n_expert) == (8, 8)
    assert st.disk.plan[0].nbytes == 3 * 8 * w.slab  # half of each of the layer's three tensors
    for _ in range(2):
        _run_pass(st, gm, a)
    st.keep([0, 3])
    for i in (0, 3):
        stage, buf = st.kept[i]
        for n, cs in stage.copies.items():
            for t, h, k in cs:
                assert np.array_equal(buf[h : h + k], file_bytes(gm, st.infos[n])[t : t + k])
    _run_pass(st, gm, a)
    st.disk.reader.close()


@pytest.mark.parametrize("how", ["truncate", "move"])
def test_a_file_truncated_or_moved_mid_run_is_a_typed_error_not_wrong_weights(card, moe, tmp_path, how):
    path = str(tmp_path / "copy.gguf")
    shutil.copy(moe, path)
    st, gm, a = _streamer(card, path)
    _run_pass(st, gm, a)
    if how == "truncate":
        os.truncate(path, os.path.getsize(path) // 2)
    else:
        os.rename(path, path + ".moved")
    t0 = time.monotonic()
    with pytest.raises(ExpertReadError, match="changed while the model runs" if how == "truncate" else "is gone"):
        _run_pass(st, gm, a)
    assert time.monotonic() - t0 < 5
    assert st.ready == {}  # no upload of the stopped pass is taken for done by a later one
    with pytest.raises(ExpertReadError, match="stopped after an earlier failure"):
        _run_pass(st, gm, a)
    st.disk.reader.close()


def test_a_hung_read_is_a_typed_error_within_the_timeout(card, moe):
    reader = ExpertReader(moe, "pread", 2, 0.3, max_range=PIECE)
    st, gm, a = _streamer(card, moe, reader)
    real = reader._read

    def slow(*args):
        time.sleep(1.0)
        return real(*args)

    reader._read = slow
    t0 = time.monotonic()
    with pytest.raises(ExpertReadError, match="did not finish within 0.3 s"):
        _run_pass(st, gm, a)
    assert time.monotonic() - t0 < 3
    reader.close()


def test_the_gpu_models_host_need_counts_what_its_streamer_takes(card, moe):
    """GPUModel's own figures (no card needed for them): host_need is what a fresh streamer of its placement holds,
    and the held layers' bytes replace their share of the staging (replan's check compares these)."""
    from hybridinfer.backends.gpu.backend import GPUModel

    st, gm, a = _streamer(card, moe)
    m = object.__new__(GPUModel)
    m.gm, m.infos, m.placement, m.reader, m.held = gm, st.infos, st.p, st.disk.reader, ()
    need = m.host_need()
    assert need.dense == 0 and need.layers == {i: s.nbytes for i, s in st.disk.plan.items()}
    assert m._host_bytes(st.p) == need.least == st.host_bytes
    m.held = (0,)
    st.keep([0])
    assert m._host_bytes(st.p) == st.host_bytes == need.layers[0] + 2 * max(need.layers[1], need.layers[3])
    st.disk.reader.close()


def test_host_copies_hold_the_streamed_experts_alone_and_pinned_runs_go_in_one_copy(card, moe):
    """No RAM budget: the streamer's page-locked copy of an expert tensor with experts pinned on the card holds its
    streamed experts only (what host_need counts), the card still gets the file's bytes every pass, and each run of
    pinned experts (ids and packed places both consecutive) goes card to card in one copy."""
    from hybridinfer.backends.gpu.disk_stage import host_need, pinned_runs
    from hybridinfer.backends.gpu.streamer import Streamer

    gm = GGUFModel(moe)
    a = model_args(gm)
    p, infos = _placement(gm, a)
    dtod = []
    inner = card.drv.memcpy_dtod_async
    card.drv.memcpy_dtod_async = lambda dst, src, n, s: (dtod.append(n), inner(dst, src, n, s))
    st = Streamer(gm, p, infos, card.drv.Stream())
    slab = infos["blk.1.ffn_up_exps.weight"].slab
    for n in p.streamed[1]:
        assert st.host[n].nbytes == (16 - len(PINS)) * slab  # not the 4 pinned experts' bytes
    assert st.host_bytes == host_need(p, infos, {}).dense
    assert pinned_runs({0: 0, 5: 1, 6: 2, 15: 3}) == [(0, 0, 1), (5, 1, 2), (15, 3, 1)]
    _run_pass(st, gm, a)
    assert sorted(dtod) == sorted([slab, 2 * slab, slab] * 3)  # gate, up, down: experts 0, 5..6, 15
