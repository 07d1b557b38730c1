"""Speculative decoding (engine/spec.py) is lossless: greedy output, and sampled output at a fixed seed, are the same
tokens with drafts as without, for one sequence and many, on llama, qwen35 and qwen35moe; after rejected drafts
every layer's state is bit for bit the state of never having seen them, and a snapshot taken after speculation
restores to a cold run's answer.

Random weights make a real drafter's acceptance meaningless, so most tests draft with ScriptedDrafter: the known
continuation with about 30% of its tokens replaced, which exercises acceptance, rejection and rollback on every
step."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.engine import spec as sp
from hybridinfer.engine import spec_cost as sc
from hybridinfer.engine.api import Engine
from hybridinfer.errors import ParameterError, UnsupportedArchitectureError

pytestmark = pytest.mark.isa  # greedy and seeded sampled answers: re-run at every ISA level (.ci/run)
ISA = os.environ.get("HYBRIDINFER_ISA")  # the CPU unit the CI run forces (library calls take it as an argument)

_GDN = dict(ssm_d_state=64, ssm_n_group=2, ssm_dt_rank=4)
SHAPES = {
    "qwen35": ("q8_0", dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=512,
                            **_GDN)),
    "qwen35moe": ("q4_k_m", dict(n_embd=256, n_layer=4, n_head=4, n_head_kv=2, head_dim=64, n_vocab=512,
                                 n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256, **_GDN)),
    "llama": ("q4_k_m", dict(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, n_vocab=512)),
}
N = 20  # tokens generated per request


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from hybridinfer.tools.synth import synth_model

    d = tmp_path_factory.mktemp("spec")
    made: dict[str, str] = {}

    def get(arch: str) -> str:
        if arch not in made:
            quant, shape = SHAPES[arch]
            made[arch] = str(d / f"{arch}.gguf")
            synth_model(made[arch], arch, shape, quant, seed=2)
        return made[arch]

    return get


def _engine(path: str, **kw) -> Engine:
    return Engine.load(path, backend="cpu", n_ctx=128, isa=ISA, n_threads=2, **kw)


def _prompts(n_vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [[int(x) for x in rng.integers(3, n_vocab, n)] for n in (9, 14, 5)]


@pytest.mark.parametrize("arch", list(SHAPES))
def test_greedy_with_drafts_equals_greedy_without(model, arch):
    path = model(arch)
    with _engine(path) as base:
        prompts = _prompts(base.args.n_vocab)
        want = [g.tokens for g in base.generate_batch(prompts, max_tokens=N, temperature=0)]
    refs = [p + w for p, w in zip(prompts, want, strict=True)]
    with _engine(path) as eng:
        for k in (1, 2, 3, 4):
            eng.spec = sp.Speculator(sp.ScriptedDrafter(refs, accept=0.7, seed=k), k, adaptive=False)
            assert eng.generate(prompts[0], max_tokens=N, temperature=0).tokens == want[0], k
            assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)] == want, k
            # drafts were taken and drafts were thrown away: both paths, and the rollback, ran
            assert 0 < eng.spec.accepted < eng.spec.drafted, (k, eng.spec.accepted, eng.spec.drafted)
        # prompt lookup: the prompt repeats itself, so its drafts are tried (whatever random weights accept)
        eng.spec = sp.Speculator(sp.NgramDrafter(), 3, adaptive=False)
        rep = prompts[1] + prompts[1]
        eng.spec.drafted = 0
        got = eng.generate(rep, max_tokens=N, temperature=0).tokens
        assert eng.spec.drafted > 0
    with _engine(path) as base:
        assert base.generate(rep, max_tokens=N, temperature=0).tokens == got


@pytest.mark.parametrize("arch", ["qwen35moe", "llama"])
def test_drafting_and_plain_sequences_in_one_verify_step(model, arch):
    """Only some sequences have drafts: the others ride in the verify pass with their one token (one-row segments)."""
    path = model(arch)
    with _engine(path) as base:
        prompts = _prompts(base.args.n_vocab)
        want = [g.tokens for g in base.generate_batch(prompts, max_tokens=N, temperature=0)]
    with _engine(path) as eng:
        eng.spec = sp.Speculator(sp.ScriptedDrafter([prompts[0] + want[0], prompts[2] + want[2]], 0.7), 3,
                                 adaptive=False)
        assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)] == want
        assert 0 < eng.spec.accepted < eng.spec.drafted


@pytest.mark.parametrize("arch", ["qwen35", "llama"])
def test_sampled_with_drafts_equals_sampled_without(model, arch):
    """Each token is sampled once from the logits of its own position with one draw of the request's generator,
    as without drafts (the rejection rule for a deterministic drafter): at a fixed seed the very same tokens, so
    their distribution is the no-draft one whatever the acceptance."""
    path = model(arch)
    kw = dict(max_tokens=N, temperature=0.7, top_k=40, top_p=0.95, min_p=0.02, repeat_penalty=1.1)
    with _engine(path) as base:
        prompts = _prompts(base.args.n_vocab)
        reqs = [dict(prompt=p, seed=11 + i) for i, p in enumerate(prompts)]
        want = [g.tokens for g in base.generate_batch(reqs, **kw)]
    with _engine(path) as eng:
        eng.spec = sp.Speculator(sp.ScriptedDrafter([p + w for p, w in zip(prompts, want, strict=True)], 0.7), 3,
                              adaptive=False)
        assert [g.tokens for g in eng.generate_batch(reqs, **kw)] == want
        assert 0 < eng.spec.accepted < eng.spec.drafted


@pytest.mark.parametrize("arch,backend", [("qwen35", "cpu"), ("qwen35moe", "cpu"), ("qwen35", "reference")])
def test_rollback_leaves_the_state_of_never_having_seen_the_drafts(model, arch, backend):
    """The CPU keeps each GDN call's inputs and runs the GDN layers again over the kept rows; the reference (the
    backends' default, row by row) keeps a copy after each row. Either way: the no-draft state, bit for bit."""
    path = model(arch)
    eng = Engine.load(path, backend=backend, n_ctx=64, **({} if backend == "reference" else
                                                          dict(isa=ISA, n_threads=2)))
    with eng:
        prompt = _prompts(eng.args.n_vocab)[1]
        plain, spec, again = eng.new_state(), eng.new_state(), eng.new_state()
        for st in (plain, spec, again):
            eng.prefill(prompt, st)
        t0, t1, bad = 7, 11, [13, 17]
        for t in (t0, t1):
            eng.decode_step([t], [plain])
        before = [a.copy() for _, _, a in spec.held(False)]
        (rows,), (undo,) = eng.verify_rows([([t0, t1, *bad], spec)])
        assert rows.shape == (4, eng.args.n_vocab)
        if backend == "cpu":  # the GDN state written out of place: the state's own arrays as before the pass
            assert len(undo.pending) == 2 * sum(t == "gdn" for t in eng.args.layer_types)
            assert all(np.array_equal(a, b) for (_, _, a), b in zip(spec.held(False), before, strict=True))
        else:
            assert undo.saved  # GDN layers: recurrent state to roll back
        assert spec.pos == len(prompt) + 4
        undo(2)  # t0 and t1 accepted, the two drafts after them rejected
        assert spec.pos == plain.pos == len(prompt) + 2
        assert np.array_equal(spec.token_ids, plain.token_ids)
        for (s, i, a), (_, _, b) in zip(spec.held(False), plain.held(False), strict=True):
            assert np.array_equal(a, b), (s.name, i)
        for (s, i, a), (_, _, b) in zip(spec.held(True), plain.held(True), strict=True):
            assert np.array_equal(a[: spec.pos], b[: plain.pos]), (s.name, i)
        # the state goes on as the plain one does, and the verify's rows were the one-token decode's logits
        assert np.array_equal(eng.decode_step([5], [spec]), eng.decode_step([5], [plain]))
        for j, t in enumerate([t0, t1, *bad]):
            assert np.array_equal(eng.decode_step([t], [again])[0], rows[j]), (path, j)


