"""The RAM-budget decisions as pure functions (backends/cpu/expert_plan.py): slots and pins under a budget, the
refusal with the bytes needed, the cache's victims, the read-ahead plan, a step's experts in chunks a cache holds and
the O_DIRECT span."""

from __future__ import annotations

import pytest

from hybridinfer.backends.cpu.expert_plan import (
    ExpertLayer,
    aligned_span,
    expert_chunks,
    halvings,
    plan_ram,
    prefetch_plan,
    rank_experts,
    victims,
)
from hybridinfer.errors import ParameterError, RamBudgetError

LAYERS = [ExpertLayer(0, 8, 100), ExpertLayer(1, 8, 100), ExpertLayer(2, 8, 150)]


def test_plan_gives_every_layer_the_same_slots_and_the_rest_to_the_first():
    # free = 1000 - 200 = 800; one slot in every layer costs 350: two rounds (700), 100 left gives block 0 one more
    p = plan_ram(1000, 200, LAYERS, n_used=2)
    assert p.slots == {0: 3, 1: 2, 2: 2}
    assert p.resident_bytes == 200 + 3 * 100 + 2 * 100 + 2 * 150 <= 1000
    assert p.on_disk
    assert p.expert_bytes == 8 * 350


def test_plan_pins_the_most_used_and_keeps_k_refillable():
    counts = {(0, 5): 9, (0, 2): 7, (0, 7): 7, (1, 1): 3}
    p = plan_ram(200 + 6 * 350, 200, LAYERS, n_used=2, counts=counts)
    assert p.slots == {0: 6, 1: 6, 2: 6}
    # 6 slots, half refillable (3 >= k = 2): the first three by count, ties to the lower id
    assert p.pinned[0] == (2, 5, 7)
    assert p.pinned[1] == (0, 1, 2)
    assert rank_experts(counts, 0, 8)[:3] == [5, 2, 7]
    # the refillable slots start with the next ranked: the cache is full from the first token
    assert p.preload[0] == (0, 1, 3) and not set(p.preload[0]) & set(p.pinned[0])
    assert all(len(p.pinned[b]) + len(p.preload[b]) == p.slots[b] for b in p.slots)
    p = plan_ram(200 + 2 * 350, 200, LAYERS, n_used=2, counts=counts)
    assert p.pinned[0] == () and p.slots[0] == 2  # exactly k slots: nothing pinned


def test_plan_holds_everything_when_it_fits():
    p = plan_ram(10**6, 200, LAYERS, n_used=2)
    assert not p.on_disk
    assert p.pinned[2] == tuple(range(8)) and p.slots[2] == 8 and p.preload[2] == ()


def test_plan_refuses_a_budget_below_the_resident_part_with_the_number():
    need = 200 + 64 + 2 * 350
    with pytest.raises(RamBudgetError) as ei:
        plan_ram(need - 1, 200, LAYERS, n_used=2, extra_bytes=64)
    assert ei.value.needed == need
    assert str(need) in str(ei.value)
    assert isinstance(ei.value, ParameterError)
    assert plan_ram(need, 200, LAYERS, n_used=2, extra_bytes=64).resident_bytes == need
    with pytest.raises(RamBudgetError):
        plan_ram(0, 200, LAYERS, n_used=2)


def test_victims_empty_first_then_fewest_uses_then_least_recent():
    occ = [3, -1, 1, 2, 0]
    counts = [5, 1, 1, 9]  # by expert
    last = [0, 0, 7, 3, 9]  # by slot
    # slot 0 is pinned (first=1); slot 1 is empty; experts 1 and 2 have one use each: slot 3 (last use 3) first
    assert victims(occ, counts, last, set(), 3, first=1) == [1, 3, 2]
    assert victims(occ, counts, last, {1, 3}, 1, first=1) == [2]
    with pytest.raises(ValueError):
        victims(occ, counts, last, {1, 2, 3}, 2, first=1)


def test_counts_halve_every_so_many_uses():
    assert halvings(0, 4095, 4096) == 0
    assert halvings(4095, 4097, 4096) == 1
    assert halvings(100, 100 + 3 * 4096, 4096) == 3
    assert halvings(0, 10**6, 0) == 0


def test_prefetch_plan_reads_the_next_layers_previous_experts_not_held():
    last = [(1, 2), (3, 4, 5), None, (6, 7)]
    held = {(1, 4)}
    plan = prefetch_plan(last, 0, 2, lambda j, e: (j, e) in held, limit=8)
    assert plan == [(1, 3), (1, 5)]  # layer 2 has not run yet, layer 3 beyond the depth
    assert prefetch_plan(last, 0, 3, lambda j, e: False, limit=1) == [(1, 3), (3, 6)]
    assert prefetch_plan(last, 3, 2, lambda j, e: False, limit=8) == []
    assert prefetch_plan(last, 0, 0, lambda j, e: False, limit=8) == []


def test_expert_chunks_read_each_expert_once():
    assert expert_chunks([5, 1, 9, 3, 7], set(), 2) == [[5, 1], [9, 3], [7]]
    assert expert_chunks([5, 1, 9, 3, 7], {9, 7}, 2) == [[5, 1, 9, 7], [3]]  # pinned need no slot: first chunk
    assert expert_chunks([4, 2], {4, 2}, 3) == [[4, 2]]
    assert expert_chunks([], set(), 3) == [[]]
    assert expert_chunks([1, 2, 3], set(), 0) == [[1], [2], [3]]
    for size in (1, 2, 3, 8):
        ch = expert_chunks(list(range(10)), {3}, size)
        flat = [e for c in ch for e in c]
        assert sorted(flat) == list(range(10)) and len(flat) == 10  # each once
        assert all(len([e for e in c if e != 3]) <= size for c in ch)


def test_aligned_span_covers_the_range():
    assert aligned_span(4096, 4096) == (4096, 4096, 0)
    assert aligned_span(100, 50) == (0, 4096, 100)
    a0, n, skip = aligned_span(8190, 10000)
    assert a0 == 4096 and a0 + skip == 8190 and a0 + n >= 8190 + 10000 and n % 4096 == 0 and a0 % 4096 == 0
