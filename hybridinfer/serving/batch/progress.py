"""Progress of a batch job: counters, a tqdm bar or JSON lines, and the summary at the end."""

from __future__ import annotations

import json
import time
from collections import Counter

MODES = ("bar", "json", "none")


class Stats:
    """What a job has done in this run (requests by status, tokens) and how much was done before it."""

    def __init__(self, total: int, done_before: int):
        self.total, self.done_before = total, done_before
        self.by_status: Counter = Counter()
        self.prompt_tokens = self.reused_tokens = self.prefilled_tokens = self.generated_tokens = 0
        self.t0 = time.perf_counter()

    def add(self, status: str, generation=None) -> None:
        """status: "200", "400" (and other HTTP statuses), or "error" (a line that is no request)."""
        self.by_status[status] += 1
        if generation is not None:
            t = generation.timings
            self.prompt_tokens += generation.prompt_tokens
            self.reused_tokens += int(t.get("reused_tokens", 0))
            self.prefilled_tokens += int(t.get("prefilled_tokens", generation.prompt_tokens))
            self.generated_tokens += len(generation.tokens)

    @property
    def written(self) -> int:
        return sum(self.by_status.values())

    def snapshot(self) -> dict:
        wall = max(time.perf_counter() - self.t0, 1e-9)
        done = self.done_before + self.written
        rate = self.written / wall
        return {"done": done, "total": self.total, "done_before": self.done_before, "written": self.written,
                "by_status": dict(sorted(self.by_status.items())), "prompt_tokens": self.prompt_tokens,
                "reused_tokens": self.reused_tokens, "prefilled_tokens": self.prefilled_tokens,
                "generated_tokens": self.generated_tokens, "wall_s": round(wall, 3),
                "requests_per_s": round(rate, 3),
                "prompt_tok_per_s": round(self.prompt_tokens / wall, 1),
                "prefill_tok_per_s": round(self.prefilled_tokens / wall, 1),
                "gen_tok_per_s": round(self.generated_tokens / wall, 1),
                "cache_hit_rate": round(self.reused_tokens / self.prompt_tokens, 4) if self.prompt_tokens else 0.0,
                "eta_s": round((self.total - done) / rate, 1) if rate > 0 and self.total >= done else None}


class Progress:
    """Shows `stats` as it changes: mode "bar" (tqdm on `stream`), "json" (a JSON line on `stream` at most every
    `every_s` seconds, and one at the end) or "none"."""

    def __init__(self, stats: Stats, mode: str, stream, every_s: float = 1.0):
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.stats, self.mode, self.stream, self.every_s = stats, mode, stream, every_s
        self._last = 0.0
        self._bar = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=stats.total, initial=stats.done_before, unit="req", file=stream,
                             dynamic_ncols=True, smoothing=0.1)

    def update(self) -> None:
        now = time.perf_counter()
        if self._bar is not None:
            n = self.stats.done_before + self.stats.written
            if n > self._bar.n:
                self._bar.update(n - self._bar.n)  # update, not n =: tqdm's rate and ETA come from its updates
            if now - self._last >= 0.2:
                s = self.stats.snapshot()
                self._bar.set_postfix_str(f"prompt {s['prompt_tok_per_s']:.0f} tok/s, gen {s['gen_tok_per_s']:.0f} "
                                          f"tok/s, cache hit {s['cache_hit_rate']:.0%}", refresh=False)
                self._bar.refresh()
                self._last = now
        elif self.mode == "json" and now - self._last >= self.every_s:
            self._emit("progress")
            self._last = now

    def _emit(self, event: str, extra: dict | None = None) -> None:
        self.stream.write(json.dumps({"event": event, **self.stats.snapshot(), **(extra or {})}) + "\n")
        self.stream.flush()

    def close(self, extra: dict | None = None) -> dict:
        """Stop showing progress; the summary (also written as the last JSON line in json mode)."""
        if self._bar is not None:
            self._bar.update(self.stats.done_before + self.stats.written - self._bar.n)
            self._bar.close()
        summary = {**self.stats.snapshot(), **(extra or {})}
        if self.mode == "json":
            self._emit("summary", extra)
        return summary


def format_summary(s: dict) -> str:
    """The summary as lines for a person."""
    status = ", ".join(f"{k}: {v}" for k, v in s["by_status"].items()) or "none"
    lines = [f"batch: {s['written']} written this run ({status}); {s['done']}/{s['total']} done"
             + (f", {s['done_before']} before" if s["done_before"] else "")
             + (" - interrupted, run the same command to go on" if s.get("interrupted") else ""),
             f"tokens: prompt {s['prompt_tokens']} (reused from the prefix cache {s['reused_tokens']}, "
             f"{s['cache_hit_rate']:.1%}; prefilled {s['prefilled_tokens']}), generated {s['generated_tokens']}",
             f"time: {s['wall_s']:.1f} s, {s['requests_per_s']:.2f} req/s, prompt {s['prompt_tok_per_s']:.0f} tok/s, "
             f"generated {s['gen_tok_per_s']:.0f} tok/s"]
    return "\n".join(lines)