def test_snapshot_after_speculation_restores_to_a_cold_answer(model):
    path = model("qwen35")
    with _engine(path) as cold:
        prompt = _prompts(cold.args.n_vocab)[0]
        first = cold.generate(prompt, max_tokens=N, temperature=0).tokens
        follow = prompt + first + [5, 6, 7]
        want = cold.generate(follow, max_tokens=N, temperature=0).tokens
    with _engine(path, prefix_cache=True) as warm:
        warm.spec = sp.Speculator(sp.ScriptedDrafter([prompt + first, follow + want], 0.6), 3, adaptive=False)
        assert warm.generate(prompt, max_tokens=N, temperature=0).tokens == first
        assert 0 < warm.spec.accepted < warm.spec.drafted
        g = warm.generate(follow, max_tokens=N, temperature=0)
        assert g.timings["reused_tokens"] > len(prompt)  # restored from the reply's snapshot, taken after drafts
        assert g.tokens == want


def test_ngram_drafter_proposes_what_followed_the_last_match():
    d = sp.NgramDrafter(ngram_min=1, ngram_max=3)
    h = np.array([1, 2, 3, 4, 5, 9, 2, 3, 4, 8, 1, 2, 3], np.int32)
    assert d.propose(h, 2) == [4, 5]  # the 3-gram [1 2 3] was seen at 0 (not [2 3]'s later match, shorter)
    h2 = np.array([2, 3, 4, 5, 2, 3, 6, 7, 2, 3], np.int32)
    assert d.propose(h2, 3) == [6, 7, 2]  # [7 2 3] unseen; [2 3] seen twice: what followed the most recent
    assert d.propose(np.array([5, 6, 7], np.int32), 3) == []


