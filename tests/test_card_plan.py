"""The per-card time model without a GPU: the bus pacing schedule, the pure FLOP count, the double-buffered
schedule, ShapeModel against a synthesized file, `plan_for_card` and the `hybridinfer plan` command."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybridinfer.backends.gpu import calibration, cards, timemodel
from hybridinfer.backends.gpu.pacing import MAX_PIECE, pace_pieces, paced_seconds
from hybridinfer.backends.gpu.work import attention_flops, gdn_flops, prefill_work
from hybridinfer.cli import main
from hybridinfer.errors import ParameterError
from hybridinfer.format.gguf_model import GGUFModel
from hybridinfer.models import model_args
from hybridinfer.tools.card_plan import plan_for_card
from hybridinfer.tools.shape_model import ShapeModel
from hybridinfer.tools.synth import plan_model, synth_model

_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
TINY_MOE = dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512, n_expert=4,
                n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, **_GDN)


# ---- pacing -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("bw", [6e9, 12e9, 7.3e9])
def test_pace_pieces_cover_the_copies_and_add_up_to_the_slow_bus_time(bw):
    sizes = [0, 1, 100 << 20, 3 * MAX_PIECE, 12345678, MAX_PIECE + 1]
    ps = pace_pieces(sizes, bw)
    for i, n in enumerate(sizes):
        mine = [p for p in ps if p.copy == i]
        assert sum(p.nbytes for p in mine) == n
        assert [p.offset for p in mine] == list(np.cumsum([0] + [p.nbytes for p in mine])[:-1])
    assert all(0 < p.nbytes <= MAX_PIECE for p in ps)
    assert sum(p.hold_ns for p in ps) == round(sum(sizes) * 1e9 / bw)
    # every piece's share is its own bytes over the rate to within the 1 ns rounding
    assert all(abs(p.hold_ns - p.nbytes * 1e9 / bw) <= 1 for p in ps)
    assert abs(paced_seconds(sizes, bw) - sum(sizes) / bw) <= 1e-9  # the ns rounding


def test_pace_pieces_rejects_bad_rates_and_sizes():
    for bad in (0, -6e9, math.inf, math.nan, "fast", None):
        with pytest.raises(ParameterError, match="bus_bw"):
            pace_pieces([10], bad)
    with pytest.raises(ParameterError, match="negative size -1"):
        pace_pieces([10, -1], 6e9)
    with pytest.raises(ParameterError, match="max_piece"):
        pace_pieces([10], 6e9, max_piece=0)


def test_pace_holds_keep_the_timeline_and_never_release_early():
    """hi_pace_hold (native/pace/pace.c, the GPU package's own module), run here directly as the CUDA driver runs it
    between copies: START sets the bus's free time to now + its share, NEXT waits for it and adds its own share, END
    waits for the last."""
    import time

    from hybridinfer.backends.gpu.k_pace import END, NEXT, START, native

    m = native()
    ffi, lib = m.ffi, m.lib
    clock = ffi.new("hi_pace_clock *")

    def hold(mode, dur):
        lib.hi_pace_hold(ffi.new("hi_pace_hold_arg *", {"clock": clock, "dur_ns": dur, "mode": mode}))

    t0 = lib.hi_pace_now_ns()
    w0 = time.perf_counter()
    assert (START, NEXT, END) == (lib.HI_PACE_START, lib.HI_PACE_NEXT, lib.HI_PACE_END)
    hold(START, 20_000_000)
    t1 = lib.hi_pace_now_ns()
    start = clock.t_next - 20_000_000
    assert t0 <= start <= t1 and t1 - t0 < 20_000_000  # START does not wait
    hold(NEXT, 30_000_000)
    assert clock.t_next == start + 50_000_000 and lib.hi_pace_now_ns() >= start + 20_000_000
    hold(END, 0)
    assert clock.t_next == start + 50_000_000 and lib.hi_pace_now_ns() >= start + 50_000_000
    assert time.perf_counter() - w0 >= 0.05
    hold(END, 0)  # a hold past its time returns at once
    assert lib.hi_pace_now_ns() - (start + 50_000_000) < 10**9


def test_pace_start_waits_for_another_streams_share_of_the_bus():
    """Two uploads on one card's clock (the weights' stream and the expert split's partial sums): a START while the
    bus is booked waits until it is free and books after it, and the first upload's next piece waits for that
    share too, so the bus carries both one after the other."""
    import threading

    from hybridinfer.backends.gpu.k_pace import END, NEXT, START, native

    m = native()
    ffi, lib = m.ffi, m.lib
    clock = ffi.new("hi_pace_clock *")

    def hold(mode, dur):
        lib.hi_pace_hold(ffi.new("hi_pace_hold_arg *", {"clock": clock, "dur_ns": dur, "mode": mode}))

    hold(START, 30_000_000)  # the weights' first piece holds the bus for 30 ms
    start = clock.t_next - 30_000_000
    got = {}

    def other():  # the partial sums' upload, from another thread: 20 ms once the weights' piece is through
        hold(START, 20_000_000)
        got["at"] = lib.hi_pace_now_ns()
        hold(END, 0)
        got["end"] = lib.hi_pace_now_ns()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert got["at"] >= start + 30_000_000 and clock.t_next == start + 50_000_000
    assert got["end"] >= start + 50_000_000
    hold(NEXT, 10_000_000)  # the weights' second piece: after both
    assert clock.t_next == start + 60_000_000 and lib.hi_pace_now_ns() >= start + 50_000_000
    hold(END, 0)
    assert lib.hi_pace_now_ns() >= start + 60_000_000


# ---- the double-buffered schedule ---------------------------------------------------------------------------

def test_pipeline_lies_between_perfect_overlap_and_none():
    rng = np.random.default_rng(0)
    for _ in range(200):
        n = int(rng.integers(1, 30))
        comp = list(rng.uniform(0, 1, n))
        tr = list(rng.uniform(0, 1, n) * (rng.uniform(0, 1, n) > 0.3))
        t = timemodel.pipeline_seconds(comp, tr)
        assert max(sum(comp), sum(tr)) - 1e-9 <= t <= sum(comp) + sum(tr) + 1e-9


def test_pipeline_cases_worked_by_hand():
    assert timemodel.pipeline_seconds([1, 1, 1], [0, 0, 0]) == 3  # resident: compute only
    # streamed, transfer-bound: copies back to back (two slots free the way), the last compute after the last copy
    assert timemodel.pipeline_seconds([0.1] * 4, [1] * 4) == pytest.approx(4.1)
    # compute-bound: the first copy, then compute; copy 2 waits for slot 0 (compute 0 ends at 1 + 2 = 3)
    assert timemodel.pipeline_seconds([2, 2, 2], [1, 1, 1]) == pytest.approx(7)
    with pytest.raises(ParameterError, match="3 compute times for 2"):
        timemodel.pipeline_seconds([1, 1, 1], [1, 1])
    with pytest.raises(ParameterError, match="layer 1"):
        timemodel.pipeline_seconds([1, -1], [0, 0])


def test_decode_seconds():
    assert timemodel.decode_seconds(2_000_000_000, 20e9, 0.5) == pytest.approx(0.2)
    with pytest.raises(ParameterError, match="host bandwidth"):
        timemodel.decode_seconds(1, 0.0, 0.5)
    with pytest.raises(ParameterError, match="decode efficiency"):
        timemodel.decode_seconds(1, 1e9, 1.5)


# ---- the FLOP count ----------------------------------------------------------------------------------------

def test_attention_flops_closed_form_equals_the_pair_count():
    for pos0, T in ((0, 1), (0, 947), (100, 37), (5, 0)):
        pairs = sum(p + 1 for p in range(pos0, pos0 + T))
        assert attention_flops(3, 64, pos0, T) == 4 * 3 * 64 * pairs


@pytest.mark.parametrize("shape", ["35b-a3b", "9b", TINY_MOE])
def test_prefill_work_matrix_flops_equal_twice_the_active_parameters(shape):
    """An independent count: 2 FLOPs per active parameter per token (synth's parameter count), less the
    embedding (a lookup) and the vectors, the head on one row."""
    arch = "qwen35" if shape == "9b" else "qwen35moe"
    gm = ShapeModel(arch, shape)
    a = model_args(gm)
    plan = plan_model(arch, shape)
    _, active = plan["params"], plan["active_params"]
    head = math.prod(gm.tensor("output.weight").ne)
    emb = math.prod(gm.tensor("token_embd.weight").ne)
    vec = sum(math.prod(s.ne) for s, _, _ in plan["tensors"] if len(s.ne) == 1 or s.name.endswith("conv1d.weight"))
    T = 947
    w = prefill_work(gm, a, T)
    assert w.gemm + w.moe == pytest.approx(2 * T * (active - head - emb - vec) + 2 * head, rel=1e-12)
    n_gdn = a.layer_types.count("gdn")
    assert w.gdn == n_gdn * gdn_flops(a, T)
    assert w.attention == (a.n_layer - n_gdn) * attention_flops(a.n_head, a.head_dim, 0, T)
    assert sum(w.by_layer.values()) == pytest.approx(w.flops, rel=1e-12)
    assert set(w.by_layer) == set(range(a.n_layer + 1))


# ---- ShapeModel --------------------------------------------------------------------------------------------

def test_shape_model_has_the_layout_of_the_synthesized_file(tmp_path):
    p = tmp_path / "m.gguf"
    synth_model(p, "qwen35moe", TINY_MOE, "q4_k_m", seed=1)
    f, s = GGUFModel(p), ShapeModel("qwen35moe", TINY_MOE, "q4_k_m")
    assert model_args(f) == model_args(s)
    assert {n: (t.qtype, tuple(t.ne), t.nbytes) for n, t in f.tensors.items()} == \
        {n: (t.qtype, tuple(t.ne), t.nbytes) for n, t in s.tensors.items()}
    a = model_args(f)
    for T in (1, 33):
        assert prefill_work(f, a, T).as_dict() == prefill_work(s, a, T).as_dict()
    pf = plan_for_card(f, a, "c2075", vram_budget=64 << 20, host_bw=10e9)
    ps = plan_for_card(s, a, "c2075", vram_budget=64 << 20, host_bw=10e9)
    assert pf.prefill == ps.prefill and pf.decode_bytes == ps.decode_bytes


# ---- plan_for_card -----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def m35():
    gm = ShapeModel("qwen35moe", "35b-a3b", "q4_k_m")
    return gm, model_args(gm)


def test_plan_is_monotone_in_tokens_and_a_bigger_card_streams_less(m35):
    gm, a = m35
    pl = plan_for_card(gm, a, "c2075", host_bw=20e9, prompts=(16, 128, 947, 4096))
    secs = [r.seconds for r in pl.prefill]
    assert secs == sorted(secs) and len(set(secs)) == len(secs)
    assert all(max(r.compute_s, r.transfer_s) <= r.seconds <= r.compute_s + r.transfer_s for r in pl.prefill)
    p = pl.placement
    assert p.total_bytes <= pl.vram_budget == cards.card("c2075").vram - (512 << 20)
    assert 0 < p.stream_bytes_per_pass < pl.weight_bytes and 0 < pl.pinned_slabs < pl.expert_slabs
    streamed = []
    for gib in (3, 4, 6, 8, 11):  # the same card's figures, more VRAM each time
        q = plan_for_card(gm, a, "k40", vram_budget=gib << 30, prompts=(947,))
        streamed.append((q.placement.stream_bytes_per_pass, q.prefill[0].transfer_s, q.prefill[0].seconds))
    for (b0, t0, s0), (b1, t1, s1) in zip(streamed, streamed[1:], strict=False):
        assert b1 < b0 and t1 < t0 and s1 <= s0
    big = plan_for_card(gm, a, "p100", prompts=(947,))
    assert big.placement.stream_bytes_per_pass < p.stream_bytes_per_pass


def test_plan_uses_the_card_table_and_the_calibration(m35):
    gm, a = m35
    c = cards.card("c2075")
    eff = calibration.Efficiency(0.5, 0.5, "test")
    pl = plan_for_card(gm, a, "fermi", host_bw=20e9, prompts=(947,), eff=eff, decode_eff=0.25)
    assert pl.card is c
    r = pl.prefill[0]
    assert r.compute_s == pytest.approx(prefill_work(gm, a, 947).flops / (c.fp32_flops * 0.5), rel=1e-9)
    assert r.transfer_s == pytest.approx(pl.placement.stream_bytes_per_pass / (c.bus_bw * 0.5), rel=1e-9)
    assert pl.decode_s == pytest.approx(pl.decode_bytes / (20e9 * 0.25))
    default = plan_for_card(gm, a, "c2075", prompts=(947,))
    assert default.eff == calibration.CALIBRATION["fermi"] and default.decode_s is None
    for cls, name in cards.PROFILES.items():  # every class has its row, each with where its figures come from
        e = calibration.efficiency(cls)
        assert 0 < e.compute <= 1 and 0 < e.bus <= 1 and e.source
        assert plan_for_card(gm, a, name, prompts=(947,)).eff == e
    with pytest.raises(ParameterError, match="'modern'"):
        calibration.efficiency("modern")


@pytest.mark.parametrize("kw,match", [
    (dict(card_name="c9999"), "unknown card 'c9999'"),
    (dict(card_name="c2075", vram_budget=7 << 30), "--vram-budget 7.00 GiB exceeds"),
    (dict(card_name="c2075", vram_budget=0), "--vram-budget must be a positive"),
    (dict(card_name="c2075", vram_budget=100 << 20), "--vram-budget 0.10 GiB on c2075"),
    (dict(card_name="c2075", host_bw=-1.0), "--host-bw must be a positive rate, got -1.0"),
    (dict(card_name="c2075", prompts=(128, 0)), r"prompt lengths .* \(128, 0\)"),
])
def test_plan_bad_values_are_named(m35, kw, match):
    gm, a = m35
    with pytest.raises(ParameterError, match=match):
        plan_for_card(gm, a, **kw)


# ---- the command -------------------------------------------------------------------------------------------

def test_plan_command_prints_the_placement_and_predictions(capsys):
    assert main(["plan", "--shape", "35b-a3b", "--card", "c2075", "--host-bw", "20", "--prompts", "128,947"]) == 0
    out = capsys.readouterr().out
    assert "c2075 (GF110, sm_20, fermi)" in out and "GiB resident" in out and "expert slabs pinned" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| 128 ") or ln.startswith("| 947 ")]
    assert len(rows) == 2
    assert "ms per token" in out


def test_plan_of_two_cards_under_a_ram_budget_splits_it_over_both_streamers(capsys):
    """plan --cards 2 --ram-budget: each split's RAM split (every card's streamer beside the CPU decode) within the
    budget; one too small is refused naming both cards' staging and the least that loads."""
    import re

    G = 2**30
    args = ["plan", "--shape", "35b-a3b", "--card", "c2075", "--cards", "2", "--vram-budget", "5GiB", "--prompts",
            "947"]
    assert main(args + ["--ram-budget", "24GiB"]) == 0
    out = capsys.readouterr().out
    for split in ("layer", "expert"):
        (line,) = [ln for ln in out.splitlines() if ln.startswith(f"ram split ({split} split):")]
        assert "gpu prefill on 2 cards" in line and "card 0 " in line and "card 1 " in line
        cpu, gpu = (float(x) for x in re.search(r"cpu decode ([\d.]+) GiB, gpu prefill on 2 cards ([\d.]+) GiB",
                                                line).groups())
        assert (cpu + gpu) * G <= 24 * G * 1.0001  # the split stays within the budget (figures rounded to 0.01)
    assert main(args + ["--ram-budget", "2GiB"]) == 2
    err = capsys.readouterr().err
    assert "over 2 cards" in err and "each card's own staging" in err and "is needed" in err


def test_plan_command_from_a_file(tmp_path, capsys):
    p = tmp_path / "m.gguf"
    synth_model(p, "qwen35moe", TINY_MOE, "q4_k_m", seed=1)
    assert main(["plan", "-m", str(p), "--card", "k80", "--host-bw", "10", "--prompts", "64"]) == 0
    out = capsys.readouterr().out
    assert str(p) in out and "| 64 |" in out


@pytest.mark.parametrize("argv,match", [
    (["--shape", "35b-a3b", "--card", "c9999"], "unknown card 'c9999'"),
    (["--shape", "35b-a3b", "--card", "c2075", "--vram-budget", "8GiB"], "--vram-budget 8.00 GiB exceeds"),
    (["--shape", "35b-a3b", "--card", "c2075", "--vram-budget", "0"], "--vram-budget must be more than 0"),
    (["--shape", "35b-a3b", "--card", "c2075", "--vram-budget", "lots"], "not a size: 'lots'"),
    (["--shape", "35b-a3b", "--card", "c2075", "--host-bw", "-3"], "must be > 0, got '-3'"),
    (["--shape", "35b-a3b", "--card", "c2075", "--host-bw", "1", "--prompts", "1,x"], "--prompts .* '1,x'"),
    (["--shape", "70b", "--card", "c2075", "--host-bw", "1"], "unknown synthetic shape '70b'"),
    (["--card", "c2075"], "one of -m MODEL or --shape"),
])
def test_plan_command_bad_values(argv, match, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    import re

    assert re.search(match, err), err


# ---- the bench's calibration figures -----------------------------------------------------------------------

def test_bench_prefill_efficiencies_come_from_the_right_rows():
    from hybridinfer.tools.benchmarks.prefill import efficiencies

    rows = [dict(engine="hybridinfer", config="--vram-budget 6GiB", tokens=947, h2d_frac=0.93, fma_frac=0.1),
            dict(engine="hybridinfer", config="whole model resident", tokens=947, h2d_frac=0.0, fma_frac=0.4),
            dict(engine="llama.cpp", config="CPU only", tokens=947, tok_s=5.0),
            dict(engine="hybridinfer", config="2 GPU(s), --devices 0,1, split expert", tokens=947, h2d_frac=0.6,
                 fma_frac=0.2)]
    assert efficiencies(rows) == {947: {"bus": 0.93, "compute_streamed": 0.1, "compute": 0.4}}


def test_cards_rows_are_measured_against_the_slowest_cards_floor():
    """bench prefill --devices: a row over cards is wall over its slowest card's floor (bus: the weights it streamed
    and the rows that came up to it; compute: its FLOPs), with the cards' bus and FLOP/s summed against their summed
    rates; one card's row is wall over max(bytes / bus, FLOPs / peak), as the single-card rows."""
    from hybridinfer.tools.benchmarks.prefill import card_figures, cards_floor

    bw, peak = 6e9, 1e13
    cards = [{"bytes_h2d": 6e9, "up_bytes": 1.2e9, "flops": 1e13, "copy_s": 1.0, "gpu_s": 1.4},
             {"bytes_h2d": 6.6e9, "up_bytes": 1.2e9, "flops": 1.1e13, "copy_s": 1.1, "gpu_s": 1.5}]
    assert cards_floor(cards, bw, peak) == pytest.approx(7.8e9 / bw)  # card 1's bus
    assert cards_floor([dict(c, flops=3e13) for c in cards], bw, peak) == pytest.approx(3.0)  # compute
    t = {"wall_s": 1.6, "gpu_s": 1.5, "bytes_h2d": 12.6e9, "work": {"flops": 2.1e13}, "cards": cards}
    f = card_figures(t, bw, peak)
    assert f["floor_ratio"] == pytest.approx(1.6 / 1.3)
    assert f["h2d_gb_s"] == pytest.approx(12.0) and f["h2d_frac"] == pytest.approx(1.0)
    assert f["gemm_tflops"] == pytest.approx(14.0) and f["fma_frac"] == pytest.approx(0.7)
    one = {"wall_s": 3.0, "gpu_s": 2.9, "copy_s": 2.9, "bytes_h2d": 17.1e9, "work": {"flops": 2e13}}
    assert card_figures(one, bw, peak)["floor_ratio"] == pytest.approx(3.0 / 2.85)
    # the layer pipeline: the rows a later card takes up are on its bus, not on the first card's
    layer = dict(t, cards=[{k: v for k, v in c.items() if k != "up_bytes"} for c in cards])
    assert card_figures(layer, bw, peak, up_rows_bytes=3e9)["floor_ratio"] == pytest.approx(1.6 / (9.6e9 / bw))


def test_bench_prefill_markdown_shows_the_counts_and_the_calibration():
    from dataclasses import asdict

    from hybridinfer.tools.benchmarks.prefill import Row, efficiencies, markdown

    rows = [asdict(Row("hybridinfer", "--vram-budget 6GiB", 947, 349.0, 2.715, 2.66, 2.70, 0.015, 5.99, 0.998, 1.78,
                       0.03, 1.02, 6.19, 4795.7e9, 14.83 * 2**30, True)),
            asdict(Row("hybridinfer", "whole model resident", 947, 3048.0, 0.311, 0.0, 0.296, 0.014, 0.0, 0.0, 16.18,
                       0.268, 3.91, 20.0, 4795.7e9, 0, True))]
    res = {"model": "m.gguf", "pinned_h2d_gb_s": 55.5, "fma_peak_tflops": 60.3, "bus_gb_s": 6.0, "bus_paced": True,
           "configs": [], "rows": rows, "efficiency": efficiencies(rows)}
    md = markdown(res)
    assert "paced to 6.0 GB/s" in md
    assert "| 1.02 | 6.19 | 4795.7, 14.83 (yes) |" in md
    assert "947 tokens: compute 0.268 of FMA peak, bus 0.998 of 6.0 GB/s" in md


def test_calibration_follows_the_kernels_a_card_runs():
    """A 63-register card (sm_2x, GK10x's sm_30) runs fermi's kernel class and takes its measured efficiency;
    sm_35 and later take their class's, a class newer than the table pascal's."""
    from hybridinfer.backends.gpu import calibration, cards

    fermi = calibration.CALIBRATION["fermi"]
    assert calibration.efficiency_for(cards.card("gtx680").limits) == fermi
    assert calibration.efficiency_for(cards.card("c2075").limits) == fermi
    assert calibration.efficiency_for(cards.card("k40").limits) == calibration.CALIBRATION["kepler"]
    assert calibration.efficiency_for(cards.limits_for((9, 0), 132)) == calibration.CALIBRATION["pascal"]
    for e in calibration.CALIBRATION.values():
        assert 0 < e.compute < 1 and 0 < e.bus <= 1 and "bench prefill --card-profile" in e.source
