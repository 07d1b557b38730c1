"""Prometheus metrics of one server (a registry of its own, so apps in one process do not share counters)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("hybridinfer_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=r)
        self.rejected = Counter("hybridinfer_requests_rejected", "requests refused with 429 (queue full)",
                                registry=r)
        self.prompt_tokens = Counter("hybridinfer_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.reused_tokens = Counter("hybridinfer_prompt_tokens_reused",
                                     "prompt tokens restored from the prefix cache instead of processed", registry=r)
        self.completion_tokens = Counter("hybridinfer_completion_tokens", "tokens generated", registry=r)
        self.drafted = Counter("hybridinfer_draft_tokens", "tokens drafted by speculative decoding (finished "
                               "requests)", registry=r)
        self.accepted = Counter("hybridinfer_draft_tokens_accepted", "drafted tokens the model accepted",
                                registry=r)
        self.ttft = Histogram("hybridinfer_time_to_first_token_seconds",
                              "from a request's submission to its first piece of text", buckets=_LATENCY, registry=r)
        self.itl = Histogram("hybridinfer_inter_token_latency_seconds",
                             "time between consecutive pieces of text of one request", buckets=_TOKEN_LATENCY,
                             registry=r)
        self.e2e = Histogram("hybridinfer_request_duration_seconds", "from submission to the last token",
                             buckets=_LATENCY, registry=r)
        self.queue = Gauge("hybridinfer_queue_depth", "requests waiting for the scheduler", registry=r)
        self.running = Gauge("hybridinfer_running_sequences", "sequences the scheduler is decoding", registry=r)
        self.held = Gauge("hybridinfer_requests_in_flight", "requests admitted and not finished", registry=r)

    def bind(self, service) -> None:
        sched = service.scheduler
        self.queue.set_function(lambda: sched.waiting)
        self.running.set_function(lambda: sched.running)
        self.held.set_function(lambda: service.held)

    def finished(self, job) -> None:
        p, c, reused = job.usage()
        self.prompt_tokens.inc(p)
        self.completion_tokens.inc(c)
        self.reused_tokens.inc(reused)
        timings = job.handle.generation.timings or {}
        self.drafted.inc(timings.get("draft_n", 0))
        self.accepted.inc(timings.get("draft_n_accepted", 0))
        self.e2e.observe(time.perf_counter() - job.t0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