def test_cost_model_backs_off():
    cost = sc.StepCost()
    for rows, sec in ((1, 0.010), (2, 0.0105), (4, 0.0115), (1, 0.010), (8, 0.0135)):
        cost.add(rows, sec)
    t0, r = cost.fit()
    assert 0.009 < t0 < 0.0105 and 0.0003 < r < 0.0006
    step = sc.line((t0, r))
    assert sc.plan_k([0.9], [4], step(1), step) == 4  # memory-bound, drafts accepted: the longest draft
    assert sc.plan_k([0.0], [4], step(1), step) == 0  # nothing accepted: no draft
    assert sc.plan_k([0.5] * 64, [4] * 64, 0.001 + 0.01 * 64, sc.line((0.001, 0.01))) == 0  # compute-bound


def test_batch_plan_drafts_only_where_the_whole_step_gains():
    """B = 8: where an extra row costs what a token does, no acceptance pays for drafts (a row per draft, a token
    per accepted one at best); where rows are nearly free, every sequence drafts the longest; a verify step dearer
    than a plain one of as many rows (its own calls, rollback, drafter) is what a single fit over both kinds of
    step missed: per sequence the old gain (E[tokens] - 1) * (t0 + r * B) / B - k * r said draft."""
    plan, line = sc.plan_k, sc.line
    per_row = line((0.0, 0.001))  # 1 ms a row, nothing fixed: compute-bound
    for a in (0.0, 0.5, 0.9, 1.0):
        assert plan([a] * 8, [3] * 8, per_row(8), per_row) == 0, a
    free = line((0.008, 0.00001))  # a memory-bound step: 8 ms whatever its rows
    assert plan([0.9] * 8, [3] * 8, free(8), free) == 3
    assert plan([0.0] * 8, [3] * 8, free(8), free) == 0
    assert plan([0.9] * 8, [3, 1, 0, 0, 0, 0, 0, 0], free(8), free) == 3  # capped ones take what they may
    t0, r = 0.002, 0.0005
    old_gain = 0.7 * (t0 + r * 8) / 8 - r  # best_k's k = 1 at a = 0.7: positive, so every sequence drafted
    assert old_gain > 0
    verify = line((0.006, 0.0004))  # measured: a verify step's own fixed cost, a row dearer too
    assert plan([0.7] * 8, [3] * 8, t0 + r * 8, verify) == 0


