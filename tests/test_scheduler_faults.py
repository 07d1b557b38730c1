"""A failure belongs to its sequence (issue 29, item 3): faults injected at each point of the scheduler's step (the
sampler, the constraint, the detokenizer, a prompt's or a reply's snapshot, the backend's prefill, the batched decode,
a shared multi-prompt prefill) end the sequence they belong to with the error, free its slot and bytes at once, and
leave every other sequence's answer exactly as a run without the fault gives it; no handle is left waiting.
Also the sampling settings' bounds (item 2): a top_k past int64 (the original bug: an OverflowError inside the numba
sampler that left the sequences admitted beside it waiting forever) is a ParameterError where the request is made."""

from __future__ import annotations

import pytest

from hybridinfer.backends import GPUPrefillCPUDecode
from hybridinfer.engine import textstream
from hybridinfer.engine.api import Engine, _make_prefix_cache
from hybridinfer.engine.sampling import SamplingParams
from hybridinfer.engine.scheduler import Scheduler, TokenSampler
from hybridinfer.errors import ParameterError

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "def add(a, b):", "Once upon a time"]
N = 6  # tokens per answer
VICTIM = 1  # the request a per-sequence fault is aimed at


class Boom(RuntimeError):
    """The injected fault."""


@pytest.fixture(scope="module")
def eng(smollm_path):
    return Engine.load(smollm_path, backend="cpu", n_ctx=256)


@pytest.fixture(scope="module")
def want(eng):
    """Each prompt's greedy answer with no fault (batch invariance: the scheduler gives the same)."""
    return [eng.generate(p, max_tokens=N, temperature=0) for p in PROMPTS]


def _run(eng, reqs, max_seqs: int = 4, victim: list | None = None) -> tuple[Scheduler, list]:
    """Submit `reqs` together and step the scheduler until it is idle (bounded); victim[0] is set to the
    Generation of request VICTIM before the first step."""
    sched = Scheduler(eng, max_seqs=max_seqs, worker=False)
    handles = sched.submit_many(reqs)
    if victim is not None:
        victim[0] = handles[VICTIM].generation
    for _ in range(200):
        if sched.idle():
            return sched, handles
        sched.step()
    raise AssertionError("the scheduler did not become idle")


def _check(sched, handles, want, failed: set[int], error: type = Boom) -> None:
    """The requests in `failed` got `error`, every other one its fault-free answer; no handle waits and nothing is
    held (slots and reserved state bytes all returned)."""
    for i, (h, w) in enumerate(zip(handles, want, strict=True)):
        assert h.done(), f"request {i} was left waiting"
        if i in failed:
            with pytest.raises(error):
                h.result(timeout=0)
        else:
            g = h.result(timeout=0)
            assert (g.tokens, g.text, g.finish_reason) == (w.tokens, w.text, w.finish_reason), i
    assert sched._reserved == 0 and sched.running == 0 and sched.waiting == 0


def _fail_victim(cls, name: str, gen_of, victim: list, at: int):
    """cls.name, except that it raises Boom on the victim's sequence (gen_of(self) is its Generation) once that
    has `at` tokens."""
    orig = getattr(cls, name)

    def f(self, *a, **kw):
        if gen_of(self) is victim[0] and len(victim[0].tokens) >= at:
            raise Boom("injected")
        return orig(self, *a, **kw)

    return f


class _FaultyConstraint:
    """A constraint that allows everything, and raises in `point` (mask or accept) at the victim's token `at`."""

    def __init__(self, point: str, at: int, victim: list):
        self.point, self.at, self.victim = point, at, victim

    def mask(self, logits):
        if self.point == "mask" and len(self.victim[0].tokens) >= self.at:
            raise Boom("injected")

    def accept(self, t):
        if self.point == "accept" and len(self.victim[0].tokens) > self.at:  # told after the token is recorded
            raise Boom("injected")
        return True


# at 0: the victim's first token, sampled in the very step that admitted it beside the others
@pytest.mark.parametrize("point,at", [("sampler", 0), ("sampler", 3), ("text.push", 3), ("text.finish", 0), ("mask", 0),
                                      ("accept", 3)])
def test_a_fault_in_one_sequence_fails_it_alone(eng, want, monkeypatch, point, at):
    reqs = [eng.make_request(p, N, temperature=0) for p in PROMPTS]
    victim = [None]
    if point in ("mask", "accept"):
        reqs[VICTIM].constraint = _FaultyConstraint(point, at, victim)
    else:
        cls, name, gen_of = {"sampler": (TokenSampler, "__call__", lambda s: s.gen),
                             "text.push": (textstream.TextStream, "push", lambda s: s.res),
                             "text.finish": (textstream.TextStream, "finish", lambda s: s.res)}[point]
        monkeypatch.setattr(cls, name, _fail_victim(cls, name, gen_of, victim, at))
    sched, handles = _run(eng, reqs, victim=victim)
    _check(sched, handles, want, {VICTIM})


