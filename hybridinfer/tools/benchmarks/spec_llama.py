"""llama.cpp's own speculative decoding beside `hybridinfer bench spec`: llama-server on the same GGUF and threads,
without drafts and with `--spec-type draft-mtp` at each draft length, fed the bench's prompt as token ids.

llama-server reports decode speed (`timings.predicted_per_second`) and, with drafts, `draft_n` / `draft_n_accepted`
per request, so the row gives the acceptance llama.cpp saw (on random weights about 0: the row measures what a wasted
draft costs there). Its greedy tokens are compared with this engine's no-draft greedy tokens on the same file."""

from __future__ import annotations

import json
import time
import urllib.request

from .serve import Server, free_port

NAME = "llama-server"


def server_cmd(binary: str, model: str, port: int, threads: int, n_ctx: int, k: int | None) -> list[str]:
    """One slot of n_ctx tokens, F32 K/V without flash attention (this engine's default; llama.cpp's own default is
    f16 K/V, whose rounding would part the greedy tokens from ours), drafts by the file's MTP block up to k tokens
    (None: none)."""
    cmd = [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), "-np", "1",
           "-c", str(n_ctx), "-fa", "off", "-ctk", "f32", "-ctv", "f32"]
    if k is not None:
        cmd += ["--spec-type", "draft-mtp", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    return cmd


def _complete(url: str, prompt: list[int], n: int) -> dict:
    body = {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "cache_prompt": False,
            "return_tokens": True, "ignore_eos": True}
    req = urllib.request.Request(url + "/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=1800) as r:
        return json.loads(r.read())


def row(out: dict, k: int | None, ref: list[int]) -> dict:
    t = out.get("timings") or {}
    drafted, accepted = t.get("draft_n"), t.get("draft_n_accepted")
    toks = [int(x) for x in out.get("tokens") or []]
    return {"k": "none" if k is None else k, "tok_s": float(t.get("predicted_per_second") or 0.0),
            "draft_n": drafted, "draft_n_accepted": accepted,
            "acceptance": (accepted / drafted) if drafted else None,
            "same_tokens_as_ours": toks[:len(ref)] == ref if toks else None}


def run(binary: str, model: str, threads: int, prompt: list[int], n: int, ks, reps: int, ref: list[int]) -> dict:
    """Rows for no drafts and draft-mtp at each k (the best of `reps` requests after one warm-up); a launch that
    fails (a file without the block, say) is a row with its error."""
    rows = []
    for k in (None, *ks):
        port = free_port()
        try:
            srv = Server(NAME, server_cmd(binary, model, port, threads, len(prompt) + n + 16, k), port)
        except RuntimeError as e:
            rows.append({"k": "none" if k is None else k, "error": str(e)[-400:]})
            continue
        try:
            _complete(srv.url, prompt, 4)  # warm-up: page the weights in
            best = None
            for _ in range(reps):
                r = row(_complete(srv.url, prompt, n), k, ref)
                best = r if best is None or r["tok_s"] > best["tok_s"] else best
            rows.append(best)
        except OSError as e:
            rows.append({"k": "none" if k is None else k, "error": f"{type(e).__name__}: {e}"})
        finally:
            srv.close()
        time.sleep(0.5)
    return {"binary": binary, "rows": rows}


def markdown(res: dict) -> str:
    lines = ["", f"{NAME} on the same file and threads (`--spec-type draft-mtp`):", "",
             "| k | tok/s | x no-draft | drafted | accepted | acceptance | greedy tokens = ours |",
             "|---|---|---|---|---|---|---|"]
    base = next((r["tok_s"] for r in res["rows"] if r["k"] == "none" and "error" not in r), None)
    for r in res["rows"]:
        if "error" in r:
            lines.append(f"| {r['k']} | error: {r['error'][:120]!r} | | | | | |")
            continue
        x = f"{r['tok_s'] / base:.2f}" if base else "-"
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.2f}"
        same = {True: "yes", False: "NO", None: "-"}[r["same_tokens_as_ours"]]
        lines.append(f"| {r['k']} | {r['tok_s']:.2f} | {x} | {r['draft_n'] if r['draft_n'] is not None else '-'} | "
                     f"{r['draft_n_accepted'] if r['draft_n_accepted'] is not None else '-'} | {acc} | {same} |")
    return "\n".join(lines)
