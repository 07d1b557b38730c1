"""Batch-job benchmark: one JSONL job in the OpenAI Batch format (N requests sharing a ~S-token system prompt, each
with its own 30-100-token question, temperature 0, up to max_tokens generated), run end to end by this engine's
`hybridinfer batch` and by llama.cpp's `llama-server` on the same GGUF and threads, one after the other (never
sharing the cores).

This engine, each run a `hybridinfer batch` subprocess on the job file (the model loaded in it, so a process starts
cold: no prefix cache survives from one configuration to the next):
  one        --max-seqs 1: one request at a time
  scheduler  --max-seqs M (default 8): the scheduler's batched decode and prefix-ordered admission
  shards     --shard 0/2 and --shard 1/2 as two processes at the same time, each with half the threads (each
             prefills the shared system prompt once for itself)
  numa P     the scheduler configuration with --numa P for each policy asked (off is the scheduler row itself); the
             plan for this host and whether the kernel took it are reported, a refusal as such
llama-server: -np 8 (slots), its prompt cache on, fed the same bodies by an async client with 8 requests in flight.

Figures per configuration: the job's wall time (requests only: this engine's batch summary excludes the model load,
llama-server's clock starts at the first request once /health answers; the load comes separately), requests/s,
prompt tokens, prompt tokens re-processed (this engine: the batch summary's prefilled tokens, i.e. not restored from
a snapshot; llama-server: the sum of timings.prompt_n), generated tokens and tok/s. "Unique" prompt tokens are the
nodes of the token trie of all prompts (tokenized here with the model's own tokenizer and chat template): what an
engine that never computes a prefix twice must prefill. Every run's output is checked to answer every custom_id once
with status 200.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from ...errors import ParameterError, TokenizerError
from .serve import LLAMA, OURS, Server, free_port, llama_cmd, reprocessed_tokens, system_prompt

MODEL_NAME = "bench"  # the model name the job's bodies give (`hybridinfer batch --model-name`)
CONFIGS = ("one", "scheduler", "shards")
NUMA_POLICIES = ("off", "interleave", "bind:0", "replicate", "auto")
QUESTION_TOKENS = (30, 100)
THINKING_OFF = {"enable_thinking": False}  # Qwen templates would otherwise open a <think> block

_QWORDS = {
    "verb": "read check test review update explain document verify compare summarize inspect rename format "
            "refactor measure describe split merge cache parse".split(),
    "noun": "file function module test change error branch commit request config value result output script "
            "package comment interface record queue parser table index".split(),
    "adj": "small large new old shared public private failing slow unused recent local remote simple nested "
           "empty".split(),
}


# the job ----------------------------------------------------------------------------------------------------------
def approx_tokens(text: str) -> int:
    """A token count without a tokenizer (about four characters a token, as serve.system_prompt assumes)."""
    return max(1, round(len(text) / 4))


def fit_system_prompt(n_tokens: int, count=None) -> str:
    """serve.system_prompt sized to about n_tokens tokens of `count` (a text -> tokens function): its own estimate
    is rescaled by what `count` measures, keeping the closest of a few tries (a prompt grows by whole rule lines)."""
    if n_tokens <= 0:
        return ""
    guess = n_tokens
    text = best = system_prompt(guess)
    if count is None:
        return text
    best_err = None
    for _ in range(5):
        got = count(text)
        err = abs(got - n_tokens)
        if best_err is None or err < best_err:
            best, best_err = text, err
        if err <= 16 or got <= 0:
            break
        guess = max(1, round(guess * n_tokens / got))
        text = system_prompt(guess)
    return best


def question(i: int, target: int, rng: random.Random, count=None, hi: int | None = None) -> str:
    """Question i: words appended until `count` says it has `target` tokens, never past `hi` (a word that would
    pass it is left out; a `hi` below the tokens of "Question i:" gets just that). Its number comes first, so no
    two questions are equal."""
    count = count or approx_tokens
    hi = max(hi or target, target)
    w = lambda k: rng.choice(_QWORDS[k])  # noqa: E731
    words = ["Question", f"{i + 1}:"]
    text = " ".join(words) + "?"
    pattern = ("in", "the", "adj", "noun")
    while count(text) < target:
        for p in pattern:
            nxt = words + [w(p) if p in _QWORDS else p]
            cand = " ".join(nxt) + "?"
            if count(cand) > hi:
                return text
            words, text = nxt, cand
            if count(text) >= target:
                break
        pattern = rng.choice((("why", "would", "you", "verb", "the", "adj", "noun"),
                              ("and", "how", "does", "the", "noun", "verb", "each", "noun"),
                              ("when", "the", "adj", "noun", "is", "adj", "or", "adj")))
    return text


def make_job(n: int = 200, system_tokens: int = 2000, max_tokens: int = 64, seed: int = 0, count=None,
             question_tokens: tuple[int, int] = QUESTION_TOKENS, model: str = MODEL_NAME) -> list[dict]:
    """n request lines in the OpenAI Batch format (chat completions, temperature 0, thinking off) sharing one system
    prompt of about system_tokens tokens, each with its own question of question_tokens (lo, hi) tokens (lengths
    drawn from `seed`). count: text -> tokens (the model's tokenizer; default: approx_tokens)."""
    lo, hi = question_tokens
    if n < 1:
        raise ParameterError(f"requests must be >= 1, got {n!r}")
    if max_tokens < 1:
        raise ParameterError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if system_tokens < 0:
        raise ParameterError(f"system_tokens must be >= 0, got {system_tokens!r}")
    if not 1 <= lo <= hi:
        raise ParameterError(f"question tokens must be lo,hi with 1 <= lo <= hi, got {question_tokens!r}")
    rng = random.Random(seed)
    system = fit_system_prompt(system_tokens, count)
    lines = []
    for i in range(n):
        msgs = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": question(i, rng.randint(lo, hi), rng, count, hi)}]
        lines.append({"custom_id": f"req-{i:05d}", "method": "POST", "url": "/v1/chat/completions",
                      "body": {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
                               "chat_template_kwargs": dict(THINKING_OFF)}})
    return lines


def write_jsonl(path: str, lines: list[dict]) -> None:
    with open(path, "w") as f:
        for ln in lines:
            f.write(json.dumps(ln) + "\n")


class ModelPrompts:
    """A GGUF's tokenizer and chat template without its weights: token counts of texts and the token ids of chat
    prompts, rendered as Engine.chat_prompt renders them."""

    def __init__(self, path: str):
        from ...format.chat_template import default_template
        from ...format.gguf_model import GGUFModel
        from ...format.tokenizer import Tokenizer

        gm = GGUFModel(path)
        self.tok = Tokenizer.from_gguf(gm)
        if self.tok is None:
            raise TokenizerError(f"{path!r} has no vocabulary: the batch-job benchmark needs a real tokenizer")
        self.template = gm.meta("tokenizer.chat_template", None) or default_template()

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_bos=False, parse_special=False))

    def chat_ids(self, messages: list[dict]) -> list[int]:
        from ...format.chat_template import render_chat

        t = self.tok
        bos = t.token_text(t.bos_id) if t.bos_id is not None else ""
        text = render_chat(self.template, messages, add_generation_prompt=True, bos_token=bos,
                           eos_token=t.token_text(t.eos_id) if t.eos_id is not None else "", enable_thinking=False)
        return t.encode(text, add_bos=False if bos and text.startswith(bos) else None)


