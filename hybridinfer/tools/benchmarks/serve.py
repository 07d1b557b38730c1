"""Serving benchmark over HTTP: this engine's `hybridinfer serve` and llama.cpp's `llama-server` on the same GGUF,
each started as a subprocess on 127.0.0.1 (one after the other, so they never share the cores), both driven by the
official `openai` client from threads with streamed chat requests.

  chat   1, 4 and 16 concurrent clients, each sending `requests` short prompts of a fixed set (temperature 0,
         max_tokens 64): time to first token and inter-token latency (between content deltas) p50/p99, aggregate
         generated tok/s (completion tokens of the usage chunk over the wall time of the level).
  agent  C conversations of T turns (default 10 x 5) on a ~2,000-token system prompt with tool definitions, up to
         max_seqs conversations at once; each turn sends the whole history (earlier replies, tool calls and tool
         results included) and a new user message. Each conversation's system prompt starts with its own workspace
         line, so its first turn is cold (with shared_system one prompt serves all: only the run's first request is
         cold). TTFT p50 of first vs later turns, prompt tokens and prompt tokens re-processed (this engine: usage
         prompt_tokens - prompt_tokens_details.cached_tokens; llama-server: timings.prompt_n of its last chunk),
         generated tok/s.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field

import numpy as np

from ...errors import ParameterError

OURS, LLAMA = "hybridinfer", "llama-server"
# requests sent to both engines: cache_prompt is llama-server's (on by default), thinking off for Qwen templates
EXTRA_BODY = {"cache_prompt": True, "chat_template_kwargs": {"enable_thinking": False}}

PROMPTS = [
    "Name three primary colors.", "What is the capital of France?", "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.", "Give me a short tip for learning to cook.",
    "What does HTTP stand for?", "List four planets of the solar system.", "Why is the sky blue?",
    "Suggest a name for a grey cat.", "How many days are there in a leap year?",
    "Translate 'good morning' into Spanish.", "What is 17 times 3?", "Describe a rainy day in one sentence.",
    "What is the boiling point of water at sea level?", "Recommend a book for a long train ride.",
    "What is the difference between a list and a tuple in Python?",
]

USER_TURNS = [
    "Open src/app/main.py and tell me what the function load_config does.",
    "The tests in tests/test_config.py fail with a KeyError. What could cause it?",
    "Search the code for every caller of load_config and summarize them.",
    "Propose a fix that keeps the old behaviour for existing config files.",
    "Run the test suite and tell me whether the fix works.",
    "Write a short commit message for the change.",
    "Are there other places where the same bug could happen?",
    "Add a regression test for the KeyError.",
]

def _tool(name: str, description: str, required: list[str], **props: tuple[str, str]) -> dict:
    """An OpenAI function tool; props: name -> (JSON type, description)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": {k: {"type": t, "description": d} for k, (t, d) in props.items()},
        "required": required}}}


TOOLS = [
    _tool("read_file", "Read a text file of the workspace and return its content.", ["path"],
          path=("string", "path relative to the workspace root"),
          start_line=("integer", "first line to return (1-based)"),
          end_line=("integer", "last line to return (inclusive)")),
    _tool("write_file", "Create or overwrite a file of the workspace.", ["path", "content"],
          path=("string", "path relative to the workspace root"), content=("string", "the whole new content")),
    _tool("run_command", "Run a shell command in the workspace and return its output.", ["command"],
          command=("string", "the command line"), timeout_s=("integer", "seconds before the command is stopped")),
    _tool("search_code", "Search the workspace for a regular expression.", ["pattern"],
          pattern=("string", "a regular expression"), max_results=("integer", "most matches returned")),
]

_WORDS = {
    "verb": "read check test review update explain document verify compare summarize inspect rename format "
            "refactor measure describe".split(),
    "noun": "file function module test change error branch commit request config value result output script "
            "package comment interface".split(),
    "adj": "small large new old shared public private failing slow unused recent local remote simple".split(),
}