def _overflowing(eng, prompt: str):
    """A request whose top_k overflows the numba sampler's int64, as every one did before SamplingParams bounded
    it (the check is bypassed here to reach the sampler)."""
    r = eng.make_request(prompt, N, temperature=0.8, top_k=5)
    object.__setattr__(r.params, "top_k", 2**63)
    return r


def test_the_original_bug_an_overflowing_top_k_in_the_sampler(eng, want):
    """The numba sampler's own error (an OverflowError, or a TypingError where numba types 2**63 as uint64) on a
    sequence's first token, in the step that admitted it and three others: it fails alone and the others finish.
    Through the worker thread, with more such requests than slots in a tight state budget: each result() raises at
    once, and a good request after them still gets its answer."""
    reqs = [eng.make_request(p, N, temperature=0) for p in PROMPTS]
    reqs[VICTIM] = _overflowing(eng, PROMPTS[VICTIM])
    sched, handles = _run(eng, reqs)
    _check(sched, handles, want, {VICTIM}, Exception)  # OverflowError, or numba's TypingError for a uint64
    worker = Scheduler(eng, max_seqs=2, state_budget=2 * sched.request_bytes(reqs[0]) + 1)
    try:
        bad = [worker.submit(_overflowing(eng, PROMPTS[0])) for _ in range(5)]
        good = worker.submit(eng.make_request(PROMPTS[2], N, temperature=0))
        for h in bad:
            with pytest.raises(Exception) as e:  # noqa: B017 - whichever numba raises
                h.result(timeout=60)
            assert not isinstance(e.value, TimeoutError)
        assert good.result(timeout=60).tokens == want[2].tokens
        assert worker._reserved == 0 and worker.running == 0
    finally:
        worker.close()


@pytest.mark.parametrize("where", ["prompt", "reply", "flush"])
def test_a_failed_snapshot_fails_its_sequence(eng, want, monkeypatch, where):
    """The prefix cache's save raising on one sequence's snapshot (its prompt's end, during its prefill; or its
    reply's end, as it finishes) fails that sequence only. Writing the deferred disk copies (flush, once per step)
    belongs to no sequence: its failure is a warning and every answer stands."""
    from hybridinfer.engine.prefix import SnapshotWarning

    cache = _make_prefix_cache({"ram_bytes": 64 << 20}, eng.gm, eng.args, eng.backend)
    monkeypatch.setattr(eng, "prefix_cache", cache)
    reqs = [eng.make_request(p, N, temperature=0) for p in PROMPTS]
    ids, orig = reqs[VICTIM].ids, cache.save

    def save(state, *a, **kw):
        if list(state.tokens[: len(ids)]) == ids and (state.pos == len(ids)) == (where == "prompt"):
            raise Boom("injected")
        return orig(state, *a, **kw)

    if where == "flush":
        monkeypatch.setattr(cache, "flush", lambda: _raise(OSError("injected: disk full")))
        with pytest.warns(SnapshotWarning, match="disk full"):
            sched, handles = _run(eng, reqs)
        _check(sched, handles, want, set())
        return
    monkeypatch.setattr(cache, "save", save)
    sched, handles = _run(eng, reqs)
    _check(sched, handles, want, {VICTIM})
    assert cache.stats["saves"] > 0  # the others' snapshots were taken


def test_a_failed_prefill_fails_its_sequence(eng, want, monkeypatch):
    reqs = [eng.make_request(p, N, temperature=0) for p in PROMPTS]
    ids, orig = reqs[VICTIM].ids, eng.backend.forward

    def forward(tokens, *a, **kw):
        if list(tokens) == ids:
            raise Boom("injected")
        return orig(tokens, *a, **kw)

    def forward_many(chunks):  # a shared pass with the victim's prompt in it fails as a whole
        if any(list(t) == ids for t, _ in chunks):
            raise Boom("injected")
        return orig_many(chunks)

    orig_many = eng.backend.forward_many
    monkeypatch.setattr(eng.backend, "forward", forward)
    monkeypatch.setattr(eng.backend, "forward_many", forward_many)
    sched, handles = _run(eng, reqs)
    _check(sched, handles, want, {VICTIM})


def test_a_failed_decode_step_fails_exactly_its_sequences(eng, want, monkeypatch):
    """decode_batch raising on its second call (requests 0 and 1 running, 2 and 3 waiting for a slot): 0 and 1 get
    the error, 2 and 3 are admitted after and answer as without the fault."""
    calls, orig = [], eng.backend.decode_batch

    def decode_batch(tokens, states):
        calls.append(len(tokens))
        if len(calls) == 2:
            raise Boom("injected")
        return orig(tokens, states)

    monkeypatch.setattr(eng.backend, "decode_batch", decode_batch)
    sched, handles = _run(eng, [eng.make_request(p, N, temperature=0) for p in PROMPTS], max_seqs=2)
    _check(sched, handles, want, {0, 1})
    assert calls[:2] == [2, 2]


