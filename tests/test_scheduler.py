"""The scheduler (continuous batching): batch invariance on the CPU backend, limits, cancellation, the prefix cache.

Batch invariance: a sequence's tokens (and the logits behind them, bit for bit) do not depend on which sequences
share its steps or when it was admitted, so each request equals the same request run alone by Engine.generate."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybridinfer.engine.api import Engine
from hybridinfer.engine.scheduler import state_bytes
from hybridinfer.errors import CapacityError, ParameterError

pytestmark = pytest.mark.isa  # sampled and greedy answers: re-run at every ISA level (.ci/run)
# the CPU unit HYBRIDINFER_ISA forces (library calls take it as an argument; only the CLI reads the variable)
ISA = os.environ.get("HYBRIDINFER_ISA")


def _ids(n_vocab: int, n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, n_vocab, n)]


@pytest.mark.parametrize("arch,quant", [("llama", "q4_k_m"), ("qwen35", "q8_0"), ("qwen35moe", "q4_k_m"),
                                        ("qwen35moe", None)])
def test_decode_batch_rows_bit_identical(arch, quant, oracle_gguf):
    """CPUModel.decode_batch: B sequences at different positions, each row equal to its own one-token forward."""
    eng = Engine.load(str(oracle_gguf(arch, quant)), backend="cpu", isa=ISA, n_ctx=96)
    V = eng.args.n_vocab
    prompts = [_ids(V, n, n) for n in (3, 7, 12, 5, 9, 1)]
    alone, together = _prefilled(eng, prompts)
    rng = np.random.default_rng(1)
    for step in range(4):
        live = list(range(len(prompts)))[step % 2 :]  # the batch changes size and members between steps
        toks = [int(rng.integers(0, V)) for _ in live]
        want = np.stack([eng.backend.forward([t], alone[j], all_logits=False)[-1].copy()
                         for t, j in zip(toks, live, strict=True)])
        got = eng.backend.decode_batch(toks, [together[j] for j in live])
        assert np.array_equal(got, want), (arch, quant, step)
    for a, b in zip(alone, together, strict=True):
        assert a.pos == b.pos and np.array_equal(a.token_ids, b.token_ids)


def _prefilled(eng, prompts: list[list[int]]):
    """Two states per prompt, each prefilled: one decoded alone, one in batches."""
    alone, together = [eng.new_state() for _ in prompts], [eng.new_state() for _ in prompts]
    for sts in (alone, together):
        for st, p in zip(sts, prompts, strict=True):
            eng.prefill(p, st)
    return alone, together


def _passes(be, monkeypatch) -> list[int]:
    """The row counts of the backend's passes through Python (recordings and prompt chunks), as they happen."""
    passes: list[int] = []
    orig = be._forward
    monkeypatch.setattr(be, "_forward", lambda *a, **k: passes.append(len(a[0])) or orig(*a, **k))
    return passes


def _batch_step(be, rng, alone, together, live) -> None:
    """One decode_batch of the `live` sequences, each row bit-identical to its sequence's own one-token forward."""
    toks = [int(rng.integers(0, be.args.n_vocab)) for _ in live]
    want = np.stack([be.forward([t], alone[j], all_logits=False)[-1].copy() for t, j in zip(toks, live, strict=True)])
    got = be.decode_batch(toks, [together[j] for j in live])
    assert np.array_equal(got, want), live


@pytest.mark.parametrize("arch,quant", [("qwen35", "q4_k_m"), ("qwen35moe", "q4_k_m")])
def test_decode_batch_replays_its_recorded_step(arch, quant, oracle_gguf, monkeypatch):
    """The same sequences decoded together step after step: the first step is recorded (one pass through Python),
    the next ones replay it (BatchReplay: one native call, each attention at its own position), bit-identical to each
    sequence alone; a change of members records again; release() lets a finished sequence's memory go."""
    import gc
    import weakref

    eng = Engine.load(str(oracle_gguf(arch, quant)), backend="cpu", isa=ISA, n_ctx=96)
    be, V = eng.backend, eng.args.n_vocab
    alone, together = _prefilled(eng, [_ids(V, n, n + 50) for n in (4, 9, 2)])
    passes = _passes(be, monkeypatch)
    rng = np.random.default_rng(2)
    # members per step: all three for 4 steps (recorded once), then two (recorded again) for 3 steps
    for live in [[0, 1, 2]] * 4 + [[0, 2]] * 3:
        _batch_step(be, rng, alone, together, live)
    # B = 1 forwards record their own one-token replay once per state; the batch passes: 3 rows once, 2 rows once
    assert [p for p in passes if p > 1] == [3, 2]
    st = together[1]
    ref = weakref.ref(st.k[next(i for i, t in enumerate(eng.args.layer_types) if t == "attention")])
    be.release(st)
    for ws in be._ws.values():
        assert not any(p.holds({id(a) for a in st.k + st.v + st.conv + st.ssm}) for p in ws.replays.values())
    together[1] = st = None
    gc.collect()
    assert ref() is None  # nothing the backend keeps holds the released sequence's cache