def test_batch_plan_never_expects_fewer_tokens_per_second_than_plain_steps():
    """Random costs, acceptances and caps: a plan that drafts expects at least a plain step's tokens per second, and
    a plan that does not draft had no k that expected more (the guarantee, under the cost model)."""
    rng = np.random.default_rng(7)
    for _ in range(400):
        B = int(rng.integers(1, 17))
        acc, caps = list(rng.random(B)), [int(c) for c in rng.integers(0, 5, B)]
        plain_line = sc.line((rng.random() * 0.01, rng.random() * 0.002))
        verify = sc.line((rng.random() * 0.02, rng.random() * 0.002))
        rec, left = 1 + 4 * rng.random(), int(rng.integers(1, 200))
        replayed = {int(k) for k in rng.integers(1, 5, 2)}

        rate = {}  # expected tokens per second of the whole step at each k, as the cost model prices it
        for k in range(1, max(caps) + 1):
            ks = [min(k, c) for c in caps]
            tokens = B + sum(sc.expected_tokens(a, j) - 1 for a, j in zip(acc, ks, strict=True))
            t = verify(B + sum(ks))
            rate[k] = tokens / (t if k in replayed else t * (1 + (rec - 1) / max(1.0, left * B / tokens)))
        k = sc.plan_k(acc, caps, plain_line(B), verify, rec, replayed, left)
        base = B / plain_line(B)
        if k:
            assert rate[k] > base and rate[k] == max(rate.values())
        else:
            assert all(r <= base for r in rate.values())


def test_spec_cost_prices_recorded_steps_apart_and_probes_after_a_while():
    c = sc.SpecCost()
    assert c.model(8) is None  # nothing measured (the Speculator's first step drafts: it records either way)
    c.add(8, 0.030, drafted=False, recorded=True)  # the first step of these sequences records: not its price
    c.add(8, 0.010, drafted=False)
    plain, verify, rec = c.model(8)
    assert plain == pytest.approx(0.010) and rec == pytest.approx(3.0)
    assert verify(32) == pytest.approx(0.009 + 0.001 * 4)  # unseen: a memory-bound plain step's price (a probe)
    c.add(16, 0.060, drafted=True, recorded=True)  # recorded: its replays should take a third (record_x)
    assert c.model(8)[1](32) == pytest.approx(0.040)  # the line through the plain step and 16 rows at 0.020 s
    c.add(16, 0.020, drafted=True)  # its replay
    plain, verify, rec = c.model(8)
    assert verify(16) == pytest.approx(0.020) and verify(24) == pytest.approx(0.030)  # the line through plain
    for _ in range(2000):  # a long time without drafts: the verify steps' evidence fades, a probe follows
        c.add(8, 0.010, drafted=False)
    assert c.model(8)[1](32) < 0.02


def test_verify_steps_seen_at_one_sequence_price_a_batch_s_rows_at_least_as_plain_rows():
    """Verify steps measured at B = 1 only (4 rows, dearer than a plain step of one row: their own calls and
    rollback), plain steps at B = 1 and 8: a verify step of the 8 sequences' 32 rows costs at least the verify
    step seen plus a plain row's price for each extra row. The line through the plain step of 8 rows fell (the
    B = 1 verify cost more than it) and priced 32 rows at 4 rows' seconds: every sequence drafted, and generate_batch
    at B = 8 ran 31% slower than without drafts on the 16-core Xeon."""
    c = sc.SpecCost()
    for _ in range(3):
        c.add(1, 0.010, drafted=False)
        c.add(4, 0.030, drafted=True)
        c.add(8, 0.024, drafted=False)
    plain, verify, rec = c.model(8)
    t0, r = c.plain.fit()
    assert plain == pytest.approx(t0 + 8 * r) and r > 0.001
    assert verify(32) >= 0.030 + 28 * r - 1e-9
    assert sc.plan_k([0.6] * 8, [3] * 8, plain, verify, rec) == 0


