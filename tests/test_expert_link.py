"""The expert split's exchange protocol (backends/gpu/expert_gpu.CardLink) between two cards' threads, on this CPU
machine: pycuda's driver and arrays are stand-ins that log every copy, the barrier is real, and the two threads
walk the walker's order of calls (a layer's chunks deferred, settled before the next layer's mixer reads their
rows). What is checked is what the CardLink docstring proves: no card queues a write of its host rows of a slot
while another card's upload of that slot's earlier rows may still be reading them (its event not yet waited
for), every deferred exchange is settled in order, and each card takes up the other card's rows of its own call."""

from __future__ import annotations

import random
import sys
import threading
import time
import types

import numpy as np
import pytest

from tests.test_state_kinds import FakeArray


class Log:
    """The copies queued by both threads, checked as they come."""

    def __init__(self, jitter: float, seed: int):
        self.lock = threading.Lock()
        self.in_flight: dict[tuple[int, int], set] = {}  # (owner card, slot) -> uploads not yet waited for
        self.violations: list[str] = []
        self.uploads: list[tuple[int, int, int]] = []  # (reader card, owner card, slot)
        self.rng, self.jitter = random.Random(seed), jitter

    def pause(self) -> None:
        if self.jitter:
            with self.lock:
                t = self.rng.random() * self.jitter
            time.sleep(t)


class Op:
    def __init__(self, kind: str, key=None):
        self.kind, self.key = kind, key


def fake_pycuda(monkeypatch, log: Log, hosts: list):
    """hosts: (host-row array, (owner card, slot)) of the Exchange, filled once it exists."""

    class Stream:
        def __init__(self, flags=0):
            self.last = None

        def wait_for_event(self, ev):
            pass

        def synchronize(self):
            pass

    class Event:
        def __init__(self):
            self.op = None

        def record(self, stream=None):
            self.op = stream.last if stream is not None else None

        def synchronize(self):
            op = self.op
            if op is not None and op.kind == "up":
                with log.lock:
                    log.in_flight[op.key].discard(op)
            log.pause()

        def query(self):
            return True

    def owner(host):
        for a, ks in hosts:
            if np.shares_memory(host, a):
                return ks
        raise AssertionError("a copy from rows that are not the exchange's")

    def dtoh(host, src, stream):
        log.pause()
        k, s = owner(host)
        with log.lock:
            busy = log.in_flight.get((k, s))
            if busy:
                log.violations.append(f"card {k} writes its slot {s} while {len(busy)} upload(s) may still read it")
        stream.last = Op("down", (k, s))

    def htod(dst, host, stream):
        log.pause()
        key = owner(host)
        op = Op("up", key)
        with log.lock:
            log.in_flight.setdefault(key, set()).add(op)
            log.uploads.append((stream.card, *key))
        stream.last = op

    drv = types.ModuleType("pycuda.driver")
    drv.Stream, drv.Event = Stream, Event
    drv.memcpy_dtoh_async, drv.memcpy_htod_async = dtoh, htod
    drv.memcpy_dtod_async = lambda dst, src, n, stream: None
    drv.pagelocked_empty = lambda shape, dt, mem_flags=0: np.zeros(shape, dt)
    drv.host_alloc_flags = types.SimpleNamespace(PORTABLE=1)
    gpuarray = types.ModuleType("pycuda.gpuarray")
    gpuarray.empty = lambda shape, dt: FakeArray(np.zeros(shape, dt))
    pkg = types.ModuleType("pycuda")
    pkg.driver, pkg.gpuarray = drv, gpuarray
    for name, mod in (("pycuda", pkg), ("pycuda.driver", drv), ("pycuda.gpuarray", gpuarray)):
        monkeypatch.setitem(sys.modules, name, mod)
    return drv, FakeArray, Stream


def run_pass(monkeypatch, layers: int, chunks: int, jitter: float, seed: int) -> Log:
    from hybridinfer.backends.gpu import expert_gpu as eg

    monkeypatch.setattr(eg.ke, "add", lambda *a, **k: None)
    monkeypatch.setattr(eg.km, "shared_add", lambda *a, **k: None)
    log, hosts = Log(jitter, seed), []
    drv, Array, Stream = fake_pycuda(monkeypatch, log, hosts)
    C, D = 4, 2
    ex = eg.Exchange(2, C, D)
    hosts += [(a, (k, s)) for k in range(2) for s, a in enumerate(ex.host[k])]

    links = []
    for k in range(2):
        m = types.SimpleNamespace(chunk=C, args=types.SimpleNamespace(n_embd=D), drv=drv, stream=Stream(),
                                  streamer=types.SimpleNamespace(pacer=None))
        link = eg.CardLink(ex, k, m)
        link.up_stream.card = k
        links.append(link)
    errs: list = []

    def card(k: int) -> None:
        link, h = links[k], Array(np.zeros((chunks * C, D), np.float32))
        try:
            link.reset()
            for _ in range(layers):
                for c in range(chunks):
                    r0, r1 = c * C, (c + 1) * C
                    link.settle(r0, r1)  # the mixer reads these rows
                    link.settle(r0, r1)  # the MoE's norm reads them
                    p = link.calls % len(link.part)
                    link.defer(link.part[p][:C], None, None, h[r0:r1], (r0, r1))
            link.settle()
        except BaseException as e:  # the other card leaves the barrier rather than wait
            errs.append(e)
            ex.barrier.abort()

    threads = [threading.Thread(target=card, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errs, errs
    assert all(not lk.pending for lk in links)
    log.calls = [lk.calls for lk in links]
    return log


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("layers,chunks", [(6, 4), (5, 1), (3, 7)])
def test_no_card_writes_host_rows_another_may_still_read(monkeypatch, seed, layers, chunks):
    from hybridinfer.backends.gpu import expert_card as ec

    assert ec.READ_LAG <= ec.HOST_SLOTS - ec.PENDING - 1  # the docstring's condition
    log = run_pass(monkeypatch, layers, chunks, jitter=2e-4, seed=seed)
    assert log.violations == []
    n = layers * chunks
    assert log.calls == [n, n]
    # every call's exchange: each card took up the other's rows of that call's slot, in call order
    for k in range(2):
        got = [(o, s) for r, o, s in log.uploads if r == k]
        assert got == [(1 - k, c % ec.HOST_SLOTS) for c in range(n)]


def test_waiting_for_uploads_too_late_is_caught(monkeypatch):
    """With a card waiting for its uploads one barrier past what the host slots allow, the other card writes rows
    still being read: the check above can fail."""
    from hybridinfer.backends.gpu import expert_card as ec

    monkeypatch.setattr(ec, "READ_LAG", ec.HOST_SLOTS - ec.PENDING + 1)
    log = run_pass(monkeypatch, 6, 4, jitter=0.0, seed=0)
    assert log.violations