def system_prompt(n_tokens: int, workspace: str = "", seed: int = 0) -> str:
    """A deterministic agent system prompt of about n_tokens tokens (common English words, ~1.2 tokens each;
    the tool definitions come on top of it): numbered working rules for a coding agent."""
    rng = random.Random(seed)
    w = lambda k: rng.choice(_WORDS[k])  # noqa: E731
    head = (f"Workspace: {workspace}\n" if workspace else "") + (
        "You are a careful coding agent working in a software repository. Use the tools to read, search and "
        "change files and to run commands. Follow these rules:\n")
    parts, n, i = [head], len(head) // 4, 0
    while n < n_tokens:
        i += 1
        s = (f"{i}. Always {w('verb')} the {w('adj')} {w('noun')} before you {w('verb')} any {w('noun')}, and "
             f"{w('verb')} the {w('noun')} when the {w('noun')} is {w('adj')}.\n")
        parts.append(s)
        n += 26
    return "".join(parts)


def tool_result(call: dict, conv: int, turn: int) -> str:
    return f"[{call['name']} #{conv}.{turn}] ok: 12 lines, no errors; the value of load_config is 'default'."


# statistics -----------------------------------------------------------------------------------------------
def percentile(xs, q: float) -> float | None:
    """The q-th percentile (linear interpolation between order statistics); None without samples."""
    return float(np.percentile(np.asarray(xs, dtype=float), q)) if len(xs) else None


def reprocessed_tokens(usage: dict | None, timings: dict | None) -> int | None:
    """Prompt tokens a server computed for one request: llama-server's timings.prompt_n where given, else
    usage.prompt_tokens - usage.prompt_tokens_details.cached_tokens (0 cached when the details are absent)."""
    if timings and timings.get("prompt_n") is not None:
        return int(timings["prompt_n"])
    if not usage or usage.get("prompt_tokens") is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return int(usage["prompt_tokens"]) - int(cached)


@dataclass
class Sample:
    """One streamed request, as the client saw it."""
    turn: int = 0
    ttft: float | None = None  # s, to the first delta with content, reasoning or a tool call
    itl: list = field(default_factory=list)  # s between such deltas
    completion: int = 0
    prompt: int = 0
    reprocessed: int | None = None
    error: str | None = None


def summarize(samples: list[Sample], wall: float) -> dict:
    ok = [s for s in samples if s.error is None]
    ttft = [s.ttft * 1e3 for s in ok if s.ttft is not None]
    itl = [x * 1e3 for s in ok for x in s.itl]
    comp = sum(s.completion for s in ok)
    rep = [s.reprocessed for s in ok]
    err = next((s.error for s in samples if s.error), None)
    return {"requests": len(samples), "errors": len(samples) - len(ok), "first_error": err,
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "itl_p50_ms": percentile(itl, 50), "itl_p99_ms": percentile(itl, 99),
            "completion_tokens": comp, "wall_s": wall, "tok_s": comp / wall if wall > 0 else 0.0,
            "prompt_tokens": sum(s.prompt for s in ok),
            "reprocessed": sum(rep) if ok and None not in rep else None}


# one streamed request -------------------------------------------------------------------------------------
def stream_chat(client, model: str, messages: list, max_tokens: int, tools=None) -> tuple[Sample, dict]:
    """Send one streamed chat request; the Sample and the assistant message to append to the history."""
    s = Sample()
    kw = {"tools": tools} if tools else {}
    t0 = last = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=EXTRA_BODY, **kw)
    text, calls, usage, timings, deltas = [], {}, None, None, 0
    for chunk in stream:
        now = time.perf_counter()
        timings = (chunk.model_extra or {}).get("timings") or timings
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for ch in chunk.choices:
            d = ch.delta
            got = bool(d.content) or bool((d.model_extra or {}).get("reasoning_content"))
            text.append(d.content or "")
            for tc in d.tool_calls or []:
                got = True
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or tc.id
                if tc.function is not None:
                    c["name"] = c["name"] or tc.function.name or ""
                    c["arguments"] += tc.function.arguments or ""
            if got:
                deltas += 1
                if s.ttft is None:
                    s.ttft = now - t0
                else:
                    s.itl.append(now - last)
                last = now
    s.completion = int(usage["completion_tokens"]) if usage and usage.get("completion_tokens") else deltas
    s.prompt = int(usage["prompt_tokens"]) if usage and usage.get("prompt_tokens") else 0
    s.reprocessed = reprocessed_tokens(usage, timings)
    msg = {"role": "assistant", "content": "".join(text)}
    good = [c for _, c in sorted(calls.items()) if c["name"] and _json_object(c["arguments"] or "{}")]
    if good:  # a call cut short by max_tokens (arguments not JSON) is left out of the history
        msg["tool_calls"] = [{"id": c["id"] or f"call_{i}", "type": "function",
                              "function": {"name": c["name"], "arguments": c["arguments"] or "{}"}}
                             for i, c in enumerate(good)]
    return s, msg