def test_a_verify_step_recorded_before_any_plain_one_counts_once_recordings_are_priced():
    """The Speculator's first step drafts and records; its seconds count (over record_x) as soon as plain steps give
    record_x, so a verify step that costs several plain ones stops the drafts without another probe."""
    c = sc.SpecCost()
    c.add(2, 0.150, drafted=True, recorded=True)  # k = 1 on one sequence, recorded: 3x its replays
    c.add(1, 0.060, drafted=False, recorded=True)
    assert c.model(1) is None and c.record_x is None  # no plain step priced yet: the recorded verify waits
    c.add(1, 0.020, drafted=False)
    plain, verify, rec = c.model(1)
    assert rec == pytest.approx(3.0) and verify(2) >= 0.050 - 1e-9  # 0.150 / 3 (the line starts at 0 s, not below)
    assert sc.plan_k([0.6], [1], plain, verify, rec, replayed={1}) == 0  # 1.6 tokens in 2.5 plain steps: no draft


def test_a_new_split_of_rows_pays_for_its_recording():
    line = sc.line((0.008, 0.00001))
    assert sc.plan_k([0.9] * 4, [2] * 4, line(4), line, record_x=6.0, replayed={2}, left=100) == 2
    assert sc.plan_k([0.9] * 4, [2] * 4, line(4), line, record_x=6.0, replayed=(), left=2) == 0  # nothing to reuse
    assert sc.plan_k([0.9] * 4, [2] * 4, line(4), line, record_x=6.0, replayed=(), left=400) == 2  # spread thin


def test_a_sequence_whose_drafts_all_fail_backs_off():
    """Drafts that are always rejected: the waits double (1, 2, 4, ...), so over 200 steps the sequence drafts on
    fewer than one step in ten; an accepted draft ends the wait."""
    from types import SimpleNamespace as NS

    class Always:
        def propose(self, history, k):
            return [1] * k

    spec = sp.Speculator(Always(), 3)
    for _ in range(3):  # plain steps measured, verify steps not yet: drafting is priced as a memory-bound step
        spec.cost.add(1, 0.010, drafted=False)
    st = NS(n_ctx=1000, pos=10, tokens=np.zeros(1000, np.int32))
    seq = NS(spec=None, next_tok=2, state=st, handle=NS(request=NS(max_tokens=500), generation=NS(tokens=[])))
    drafted = 0
    for _ in range(200):
        (d,) = spec.drafts([seq])
        if d:
            drafted += 1
            spec._count(seq.spec, len(d), 0)
    assert 3 <= drafted < 20, drafted
    assert spec.prior < 0.45  # what a new sequence is first assumed to accept: this drafter's record (from 0.6)
    later = sp.Speculator(Always(), 3, learned=spec)
    assert later.prior == spec.prior and later.cost is spec.cost
    spec._count(seq.spec, 3, 2)
    assert seq.spec.wait == 0 and spec.drafts([seq])[0]