def unique_prompt_tokens(prompts: list[list[int]]) -> int:
    """Nodes of the token trie of `prompts`: the tokens an engine that never computes a shared prefix twice
    prefills (each prompt in sorted order adds what it does not share with the one before it)."""
    from ...serving.batch.order import shared_prefix_tokens

    keys = sorted(prompts)
    return sum(len(p) for p in keys) - shared_prefix_tokens(keys)


# checking an output -----------------------------------------------------------------------------------------------
def check_answers(records: list[dict], ids: list[str]) -> dict:
    """How the output records answer the job's custom_ids: each once with status 200 is the good case."""
    seen = Counter(r.get("custom_id") for r in records)
    ok = Counter(r.get("custom_id") for r in records if (r.get("response") or {}).get("status_code") == 200)
    want = set(ids)
    return {"answered": sum(1 for i in want if ok[i] == 1 and seen[i] == 1),
            "missing": sum(1 for i in want if seen[i] == 0),
            "duplicates": sum(1 for i in want if seen[i] > 1),
            "not_ok": sum(1 for i in want if seen[i] and not ok[i]),
            "unknown": sum(c for i, c in seen.items() if i not in want)}


def _read_records(paths: list[str]) -> list[dict]:
    out = []
    for p in paths:
        if os.path.exists(p):
            with open(p, "rb") as f:
                out += [json.loads(x) for x in f if x.strip()]
    return out