@pytest.mark.parametrize("arch,quant", [("qwen35", "q4_k_m"), ("qwen35moe", "q4_k_m")])
def test_a_new_set_of_as_many_sequences_takes_the_recording_over(arch, quant, oracle_gguf, monkeypatch):
    """Members change at the same batch size (one ends and another joins; two at once; the old set again at other
    positions): the first set's recording is pointed at the new members (BatchReplay.rebind), no pass through Python
    again, and every row is bit-identical to its sequence alone. The ended sequence's memory goes at its release;
    a state whose arrays have other shapes (another context length) is recorded anew."""
    import gc
    import weakref

    eng = Engine.load(str(oracle_gguf(arch, quant)), backend="cpu", isa=ISA, n_ctx=96)
    be, V = eng.backend, eng.args.n_vocab
    prompts = [_ids(V, n, n + 70) for n in (4, 9, 2, 6, 3)]
    alone, together = _prefilled(eng, prompts)
    passes = _passes(be, monkeypatch)
    rng = np.random.default_rng(3)

    def step(live):
        _batch_step(be, rng, alone, together, live)

    for live in [[0, 1, 2]] * 3:
        step(live)
    ref = weakref.ref(together[1].k[next(i for i, t in enumerate(eng.args.layer_types) if t == "attention")])
    be.release(together[1])
    together[1] = None
    gc.collect()
    assert ref() is None  # the recording it was in let go of its arrays
    for live in [[0, 3, 2]] * 2 + [[4, 3, 0]] * 2 + [[2, 0, 3]]:
        step(live)
    assert [p for p in passes if p > 1] == [3]  # one recording of three rows, pointed at each new set
    for sts in (alone, together):  # another context length: arrays of other shapes
        for j in (0, 1, 2):
            sts[j] = be.new_state(64)
            eng.prefill(prompts[j], sts[j])
    passes.clear()
    step([0, 1, 2])
    assert [p for p in passes if p > 1] == [3]  # recorded anew


def _requests(V: int) -> list[dict]:
    reqs = []
    for i in range(7):
        r = {"prompt": _ids(V, 2 + 5 * i, 40 + i), "max_tokens": 3 + (i * 5) % 11}
        if i % 2:
            r.update(temperature=0.8, seed=i, top_k=30, top_p=0.9, min_p=0.02, repeat_penalty=1.1)
        else:
            r.update(temperature=0)
        reqs.append(r)
    return reqs


def _alone(eng: Engine, r: dict):
    r = dict(r)
    return eng.generate(r.pop("prompt"), **r)


@pytest.mark.parametrize("arch,quant", [("llama", "q8_0"), ("qwen35", "q4_k_m"), ("qwen35moe", "q4_k_m")])
def test_batch_invariance_staggered_admission(arch, quant, oracle_gguf):
    """Sequences of different prompt lengths, admitted at different steps (max_seqs below the request count, and
    some submitted later), finishing at different lengths, one cancelled mid-way: each equals its run alone. The
    test drives the scheduler's steps itself, so the schedule is the same on every machine."""
    from hybridinfer.engine.scheduler import Scheduler

    eng = Engine.load(str(oracle_gguf(arch, quant)), backend="cpu", isa=ISA, n_ctx=128)
    reqs = _requests(eng.args.n_vocab)
    want = [_alone(eng, r) for r in reqs]
    sched = Scheduler(eng, max_seqs=4, worker=False)
    first = [sched.submit(eng.make_request(**r)) for r in reqs[:4]]
    victim = sched.submit(eng.make_request(reqs[0]["prompt"], max_tokens=60, temperature=0))
    for _ in range(3):
        sched.step()
    late = [sched.submit(eng.make_request(**r)) for r in reqs[4:]]
    running = []
    while not sched.idle():
        sched.step()
        running.append(sched.running)
        if len(victim.generation.tokens) == 5:
            victim.cancel()
    got = [h.result(timeout=1) for h in first + late]
    assert victim.result(timeout=1).finish_reason == "cancelled" and len(victim.generation.tokens) == 5
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
    assert max(running) == 4 and sched.peak_running == 4 and running[-1] == 0
    assert sched._reserved == 0