def test_a_drafter_whose_drafts_fail_stops_drafting_for_new_sequences():
    """The prior a new sequence starts from counts the drafter's recent verifies: after six all-rejected ones a new
    sequence does not draft once verify steps are priced (two rows at 1.2 a plain step); plain steps fade the record,
    so after a long while without drafts the prior is back near its start and drafting is tried again; drafts that
    are accepted raise it."""
    from types import SimpleNamespace as NS

    class Always:
        def propose(self, history, k):
            return [1] * k

    spec = sp.Speculator(Always(), 3)
    for _ in range(3):
        spec.cost.add(1, 0.010, drafted=False)
        spec.cost.add(2, 0.012, drafted=True)
        spec.cost.add(4, 0.016, drafted=True)

    def seq():
        st = NS(n_ctx=1000, pos=10, tokens=np.zeros(1000, np.int32))
        return NS(spec=None, next_tok=2, state=st, handle=NS(request=NS(max_tokens=500), generation=NS(tokens=[])))

    first = seq()
    assert spec.drafts([first])[0]  # 0.6 assumed: it drafts
    for _ in range(6):
        spec._count(first.spec, 1, 0)
    assert spec.prior < 0.2
    fresh = seq()
    assert not any(spec.drafts([fresh])[0] for _ in range(20))
    for _ in range(3000):  # plain steps: the record fades
        spec.start(None)
        spec.timed(1, False)
    assert spec.prior > 0.5
    for _ in range(20):
        spec._count(first.spec, 2, 2)
    assert spec.prior > 0.85


def test_a_probe_of_a_batch_drafts_for_one_sequence():
    """Verify steps not priced yet (or not lately): at B > 1 the probe drafts for one sequence only, the one with
    the highest acceptance estimate, so every stream waits for B + k rows, not B (k + 1); once verify steps are
    priced and pay, every sequence drafts; one sequence alone probes as before."""
    from types import SimpleNamespace as NS

    class Always:
        def propose(self, history, k):
            return [1] * k

    def seqs(accepts):
        out = []
        for a in accepts:
            st = NS(n_ctx=1000, pos=10, tokens=np.zeros(1000, np.int32))
            out.append(NS(spec=sp.SeqSpec(accept=a), next_tok=2, state=st,
                          handle=NS(request=NS(max_tokens=500), generation=NS(tokens=[]))))
        return out

    spec = sp.Speculator(Always(), 2)
    for _ in range(3):
        spec.cost.add(4, 0.010, drafted=False)
    d = spec.drafts(seqs([0.5, 0.9, 0.7, 0.6]))
    assert [len(x) for x in d] == [0, 2, 0, 0]
    assert [len(x) for x in spec.drafts(seqs([0.9]))] == [2]
    for rows in (5, 6, 8, 12):  # verify steps measured as cheap as plain ones: drafts pay for everyone
        spec.cost.add(rows, 0.010, drafted=True)
    assert all(len(x) == 2 for x in spec.drafts(seqs([0.9, 0.9, 0.9, 0.9])))


def test_bad_spec_options_are_refused_by_name(model):
    path = model("llama")
    for kw in (dict(spec_type="medusa"), dict(spec_type="ngram", draft_max=0), dict(draft_max=5),
               dict(draft_max=2.0)):
        with pytest.raises(ParameterError, match="spec_type|draft_max"):
            _engine(path, **kw)
    for name in ("mtp", "draft-mtp"):  # llama.cpp's name for it too
        with pytest.raises(UnsupportedArchitectureError, match="mtp"):
            _engine(path, spec_type=name)
    with _engine(path, spec_type="ngram-simple", draft_max=2) as eng:  # llama.cpp's name for prompt lookup
        assert isinstance(eng.spec.drafter, sp.NgramDrafter) and eng.spec.draft_max == 2


def test_a_failed_verify_step_fails_its_sequences_and_the_engine_goes_on(model):
    path = model("qwen35")
    with _engine(path) as eng:
        prompts = _prompts(eng.args.n_vocab)
        want = [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)]
        eng.spec = sp.Speculator(sp.ScriptedDrafter([p + w for p, w in zip(prompts, want, strict=True)], 1.0), 2,
                                 adaptive=False)
        real, calls = eng.backend.forward_rows, []

        def once_broken(chunks, undo=False):
            calls.append(len(chunks))
            if len(calls) == 1:
                raise RuntimeError("verify broke")
            return real(chunks, undo)

        eng.backend.forward_rows = once_broken
        hs = [eng.submit(p, max_tokens=N, temperature=0) for p in prompts]
        errors = []
        for h in hs:
            try:
                h.result(timeout=120)
            except RuntimeError as e:
                errors.append(str(e))
        assert errors and all(e == "verify broke" for e in errors)
        assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)] == want
        assert eng.scheduler.idle() and len(calls) > 1


