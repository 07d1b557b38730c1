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


@pytest.mark.parametrize("io,bus_bw", [("pread", None), ("direct", 8e9)])
def test_gpu_prefill_reading_experts_from_the_file_gives_the_resident_logits(oracle_gguf, io, bus_bw):
    path = oracle_gguf("qwen35moe", "q8_0")
    bus = {} if bus_bw is None else {"bus_bw": bus_bw}  # the bus sets what streams, so the least budget too
    base = _load(path, **bus)
    ids = _ids(base.args.n_vocab)
    try:
        assert base.backend.gpu.placement.stream_bytes_per_pass > 0
        want = base.prefill(ids, base.new_state(), all_logits=True)
    finally:
        base.close()
    budget = _least(path, expert_io=io, **bus)
    kw = {"ram_budget": budget, "expert_io": io} | bus
    eng = _load(path, **kw)
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