def _json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:  # cut short by max_tokens
        return False


def _client(base_url: str):
    import openai

    return openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=3600)


# workloads ------------------------------------------------------------------------------------------------
def run_chat(base_url: str, model: str, clients: int, requests: int, max_tokens: int) -> dict:
    """`clients` threads, each sending `requests` streamed chat requests one after the other."""
    samples: list[Sample] = []
    lock, start = threading.Lock(), threading.Barrier(clients + 1)

    def worker(i: int) -> None:
        start.wait()
        cl = _client(base_url)
        for j in range(requests):
            prompt = PROMPTS[(i * requests + j) % len(PROMPTS)]
            try:
                s, _ = stream_chat(cl, model, [{"role": "user", "content": prompt}], max_tokens)
            except Exception as e:  # noqa: BLE001 - counted, shown in the table
                s = Sample(error=f"{type(e).__name__}: {e}")
            with lock:
                samples.append(s)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return summarize(samples, time.perf_counter() - t0)


def run_agent(base_url: str, model: str, conversations: int, turns: int, concurrency: int, max_tokens: int,
              system_tokens: int, shared_system: bool = False) -> dict:
    """C conversations of T turns, up to `concurrency` at once; each turn resends the whole history."""
    samples: list[Sample] = []
    lock = threading.Lock()
    todo = list(range(conversations))
    tool_tokens = len(json.dumps(TOOLS)) // 4

    def conversation(c: int, cl) -> None:
        ws = "" if shared_system else f"/home/dev/project-{c:03d} (session {c * 7919 % 10007})"
        msgs = [{"role": "system", "content": system_prompt(max(system_tokens - tool_tokens, 0), ws)}]
        for t in range(turns):
            msgs.append({"role": "user", "content": USER_TURNS[(c + t) % len(USER_TURNS)]})
            try:
                s, reply = stream_chat(cl, model, msgs, max_tokens, tools=TOOLS)
            except Exception as e:  # noqa: BLE001 - the conversation stops; counted, shown in the table
                with lock:
                    samples.append(Sample(turn=t, error=f"{type(e).__name__}: {e}"))
                return
            s.turn = t
            with lock:
                samples.append(s)
            msgs.append(reply)
            for call in reply.get("tool_calls", []):
                msgs.append({"role": "tool", "tool_call_id": call["id"],
                             "content": tool_result(call["function"], c, t)})

    def worker() -> None:
        cl = _client(base_url)
        while True:
            with lock:
                if not todo:
                    return
                c = todo.pop(0)
            conversation(c, cl)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, conversations))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    row = summarize(samples, time.perf_counter() - t0)
    ok = [s for s in samples if s.error is None]
    # cold: the engine computed most of the prompt; cached: it restored most of it (system prompt, history)
    cold = [s for s in ok if s.reprocessed is not None and s.reprocessed > s.prompt / 2]
    cached = [s for s in ok if s.reprocessed is not None and s.reprocessed <= s.prompt / 2]
    for name, part in (("first", [s for s in ok if s.turn == 0]), ("later", [s for s in ok if s.turn > 0]),
                       ("cold", cold), ("cached", cached)):
        sub = summarize(part, 1.0)
        row[f"{name}_ttft_p50_ms"] = sub["ttft_p50_ms"]
        row[f"{name}_prompt_tokens"] = sub["prompt_tokens"]
        row[f"{name}_reprocessed"] = sub["reprocessed"]
        row[f"{name}_requests"] = len(part)
    c, w = row["cold_ttft_p50_ms"], row["cached_ttft_p50_ms"]
    row["cached_over_cold_ttft"] = w / c if c and w is not None else None
    first = [s for s in ok if s.turn == 0]
    row["first_turn_prompt_tokens_mean"] = float(np.mean([s.prompt for s in first])) if first else None
    keep = ("requests", "ttft_p50_ms", "completion_tokens", "prompt_tokens", "reprocessed")
    per_turn = [summarize([s for s in samples if s.turn == t and s.error is None], 1.0) for t in range(turns)]
    row["per_turn"] = [{"turn": t} | {k: r[k] for k in keep} for t, r in enumerate(per_turn)]
    row.update(conversations=conversations, turns=turns, shared_system=shared_system)
    return row


