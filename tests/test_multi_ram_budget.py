"""A RAM budget with GPU prefill over several cards (`devices=[...]`, both split modes), wired on this CPU machine:
each card is a GPUModel whose construction is a stand-in (no CUDA: every matrix streamed, nothing uploaded) but whose
figures under the budget are GPUModel's own (its reader of the file, its disk staging plan, host_need), and the rest
is the real path: make_backend, open_cards, MultiGPUModel / ExpertParallelModel, the split of the budget over the
CPU decode and every card's streamer, the refusal, the CPU decode after, close; and, with a stand-in pass that reads
each card's cold experts through its reader and the real disk staging, the cards' worker threads meeting a file that
fails mid-run. The logits of a real multi-card prefill under a budget are tests/test_gpu_ram_budget_cards.py's (on two
GPUs)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import threading
import time
import types

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.errors import RamBudgetError
from tests.bounded import bounded
from tests.test_expert_disk import CTX, SHAPE, _sizes, moe_with_engine

L = SHAPE["n_layer"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from moe_with_engine(tmp_path_factory, "multi_ram", "q8_0", 6)


@pytest.fixture
def cards(monkeypatch):
    """Stand-in cards under the real multi-card models; returns the list of every card model made."""
    import hybridinfer.backends.gpu.backend as gb
    import hybridinfer.backends.gpu.expert_card as ec
    import hybridinfer.backends.gpu.expert_gpu as eg
    import hybridinfer.backends.gpu.loader as loader
    import hybridinfer.backends.gpu.multi_gpu as mg
    from hybridinfer.backends.gpu.expert_card import own_weights
    from hybridinfer.backends.gpu.placement import Placement, weights_of

    made = []

    class Card(gb.GPUModel):
        def __init__(self, gm, args, n_ctx, layers=None, own=None, disk=None, **kw):
            if own is not None:
                self.own = own
            self.first, self.end = (0, args.n_layer + 1) if layers is None else layers
            ws = [w for w in weights_of(gm, args, matrices_only=True) if self.first <= w.layer < self.end]
            self.infos = {w.name: w for w in (ws if self.own is None else own_weights(ws, self.own))}
            streamed: dict = {}
            for n, w in self.infos.items():
                streamed.setdefault(w.layer, []).append(n)
            self.gm, self.args, self.disk, self.placement = gm, args, disk, Placement(1 << 40, streamed=streamed)
            self.reader, self.held, self.closed = disk.reader() if disk is not None else None, (), False
            self.n_ctx, self.n_rows, self.n_res, self.compiled, self.tok_embd = n_ctx, 64, 64, [], None
            made.append(self)

        def hold(self, layers):  # no streamer to keep copies in: what the split asked for is recorded
            self.held = tuple(layers)

        def close(self):
            super().close()
            self.closed = True

    def slots(gm, args, n_ctx, devices, vram_budget, chunk, card_profile):
        s = [types.SimpleNamespace(vram_budget=1 << 30, label=f"device {d} (stand-in)") for d in devices]
        return list(devices), [object() for _ in devices], s, weights_of(gm, args, matrices_only=True)

    def layer_plan(gm, args, n_ctx, ws, slots):
        cut = [0, args.n_layer // 2, args.n_layer + 1]
        return types.SimpleNamespace(shares=[types.SimpleNamespace(slot=s, first=a, end=b)
                                             for s, a, b in zip(slots, cut, cut[1:], strict=False)])

    monkeypatch.setattr(gb, "GPUModel", Card)
    monkeypatch.setattr(eg, "ExpertCard", Card)
    monkeypatch.setattr(loader, "on_card", lambda ctx: contextlib.nullcontext())
    monkeypatch.setattr(loader, "device_name", lambda d: "stand-in")
    monkeypatch.setattr(mg, "card_slots", slots)
    monkeypatch.setattr(eg, "card_slots", slots)
    monkeypatch.setattr(mg, "layer_plan", layer_plan)
    monkeypatch.setattr(ec, "with_link", lambda s, args, chunk: s)
    monkeypatch.setattr(ec, "link_bytes", lambda args, chunk: 0)
    monkeypatch.setattr(ec, "plan_split", lambda ws, slots, head: ([SHAPE["n_expert"] // 2] * 2, None))
    monkeypatch.setattr(eg, "Exchange", lambda *a: types.SimpleNamespace())
    monkeypatch.setattr(eg, "CardLink", lambda ex, k, m: types.SimpleNamespace())
    return made


def _fake_link(ex, k, m):
    """expert_gpu.CardLink as far as a pass that reads no exchange uses it."""
    link = types.SimpleNamespace(ex=ex)
    link.reset = lambda: vars(link).update(calls=0, bytes=0, pending=[], sync_s=0.0, barrier_s=0.0)
    return link


def _load(path, budget, mode):
    return Engine.load(path, backend="gpu", n_ctx=CTX, spec_type="none", ram_budget=budget, devices=[0, 1],
                       split_mode=mode, expert_io="pread", readers=2)


def _expert_bytes(gm) -> dict[int, int]:
    """Bytes of each layer's routed experts in the file."""
    out: dict[int, int] = {}
    for n, t in gm.tensors.items():
        if n.startswith("blk.") and "_exps" in n:
            out[int(n.split(".")[1])] = out.get(int(n.split(".")[1]), 0) + int(t.nbytes)
    return out