def usage_reprocessed(records: list[dict]) -> int:
    """Prompt tokens minus cached_tokens over the answers' usage (the figure the output itself reports)."""
    total = 0
    for r in records:
        u = ((r.get("response") or {}).get("body") or {}).get("usage") or {}
        total += reprocessed_tokens(u, None) or 0
    return total


# this engine ------------------------------------------------------------------------------------------------------
def _child_env() -> dict:
    """The environment of a `python -m hybridinfer` child: this package first on its path, wherever it lies."""
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])  # the folder holding hybridinfer/
    env["PYTHONPATH"] = os.pathsep.join([root] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def batch_cmd(model: str, job: str, out: str, summary: str, threads: int, n_ctx: int, max_seqs: int,
              shard: str = "0/1", numa: str = "off", backend: str = "cpu") -> list[str]:
    return [sys.executable, "-m", "hybridinfer", "batch", job, "-o", out, "-m", model, "-t", str(threads),
            "--n-ctx", str(n_ctx), "--max-seqs", str(max_seqs), "--backend", backend, "--model-name", MODEL_NAME,
            "--progress", "none", "--summary", summary, "--shard", shard, "--numa", numa]


@dataclass
class Done:
    """One finished `hybridinfer batch` process."""
    rc: int
    out: str
    summary: dict | None
    stderr: str


def run_batches(specs: list[tuple[list[str], str, str]]) -> tuple[list[Done], float]:
    """Start every (cmd, output, summary path) at once, wait for all; their results and the wall time of all."""
    procs = []
    t0 = time.perf_counter()
    for cmd, out, summ in specs:
        err = tempfile.TemporaryFile()
        procs.append((subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, stdin=subprocess.DEVNULL,
                                       env=_child_env()), err, out, summ))
    done = []
    for p, err, out, summ in procs:
        rc = p.wait()
        err.seek(0)
        text = err.read().decode(errors="replace")
        err.close()
        s = None
        if os.path.exists(summ):
            with open(summ) as f:
                s = json.load(f)
        done.append(Done(rc, out, s, text))
    return done, time.perf_counter() - t0


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][-300:] if lines else ""


def ours_row(config: str, done: list[Done], wall_all: float, ids: list[str], numa: str = "off") -> dict:
    """A configuration's row from its processes' summaries and outputs."""
    bad = next((d for d in done if d.rc != 0 or d.summary is None), None)
    records = _read_records([d.out for d in done])
    row = {"config": config, "engine": OURS, "numa": numa, "requests": len(ids), **check_answers(records, ids),
           "process_s": wall_all, "error": None if bad is None else f"exit {bad.rc}: {_last_line(bad.stderr)}"}
    sums = [d.summary for d in done if d.summary is not None]
    if bad is not None or not sums:
        return row | {"wall_s": None, "prompt_tokens": None, "reprocessed": None, "generated": None,
                      "reprocessed_usage": None}
    # shards that ran at once: the job lasted as long as the slower one
    return row | {"wall_s": max(s["wall_s"] for s in sums), "prompt_tokens": sum(s["prompt_tokens"] for s in sums),
                  "reprocessed": sum(s["prefilled_tokens"] for s in sums),
                  "generated": sum(s["generated_tokens"] for s in sums),
                  "reprocessed_usage": usage_reprocessed(records)}


def numa_status(policy: str, model_bytes: int, stderr: str, topo=None) -> str:
    """What --numa `policy` came to on this host: the plan (a fallback says so) and what the run said it did (a
    policy the kernel refused is named as refused)."""
    from ...backends import numa

    topo = topo or numa.read_topology()
    try:
        p = numa.plan(topo, model_bytes, policy)
    except ValueError as e:
        return f"refused: {e}"
    if policy == "auto":
        said = f"chose {p.mode}"
    else:
        said = p.mode if p.mode == policy.split(":")[0] else f"falls back to {p.mode}"
    parts = [f"{said}" + (f" ({'; '.join(p.notes)})" if p.notes else "")]
    notes = [ln.split("note:", 1)[1].strip() for ln in stderr.splitlines() if "hybridinfer: note: --numa" in ln]
    if notes:
        parts.append("refused by the kernel: " + notes[0])
    else:
        applied = [ln.split("numa:", 1)[1].strip() for ln in stderr.splitlines() if ln.startswith("hybridinfer: numa:")]
        if applied:
            parts.append("applied: " + "; ".join(applied))
    return "; ".join(parts)


