"""One Engine driven from 8 threads at once: each call's answer equals the same call made alone (issue 19).

The backends share work buffers (and the GPU holds one sequence's state on the card), so without the engine's
lock concurrent calls overwrite each other's activations and silently produce wrong text."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from hybridinfer.engine.api import Engine

pytestmark = pytest.mark.isa  # sampled and greedy answers: re-run at every ISA level (.ci/run)
# the CPU unit HYBRIDINFER_ISA forces (library calls take it as an argument; only the CLI reads the variable)
ISA = os.environ.get("HYBRIDINFER_ISA")

N_THREADS = 8


def _requests(n_vocab: int) -> list[dict]:
    rng = np.random.default_rng(5)
    out = []
    for i in range(N_THREADS):
        ids = [int(t) for t in rng.integers(3, n_vocab, 5 + 3 * i)]
        # greedy and seeded sampling, different lengths, so the calls' steps interleave unevenly
        kw = {"temperature": 0.0} if i % 2 == 0 else {"temperature": 0.9, "seed": 100 + i, "top_k": 20}
        out.append({"prompt": ids, "max_tokens": 6 + i % 3, **kw})
    return out


def _call(eng: Engine, r: dict, i: int):
    r = dict(r)
    if i % 3 == 2:  # some threads stream, the others generate
        return ("stream", "".join(eng.stream(r.pop("prompt"), **r)))
    return ("tokens", eng.generate(r.pop("prompt"), **r).tokens)


def _round(eng: Engine, reqs: list[dict]) -> list:
    """All requests at once, one thread each, released together by a barrier."""
    got: list = [None] * len(reqs)
    errors: list = []
    barrier = threading.Barrier(len(reqs))

    def work(i: int) -> None:
        try:
            barrier.wait()
            got[i] = _call(eng, reqs[i], i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    return got


def _serial(eng: Engine, reqs: list[dict]) -> list:
    return [_call(eng, r, i) for i, r in enumerate(reqs)]


def _check(eng: Engine) -> None:
    reqs = _requests(eng.args.n_vocab)
    want = _serial(eng, reqs)
    assert any(w[1] for w in want)
    for _ in range(2):
        assert _round(eng, reqs) == want


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_threads_tiny_qwen35moe(backend, oracle_gguf):
    _check(Engine.load(str(oracle_gguf("qwen35moe")), backend=backend, n_ctx=128, **({"isa": ISA} if backend == "cpu"
                                                                                      else {})))


def test_threads_smollm_cpu_with_prefix_cache(smollm_path):
    """The real model on the CPU backend, with the prefix cache on (its lookups and saves are shared too)."""
    eng = Engine.load(smollm_path, backend="cpu", isa=ISA, n_ctx=256, prefix_cache={"ram_bytes": 64 << 20},
                      snapshot_stride=8)
    _check(eng)
    msgs = [[{"role": "user", "content": f"Name a colour number {i}."}] for i in range(N_THREADS)]
    want = [eng.generate(m, max_tokens=8, temperature=0).text for m in msgs]
    got: list = [None] * N_THREADS

    def work(i):
        got[i] = eng.generate(msgs[i], max_tokens=8, temperature=0).text

    ts = [threading.Thread(target=work, args=(i,)) for i in range(N_THREADS)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=600)
    assert got == want


@pytest.mark.gpu
def test_threads_gpu_backend(oracle_gguf):
    from gpu_profile import PROFILE

    _check(Engine.load(str(oracle_gguf("qwen35moe")), backend="gpu", n_ctx=128, card_profile=PROFILE))
