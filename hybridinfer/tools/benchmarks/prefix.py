"""Prefix-reuse benchmark: time to first token cold and warm, re-processed prompt tokens, snapshot bytes; the same
workloads through llama.cpp's server (`--ctx-checkpoints`, `--cache-ram`) in the same run.

Workloads, on token ids (so any GGUF works, synthetic ones included):
  a  the same 947-token prompt twice
  b  900 shared tokens, then the same 900 + a new 47-token suffix
  c  a 10-turn chat: each turn = the whole history (earlier prompts and replies) + 40 new user tokens
  d  N prompts (default 100) sharing a 2,000-token system prompt, each with its own 30-token question
TTFT is the time until the first token's logits are ready (our Engine.start; llama.cpp: prompt_ms of a
1-token completion). Re-processed tokens: ours = prompt tokens not restored from a snapshot; llama.cpp's
`timings.prompt_n`.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np

from . import pyplot

WORKLOADS = ("a", "b", "c", "d")


@dataclass
class Result:
    engine: str
    workload: str
    cold_ttft_ms: float  # first request of the workload (nothing cached)
    warm_ttft_ms: float  # mean over the requests that could reuse something
    prompt_tokens: int  # all requests
    reprocessed: int  # prompt tokens actually computed, all requests
    restore_ms: float = 0.0
    ram_bytes: int = 0
    disk_bytes: int = 0
    turns: list = field(default_factory=list)  # (c): tokens processed per turn

    @property
    def reused_share(self) -> float:
        return 1 - self.reprocessed / max(self.prompt_tokens, 1)


def _requests(workload: str, n_vocab: int, n_prompts: int, seed: int = 0):
    """The prompts of a workload as lists of token ids; (c) returns a generator that needs the replies."""
    rng = np.random.default_rng(seed)
    ids = lambda n: [int(x) for x in rng.integers(10, n_vocab - 10, n)]  # noqa: E731
    if workload == "a":
        p = ids(947)
        return [p, list(p)]
    if workload == "b":
        p = ids(900)
        return [p, p + ids(47)]
    if workload == "d":
        system = ids(2000)
        return [system + ids(30) for _ in range(n_prompts)]
    raise ValueError(workload)


def _drive(res: Result, workload: str, n_vocab: int, n_prompts: int, reply_tokens: int, ask) -> None:
    """Run one workload through ask(prompt, n_reply) -> (ttft ms, prompt tokens processed, reply ids, restore ms),
    filling `res`; the same driver serves both engines, so they see the same requests."""
    chat = workload == "c"
    rng = np.random.default_rng(1)
    hist: list[int] = []
    warm, restores = [], []
    for i, prompt in enumerate(range(10) if chat else _requests(workload, n_vocab, n_prompts)):
        if chat:  # the whole history (earlier prompts and replies) + 40 new user tokens
            hist = hist + [int(x) for x in rng.integers(10, n_vocab - 10, 40)]
            prompt = hist
        ms, n, reply, restore_ms = ask(prompt, reply_tokens if chat else 0)
        res.prompt_tokens += len(prompt)
        res.reprocessed += n
        if chat:
            res.turns.append(n)
            hist = hist + reply
        if i == 0:
            res.cold_ttft_ms = ms
        else:
            warm.append(ms)
            restores.append(restore_ms)
    res.warm_ttft_ms = float(np.mean(warm)) if warm else 0.0
    res.restore_ms = float(np.mean(restores)) if restores else 0.0


def _ask_ours(eng, prompt: list[int], n_reply: int):
    """TTFT of one request, then a greedy reply of n_reply tokens snapshotted at its end (chats)."""
    st = eng.new_state()
    t0 = time.perf_counter()
    lg, s = eng.start(prompt, st)
    ttft = time.perf_counter() - t0
    reply = []
    for _ in range(n_reply):
        t = int(np.argmax(lg))
        reply.append(t)
        lg = eng.backend.forward([t], st, all_logits=False)[-1]
    if reply:
        eng.prefix_cache.save(st, lg, defer_disk=True)
    eng.prefix_cache.flush()  # disk copies after the first token, as Engine.stream does
    return ttft * 1e3, s["prefilled_tokens"], reply, s["restore_s"] * 1e3


def run_ours(path: str, workloads, n_prompts: int, threads: int | None, cache_dir: str | None,
             backend: str = "cpu", reply_tokens: int = 16, stride: int | None = None) -> list[Result]:
    from ...engine.api import Engine

    out = []
    for w in workloads:
        opts = {"n_threads": threads} if backend in ("cpu", "auto") else {}
        cache = {"ram_bytes": 4 << 30, "disk_dir": None}
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)
            d = tempfile.mkdtemp(dir=cache_dir, prefix=f"prefix-{w}-")
            cache.update(disk_dir=d, disk_bytes=64 << 30)
        eng = Engine.load(path, backend=backend, n_ctx=8192, prefix_cache=cache,
                          snapshot_stride=stride, **opts)
        res = Result("hybridinfer", w, 0.0, 0.0, 0, 0)
        _drive(res, w, eng.args.n_vocab, n_prompts, reply_tokens, functools.partial(_ask_ours, eng))
        st = eng.prefix_cache.stats
        res.ram_bytes, res.disk_bytes = int(st.get("bytes_ram", 0)), int(st.get("bytes_disk", 0))
        out.append(res)
    return out


# llama.cpp's server ------------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


class LlamaServer:
    def __init__(self, binary: str, model: str, threads: int, checkpoints: int = 8, cache_ram_mib: int = 4096):
        self.port = _free_port()
        cmd = [binary, "-m", model, "-c", "8192", "-np", "1", "-t", str(threads), "--port", str(self.port),
               "--ctx-checkpoints", str(checkpoints), "--cache-ram", str(cache_ram_mib), "--no-warmup"]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < 300:
            if self.proc.poll() is not None:
                self.log.seek(0)
                raise RuntimeError(f"llama-server exited: {self.log.read()[-2000:].decode(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy in 300 s")

    def complete(self, ids: list[int], n_predict: int) -> tuple[float, int, list[int]]:
        """(prompt_ms, prompt tokens processed, generated ids)"""
        r = _post(f"http://127.0.0.1:{self.port}/completion",
                  {"prompt": ids, "n_predict": n_predict, "cache_prompt": True, "temperature": 0.0,
                   "return_tokens": True, "samplers": ["top_k"], "top_k": 1})
        t = r["timings"]
        return float(t["prompt_ms"]), int(t["prompt_n"]), [int(x) for x in r.get("tokens", [])]

    def close(self):
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def run_llama(binary: str, path: str, workloads, n_prompts: int, threads: int, n_vocab: int,
              reply_tokens: int = 16) -> list[Result]:
    out = []
    for w in workloads:
        srv = LlamaServer(binary, path, threads)
        try:
            res = Result("llama.cpp server", w, 0.0, 0.0, 0, 0)

            def ask(prompt, n_reply, srv=srv):
                ms, n, gen = srv.complete(prompt, max(n_reply, 1))
                return ms, n, gen[:n_reply], 0.0

            _drive(res, w, n_vocab, n_prompts, reply_tokens, ask)
            out.append(res)
        finally:
            srv.close()
    return out


def markdown(rows: list[Result], meta: dict) -> str:
    lines = [f"model: {meta['model']} ({meta['arch']}, {meta['n_layer']} layers), threads {meta['threads']}, "
             f"backend {meta['backend']}, snapshot stride {meta['stride']}", "",
             "| workload | engine | cold TTFT ms | warm TTFT ms | warm/cold | prompt tok | re-processed | reused | "
             "restore ms | snapshots RAM | on disk |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    mib = lambda b: f"{b / 2**20:.1f} MiB" if b else "-"  # noqa: E731
    for r in rows:
        ratio = r.warm_ttft_ms / r.cold_ttft_ms if r.cold_ttft_ms else 0.0
        lines.append(f"| {r.workload} | {r.engine} | {r.cold_ttft_ms:.1f} | {r.warm_ttft_ms:.1f} | {ratio:.2%} | "
                     f"{r.prompt_tokens} | {r.reprocessed} | {r.reused_share:.1%} | {r.restore_ms:.2f} | "
                     f"{mib(r.ram_bytes)} | {mib(r.disk_bytes)} |")
    for r in rows:
        if r.turns:
            lines.append(f"\n(c) tokens processed per turn, {r.engine}: {r.turns}")
    return "\n".join(lines)


def plot(rows: list[Result], path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    engines = sorted({r.engine for r in rows})
    fig, ax = plt.subplots(1, 2, figsize=(10, 4))
    for j, e in enumerate(engines):
        rs = [r for r in rows if r.engine == e]
        x = np.arange(len(rs)) + j * 0.4
        ax[0].bar(x, [r.warm_ttft_ms for r in rs], 0.4, label=e)
        ax[1].bar(x, [r.reprocessed for r in rs], 0.4, label=e)
        for a in ax:
            a.set_xticks(np.arange(len(rs)) + 0.2, [r.workload for r in rs])
    ax[0].set_ylabel("warm time to first token (ms)")
    ax[1].set_ylabel("prompt tokens re-processed")
    ax[0].set_yscale("log")
    ax[1].set_yscale("log")
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run(path: str, workloads=WORKLOADS, n_prompts: int = 100, threads: int | None = None,
        llama_server: str | None = None, cache_dir: str | None = None, backend: str = "cpu",
        stride: int | None = None) -> tuple[list[Result], dict]:
    from ...format.gguf_model import GGUFModel
    from ...models import model_args

    threads = threads or os.cpu_count()
    args = model_args(GGUFModel(path))
    meta = {"model": os.path.basename(path), "arch": args.arch, "n_layer": args.n_layer, "threads": threads,
            "backend": backend, "stride": "default" if stride is None else stride}
    rows = run_ours(path, workloads, n_prompts, threads, cache_dir, backend, stride=stride)
    if llama_server:
        if not (os.path.exists(llama_server) or shutil.which(llama_server)):
            raise FileNotFoundError(f"llama-server not found: {llama_server}")
        rows += run_llama(llama_server, path, workloads, n_prompts, threads, args.n_vocab)
    return rows, meta


def to_json(rows: list[Result], meta: dict) -> str:
    return json.dumps({"meta": meta, "rows": [asdict(r) | {"reused_share": r.reused_share} for r in rows]}, indent=1)