def test_a_drafter_that_fails_fails_its_sequences_and_the_engine_goes_on(model):
    """An exception in the drafter (here its proposals, on the step where a prompt's first token goes to the
    decode) ends the step's sequences with it; none is left unanswered, and the next requests run."""
    path = model("qwen35")
    with _engine(path) as eng:
        prompts = _prompts(eng.args.n_vocab)
        want = [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)]

        class Broken:
            def propose(self, history, k):
                raise RuntimeError("drafter broke")

        kept, eng.spec = eng.spec, sp.Speculator(Broken(), 2, adaptive=False)
        hs = [eng.submit(p, max_tokens=N, temperature=0) for p in prompts]
        for h in hs:
            with pytest.raises(RuntimeError, match="drafter broke"):
                h.result(timeout=120)
        eng.spec = kept
        assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)] == want
        assert eng.scheduler.idle()


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["qwen35", "qwen35moe"])
def test_gpu_prefill_then_drafts_gives_the_tokens_without(model, arch):
    """backend="gpu": prompts prefilled on the card, decode and verify rows on the CPU: the same tokens as that
    backend gives without drafts, one sequence and many."""
    path = model(arch)
    kw = dict(backend="gpu", n_ctx=128, isa=ISA)
    with Engine.load(path, **kw) as base:
        prompts = _prompts(base.args.n_vocab)
        want = [g.tokens for g in base.generate_batch(prompts, max_tokens=N, temperature=0)]
        one = base.generate(prompts[1], max_tokens=N, temperature=0).tokens
    with Engine.load(path, **kw) as eng:
        eng.spec = sp.Speculator(sp.ScriptedDrafter([p + w for p, w in zip(prompts, want, strict=True)], 0.7), 3,
                                 adaptive=False)
        assert [g.tokens for g in eng.generate_batch(prompts, max_tokens=N, temperature=0)] == want
        assert eng.generate(prompts[1], max_tokens=N, temperature=0).tokens == one
        assert 0 < eng.spec.accepted < eng.spec.drafted


def test_stop_strings_logprobs_and_max_tokens_end_where_they_do_without_drafts(model):
    """A sequence that ends inside a verified span (a stop string, max_tokens) ends at the same token, with the
    same text, finish reason and log-probabilities as without drafts."""
    path = model("qwen35")
    with _engine(path) as base:
        prompt = _prompts(base.args.n_vocab)[0]
        full = base.generate(prompt, max_tokens=N, temperature=0)
        stop = base.detokenize(full.tokens[7:9])  # a stop string a few tokens in
        kw = dict(max_tokens=N, temperature=0, logprobs=2)
        want = [base.generate(prompt, stop=[stop], **kw), base.generate(prompt, **{**kw, "max_tokens": 6})]
        assert want[0].finish_reason == "stop" and len(want[0].tokens) < N and want[1].finish_reason == "length"
    with _engine(path) as eng:
        eng.spec = sp.Speculator(sp.ScriptedDrafter([prompt + full.tokens], 1.0), 4, adaptive=False)
        got = [eng.generate(prompt, stop=[stop], **kw), eng.generate(prompt, **{**kw, "max_tokens": 6})]
        assert eng.spec.accepted > 0
    for g, w in zip(got, want, strict=True):
        assert (g.text, g.tokens, g.finish_reason) == (w.text, w.tokens, w.finish_reason)
        assert g.logprobs == w.logprobs
