"""GPU prefill under a RAM budget on a card: the routed experts the card does not pin are read from the GGUF on every
pass (gpu/disk_stage.py) and the logits are those of the same prefill without a budget; a file truncated mid-run is an
ExpertReadError, never logits."""

from __future__ import annotations

import os
import shutil
import time

import pytest
from gpu_profile import PROFILE

from hybridinfer.engine.api import Engine
from hybridinfer.errors import ExpertReadError, ParameterError, RamBudgetError
from tests.bounded import bounded
from tests.test_gpu_prefill import _close, _ids, _streaming_budget

pytestmark = pytest.mark.gpu


def _load(path, **kw):
    return Engine.load(str(path), backend="gpu", n_ctx=256, gpu_chunk=32, vram_budget=_streaming_budget(path),
                       card_profile=PROFILE, spec_type="none", **kw)


def _least(path, **kw) -> int:
    """The least RAM budget that loads (its refusal names it): every side reads what it can from the file."""
    try:
        _load(path, ram_budget=1, **kw).close()
    except RamBudgetError as e:
        return e.needed
    except ParameterError as e:
        if "O_DIRECT" in str(e):  # the oracle models' directory is on a file system without it (tmpfs)
            pytest.skip(str(e))
        raise
    raise AssertionError("a 1-byte RAM budget loaded")


# Experts that outweigh O_DIRECT's readers' buffers (2 readers x a 4 MiB piece): 64 of 512 wide per layer, about
# 27 MB a layer at q8_0, where the oracle model's ~1 MB a layer is held rather than read (ram_split.GpuHost.least).
WIDE_MOE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=64, n_expert_used=4,
                n_ff_exp=512, n_ff_shexp=256, ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)


@pytest.fixture
def wide_moe(oracle_gguf):
    """WIDE_MOE beside the oracle models (a file system that takes O_DIRECT, where tmpfs would not), removed after."""
    from hybridinfer.tools.synth import synth_model

    path = os.path.join(os.path.dirname(oracle_gguf("qwen35moe", "q8_0")), f"wide-moe-{os.getpid()}.gguf")
    synth_model(path, "qwen35moe", WIDE_MOE, "q8_0", seed=3)
    yield path
    os.remove(path)


@pytest.mark.parametrize("io,bus_bw,readers", [("pread", None, None), ("direct", 8e9, 2)])
def test_gpu_prefill_reading_experts_from_the_file_gives_the_resident_logits(request, io, bus_bw, readers):
    path = request.getfixturevalue("oracle_gguf")("qwen35moe", "q8_0") if io == "pread" else \
        request.getfixturevalue("wide_moe")
    bus = {} if bus_bw is None else {"bus_bw": bus_bw}  # the bus sets what streams, so the least budget too
    base = _load(path, **bus)
    ids = _ids(base.args.n_vocab)
    try:
        assert base.backend.gpu.placement.stream_bytes_per_pass > 0
        want = base.prefill(ids, base.new_state(), all_logits=True)
    finally:
        base.close()
    io_kw = {"expert_io": io} | ({} if readers is None else {"readers": readers})
    budget = _least(path, **io_kw, **bus)
    eng = _load(path, ram_budget=budget, **io_kw, **bus)
    try:
        gm = eng.backend.gpu
        split = gm.ram_split
        assert split.disk and split.total <= budget and split.read_per_pass > 0
        assert eng.backend.cpu.ram_plan.on_disk
        assert gm.streamer.host_bytes == split.gpu_bytes - (split.gpu.bounce if split.disk else 0)
        for k in range(2):  # every pass reads the cold experts again
            st = eng.new_state()
            got = eng.prefill(ids, st, all_logits=True)
            _close(got, want, f"gpu prefill under a {budget} B RAM budget [{io}], pass {k}")
            assert st.pos == len(ids)
            assert gm.disk_stats()["bytes_read"] == (k + 1) * split.read_per_pass
            assert gm.last_timing["bytes_h2d"] == gm.placement.stream_bytes_per_pass
    finally:
        eng.close()


def test_a_file_truncated_during_gpu_prefill_is_a_typed_error(oracle_gguf, tmp_path):
    src = oracle_gguf("qwen35moe", "q8_0")
    path = str(tmp_path / "copy.gguf")
    shutil.copy(src, path)
    eng = _load(path, ram_budget=_least(path), read_timeout=5.0)
    try:
        ids = _ids(eng.args.n_vocab)
        eng.prefill(ids, eng.new_state())
        os.truncate(path, os.path.getsize(path) // 2)
        t0 = time.monotonic()
        out = bounded(lambda: eng.prefill(ids, eng.new_state(), all_logits=True), timeout=60)
        assert isinstance(out.get("error"), ExpertReadError), out
        assert time.monotonic() - t0 < 10
        # and every later pass, never logits of stale weights
        out = bounded(lambda: eng.prefill(ids, eng.new_state(), all_logits=True), timeout=60)
        assert isinstance(out.get("error"), ExpertReadError) and "stopped" in str(out["error"]), out
    finally:
        eng.close()
