"""Issue 30, items 1-2: the scheduler is the only path to compute, with chunked prefill mixed with decode.

- Chunk and co-scheduling invariance: on the CPU backend a request's tokens and log-probabilities are bit-identical
  for step budgets of 16, 64 and 512 tokens, alone or with others admitted at other steps (llama, qwen35,
  qwen35moe), and `generate` (now through the scheduler) is the teacher-forced greedy answer of `Engine.logits`.
- No stall: while 4 sequences decode, a 2,000-token prompt is admitted; every running sequence gets a token at
  every step (counted in steps).
- Engine.close(): the worker thread ends, queued and running requests get EngineClosed, the backend's memory goes;
  the server's lifespan calls it."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest
from sched_steps import steps_until_first_token

from hybridinfer.engine.api import Engine
from hybridinfer.engine.chunk_cost import ChunkCost, work_of
from hybridinfer.engine.compute import MAX_PASS_STEPS, STALL, chunk_end, pass_tokens, prompt_budget
from hybridinfer.engine.scheduler import Scheduler
from hybridinfer.errors import EngineClosed, ParameterError
from hybridinfer.tools.benchmarks.batch_api import NoEnd


def _ids(n_vocab: int, n: int, seed: int) -> list[int]:
    return [int(x) for x in np.random.default_rng(seed).integers(3, n_vocab, n)]


def _drive(sched: Scheduler, limit: int = 2000) -> None:
    for _ in range(limit):
        if sched.idle():
            return
        sched.step()
    raise AssertionError("the scheduler did not become idle")


def test_chunk_end_cuts_at_budget_chunk_snapshot_and_end():
    assert chunk_end(0, 100, [], 16, 512) == 16
    assert chunk_end(10, 100, [], 512, 32) == 42  # prefill_chunk bounds it too
    assert chunk_end(10, 100, [20, 50], 64, 512) == 20  # the next snapshot position ends the chunk
    assert chunk_end(20, 100, [20, 50], 64, 512) == 50
    assert chunk_end(90, 100, [], 64, 512) == 100
    assert chunk_end(5, 100, [], 0, 512) == 6  # at least one token


@pytest.mark.isa
@pytest.mark.parametrize("arch,quant", [("llama", "q4_k_m"), ("qwen35", "q8_0"), ("qwen35moe", "q4_k_m")])
def test_tokens_and_logprobs_do_not_depend_on_step_budget_or_company(arch, quant, oracle_gguf):
    # every ISA unit (HYBRIDINFER_ISA, re-run by CI at each level): no unit's prefill depends on its chunking
    eng = Engine.load(str(oracle_gguf(arch, quant)), backend="cpu", n_ctx=128, isa=os.environ.get("HYBRIDINFER_ISA"))
    V = eng.args.n_vocab
    mine, others = _ids(V, 45, 1), [_ids(V, 37, 2), _ids(V, 9, 3), _ids(V, 60, 4)]
    kw = dict(max_tokens=6, temperature=0, logprobs=2)
    want = eng.generate(mine, **kw)
    # generate through the scheduler equals the teacher-forced greedy argmax of Engine.logits (the old path's answer)
    lg = eng.logits(mine + want.tokens[:-1])
    assert want.tokens == [int(t) for t in np.argmax(lg[len(mine) - 1 :], axis=-1)]
    for budget in (16, 64, 512):
        alone = Scheduler(eng, max_seqs=4, worker=False, step_tokens=budget)
        (h,) = alone.submit_many([eng.make_request(mine, **kw)])
        _drive(alone)
        g = h.result(timeout=0)
        assert (g.tokens, g.logprobs) == (want.tokens, want.logprobs), (arch, budget, "alone")
        # with others: two admitted before it (one long), it joins at the third step, one more after it
        mixed = Scheduler(eng, max_seqs=4, worker=False, step_tokens=budget)
        first = mixed.submit_many([eng.make_request(p, **kw) for p in others[:2]])
        mixed.step()
        mixed.step()
        (h,) = mixed.submit_many([eng.make_request(mine, **kw)])
        mixed.step()
        last = mixed.submit_many([eng.make_request(others[2], **kw)])
        _drive(mixed)
        g = h.result(timeout=0)
        assert (g.tokens, g.logprobs) == (want.tokens, want.logprobs), (arch, budget, "mixed")
        for hh, p in zip(first + last, others[:2] + others[2:], strict=True):
            assert hh.result(timeout=0).tokens == eng.generate(p, **kw).tokens


def test_a_long_prompt_does_not_stall_running_streams(smollm_path):
    """4 sequences decoding; a 2,000-token prompt admitted beside them with a 64-token step budget is prefilled
    over many steps, and every step gives each of the 4 exactly one token."""
    eng = Engine.load(smollm_path, backend="cpu", n_ctx=2100, max_seqs=5)
    eos = eng.tokenizer.eos_id
    sched = Scheduler(eng, max_seqs=5, worker=False, step_tokens=64)
    runners = sched.submit_many([eng.make_request(p, max_tokens=300, temperature=0, constraint=NoEnd([eos]))
                                 for p in ("One.", "Two, two.", "Three.", "Four, four.")])
    sched.step()
    assert [len(h.generation.tokens) for h in runners] == [1, 1, 1, 1]
    (long,) = sched.submit_many([eng.make_request(_ids(eng.args.n_vocab, 2000, 9), max_tokens=2, temperature=0)])
    steps = steps_until_first_token(sched, long, runners, limit=290)  # >= 16 prompt tokens a step
    assert steps >= 2000 // 64  # the prompt went in chunks within the budget (less the 4 decode tokens)
    for h in runners:
        h.cancel()
    _drive(sched)
    assert sched._reserved == 0


def test_pass_tokens_bounds_a_streamed_pass_only_while_others_decode():
    assert pass_tokens(64, 0, {"tokens": 900, "wall_s": 1.0, "copy_s": 1.0}) is None  # nobody waits: whole
    assert pass_tokens(64, 3, None) == 64  # no pass timed yet: the step budget
    assert pass_tokens(64, 3, {"tokens": 100, "wall_s": 1.0, "copy_s": 0.95}) == 200  # transfer-bound: more ride
    assert pass_tokens(64, 3, {"tokens": 1000, "wall_s": 2.0, "copy_s": 0.5}) == 250  # compute-bound: to the stream
    assert pass_tokens(64, 3, {"tokens": 10, "wall_s": 2.0, "copy_s": 0.5}) == 64  # never under the budget
    assert pass_tokens(64, 3, {"tokens": 10**6, "wall_s": 1.0, "copy_s": 1.0}) == 64 * MAX_PASS_STEPS


def test_prompt_budget_is_the_step_in_time_while_others_decode():
    assert prompt_budget(256, 0, 0.05) == (256, None)  # nobody decodes: the whole step budget, no time limit
    assert prompt_budget(256, 4, None) == (252, None)  # nothing measured yet: the budget less the decode tokens
    assert prompt_budget(256, 4, 0.05) == (252, STALL * 0.05)  # STALL decode steps' time of prompt chunks
    assert prompt_budget(8, 8, 0.05)[0] == 1


def test_chunk_cost_prices_a_chunk_by_its_place_in_the_prompt():
    """Passes timed as 1 ms a token plus 2 us a token-position: the fit finds both terms, so a chunk deep in a long
    prompt gets fewer tokens for the same seconds than one at its start; passes all at one place fall back to the
    per-token average (b = 0)."""
    def secs(chunks):
        n, q = work_of(chunks)
        return 1e-3 * n + 2e-6 * q

    cost = ChunkCost()
    assert cost.tokens_within(0, 0.1) is None and cost.seconds([(0, 8)]) is None  # nothing measured yet
    for chunks in ([(0, 64)], [(512, 64)], [(2048, 32), (0, 16)], [(4096, 128)]):
        cost.observe(chunks, secs(chunks))
    assert abs(cost.a - 1e-3) < 1e-9 and abs(cost.b - 2e-6) < 1e-11
    near, deep = cost.tokens_within(0, 0.05), cost.tokens_within(4000, 0.05)
    assert near == 47 and deep == 5  # 0.05 s: 47 tokens at the start (2 ms each, rising), 5 after 4000
    assert cost.seconds([(4000, deep)]) <= 0.05 < cost.seconds([(4000, deep + 1)])
    flat = ChunkCost()
    for _ in range(3):
        flat.observe([(100, 50)], 0.1)
    assert flat.b == 0 and abs(flat.a - 0.002) < 1e-12 and flat.tokens_within(5000, 0.1) == 50


def test_chunk_cost_finds_a_chunks_own_cost():
    """Passes timed as 1 ms a token, 2 us a token-position and 5 ms a chunk (each chunk's own calls): the fit finds
    all three, so a pass of many short prompts is not under-priced, and a chunk's tokens leave room for its own
    5 ms."""
    def secs(chunks):
        n, q = work_of(chunks)
        return 1e-3 * n + 2e-6 * q + 5e-3 * len(chunks)

    cost = ChunkCost()
    for chunks in ([(0, 64)], [(512, 64)], [(2048, 32), (0, 16)], [(4096, 128)], [(0, 8)] * 6, [(100, 20)] * 3):
        cost.observe(chunks, secs(chunks))
    assert abs(cost.a - 1e-3) < 1e-9 and abs(cost.b - 2e-6) < 1e-11 and abs(cost.c - 5e-3) < 1e-9
    assert cost.seconds([(0, 8)] * 6) == pytest.approx(secs([(0, 8)] * 6))
    assert cost.tokens_within(0, 0.005) == 0 and cost.tokens_within(0, 0.055) == 47


def test_a_step_takes_the_prompt_tokens_of_stall_decode_steps(smollm_path, monkeypatch):
    """With a decode step measured at 10 ms and a prompt token priced at 1 ms (held there), a 300-token prompt
    admitted beside 2 decoding sequences advances by at most 30 tokens a step; each step still gives every runner a
    token."""
    import hybridinfer.engine.scheduler as sm

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=400, max_seqs=3)
    sched = Scheduler(eng, max_seqs=3, worker=False, step_tokens=256)
    monkeypatch.setattr(sm, "ema", lambda old, new, keep=0.7: old if old is not None else new)
    runners = sched.submit_many([eng.make_request(p, max_tokens=40, temperature=0,
                                                  constraint=NoEnd([eng.tokenizer.eos_id])) for p in ("One.", "Two.")])
    sched.step()
    sched._decode_s, sched._cost = 0.010, ChunkCost(a=0.001)
    monkeypatch.setattr(sched._cost, "observe", lambda chunks, seconds: None)
    (long,) = sched.submit_many([eng.make_request(_ids(eng.args.n_vocab, 300, 2), max_tokens=2, temperature=0)])
    seen = []
    while not long.generation.tokens:
        sched.step()
        s = next((q for q in sched._prefilling if q.handle is long), None)
        seen.append(s.state.pos if s is not None and s.state is not None else 300)
    steps = [b - a for a, b in zip([0] + seen, seen, strict=False)]
    assert max(steps) <= 30 and len(seen) >= 10, seen
    for h in runners:
        h.cancel()
    _drive(sched)


class _CPUPass:
    """A single-pass prefill device made of a CPU backend (GPUPrefillCPUDecode's `gpu`), timing its passes as the GPU
    does (last_timing: a transfer-bound pass) and keeping each pass's token count."""

    def __init__(self, cpu):
        self.cpu, self.passes, self.last_timing = cpu, [], {}

    def forward(self, tokens, state, all_logits=True, snapshot_at=(), on_snapshot=None):
        self.passes.append(len(tokens))
        self.last_timing = {"tokens": len(tokens), "wall_s": 1.0, "copy_s": 1.0}
        return self.cpu.forward(tokens, state, all_logits=all_logits)


def test_a_long_prompt_on_a_single_pass_backend_waits_one_pass_at_a_time(smollm_path):
    """The GPU's path (one streamed pass per step): while 2 sequences decode, a 600-token prompt goes in several
    passes, each within pass_tokens, and every step gives each running sequence one token; with nothing decoding,
    a prompt goes whole in one pass. Its answer is the CPU's (the device here computes as the CPU does)."""
    from hybridinfer.backends import GPUPrefillCPUDecode

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=700, max_seqs=3)
    dev = _CPUPass(eng.backend)
    eng.backend = GPUPrefillCPUDecode(dev, eng.backend)
    eos = eng.tokenizer.eos_id
    sched = Scheduler(eng, max_seqs=3, worker=False, step_tokens=64)
    prompt = _ids(eng.args.n_vocab, 600, 4)
    (alone,) = sched.submit_many([eng.make_request(prompt, max_tokens=2, temperature=0)])
    _drive(sched)
    assert dev.passes == [600]
    runners = sched.submit_many([eng.make_request(p, max_tokens=40, temperature=0, constraint=NoEnd([eos]))
                                 for p in ("One.", "Two, two.")])
    sched.step()
    dev.passes.clear()
    (long,) = sched.submit_many([eng.make_request(prompt, max_tokens=2, temperature=0)])
    steps = steps_until_first_token(sched, long, runners)
    assert dev.passes == [64, 128, 256, 152], dev.passes  # transfer-bound passes: each twice the last
    assert steps == len(dev.passes)
    for h in runners:
        h.cancel()
    _drive(sched)
    assert long.result().tokens == alone.result().tokens


def test_close_ends_the_worker_answers_every_request_and_frees_memory(smollm_path):
    with Engine.load(smollm_path, backend="cpu", n_ctx=256, max_seqs=1) as eng:
        eos = eng.tokenizer.eos_id
        sched = eng.scheduler
        running = eng.submit("Once upon a time", max_tokens=200, temperature=0, constraint=NoEnd([eos]))
        queued = [eng.submit("Hello", max_tokens=4, temperature=0) for _ in range(3)]
        next(iter(running))  # it runs: the worker is there
        assert sched.worker_alive
        be = weakref.ref(eng.backend)
    assert not sched.worker_alive and sched._thread is not None and not sched._thread.is_alive()
    for h in [running, *queued]:
        with pytest.raises(EngineClosed, match="closed"):
            h.result(timeout=5)
    assert sched._reserved == 0 and sched.idle()
    with pytest.raises(EngineClosed):
        eng.generate("Hello", max_tokens=2)
    with pytest.raises(EngineClosed):
        eng.logits([1, 2, 3])
    eng.close()  # twice: harmless
    gc.collect()
    assert be() is None  # nothing holds the backend (its weights, work buffers and thread pool) any more


def test_an_engine_dropped_without_close_lets_go_of_everything(smollm_path):
    """An engine whose program drops it after generating (its worker started, close() never called) is collected:
    its worker thread ends and its backend is closed (its thread pool gone) and freed."""
    import time

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=256)
    assert eng.generate("Hello", max_tokens=2, temperature=0).finish_reason in ("length", "stop")
    thread, ref = eng.scheduler._thread, weakref.ref(eng)
    be = eng.backend
    assert thread.is_alive()
    del eng
    t0 = time.monotonic()
    while (ref() is not None or thread.is_alive()) and time.monotonic() - t0 < 30:
        gc.collect()
        time.sleep(0.1)
    assert ref() is None and not thread.is_alive()
    assert be.layers == [] and be.out is None  # CPUModel.close ran: weights, buffers and the pool let go