# servers --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1, up once GET /health answers 200; close() ends it (terminate, then kill)."""

    def __init__(self, name: str, cmd: list[str], port: int, timeout: float = 600.0):
        self.name, self.cmd, self.port = name, cmd, port
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self._wait(timeout)
        except BaseException:
            self.close()
            raise

    def _wait(self, timeout: float) -> None:
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not answer /health in {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read()[-n:].decode(errors="replace")

    def model_id(self) -> str:
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
            return json.loads(r.read())["data"][0]["id"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def ours_cmd(model: str, port: int, threads: int, max_seqs: int, n_ctx: int, backend: str,
             template: str | None = None, cache_ram: int | None = None) -> list[str]:
    return [sys.executable, "-m", "hybridinfer", "serve", "-m", model, "--port", str(port), "--host", "127.0.0.1",
            "--max-seqs", str(max_seqs), "-t", str(threads), "--backend", backend, "--n-ctx", str(n_ctx),
            "--log-level", "warning", "--report-cached-tokens"] + (
                ["--chat-template-file", template] if template else []) + (
                [] if cache_ram is None else ["--prefix-cache-ram", str(cache_ram)])


def llama_cmd(binary: str, model: str, port: int, threads: int, max_seqs: int, n_ctx: int,
              template: str | None = None) -> list[str]:
    """llama-server with max_seqs slots of n_ctx tokens each (-c is split over the slots), its prompt cache on
    (the default; requests also send cache_prompt), no flash attention (as this engine's CPU path); with a
    template file, rendered by its Jinja engine (--jinja) as this engine renders it, tools included."""
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-np",
            str(max_seqs), "-c", str(max_seqs * n_ctx), "-fa", "off"] + (
                ["--jinja", "--chat-template-file", template] if template else [])


def bench_server(srv: Server, cfg: dict) -> list[dict]:
    """Both workloads against one running server: rows of engine x workload x concurrency."""
    model = srv.model_id()
    stream_chat(_client(srv.url), model, [{"role": "user", "content": "Say hi."}], 4)  # warm-up, not counted
    rows = []
    for c in cfg["concurrency"]:
        r = run_chat(srv.url, model, c, cfg["requests"], cfg["max_tokens"])
        rows.append({"engine": srv.name, "workload": "chat", "concurrency": c} | r)
        print(f"  {srv.name} chat x{c}: {r['tok_s']:.1f} tok/s, TTFT p50 {_f(r['ttft_p50_ms'])} ms", flush=True)
    if cfg["conversations"] and cfg["turns"]:
        conc = min(cfg["max_seqs"], cfg["conversations"])
        r = run_agent(srv.url, model, cfg["conversations"], cfg["turns"], conc, cfg["max_tokens"],
                      cfg["system_tokens"], cfg["shared_system"])
        rows.append({"engine": srv.name, "workload": "agent", "concurrency": conc} | r)
        print(f"  {srv.name} agent: TTFT cold {_f(r['cold_ttft_p50_ms'])} ms, cached {_f(r['cached_ttft_p50_ms'])}"
              f" ms, re-processed {r['reprocessed']} of {r['prompt_tokens']}", flush=True)
    return rows


def run(model: str, threads: int, max_seqs: int = 16, concurrency=(1, 4, 16), requests: int = 4,
        max_tokens: int = 64, conversations: int = 10, turns: int = 5, system_tokens: int = 2000,
        shared_system: bool = False, n_ctx: int = 4096, backend: str = "cpu",
        llama_server: str | None = None, chat_template_file: str | None = None,
        cache_ram: int | None = None) -> dict:
    try:
        import openai  # noqa: F401
    except ModuleNotFoundError:
        raise ParameterError("bench serve needs the openai client: pip install openai") from None
    cfg = {"model": os.path.basename(model), "threads": threads, "max_seqs": max_seqs,
           "concurrency": list(concurrency), "requests": requests, "max_tokens": max_tokens,
           "conversations": conversations, "turns": turns, "system_tokens": system_tokens,
           "shared_system": shared_system, "n_ctx": n_ctx, "backend": backend, "llama_server": llama_server,
           "chat_template_file": chat_template_file, "prefix_cache_ram": cache_ram}
    rows = []
    makers = [(OURS, lambda p: ours_cmd(model, p, threads, max_seqs, n_ctx, backend, chat_template_file,
                                                  cache_ram))]
    if llama_server:
        makers.append((LLAMA, lambda p: llama_cmd(llama_server, model, p, threads, max_seqs, n_ctx,
                                                       chat_template_file)))
    for name, make in makers:  # one at a time: the engines do not share the cores
        port = free_port()
        print(f"starting {name} on 127.0.0.1:{port}", flush=True)
        srv = Server(name, make(port), port)
        try:
            rows += bench_server(srv, cfg)
        finally:
            srv.close()
    return {"meta": cfg, "rows": rows}


# output ---------------------------------------------------------------------------------------------------
def _f(v, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def markdown(res: dict) -> str:
    m, rows = res["meta"], res["rows"]
    out = [f"model: {m['model']}, threads {m['threads']}, max_seqs {m['max_seqs']} (llama-server -np), "
           f"{m['requests']} requests per client, max_tokens {m['max_tokens']}, backend {m['backend']}", "",
           "| engine | workload | clients | requests (errors) | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
           "| tok/s | prompt tok | re-processed |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['engine']} | {r['workload']} | {r['concurrency']} | {r['requests']} ({r['errors']}) | "
                   f"{_f(r['ttft_p50_ms'])} | {_f(r['ttft_p99_ms'])} | {_f(r['itl_p50_ms'])} | "
                   f"{_f(r['itl_p99_ms'])} | {_f(r['tok_s'])} | {r['prompt_tokens']} | {_f(r['reprocessed'], 'd')} |")
    agent = [r for r in rows if r["workload"] == "agent"]
    if agent:
        out += ["", f"agent: {m['conversations']} conversations x {m['turns']} turns, system prompt ~"
                    f"{m['system_tokens']} tokens with {len(TOOLS)} tools"
                    + (" (shared by all conversations)" if m["shared_system"] else " (one per conversation)"), "",
                "(cold: the engine computed over half of the prompt; cached: it restored at least half)", "",
                "| engine | first-turn prompt tok | cold requests | TTFT p50 cold ms | cached requests | "
                "TTFT p50 cached ms | cached/cold | later turns: prompt tok | re-processed | total re-processed |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for r in agent:
            out.append(f"| {r['engine']} | {_f(r['first_turn_prompt_tokens_mean'], '.0f')} | "
                       f"{r['cold_requests']} | {_f(r['cold_ttft_p50_ms'])} | {r['cached_requests']} | "
                       f"{_f(r['cached_ttft_p50_ms'])} | {_f(r['cached_over_cold_ttft'], '.1%')} | "
                       f"{r['later_prompt_tokens']} | {_f(r['later_reprocessed'], 'd')} | "
                       f"{_f(r['reprocessed'], 'd')} |")
    errs = [f"{r['engine']} {r['workload']} x{r['concurrency']}: {r['first_error']}" for r in rows if r["errors"]]
    if errs:
        out += ["", "errors (first of each row):", *errs]
    out += _versus(rows)
    return "\n".join(out)


def _versus(rows: list[dict]) -> list[str]:
    """This engine against llama-server: tok/s ratio per concurrency, re-processed tokens of the agent run."""
    get = lambda e, w, c=None: next((r for r in rows if r["engine"] == e and r["workload"] == w  # noqa: E731
                                     and (c is None or r["concurrency"] == c)), None)
    out = []
    for r in rows:
        other = get(LLAMA, r["workload"], r["concurrency"]) if r["engine"] == OURS else None
        if other and r["workload"] == "chat" and other["tok_s"]:
            out.append(f"- {r['concurrency']} clients: tok/s {r['tok_s'] / other['tok_s']:.2f}x llama-server")
    a, b = get(OURS, "agent"), get(LLAMA, "agent")
    if a and b and a["reprocessed"] is not None and b["reprocessed"] is not None:
        out.append(f"- agent: re-processed prompt tokens {a['reprocessed']} vs llama-server {b['reprocessed']}; "
                   f"tok/s {a['tok_s']:.1f} vs {b['tok_s']:.1f}")
    return ["", "this engine vs llama-server:", *out] if out else []
