"""Routed experts read from the GGUF under a RAM budget (backends/cpu/expert_store.py): the same logits bit for bit as
the fully resident model for decode, batched decode and prompt chunks; a file truncated, replaced or too slow mid-run
gives ExpertReadError within a bounded time; a budget below the resident part is refused with the bytes needed."""

from __future__ import annotations

import os
import shutil
import time

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.errors import ExpertReadError, RamBudgetError
from hybridinfer.tools.synth import synth_model
from tests.bounded import bounded

pytestmark = pytest.mark.isa  # native kernels of every SIMD unit: CI runs these at each level

SHAPE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=16, n_expert_used=4,
             n_ff_exp=256, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
CTX = 128


def moe_with_engine(tmp_path_factory, folder: str, quant: str, seed: int):
    """A synthetic MoE of SHAPE written under a fresh `folder`, with a CPU engine over the whole of it: (path,
    engine) yielded, the engine closed after (a module fixture's body)."""
    p = tmp_path_factory.mktemp(folder) / "moe.gguf"
    synth_model(p, "qwen35moe", SHAPE, quant, seed=seed)
    eng = Engine.load(str(p), backend="cpu", n_ctx=CTX, spec_type="none")
    yield str(p), eng
    eng.close()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    yield from moe_with_engine(tmp_path_factory, "disk", "q4_k_m", 3)


def _sizes(eng) -> tuple[int, int]:
    """(bytes other than the routed experts, bytes of all routed experts) of the loaded model"""
    from hybridinfer.backends.cpu.expert_setup import ExpertOptions, plan_model

    be = eng.backend
    blocks = be.layers + ([be.mtp_layer] if be.mtp_layer is not None else [])
    plan, _ = plan_model(be, blocks, ExpertOptions(ram_budget=1 << 50))
    return plan.fixed_bytes, plan.expert_bytes


def _load(path, budget, **kw):
    return Engine.load(path, backend="cpu", n_ctx=CTX, spec_type="none", ram_budget=budget, **kw)


def _run(be) -> list[np.ndarray]:
    """Logits of three prompts (one whole, two chunked together), then six steps: one sequence alone (replayed
    decode) and two in a batch (replayed decode_batch), each fed its own greedy token."""
    sts = [be.new_state(CTX) for _ in range(3)]
    outs = [be.forward(list(range(3, 40)), sts[0], all_logits=True).copy()]
    outs.append(be.forward_many([(list(range(50, 70)), sts[1]), (list(range(90, 101)), sts[2])]).copy())
    t = [int(np.argmax(outs[0][-1])), *(int(np.argmax(r)) for r in outs[1])]
    for _ in range(6):
        one = be.forward([t[0]], sts[0]).copy()
        two = be.decode_batch(t[1:], sts[1:]).copy()
        outs += [one, two]
        t = [int(np.argmax(one[-1])), *(int(np.argmax(r)) for r in two)]
    return outs


@pytest.mark.parametrize("io,prefetch", [("pread", 1), ("direct", 0)])
def test_disk_experts_give_the_resident_logits_bit_for_bit(model, io, prefetch):
    path, full = model
    fixed, experts = _sizes(full)
    budget = fixed + experts // 3
    eng = _load(path, budget, expert_io=io, prefetch_layers=prefetch)
    try:
        be = eng.backend
        plan = be.ram_plan
        assert plan.on_disk and plan.resident_bytes <= budget
        assert all(4 <= n < 16 for n in plan.slots.values())
        want, got = _run(full.backend), _run(be)
        assert len(want) == len(got)
        for j, (a, b) in enumerate(zip(want, got, strict=True)):
            assert a.shape == b.shape and np.array_equal(a, b), f"output {j} differs"
        st = be.experts.stats()
        assert st["misses"] > 0 and st["hits"] > 0 and st["bytes_read"] > 0
        assert (st["prefetched"] > 0) == (prefetch > 0)
        # the 37-token prompt routes to more experts than a layer's slots: it ran in chunks of experts
        assert st["chunked_steps"] >= len(be.experts.order)
    finally:
        eng.close()