class _CPUAsGPU:
    """A single-pass prefill device made of the CPU backend (one forward over the whole prompt), failing on one
    prompt."""

    def __init__(self, cpu, bad_ids):
        self.cpu, self.bad_ids = cpu, bad_ids

    def forward(self, tokens, state, all_logits=True, snapshot_at=(), on_snapshot=None):
        if list(tokens) == self.bad_ids:
            raise Boom("injected")
        return self.cpu.forward(tokens, state, all_logits=all_logits)


def test_a_failed_shared_prefill_retries_each_alone(eng, want, monkeypatch):
    """A single-pass backend's prefill of all admitted prompts in one pass fails: whose fault it is is unknown, so
    each is prefilled alone on a fresh state; the one that fails again gets its error, the others their answers."""
    reqs = [eng.make_request(p, N, temperature=0) for p in PROMPTS]
    be = GPUPrefillCPUDecode(_CPUAsGPU(eng.backend, reqs[VICTIM].ids), eng.backend)
    shared = []
    monkeypatch.setattr(be, "prefill_many", lambda prompts: shared.append(len(prompts)) or _raise(Boom("one pass")))
    monkeypatch.setattr(eng, "backend", be)
    sched, handles = _run(eng, reqs)
    assert shared == [4]
    _check(sched, handles, want, {VICTIM})


def _raise(e):
    raise e


def test_engine_generate_raises_a_fault_and_goes_on(eng, want, monkeypatch):
    """Engine.generate (a request on the scheduler): a fault in its sampler is raised to the caller, and the engine
    answers the next request as before."""
    monkeypatch.setattr(TokenSampler, "__call__", lambda self, *a: _raise(Boom("injected")))
    with pytest.raises(Boom):
        eng.generate(PROMPTS[0], max_tokens=N, temperature=0)
    monkeypatch.undo()
    with pytest.raises(Boom):
        eng.generate(PROMPTS[0], max_tokens=N, temperature=0, constraint=_FaultyConstraint("mask", 0, [want[0]]))
    assert eng.generate(PROMPTS[0], max_tokens=N, temperature=0).tokens == want[0].tokens


# item 2: every sampling setting bounded where it enters ------------------------------------------------------------
BAD = [({"top_k": 2**63}, "top_k"), ({"top_k": -1}, "top_k"), ({"top_k": 1.5}, "top_k"),
       ({"seed": 2**64}, "seed"), ({"seed": -(2**63) - 1}, "seed"),
       ({"max_tokens": 2**63}, "max_tokens"), ({"logprobs": 2**63}, "logprobs"),
       ({"temperature": float("inf")}, "temperature"), ({"temperature": -0.1}, "temperature"),
       ({"top_p": float("nan")}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"min_p": -0.1}, "min_p"),
       ({"presence_penalty": float("inf")}, "presence_penalty"),
       ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repeat_penalty": 0.0}, "repeat_penalty")]


@pytest.mark.parametrize("kw,name", BAD)
def test_sampling_settings_are_bounded_where_they_enter(eng, kw, name):
    """A ParameterError naming the setting from make_request, submit and generate alike, before anything runs."""
    for call in (eng.make_request, eng.submit, eng.generate):
        with pytest.raises(ParameterError, match=name):
            call(PROMPTS[0], **{"max_tokens": N, **kw})
    assert eng.scheduler.waiting == 0 and eng.scheduler.running == 0


@pytest.mark.parametrize("kw", [{"repeat_last_n": 2**63}, {"repeat_last_n": -1}, {"top_k": 2**70},
                                {"seed": 2.0}, {"temperature": True}])
def test_sampling_params_refuse_what_the_sampler_cannot_take(kw):
    with pytest.raises(ParameterError, match=next(iter(kw))):
        SamplingParams(**kw)


def test_top_k_past_the_vocabulary_keeps_every_token_and_seeds_wrap(eng):
    """top_k up to int64's maximum is accepted: at or past the vocabulary it keeps every token, as top_k = 0; a seed
    is taken mod 2**64 (-1 and 2**64 - 1 are the same stream). The same code path on both sides of each
    comparison, so this holds on any ISA."""
    kw = dict(max_tokens=N, temperature=1.0, top_p=1.0, min_p=0.0, seed=11)
    off = eng.generate(PROMPTS[3], top_k=0, **kw).tokens
    assert eng.generate(PROMPTS[3], top_k=2**63 - 1, **kw).tokens == off
    assert eng.generate(PROMPTS[3], top_k=eng.args.n_vocab, **kw).tokens == off
    assert eng.submit(PROMPTS[3], top_k=2**63 - 1, **kw).result(timeout=60).tokens == off
    kw.pop("seed")
    a = eng.generate(PROMPTS[3], seed=-1, **kw).tokens
    assert a == eng.generate(PROMPTS[3], seed=2**64 - 1, **kw).tokens
    SamplingParams(seed=-(2**63))  # the signed minimum is accepted too