def test_generate_batch_smollm_equals_alone_and_stops(smollm_path):
    """The real model: varied chat and raw prompts as one batch equal each run alone, with stop strings and EOS."""
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512, max_seqs=8)
    reqs = [
        [{"role": "user", "content": "What is the capital of France?"}],
        "The capital of France is",
        {"prompt": "Count from one to ten: one, two, three,", "stop": [" five"]},
        {"prompt": "Once upon a time", "max_tokens": 5},
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi."}],
        {"prompt": "def fib(n):", "stop": "\n\n", "max_tokens": 40},
        {"prompt": "1, 2, 3, 4,", "temperature": 0.7, "seed": 3},
        [{"role": "user", "content": "Name three colours."}],
    ]
    got = eng.generate_batch(reqs, max_tokens=24, temperature=0)
    for r, g in zip(reqs, got, strict=True):
        kw = {"max_tokens": 24, "temperature": 0}
        if isinstance(r, dict):
            kw.update(r)
            r = kw.pop("prompt")
        w = eng.generate(r, **kw)
        assert (g.text, g.tokens, g.finish_reason) == (w.text, w.tokens, w.finish_reason)
    assert got[2].finish_reason == "stop" and " five" not in got[2].text
    assert got[3].finish_reason == "length" and len(got[3].tokens) == 5


def test_limits_hold_under_a_random_workload(oracle_gguf):
    """max_seqs and the state budget are never exceeded; a request that could never fit is a typed error."""
    eng = Engine.load(str(oracle_gguf("qwen35moe", "q8_0")), backend="cpu", isa=ISA, n_ctx=128)
    args = eng.args
    budget = state_bytes(args, 60) * 3  # room for about three long sequences at once
    from hybridinfer.engine.scheduler import Scheduler

    sched = Scheduler(eng, max_seqs=5, state_budget=budget)
    rng = np.random.default_rng(9)
    handles = []
    for i in range(16):
        n, m = int(rng.integers(1, 30)), int(rng.integers(1, 30))
        handles.append(sched.submit(eng.make_request(_ids(args.n_vocab, n, i), max_tokens=m, temperature=0)))
        if i % 5 == 4:
            handles[-2].cancel()
    for h in handles:
        h.result(timeout=300)
    assert 1 <= sched.peak_running <= 5
    assert 0 < sched.peak_reserved <= budget
    assert sched._reserved == 0 and sched.running == 0 and sched.waiting == 0
    small = Scheduler(eng, state_budget=state_bytes(args, 10))
    with pytest.raises(CapacityError, match="state budget"):
        small.submit(eng.make_request(_ids(args.n_vocab, 40, 1), max_tokens=10, temperature=0))
    with pytest.raises(ParameterError, match="max_seqs"):
        Scheduler(eng, max_seqs=0)
    with pytest.raises(ParameterError, match="state_budget"):
        Scheduler(eng, state_budget=-5)
    sched.close()


def test_shared_system_prompt_restores_one_snapshot(smollm_path):
    """Requests sharing a system prompt in one batch: the prefix is prefilled once and restored for the others."""
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512, prefix_cache={"ram_bytes": 256 << 20},
                      snapshot_stride=0, max_seqs=4)
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    reqs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
            for q in ("Hi?", "What is 2+2?", "Name a fruit.", "Say yes.")]
    got = eng.generate_batch(reqs, max_tokens=4, temperature=0)
    system_turn = len(eng.tokenize(eng.chat_prompt(reqs[0][:1], add_generation_prompt=False)))
    assert got[0].timings["reused_tokens"] == 0
    for g in got[1:]:  # the first one's prefill snapshotted where the prompts part ways; the others restore it
        assert g.timings["reused_tokens"] >= system_turn, g.timings
    assert eng.prefix_cache.stats["hits"] >= 3
    cold = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512)
    for r, g in zip(reqs, got, strict=True):
        assert cold.generate(r, max_tokens=4, temperature=0).tokens == g.tokens