@pytest.mark.parametrize("mode", ["layer", "expert"])
def test_a_ram_budget_over_two_cards_counts_every_cards_streamer(model, cards, mode):
    from hybridinfer.backends import GPUPrefillCPUDecode
    from hybridinfer.backends.ram_split import CardsSplit, least_of
    from hybridinfer.format.gguf_model import GGUFModel

    path, full = model
    fixed, experts = _sizes(full)
    per_layer = _expert_bytes(GGUFModel(path))
    # the CPU keeps a third of the experts; the cards' streamers their least (each its own staging and readers)
    probe = _load(path, 1 << 36, mode)
    needs = probe.backend.gpu.host_need()
    probe.close()
    assert len(needs) == 2 and all(c.closed and c.reader.fd is None for c in cards)  # each card's reader closed
    if mode == "layer":  # each card reads its own layers' experts, every layer's by one card
        assert [sorted(g.layers) for g in needs] == [list(range(L // 2)), list(range(L // 2, L))]
        assert {i: n for g in needs for i, n in g.layers.items()} == per_layer
    else:  # each card reads its own share of every layer's experts, the file's bytes of them
        assert all(sorted(g.layers) == list(range(L)) for g in needs)
        assert {i: needs[0].layers[i] + needs[1].layers[i] for i in range(L)} == per_layer
        c1 = cards[-1]
        w = next(w for w in c1.infos.values() if w.n_expert and w.layer == 0)
        reads = c1._disk(c1.placement)[1][0].reads
        assert w.first_expert == SHAPE["n_expert"] // 2
        assert min(f for _, f, _ in reads) >= c1.gm.tensor(w.name).offset + w.first_expert * w.slab
    cards.clear()
    budget = fixed + experts // 3 + least_of(needs)
    eng = _load(path, budget, mode)
    try:
        be = eng.backend
        assert isinstance(be, GPUPrefillCPUDecode) and len(cards) == 2
        assert all(c.disk.path == path and c.disk.io == "pread" and c.reader is not None for c in cards)
        assert cards[0].reader is not cards[1].reader  # a pool and staging a card, each used by its card's thread
        split, plan = be.gpu.ram_split, be.cpu.ram_plan
        assert isinstance(split, CardsSplit) and [c.gpu for c in split.cards] == list(needs)
        assert plan.budget == budget - least_of(needs) and plan.on_disk  # the CPU's share: less every card's least
        assert split.cpu_bytes == plan.resident_bytes and split.total <= budget
        assert [c.held for c in cards] == list(split.held)
        assert all(c.tok_embd is be.cpu.tok_embd for c in cards)  # every card embeds from the CPU's copy
        assert be.gpu.disk_stats() == {"bytes_read": 0, "reads": 0, "cards": [{"bytes_read": 0, "reads": 0}] * 2}
        assert "gpu prefill on 2 cards" in split.summary()
        # CPU decode under its share: the resident model's logits, bit for bit
        sa, sb = full.backend.new_state(CTX), be.new_state(CTX)
        for t in (5, 17, 3, 99, 42):
            a, b = full.backend.forward([t], sa), be.forward([t], sb)
            assert np.array_equal(a, b)
    finally:
        eng.close()
    assert all(c.closed for c in cards)
    # a budget too small for the CPU's least beside both cards' staging: refused, naming the least that loads
    with pytest.raises(RamBudgetError) as e:
        _load(path, fixed + least_of(needs), mode)
    msg = str(e.value)
    assert "over 2 cards" in msg and f"at least {e.value.needed} B" in msg and e.value.needed > fixed + least_of(needs)
    assert all(c.closed for c in cards)  # the refused load's cards let go of their readers
    eng = _load(path, e.value.needed, mode)
    try:
        assert eng.backend.gpu.ram_split.total <= e.value.needed
    finally:
        eng.close()


@pytest.mark.parametrize("mode", ["layer", "expert"])
@pytest.mark.parametrize("why", ["gone", "budget"])
def test_a_card_failing_at_load_closes_the_cards_before_it(model, cards, monkeypatch, mode, why):
    """The second card's model cannot be made (a card that fails or is gone; its own pass plan needing more than the
    split gave it): the error names it (a budget's, what it was to hold too), and the first card's model (its
    buffers, its reader of the file) is closed, not left behind."""
    import hybridinfer.backends.gpu.backend as gb
    import hybridinfer.backends.gpu.expert_gpu as eg
    from hybridinfer.backends.gpu.multi_card import CardBudgetError
    from hybridinfer.backends.gpu.placement import BudgetError
    from hybridinfer.errors import BackendNotAvailableError

    Card = gb.GPUModel
    fail = {"gone": BackendNotAvailableError("cuCtxCreate failed: no CUDA-capable device is detected"),
            "budget": BudgetError("vram budget 100 B cannot hold the pass buffers")}[why]

    class Failing(Card):
        def __init__(self, *a, **kw):
            if cards:  # the first card is made; the second fails
                raise fail
            super().__init__(*a, **kw)

    monkeypatch.setattr(gb, "GPUModel", Failing)
    monkeypatch.setattr(eg, "ExpertCard", Failing)
    share = {"layer": f"layers {L // 2}..{L}", "expert": f"experts {SHAPE['n_expert'] // 2}..{SHAPE['n_expert'] - 1} "
             "of each layer"}[mode]
    want = ((BackendNotAvailableError, r"device 1 \(stand-in\): cuCtxCreate failed") if why == "gone" else
            (CardBudgetError, rf"device 1 \(stand-in\): {share}: vram budget 100 B"))
    with pytest.raises(want[0], match=want[1]) as e:
        _load(model[0], 1 << 36, mode)
    assert why == "gone" or e.value.card == "device 1 (stand-in)"
    assert len(cards) == 1 and cards[0].closed and cards[0].reader.fd is None


def _reading_walk(m, items, all_logits=False, rows_in=None, rows_out=None):
    """walker.walk's stand-in: as far as the file goes, a card's pass, its layers' cold experts (those not held)
    read through its own reader into the real disk staging (DiskStager: two buffers, a layer ahead) in layer
    order; an expert split's cards meet after each layer, as their exchange makes them wait for one another."""
    from hybridinfer.backends.gpu.disk_stage import DiskStager
    from hybridinfer.backends.gpu.expert_gpu import BARRIER_S

    st = getattr(m, "stager", None)
    if st is None:
        host = types.SimpleNamespace(pagelocked_empty=lambda n, dt: np.zeros(n, dt))
        plan = {i: s for i, s in m._disk(m.placement)[1].items() if i not in m.held}
        st = m.stager = DiskStager(host, m.reader, plan)
    link = getattr(m, "link", None)
    for i in st.order:
        _, buf = st.take(i)
        if st.next_after(i) is not None:
            st.start(st.next_after(i))
        assert buf.any()  # the experts' bytes, not the buffer's zeros
        if link is not None:
            link.ex.barrier.wait(BARRIER_S)
    m.last_timing = {"bytes_h2d": 0, "work": {"flops": 0.0}, "copy_s": 0.0, "gpu_s": 0.0}
    if rows_out is not None:
        return [rows_out]
    return [np.zeros((len(it.ids) if all_logits else 1, SHAPE["n_vocab"]), np.float32) for it in items]


@pytest.mark.parametrize("mode", ["layer", "expert"])
@pytest.mark.parametrize("how", ["truncate", "eio"])
def test_a_file_failing_mid_run_is_a_card_failed_error_naming_the_card(model, cards, monkeypatch, tmp_path, mode, how):
    """Issue 34: under a RAM budget every card reads its cold experts from the GGUF on each pass. The file truncated
    after load (every card's next read fails; the first card in order is named), or one card's reads failing (EIO on
    card 1's reader: card 1 is named, and the other card is not left waiting for it): the pass raises CardFailedError
    naming the card with the ExpertReadError as its cause, within seconds, every card's worker ended; the next pass
    fails the same way; the model then closes, every card's reader with it."""
    import hybridinfer.backends.gpu.expert_gpu as eg
    import hybridinfer.backends.gpu.multi_gpu as mg
    from hybridinfer.errors import CardFailedError, ExpertReadError

    drv = types.ModuleType("pycuda.driver")  # CardRunner.host_rows's page-locked rows: plain ones here
    drv.pagelocked_empty = lambda shape, dt, mem_flags=0: np.zeros(shape, dt)
    drv.host_alloc_flags = types.SimpleNamespace(PORTABLE=1)
    pkg = types.ModuleType("pycuda")
    pkg.driver = drv
    monkeypatch.setitem(sys.modules, "pycuda", pkg)
    monkeypatch.setitem(sys.modules, "pycuda.driver", drv)
    monkeypatch.setattr(mg, "walk", _reading_walk)
    monkeypatch.setattr(eg, "walk", _reading_walk)
    monkeypatch.setattr(eg, "Exchange", lambda n, rows, width: types.SimpleNamespace(n=n, barrier=threading.Barrier(n)))
    monkeypatch.setattr(eg, "CardLink", _fake_link)
    path = str(tmp_path / "copy.gguf")
    shutil.copy(model[0], path)
    kw = {"micro_batch": 16} if mode == "layer" else {}  # layer: three micro-batches through the pipeline
    eng = Engine.load(path, backend="gpu", n_ctx=CTX, spec_type="none", ram_budget=1 << 36, devices=[0, 1],
                      split_mode=mode, expert_io="pread", readers=2, **kw)
    eng.backend.gpu.hold(((), ()))  # no copies kept (a 4-layer model's cards keep all): every pass reads the file
    try:
        be = eng.backend
        prompt = list(range(200, 240))
        be.forward(prompt, be.new_state(CTX))  # the file whole: a pass reads every card's cold experts
        per = be.gpu.disk_stats()["cards"]
        assert [sorted(c.stager.plan) for c in cards] == ([[0, 1], [2, 3]] if mode == "layer" else [[0, 1, 2, 3]] * 2)
        passes = be.gpu.last_timing["micro_batches"]  # a card's pass a micro-batch: its cold experts read each time
        assert passes == (3 if mode == "layer" else 1)
        assert [d["bytes_read"] for d in per] == [passes * sum(s.nbytes for s in c.stager.plan.values()) for c in cards]
        if how == "truncate":
            os.truncate(path, os.path.getsize(path) // 2)
            failing, why = 0, "changed while the model runs"
        else:
            def eio(*a, **k):
                raise OSError(errno.EIO, os.strerror(errno.EIO))

            cards[1].reader._pread = eio
            failing, why = 1, os.strerror(errno.EIO)
        for _ in range(2):  # the pass that meets the failure, then the next one
            t0 = time.monotonic()
            got = bounded(lambda: be.forward(prompt, be.new_state(CTX)), timeout=60)
            assert time.monotonic() - t0 < 20
            e = got.get("error")
            assert isinstance(e, CardFailedError), got
            assert (e.device, e.card) == (failing, "stand-in") and f"device {failing} (stand-in)" in str(e)
            assert isinstance(e.__cause__, ExpertReadError) and path in str(e.__cause__)
            assert why in str(e.__cause__)
            assert not any(t.name.startswith(("hybridinfer-card-", "hybridinfer-expert-card-"))
                           for t in threading.enumerate())
            why = "stopped after an earlier failure"  # the next pass: refused at its first read
    finally:
        assert bounded(eng.close, timeout=30) == {"value": None}
    assert len(cards) == 2 and all(c.closed and c.reader.fd is None for c in cards)
    for t in [t for c in cards for t in c.reader.pool._threads]:  # each card's readers end
        t.join(10)
        assert not t.is_alive()


@pytest.mark.parametrize("mode", ["layer", "expert"])
def test_a_card_that_fails_to_close_leaves_the_other_closed(model, cards, monkeypatch, mode):
    """The first card's close raises (its context is gone): the second card and its reader of the file are still
    closed, and the close reports the first card's error."""
    path = model[0]
    eng = _load(path, 1 << 36, mode)
    gpu = eng.backend.gpu
    assert len(cards) == 2
    first = cards[0]
    real = type(first).close

    def dead(self):
        real(self)
        raise OSError("device 0 (stand-in): context destroyed")

    monkeypatch.setattr(first, "close", dead.__get__(first))
    try:
        with pytest.raises(OSError, match="context destroyed"):
            gpu.close()
        assert all(c.closed for c in cards) and cards[1].reader.fd is None
        assert gpu.cards == []
    finally:
        eng.close()