def run_ours(model: str, job: str, ids: list[str], tmp: str, threads: int, n_ctx: int, max_seqs: int,
             configs, policies, backend: str = "cpu") -> list[dict]:
    size = os.path.getsize(model)
    runs: list[tuple[str, str, list[tuple[int, str, int, str]]]] = []  # (config, numa, [(threads, shard, seqs)])
    if "one" in configs:
        runs.append(("one at a time (max_seqs 1)", "off", [(threads, "0/1", 1)]))
    if "scheduler" in configs or "off" in policies:
        runs.append((f"scheduler (max_seqs {max_seqs})", "off", [(threads, "0/1", max_seqs)]))
    if "shards" in configs:
        half = max(1, threads // 2)
        runs.append((f"2 shards at once ({half} threads each)", "off",
                      [(half, "0/2", max_seqs), (half, "1/2", max_seqs)]))
    runs += [(f"scheduler, numa {p}", p, [(threads, "0/1", max_seqs)]) for p in policies if p != "off"]
    rows = []
    for k, (config, policy, procs) in enumerate(runs):
        specs = []
        for j, (t, shard, seqs) in enumerate(procs):
            out, summ = os.path.join(tmp, f"out{k}-{j}.jsonl"), os.path.join(tmp, f"summary{k}-{j}.json")
            specs.append((batch_cmd(model, job, out, summ, t, n_ctx, seqs, shard, policy, backend), out, summ))
        print(f"  {OURS}: {config}", flush=True)
        done, wall = run_batches(specs)
        row = ours_row(config, done, wall, ids, policy)
        row["numa_status"] = numa_status(policy, size, "\n".join(d.stderr for d in done)) if policy != "off" else ""
        rows.append(row)
        print(f"    wall {_f(row['wall_s'])} s, re-processed {row['reprocessed']} of {row['prompt_tokens']}"
              + (f", {row['numa_status']}" if row["numa_status"] else "")
              + (f"; error {row['error']}" if row["error"] else ""), flush=True)
    return rows


def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


# llama-server -----------------------------------------------------------------------------------------------------
async def post_all(base_url: str, lines: list[dict], concurrency: int, extra: dict | None = None) -> list[dict]:
    """POST every line's body to its url with `concurrency` requests in flight; one record per line as the batch
    writes it ({custom_id, response: {status_code, body}} or an error)."""
    import httpx

    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as client:
        async def one(line: dict) -> dict:
            async with sem:
                try:
                    r = await client.post(line["url"], json={**line["body"], **(extra or {})})
                    body = r.json()
                except Exception as e:  # noqa: BLE001 - that line's failure, counted in the table
                    return {"custom_id": line["custom_id"], "response": None,
                            "error": {"message": f"{type(e).__name__}: {e}"}}
                return {"custom_id": line["custom_id"], "response": {"status_code": r.status_code, "body": body},
                        "error": None}

        return list(await asyncio.gather(*(one(ln) for ln in lines)))


def llama_row(records: list[dict], ids: list[str], wall: float, load_s: float, slots: int) -> dict:
    ok = [(r["response"]["body"] or {}) for r in records if (r.get("response") or {}).get("status_code") == 200]
    rep = [reprocessed_tokens(b.get("usage"), b.get("timings")) for b in ok]
    first_err = next((json.dumps(r.get("error") or r["response"]["body"])[:300] for r in records
                      if (r.get("response") or {}).get("status_code") != 200), None)
    return {"config": f"llama-server -np {slots}", "engine": LLAMA, "numa": "off", "numa_status": "",
            "requests": len(ids), **check_answers(records, ids), "wall_s": wall, "process_s": load_s + wall,
            "prompt_tokens": sum(int((b.get("usage") or {}).get("prompt_tokens") or 0) for b in ok),
            "reprocessed": None if None in rep else sum(rep),
            "generated": sum(int((b.get("usage") or {}).get("completion_tokens") or 0) for b in ok),
            "reprocessed_usage": usage_reprocessed([r for r in records if r.get("response")]), "error": first_err}


def run_llama(binary: str, model: str, lines: list[dict], threads: int, slots: int, n_ctx: int) -> dict:
    ids = [ln["custom_id"] for ln in lines]
    port = free_port()
    print(f"  {LLAMA}: -np {slots} on 127.0.0.1:{port}", flush=True)
    t0 = time.perf_counter()
    srv = Server(LLAMA, llama_cmd(binary, model, port, threads, slots, n_ctx), port)
    load_s = time.perf_counter() - t0
    try:
        t0 = time.perf_counter()
        records = asyncio.run(post_all(srv.url, lines, slots, {"cache_prompt": True}))
        wall = time.perf_counter() - t0
    finally:
        srv.close()
    row = llama_row(records, ids, wall, load_s, slots)
    print(f"    wall {wall:.1f} s, re-processed {row['reprocessed']} of {row['prompt_tokens']}", flush=True)
    return row


# the whole benchmark ----------------------------------------------------------------------------------------------
def parse_policies(spec: str) -> tuple[str, ...]:
    """'off,interleave,bind:0' -> the policies, each checked as `hybridinfer batch --numa` checks it."""
    out = tuple(p.strip() for p in spec.split(",") if p.strip())
    for p in out:
        if not (p in ("off", "interleave", "replicate", "auto") or (p.startswith("bind:") and p[5:].isdigit())):
            raise ParameterError(f"--numa-policies: {p!r} is not off, interleave, bind:N, replicate or auto")
    return out


def parse_configs(spec: str) -> tuple[str, ...]:
    out = tuple(c.strip() for c in spec.split(",") if c.strip())
    bad = [c for c in out if c not in CONFIGS]
    if bad:
        raise ParameterError(f"--configs: unknown configuration(s) {bad}; choose from {','.join(CONFIGS)}")
    return out


def run(model: str, threads: int, requests: int = 200, system_tokens: int = 2000, max_tokens: int = 64,
        max_seqs: int = 8, llama_server: str | None = None, numa_policies=NUMA_POLICIES, configs=CONFIGS,
        seed: int = 0, n_ctx: int | None = None, llama_np: int = 8, backend: str = "cpu",
        question_tokens: tuple[int, int] = QUESTION_TOKENS) -> dict:
    from ...backends import numa

    mp = ModelPrompts(model)
    lines = make_job(requests, system_tokens, max_tokens, seed, mp.count, question_tokens)
    ids = [ln["custom_id"] for ln in lines]
    prompts = [mp.chat_ids(ln["body"]["messages"]) for ln in lines]
    system = lines[0]["body"]["messages"][0]["content"] if system_tokens > 0 else ""
    qlens = [mp.count(ln["body"]["messages"][-1]["content"]) for ln in lines]
    longest = max(len(p) for p in prompts)
    need = longest + max_tokens + 16
    if n_ctx is None:
        n_ctx = -(-need // 256) * 256  # room for the longest prompt and its answer in every slot
    elif n_ctx < need:
        raise ParameterError(f"--n-ctx {n_ctx} is too small: the longest prompt ({longest} tokens) and max_tokens "
                             f"{max_tokens} need {need}")
    topo = numa.read_topology()
    meta = {"model": os.path.basename(model), "threads": threads, "requests": requests, "system_tokens": system_tokens,
            "system_tokens_actual": mp.count(system) if system else 0, "question_tokens": [min(qlens), max(qlens)],
            "max_tokens": max_tokens, "max_seqs": max_seqs, "n_ctx": n_ctx, "llama_np": llama_np, "seed": seed,
            "backend": backend, "configs": list(configs), "numa_policies": list(numa_policies),
            "numa_nodes": len(topo.nodes), "numa_mem_nodes": len(topo.mem_nodes), "llama_server": llama_server,
            "prompt_tokens": sum(len(p) for p in prompts), "unique_prompt_tokens": unique_prompt_tokens(prompts)}
    print(f"job: {requests} requests, system prompt {meta['system_tokens_actual']} tokens, questions "
          f"{min(qlens)}-{max(qlens)} tokens, {meta['prompt_tokens']} prompt tokens of which "
          f"{meta['unique_prompt_tokens']} unique; n_ctx {n_ctx}", flush=True)
    with tempfile.TemporaryDirectory(prefix="hybridinfer-bench-batch-") as tmp:
        job = os.path.join(tmp, "job.jsonl")
        write_jsonl(job, lines)
        rows = run_ours(model, job, ids, tmp, threads, n_ctx, max_seqs, configs, numa_policies, backend)
    if llama_server:
        rows.append(run_llama(llama_server, model, lines, threads, llama_np, n_ctx))
    return {"meta": meta, "rows": rows}