def test_a_device_stand_in_closes_without_a_card(smollm_path):
    """GPUPrefillCPUDecode over a stand-in device (no CUDA context ever made, no pycuda needed) closes: its CPU
    backend and the stand-in let go, nothing of CUDA's is touched (an engine's finalizer runs this)."""
    from hybridinfer.backends import GPUPrefillCPUDecode

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=128)
    closed = []
    dev = _CPUPass(eng.backend)
    dev.close = lambda: closed.append(True)
    GPUPrefillCPUDecode(dev, eng.backend).close()
    assert closed == [True] and eng.backend.layers == []


def test_server_lifespan_closes_the_engine(smollm_path):
    from fastapi.testclient import TestClient

    from hybridinfer.serving.serve import create_app

    eng = Engine.load(smollm_path, backend="cpu", n_ctx=256)
    with TestClient(create_app(eng, close_engine=True), base_url="http://127.0.0.1") as client:  # a loopback Host
        assert client.get("/health").json()["status"] == "ok"
        assert eng.backend is not None
    assert eng.backend is None  # the app's shutdown closed it
    with pytest.raises(EngineClosed):
        eng.submit("Hello", max_tokens=2)


def test_step_tokens_is_checked_before_loading():
    with pytest.raises(ParameterError, match="step_tokens"):
        Engine.load("/nonexistent.gguf", step_tokens=0)


def test_an_engine_left_open_is_closed_at_exit(smollm_path, tmp_path):
    """A program that never calls close(): its engine (kept alive by its worker) is closed by the exit hook, before
    the interpreter's teardown (where a card's buffers would be freed outside their context). A hook registered
    before the engine runs after its close and sees it closed."""
    import subprocess
    import sys

    prog = tmp_path / "prog.py"
    prog.write_text(
        "import atexit\n"
        "from hybridinfer.engine.api import Engine\n"
        "box = []\n"
        "atexit.register(lambda: print('at exit:', 'closed' if box[0].backend is None else 'open', flush=True))\n"
        f"e = Engine.load({smollm_path!r}, backend='cpu', n_ctx=256, n_threads=1)\n"
        "box.append(e)\n"
        "print('ok' if e.generate('Hi.', max_tokens=2, temperature=0).tokens else 'none', flush=True)\n")
    r = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["ok", "at", "exit:", "closed"], r.stdout