def test_engine_generates_the_same_tokens_under_a_budget(model):
    path, full = model
    fixed, experts = _sizes(full)
    eng = _load(path, fixed + experts // 4)
    try:
        prompts = [[5, 6, 7, 8], [100, 200, 300]]
        a = full.generate_batch([{"prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts])
        b = eng.generate_batch([{"prompt": p, "max_tokens": 8, "temperature": 0} for p in prompts])
        assert [g.tokens for g in a] == [g.tokens for g in b]
        assert all(len(g.tokens) == 8 for g in b)
    finally:
        eng.close()


def test_budget_below_the_resident_part_is_refused_with_the_bytes_needed(model):
    path, full = model
    fixed, experts = _sizes(full)
    per_slot = experts // 16  # one expert of every layer
    need = fixed + 4 * per_slot
    with pytest.raises(RamBudgetError) as ei:
        _load(path, need - 1)
    assert ei.value.needed == need and str(need) in str(ei.value)
    eng = _load(path, need)  # exactly the least budget loads, with k slots a layer and nothing pinned
    try:
        assert eng.backend.ram_plan.resident_bytes == need
        assert all(n == 4 for n in eng.backend.ram_plan.slots.values())
        assert eng.backend.forward([1, 2, 3], eng.backend.new_state(CTX)).shape == (3, SHAPE["n_vocab"])
    finally:
        eng.close()


def _broken_run(tmp_path, model, damage, **kw):
    """A copy of the model under a small budget, run, damaged by damage(path), run again: the error and its time."""
    src, full = model
    path = str(tmp_path / "copy.gguf")
    shutil.copy(src, path)
    fixed, experts = _sizes(full)
    eng = _load(path, fixed + 4 * (experts // 16), prefetch_layers=0, **kw)
    try:
        be = eng.backend
        be.forward(list(range(1, 20)), be.new_state(CTX))
        damage(path, be)
        t0 = time.monotonic()
        out = bounded(lambda: be.forward(list(range(200, 240)), be.new_state(CTX)), timeout=60)
        took = time.monotonic() - t0
        again = bounded(lambda: be.forward([7], be.new_state(CTX)), timeout=60)
        return out.get("error"), took, again.get("error"), path
    finally:
        eng.close()


def test_truncated_file_gives_a_typed_error_naming_file_and_range(tmp_path, model):
    err, took, again, path = _broken_run(tmp_path, model, lambda p, be: os.truncate(p, os.path.getsize(p) // 2))
    assert isinstance(err, ExpertReadError), err
    assert path in str(err) and "bytes " in str(err)
    assert took < 30
    assert isinstance(again, ExpertReadError)


def test_replaced_file_gives_a_typed_error(tmp_path, model):
    def replace(p, be):
        other = p + ".new"
        shutil.copy(p, other)
        os.replace(other, p)

    err, _, _, path = _broken_run(tmp_path, model, replace)
    assert isinstance(err, ExpertReadError) and "replaced" in str(err) and path in str(err)


def test_moved_file_gives_a_typed_error(tmp_path, model):
    err, _, _, path = _broken_run(tmp_path, model, lambda p, be: os.rename(p, p + ".moved"))
    assert isinstance(err, ExpertReadError) and "moved or deleted" in str(err) and path in str(err)
    assert "bytes " in str(err)


def test_a_read_that_hangs_ends_at_the_timeout(tmp_path, model):
    def hang(p, be):
        reader = be.experts.reader
        real = reader._read

        def slow(*a):
            time.sleep(3)
            return real(*a)

        reader._read = slow

    err, took, again, _ = _broken_run(tmp_path, model, hang, read_timeout=0.3)
    assert isinstance(err, ExpertReadError) and "did not finish within 0.3 s" in str(err)
    assert took < 3
    assert isinstance(again, ExpertReadError) and "stopped" in str(again)


def test_options_that_do_not_go_with_a_budget_are_refused(model):
    from hybridinfer.errors import ParameterError

    path, full = model
    fixed, experts = _sizes(full)
    with pytest.raises(ParameterError, match="weights='mmap'"):
        _load(path, fixed + experts // 2, weights="mmap")
    with pytest.raises(ParameterError, match="expert_io"):
        _load(path, fixed + experts // 2, expert_io="mmap")
    with pytest.raises(ParameterError, match="option of the cpu and gpu backends"):
        Engine.load(path, backend="reference", n_ctx=CTX, ram_budget=fixed + experts // 2)
    with pytest.raises(ParameterError, match="only apply with ram_budget"):
        Engine.load(path, backend="cpu", n_ctx=CTX, expert_io="direct")


def test_gpu_prefill_and_cpu_decode_split_the_budget(model, monkeypatch):
    """backend "gpu" under a budget (the card a stand-in): the CPU backend plans under what the GPU streamer's least
    leaves, the GPU keeps copies of whole layers only where the CPU left room, and a budget too small for both is
    refused with the least that loads."""
    import hybridinfer.backends.gpu.backend as gb
    from hybridinfer.backends.ram_split import GpuHost
    from hybridinfer.errors import BackendNotAvailableError

    path, full = model
    fixed, experts = _sizes(full)
    need = GpuHost(dense=1 << 20, layers={i: experts // 8 for i in range(SHAPE["n_layer"])})  # half of each layer

    class Card:
        def __init__(self, gm, args, n_ctx, disk=None, **kw):
            self.disk, self.held = disk, None

        def host_need(self):
            return need

        def hold(self, layers):
            self.held = tuple(layers)

    monkeypatch.setattr(gb, "GPUModel", Card)

    def load(budget):
        return Engine.load(path, backend="gpu", n_ctx=CTX, spec_type="none", ram_budget=budget, expert_io="direct")

    eng = load(fixed + experts // 3 + need.least)
    be = eng.backend
    split, plan = be.gpu.ram_split, be.cpu.ram_plan
    assert be.gpu.disk.path == path and be.gpu.disk.io == "direct"
    assert plan.budget == fixed + experts // 3 and plan.on_disk  # the CPU's share: the budget less the GPU's least
    assert split.cpu_bytes == plan.resident_bytes and split.total <= fixed + experts // 3 + need.least
    assert be.gpu.held == split.held == () and split.disk == (0, 1, 2, 3)
    assert be.gpu.tok_embd is be.cpu.tok_embd
    eng.close()
    eng = load(fixed + experts + need.full)  # the CPU holds every expert; what is left holds the GPU's layers
    split = eng.backend.gpu.ram_split
    assert not eng.backend.cpu.ram_plan.on_disk and split.held == (0, 1, 2, 3) and split.read_per_pass == 0
    assert split.total <= fixed + experts + need.full
    eng.close()
    with pytest.raises(RamBudgetError) as e:
        load(fixed + need.least)
    assert "GPU prefill takes" in str(e.value) and e.value.needed > fixed + need.least
    eng = load(e.value.needed)  # the least it named loads
    assert eng.backend.gpu.ram_split.total <= e.value.needed
    eng.close()

    class NoCard:
        def __init__(self, *a, **k):
            raise BackendNotAvailableError("no CUDA device (stand-in)")

    import hybridinfer.backends as backends

    monkeypatch.setattr(gb, "GPUModel", NoCard)
    monkeypatch.setattr(backends, "_warned", False)
    with pytest.warns(UserWarning, match="no usable GPU"):  # auto without a card: the CPU has the whole budget
        eng = Engine.load(path, backend="auto", n_ctx=CTX, spec_type="none", ram_budget=fixed + experts // 3)
    assert eng.backend.ram_plan.budget == fixed + experts // 3
    eng.close()


def test_usage_counts_pin_the_most_used_experts_of_a_later_load(model):
    from hybridinfer.backends.cpu.expert_plan import rank_experts

    path, full = model
    fixed, experts = _sizes(full)
    budget = fixed + 10 * (experts // 16)  # 10 slots a layer: 5 refillable, 5 pinned
    eng = _load(path, budget)
    try:
        be = eng.backend
        be.forward(list(range(5, 30)), be.new_state(CTX))
        counts = be.experts.usage_counts()
        for c in be.experts.order:  # every token's k experts counted in every layer
            assert sum(n for (b, _), n in counts.items() if b == c.block) == 25 * SHAPE["n_expert_used"]
    finally:
        eng.close()
    again = _load(path, budget, expert_counts=counts)
    try:
        plan = again.backend.ram_plan
        for b, pins in plan.pinned.items():
            assert len(pins) == 5 and set(pins) == set(rank_experts(counts, b, 16)[:5])
            cache = next(c for c in again.backend.experts.order if c.block == b)
            assert [int(cache.occupant[s]) for s in range(5)] == list(pins)
            assert (cache.occupant >= 0).all() and not cache.pending  # every slot read at load
    finally:
        again.close()


def test_cli_load_log_says_what_stays_and_what_is_read(model, capsys):
    from hybridinfer.cli import main

    path, full = model
    fixed, experts = _sizes(full)
    rc = main(["run", "-m", path, "--backend", "cpu", "--raw", "-p", "hi", "-n", "2", "--spec-type", "none",
               "--ram-budget", str(fixed + experts // 3), "--expert-io", "direct"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "resident" in err and "read from the file when selected" in err and "expert slots per layer" in err


def test_cli_load_log_shows_the_gpu_split(model, monkeypatch, capsys):
    """`run --backend gpu --ram-budget` says the split above the CPU plan (the card a stand-in that prefills through
    the resident CPU model)."""
    import hybridinfer.backends.gpu.backend as gb
    from hybridinfer.backends.ram_split import GpuHost
    from hybridinfer.cli import main

    path, full = model
    fixed, experts = _sizes(full)
    need = GpuHost(dense=1 << 20, layers={i: experts // 8 for i in range(SHAPE["n_layer"])})

    class Card:
        compiled = []

        def __init__(self, gm, args, n_ctx, disk=None, **kw):
            pass

        def host_need(self):
            return need

        def hold(self, layers):
            pass

        def forward(self, tokens, state, all_logits=True, **kw):
            return full.backend.forward(tokens, state, all_logits=all_logits)

    monkeypatch.setattr(gb, "GPUModel", Card)
    rc = main(["run", "-m", path, "--backend", "gpu", "--raw", "-p", "hi there", "-n", "2", "--spec-type", "none",
               "--ram-budget", str(fixed + experts // 3 + need.least)])
    err = capsys.readouterr().err
    assert rc == 0, err
    split = err.index("split: cpu decode")
    assert "read from the file each prompt pass" in err and err.index("expert slots per layer") > split


def test_verify_rows_and_the_mtp_block_read_from_the_cache(tmp_path):
    """Speculative verify rows (one sequence: the bound verify step; several: the prompt path) give the resident
    bits, and the MTP block's experts get a cache of their own that its drafts read through."""
    path = str(tmp_path / "mtp.gguf")
    synth_model(path, "qwen35moe", SHAPE, "q4_k_m", seed=5, mtp=True)
    full = Engine.load(path, backend="cpu", n_ctx=CTX)
    try:
        fixed, experts = _sizes(full)  # five MoE blocks: the trunk's four and the MTP block
        eng = Engine.load(path, backend="cpu", n_ctx=CTX, ram_budget=fixed + experts // 3)
        try:
            be, ref = eng.backend, full.backend
            assert len(be.experts.caches) == SHAPE["n_layer"] + 1 and len(be.experts.order) == SHAPE["n_layer"]

            def run(m):
                sts = [m.new_state(CTX) for _ in range(3)]
                for j, st in enumerate(sts):
                    m.forward(list(range(20 + j, 30 + j)), st)
                one = m.forward_rows([([4, 5, 6], sts[0])])
                return [x.copy() for x in one] + [x.copy() for x in m.forward_rows([([7, 8], sts[1]),
                                                                                     ([9, 10, 11], sts[2])])]

            a, b = run(ref), run(be)
            assert len(a) == 3 and all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
            req = [{"prompt": [5, 6, 7, 5, 6, 7, 5, 6], "max_tokens": 6, "temperature": 0}]
            want, got = full.generate_batch(req), eng.generate_batch(req)  # the MTP drafter: the file has the block
            assert got[0].tokens == want[0].tokens
            mtp = next(c for c in be.experts.caches.values() if c.block == SHAPE["n_layer"])
            assert mtp.uses > 0  # the drafter ran the block, its experts through its cache
        finally:
            eng.close()
    finally:
        full.close()


def test_plan_file_agrees_with_the_loaded_model(model, capsys):
    from hybridinfer.backends.cpu.expert_setup import plan_file, uniform_read_bytes
    from hybridinfer.cli import main
    from hybridinfer.format.gguf_model import GGUFModel

    path, full = model
    fixed, experts = _sizes(full)
    budget = fixed + experts // 3
    gm = GGUFModel(path)
    rp = plan_file(gm, SHAPE["n_expert_used"], budget)
    eng = _load(path, budget)
    try:
        loaded = eng.backend.ram_plan
        assert rp.expert_bytes == loaded.expert_bytes
        assert abs(rp.fixed_bytes - loaded.fixed_bytes) <= 64 * len(gm.tensors)  # alignment padding only
        assert sum(rp.slots.values()) in range(sum(loaded.slots.values()) - 4, sum(loaded.slots.values()) + 5)
    finally:
        eng.close()
    per_token = uniform_read_bytes(rp, SHAPE["n_expert_used"])
    assert 0 < per_token < SHAPE["n_expert_used"] * experts / 16
    assert main(["plan", "-m", path, "--card", "k40", "--host-bw", "100", "--ram-budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "cpu ram:" in out and "read per decode token" in out
    # the split with the card's streamer (a k40 holds this model whole: it takes no host memory, reads nothing)
    assert "ram split:" in out and "gpu prefill 0.0 MiB" in out and "in 0 layers read from the file" in out
    assert main(["plan", "-m", path, "--card", "k40", "--host-bw", "100", "--ram-budget", "1000"]) == 2
    assert "is too small" in capsys.readouterr().err
    # the 35B-A3B on a K80 streams its experts: under 12 GiB the card reads its cold ones each pass, the CPU its slots
    assert main(["plan", "--shape", "35b-a3b", "--card", "k80", "--host-bw", "10", "--ram-budget", "12GiB"]) == 0
    out = capsys.readouterr().out
    split = next(line for line in out.splitlines() if line.startswith("ram split:"))
    assert "0 layers kept" in split and " in 0 layers read" not in split and "read from the file each prompt" in split
