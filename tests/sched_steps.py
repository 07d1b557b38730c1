"""Driving a Scheduler by hand in the no-stall tests: steps until a prompt's first token, checking each step gave
every running sequence exactly one token."""

from __future__ import annotations


def steps_until_first_token(sched, handle, runners, limit: int = 10**6) -> int:
    """Step `sched` until `handle` has its first token; every step must give each of `runners` one token. Returns
    the steps taken."""
    steps = 0
    while not handle.generation.tokens:
        before = [len(h.generation.tokens) for h in runners]
        sched.step()
        steps += 1
        assert [len(h.generation.tokens) for h in runners] == [b + 1 for b in before], steps
        assert steps < limit, steps
    return steps