def test_prompts_admitted_together_share_one_prefill_pass(smollm_path, monkeypatch):
    """Sequences admitted together on the CPU: their prompts' chunks go through one pass (each weight read once for
    all), and each samples its first token in that step, before the step's decode; the answers are each one's
    own."""
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=256, max_seqs=4)
    reqs = [eng.make_request(p, max_tokens=3, temperature=0) for p in ("One.", "Two, two.", "Three, three, three.")]
    seen, steps = [], eng.prefill_steps

    def spy(plan):  # at each prefill pass: its prompts, and how many tokens every request has generated so far
        seen.append((len(plan), [len(h.generation.tokens) for h in handles]))
        return steps(plan)

    monkeypatch.setattr(eng, "prefill_steps", spy)
    with eng.lock:  # all three wait until submitted together, so they are admitted in one step
        handles = eng.scheduler.submit_many(reqs)
    for h in handles:
        h.result(timeout=120)
    assert seen[0] == (3, [0, 0, 0]), seen
    assert len(seen) == 1, seen  # short prompts: done in that one pass
    assert [h.generation.tokens for h in handles] == [eng.generate(r.ids, max_tokens=3, temperature=0).tokens
                                                      for r in reqs]


def test_requests_without_ends_keep_only_shared_snapshots(smollm_path):
    """keep_ends=False (a batch job's requests): the shared prefix is still snapshotted and restored, but nothing at
    a prompt's end or a reply's end (no next turn would use them); the tokens are the same either way."""
    from hybridinfer.engine.scheduler import Scheduler

    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512, prefix_cache={"ram_bytes": 256 << 20},
                      snapshot_stride=0, max_seqs=4)
    system = "You are a helpful assistant who answers in one short sentence. " * 4
    prompts = [eng.chat_prompt([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in ("Hi?", "What is 2+2?", "Name a fruit.")]
    reqs = [eng.make_request(p, 4, temperature=0) for p in prompts]
    for r in reqs:
        r.keep_ends = False
    sched = Scheduler(eng, max_seqs=4, worker=False)
    hs = sched.submit_many(reqs)
    while not sched.idle():
        sched.step()
    got = [h.result(timeout=0) for h in hs]
    assert all(g.timings["reused_tokens"] > 0 for g in got[1:])
    for r, g in zip(reqs, got, strict=True):
        hit = eng.prefix_cache.lookup(r.ids + g.tokens)
        assert hit is not None and hit.pos < len(r.ids), (hit and hit.pos, len(r.ids))  # only the shared prefix
    cold = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=512)
    for p, g in zip(prompts, got, strict=True):
        assert cold.generate(p, max_tokens=4, temperature=0).tokens == g.tokens


@pytest.mark.oracle
def test_smollm_batch_greedy_equals_alone_and_llama_cpp(smollm_path):
    """8 varied prompts as one batch: each greedy continuation equals the prompt run alone and llama.cpp's."""
    llama_cpp = pytest.importorskip("llama_cpp")

    from oracle_models import llama_greedy
    from test_cpu_backend import PROMPTS, _native_isa_only, llama_one_token_batches

    _native_isa_only()
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=512, max_seqs=8, isa=ISA)
    prompts = PROMPTS + ["import numpy as np\n", "Q: What is the largest planet?\nA:"]
    assert len(prompts) == 8
    ids = [eng.tokenize(p) for p in prompts]
    got = eng.generate_batch(ids, max_tokens=24, temperature=0)
    llm = llama_one_token_batches(llama_cpp, smollm_path)  # the one-token float order this engine gives each token
    for p, i, g in zip(prompts, ids, got, strict=True):
        assert g.tokens == eng.generate(i, max_tokens=24, temperature=0).tokens, p
        assert g.tokens == llama_greedy(llm, i, 24, eng.tokenizer.stop_ids), p


@pytest.mark.gpu
def test_gpu_prefill_then_batched_cpu_decode_equals_alone(oracle_gguf):
    """backend="gpu" on the scheduler's worker thread: GPU prefill per admitted prompt, batched CPU decode; each
    request equals the same request through Engine.generate (the card's context is pushed on the worker)."""
    from gpu_profile import PROFILE

    eng = Engine.load(str(oracle_gguf("qwen35moe", "q8_0")), backend="gpu", n_ctx=128, max_seqs=3,
                      card_profile=PROFILE)
    reqs = _requests(eng.args.n_vocab)
    want = [_alone(eng, r) for r in reqs]
    got = eng.generate_batch(reqs)
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason


