"""The multi-card prefill's orchestration without a GPU (gpu/pipeline.py, gpu/multi_gpu.MultiGPUModel's forward):
stand-in cards that compute a toy recurrent model over their layer range, with per-token and recurrent state in a
real DecoderState, against the same model on one stand-in card; micro-batches, the state views, a card's failure."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from hybridinfer.backends.gpu import multi_card, pipeline
from hybridinfer.backends.gpu.multi_gpu import MultiGPUModel, check_devices
from hybridinfer.backends.gpu.pipeline import IN_FLIGHT, micro_batches, run_pipeline, state_view
from hybridinfer.backends.state import DecoderState
from hybridinfer.errors import CardFailedError, ParameterError

TYPES = ("gdn", "attention", "gdn", "gdn", "attention", "gdn")
D, N_CTX, VOCAB = 4, 256, 50


def new_state() -> DecoderState:
    st = DecoderState(n_ctx=N_CTX, layer_types=TYPES, tokens=np.zeros(N_CTX, np.int32))
    for i, t in enumerate(TYPES):
        if t == "gdn":
            st.arrays["ssm"][i] = np.zeros((2, 3), np.float64)
        else:
            st.arrays["k"][i] = np.zeros((N_CTX, 2), np.float64)
    return st


class FakeCard:
    """Layers [first, end) of a toy model (the head: layer len(TYPES)): a GDN layer carries a recurrent value, an
    attention layer writes its rows at their positions and reads every row up to each; so a wrong position, a lost
    state or a mixed-up micro-batch changes the output. Records what it ran, and when."""

    def __init__(self, device, first, end, fail_at=None, delay=0.0):
        self.device, self.first, self.end, self.fail_at, self.delay = device, first, end, fail_at, delay
        self.name, self.label = f"Fake {device}", f"device {device} (Fake {device})"
        self.log: list = []
        self.seen: list = []  # the state (a card's view) of each run
        self.m = SimpleNamespace(first=first, end=end)
        self.totals: dict = {}

    def host_rows(self, n, i):
        return np.full((n, D), np.nan)

    def run(self, job, state, rows_in, out):
        if self.fail_at is not None and len(self.log) == self.fail_at:
            raise RuntimeError("the card fell off the bus")
        self.log.append((job.seq, job.p0, len(job.ids), state.pos, time.perf_counter()))
        self.seen.append(state)
        time.sleep(self.delay)
        T, p0 = len(job.ids), state.pos
        x = (np.outer(job.ids, np.arange(1, D + 1)) / VOCAB if rows_in is None else rows_in[:T].copy())
        for i in range(self.first, min(self.end, len(TYPES))):
            for t in range(T):
                if TYPES[i] == "gdn":
                    S = state.arrays["ssm"][i]
                    S[0, 0] = 0.5 * S[0, 0] + x[t].sum() / (i + 1)
                    x[t] += np.tanh(S[0, 0])
                else:
                    K = state.arrays["k"][i]
                    K[p0 + t, 0] = x[t, 0] - x[t, 1]
                    x[t] += np.cos(K[: p0 + t + 1, 0]).mean()
        state.tokens[p0 : p0 + T] = job.ids
        state.pos = p0 + T
        if self.end > len(TYPES):
            lg = np.tanh(x) * 3
            return lg if job.all_logits else lg[-1:]
        out[:T] = x
        return out[:T]


def model(cards, micro_batch=None) -> MultiGPUModel:
    """A MultiGPUModel over stand-in cards (its constructor needs CUDA; forward and forward_many do not)."""
    m = object.__new__(MultiGPUModel)
    m.args = SimpleNamespace(n_vocab=VOCAB, layer_types=TYPES)
    m.cards, m.micro_batch, m.n_ctx, m.n_rows, m.chunk, m.last_timing = cards, micro_batch, N_CTX, 128, 32, {}
    m._views = {}
    return m


def prompt(n, seed):
    return np.random.default_rng(seed).integers(0, VOCAB, n)


def test_micro_batches_cut_each_prompt_evenly_in_order():
    jobs = micro_batches([947, 5, 300], 256)
    assert [len(j.ids) for j in jobs if j.seq == 0] == [236, 237, 237, 237]
    assert [(j.seq, j.p0, j.last) for j in jobs if j.seq == 1] == [(1, 0, True)]
    assert [len(j.ids) for j in jobs if j.seq == 2] == [150, 150]
    for s, T in enumerate([947, 5, 300]):
        assert np.array_equal(np.concatenate([j.ids for j in jobs if j.seq == s]), np.arange(T))
    with pytest.raises(ValueError, match="at least 1, got 0"):
        micro_batches([3], 0)


def test_state_view_shares_the_arrays_not_the_position():
    st = new_state()
    st.pos = 7
    v = state_view(st)
    v.arrays["ssm"][0][0, 0] = 3.0
    v.pos, v.tokens[7] = 9, 11
    assert st.arrays["ssm"][0][0, 0] == 3.0 and st.pos == 7 and st.tokens[7] == 0


@pytest.mark.parametrize("split", [[(0, 3), (3, 7)], [(0, 1), (1, 4), (4, 7)], [(0, 6), (6, 7)]])
@pytest.mark.parametrize("micro", [None, 16, 7])
def test_cards_equal_one_card(split, micro):
    prompts = [prompt(40, 1), prompt(3, 2)]
    one = model([FakeCard(0, 0, 7)])
    many = model([FakeCard(k, f, e) for k, (f, e) in enumerate(split)], micro)
    many.rows_for = one.rows_for = lambda T, mb=micro: mb or T  # no time model here: the given rows
    for p0 in (0, 9):  # a fresh state, and one that continues (a restored prefix)
        sa, sb = new_state(), new_state()
        if p0:
            pre = prompt(p0, 3)
            one.forward(pre, sa, all_logits=False)
            many.forward(pre, sb, all_logits=False)
        want = one.forward(prompts[0], sa, all_logits=True)
        got = many.forward(prompts[0], sb, all_logits=True)
        assert got.shape == (40, D) and np.array_equal(got, want)
        assert sa.pos == sb.pos == p0 + 40 and np.array_equal(sa.tokens, sb.tokens)
        for name in ("ssm", "k"):
            for x, y in zip(sa.arrays[name], sb.arrays[name], strict=True):
                assert (x is None) == (y is None) and (x is None or np.array_equal(x, y))
    n40, n9 = len(micro_batches([40], micro or 40)), len(micro_batches([9], micro or 9))
    assert many.last_timing["micro_batches"] == n40
    assert all(len(c.log) == 2 * n40 + n9 for c in many.cards)


def test_several_prompts_flow_through_together_and_each_gets_its_logits():
    ps = [prompt(n, s) for s, n in enumerate([30, 2, 17])]
    one = model([FakeCard(0, 0, 7)])
    many = model([FakeCard(0, 0, 4), FakeCard(1, 4, 7)], micro_batch=8)
    many.rows_for = lambda T: 8
    one.rows_for = lambda T: T
    sa, sb = [new_state() for _ in ps], [new_state() for _ in ps]
    want = [one.forward(p, s, all_logits=False) for p, s in zip(ps, sa, strict=True)]
    got = many.forward_many([(p, s, (), None) for p, s in zip(ps, sb, strict=True)])
    for w, g, a, b in zip(want, got, sa, sb, strict=True):
        assert g.shape == (1, D) and np.array_equal(g, w) and a.pos == b.pos
    # card 1 ran the prompts' micro-batches in the order card 0 sent them
    assert [x[:2] for x in many.cards[1].log] == [x[:2] for x in many.cards[0].log]


def test_the_cards_work_at_the_same_time():
    """Card 0 starts micro-batch m+1 before card 1 is done with micro-batch m: the pipeline overlaps."""
    cards = [FakeCard(0, 0, 3, delay=0.05), FakeCard(1, 3, 7, delay=0.05)]
    m = model(cards, micro_batch=8)
    m.rows_for = lambda T: 8
    m.forward(prompt(32, 5), new_state(), all_logits=False)
    starts0 = [x[4] for x in cards[0].log]
    starts1 = [x[4] for x in cards[1].log]
    assert len(starts0) == len(starts1) == 4
    assert starts0[1] < starts1[0] + 0.05  # card 0 on its second micro-batch while card 1 is on its first


def test_snapshots_inside_a_prompt_cut_it_and_see_the_whole_state():
    m = model([FakeCard(0, 0, 2), FakeCard(1, 2, 7)], micro_batch=8)
    m.rows_for = lambda T: 8
    one = model([FakeCard(0, 0, 7)])
    one.rows_for = lambda T: T
    ids = prompt(30, 9)
    seen = []
    st = new_state()
    m.forward(ids, st, all_logits=False, snapshot_at=(12, 30, 50), on_snapshot=lambda s, lg: seen.append(
        (s.pos, s.arrays["ssm"][5].copy(), lg.copy())))
    assert [p for p, _, _ in seen] == [12]  # inside the prompt only (its end is the engine's)
    ref = new_state()
    lg = one.forward(ids[:12], ref, all_logits=False)
    assert np.array_equal(seen[0][1], ref.arrays["ssm"][5]) and np.array_equal(seen[0][2], lg[-1])


def test_a_failing_card_is_named_and_every_card_stops():
    cards = [FakeCard(0, 0, 3), FakeCard(1, 3, 5, fail_at=1), FakeCard(2, 5, 7)]
    m = model(cards, micro_batch=4)
    m.rows_for = lambda T: 4
    before = threading.active_count()
    with pytest.raises(CardFailedError, match=r"device 1 \(Fake 1\).*fell off the bus") as e:
        m.forward(prompt(40, 4), new_state(), all_logits=False)
    assert e.value.device == 1 and e.value.card == "Fake 1"
    assert threading.active_count() == before  # no worker left behind
    assert len(cards[0].log) <= 1 + 1 + IN_FLIGHT  # card 0 stopped soon after (it may be a few micro-batches on)
    assert len(cards[2].log) <= 1


def test_run_pipeline_keeps_card_0_at_most_in_flight_ahead():
    st = new_state()
    slow = FakeCard(1, 3, 7, delay=0.02)
    cards = [FakeCard(0, 0, 3), slow]
    jobs = micro_batches([40], 4)
    run_pipeline(cards, jobs, [(prompt(40, 6), st)], 4)
    t0 = [x[4] for x in cards[0].log]
    t1 = [x[4] for x in slow.log]
    for j in range(IN_FLIGHT + 1, len(jobs)):  # card 0's job j waits for card 1 to have read job j - IN_FLIGHT
        assert t0[j] >= t1[j - IN_FLIGHT - 1]
    assert st.pos == 40


def test_check_devices():
    assert check_devices([0, 1], None) == ([0, 1], [None, None])
    assert check_devices([0, 0], 5 << 30) == ([0, 0], [5 << 30] * 2)
    assert check_devices((1, 0), [1, 2]) == ([1, 0], [1, 2])
    for devs, b, match in (([], None, "non-empty list"), ([0, -1], None, "-1 is not a CUDA device"),
                           ([0, "1"], None, "'1' is not"), ([0, 1], [1, 2, 3], "3 VRAM budgets for 2 devices"),
                           ([0], [0], "device 0 must be a positive"), (None, [1, 2], "needs devices")):
        with pytest.raises(ParameterError, match=match):
            check_devices(devs, b)
    with pytest.raises(ParameterError, match="not both"):
        check_devices([0, 1], None, device=0)


def test_the_micro_batch_count_follows_the_time_model():
    slot = multi_card.CardSlot(multi_card.cards.card("c2075"), 1 << 30, 0, multi_card.calibration.efficiency("fermi"),
                               "card")
    share = multi_card.CardShare(slot, 0, 1, None, compute_s=8.0, transfer_s=1.0, handoff_s=0.0, stage_s=0.0)
    # compute-bound: more micro-batches overlap more, up to where each one's transfer dominates
    assert multi_card.micro_batch_count([share, share], 4096, 4096) == 8
    # a short prompt's compute is below one transfer: one micro-batch
    assert multi_card.micro_batch_count([share, share], 4096, 128) == 1
    assert multi_card.micro_batch_count([share], 4096, 4096) == 1  # one card gains nothing from cutting
    assert pipeline.Job(0, np.arange(2), 0, True).all_logits is False


def test_a_state_keeps_its_views_while_it_is_as_the_cards_left_it():
    """The cards' copies of a state stay theirs between calls (no upload) only while the host state is unchanged."""
    cards = [FakeCard(0, 0, 3), FakeCard(1, 3, 7)]
    m = model(cards, micro_batch=8)
    m.rows_for = lambda T: 8
    st = new_state()
    m.forward(prompt(16, 1), st, all_logits=False)
    m.forward(prompt(16, 2), st, all_logits=False)  # the scheduler's next chunk: the same views
    assert all(len({id(v) for v in c.seen}) == 1 for c in cards)
    assert cards[0].seen[0] is not cards[1].seen[0]  # a view a card
    st.tokens[st.pos] = 5  # CPU decode moved it on: new views, each card uploads it again
    st.pos += 1
    m.forward(prompt(8, 3), st, all_logits=False)
    assert cards[0].seen[-1] is not cards[0].seen[0] and cards[0].seen[-1].pos == st.pos
    other = new_state()  # another state of the same position gets views of its own
    m.forward(prompt(8, 4), other, all_logits=False)
    assert cards[1].seen[-1] is not cards[1].seen[-2]
    bad = [FakeCard(0, 0, 3, fail_at=0), cards[1]]
    m.cards = bad
    with pytest.raises(CardFailedError):
        m.forward(prompt(8, 5), st, all_logits=False)
    assert m._views == {}  # after a failure every state goes up again