@pytest.mark.gpu
def test_gpu_pass_is_cut_while_others_decode(oracle_gguf):
    """backend="gpu": while 2 sequences decode, a 160-token prompt goes through several streamed passes (each within
    compute.pass_tokens), and every step gives each running sequence one token; alone, the same prompt is one
    pass."""
    from gpu_profile import PROFILE
    from sched_steps import steps_until_first_token

    from hybridinfer.engine.scheduler import Scheduler
    from hybridinfer.tools.benchmarks.batch_api import NoEnd

    eng = Engine.load(str(oracle_gguf("qwen35moe", "q8_0")), backend="gpu", n_ctx=256, max_seqs=3,
                      card_profile=PROFILE)
    gpu, passes = eng.backend.gpu, []
    orig = gpu.forward

    def forward(tokens, *a, **kw):
        passes.append(len(tokens))
        return orig(tokens, *a, **kw)

    gpu.forward = forward
    sched = Scheduler(eng, max_seqs=3, worker=False, step_tokens=16)
    prompt = [int(x) for x in np.random.default_rng(3).integers(3, eng.args.n_vocab, 160)]
    (alone,) = sched.submit_many([eng.make_request(prompt, max_tokens=2, temperature=0)])
    while not sched.idle():
        sched.step()
    assert passes == [160] and len(alone.result().tokens) >= 1
    end = NoEnd(getattr(eng.tokenizer, "stop_ids", ()))  # the runners decode until cancelled
    runners = sched.submit_many([eng.make_request(p, max_tokens=60, temperature=0, constraint=end)
                                 for p in ([5, 6, 7, 8], [9, 10, 11, 12, 13])])
    sched.step()
    passes.clear()
    (long,) = sched.submit_many([eng.make_request(prompt[::-1], max_tokens=2, temperature=0)])
    steps = steps_until_first_token(sched, long, runners)
    assert len(passes) == steps >= 2 and sum(passes) == 160 and max(passes) < 160, passes
    for h in runners:
        h.cancel()
    while not sched.idle():
        sched.step()
    eng.close()


class _OnlyEven:
    """A toy constraint: odd token ids are forbidden; records what it was told."""

    def __init__(self):
        self.seen = []

    def mask(self, logits):
        logits[1::2] = -np.inf

    def accept(self, t):
        self.seen.append(t)
        return True


def test_constraint_masks_and_advances_in_both_paths(oracle_gguf):
    """Request.constraint: the scheduler and Engine.stream mask each step's logits with it and tell it each token,
    and the two paths still agree (structured output in the server rests on this)."""
    eng = Engine.load(str(oracle_gguf("qwen35", "q8_0")), backend="cpu", isa=ISA, n_ctx=64)
    ids = _ids(eng.args.n_vocab, 6, 2)
    c1, c2 = _OnlyEven(), _OnlyEven()
    alone = eng.generate(ids, max_tokens=12, temperature=0.9, seed=4, constraint=c1)
    (batched,) = eng.generate_batch([{"prompt": ids, "constraint": c2}], max_tokens=12, temperature=0.9, seed=4)
    assert alone.tokens == batched.tokens and len(alone.tokens) == 12
    assert all(t % 2 == 0 for t in alone.tokens) and c1.seen == alone.tokens == c2.seen
    # without it, odd ids would come: they hold a good share of the first step's distribution (a property of the
    # logits, not of which token a sample picks, so it holds at any ISA's rounding)
    lg = eng.prefill(ids, eng.new_state())[-1].astype(np.float64) / 0.9
    p = np.exp(lg - lg.max())
    assert p[1::2].sum() / p.sum() > 0.2


def test_logprobs_and_frequency_penalty_in_both_paths(oracle_gguf):
    """logprobs: each generated token's log-softmax (of the raw logits) and the top alternatives, the same through
    the scheduler and Engine.stream; frequency_penalty changes what is sampled and is checked like the others."""
    eng = Engine.load(str(oracle_gguf("qwen35moe", "q8_0")), backend="cpu", isa=ISA, n_ctx=64)
    ids = _ids(eng.args.n_vocab, 5, 8)
    alone = eng.generate(ids, max_tokens=6, temperature=0, logprobs=3)
    (batched,) = eng.generate_batch([ids], max_tokens=6, temperature=0, logprobs=3)
    assert alone.logprobs == batched.logprobs and len(alone.logprobs) == 6
    st = eng.new_state()
    lg = eng.prefill(ids, st)[-1]
    first = alone.logprobs[0]
    want = lg.astype(np.float64) - np.log(np.exp(lg.astype(np.float64) - lg.max()).sum()) - lg.max()
    assert first["token"] == alone.tokens[0] == int(np.argmax(lg))  # greedy: the most likely token
    assert first["logprob"] == pytest.approx(want[first["token"]], abs=1e-9)
    assert [i for i, _ in first["top"]] == list(np.argsort(-want, kind="stable")[:3])
    plain = eng.generate(ids, max_tokens=12, temperature=0)
    pen = eng.generate(ids, max_tokens=12, temperature=0, frequency_penalty=5.0)
    assert plain.tokens != pen.tokens
    with pytest.raises(ParameterError, match="frequency_penalty"):
        eng.generate(ids, frequency_penalty=float("nan"))
