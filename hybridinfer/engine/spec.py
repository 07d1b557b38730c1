"""Speculative decoding: a drafter proposes the next few tokens of a sequence, one forward pass of the main model
over [sampled token, drafts] checks them all (each weight byte read once for every row), and the scheduler keeps
the drafts the model would have produced itself.

Lossless by construction. A drafter here is deterministic (its proposal is a point mass), so the standard rejection
rule (accept draft d with probability min(1, p(d)/q(d)) = p(d), else sample from the normalized max(0, p - q)) is
the same as: sample s from the model's distribution p at that row with the request's own sampler, keep the draft
while s == d, and at the first s != d emit s. Every emitted token is sampled once, from the logits of its own
position, with one draw of the sequence's generator, exactly as without drafts; the CPU backend computes each verify
row in the float shape of a one-token step (docs/numerics.md), so greedy output and sampled output with a fixed seed
are the same tokens with drafts and without.

Rollback. A K/V row past the accepted positions is simply never read again (rows >= pos are invalid). A GDN layer's
recurrent state cannot be cut back: the verify pass copies each sequence's recurrent arrays first and keeps each GDN
call's inputs (backends/state.RowsUndo), and after a rejection the arrays are put back and the GDN layers alone run
again over the accepted rows (no product again: the same bits the pass computed there). Snapshots and the prefix
cache only ever see a state after this, so they hold accepted positions only.

Drafters are found by name in DRAFTERS (`--spec-type`): "ngram" (prompt lookup), "mtp" (Qwen3.5/3.6's
multi-token-prediction block, engine/spec_mtp.py; a typed error for a file without it; the default where the file
has it), "none".
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np

from ..errors import MTPUnavailableError, ParameterError
from .compute import ema
from .spec_cost import MIN_EVIDENCE, SpecCost, plan_k  # what drafting costs and when it pays

SPEC_TYPES = ("none", "ngram", "mtp")
# llama.cpp's --spec-type names for the same kinds (its ngram-simple: the last n tokens looked up, the m after them)
SPEC_ALIASES = {"ngram-simple": "ngram", "draft-mtp": "mtp"}
MAX_DRAFT = 4  # --draft-max's range is 1..MAX_DRAFT (the k = 1..4)
DEFAULT_DRAFT_MAX = 3
MAX_SPLITS = 8  # splits of rows a backend keeps recorded (cpu's CPUModel.MAX_SPLITS): replayed when seen again
MAX_BACKOFF = 64  # steps a sequence whose drafts are all rejected waits at most before it drafts again
# a new sequence's acceptance before its first verify: this drafter's record, (hits + PRIOR x PRIOR_TRIES) / (tries +
# PRIOR_TRIES) over its recent verifies (each kept RECORD_KEEP a verify, and fading RECORD_FADE a plain step, so a
# drafter that stopped drafting is tried again after a while). Counts, not a running average of verifies: a drafter
# whose drafts all fail falls to 0.17 in six verifies (a running average at 0.95 a verify stayed at 0.44), where a
# drafted token no longer pays, so a server's new sequences stop drafting at once
PRIOR, PRIOR_TRIES, RECORD_KEEP, RECORD_FADE = 0.6, 2.0, 0.98, 0.999


class NgramDrafter:
    """Prompt-lookup drafts (llama.cpp's `ngram` speculative type, no extra weights): the longest suffix of the
    sequence so far (prompt and output, `ngram_max` tokens down to `ngram_min`) that occurred before, and the
    tokens that followed its most recent earlier occurrence."""

    name = "ngram"

    def __init__(self, ngram_min: int = 1, ngram_max: int = 3):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        L = len(history)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            tail = history[L - n :]
            # every start j < L - n of an earlier occurrence of the tail: windows of n compared at once
            win = np.lib.stride_tricks.sliding_window_view(history[: L - 1], n)
            hits = np.flatnonzero((win == tail).all(axis=1))
            hits = hits[hits + n < L]
            if hits.size:
                j = int(hits[-1]) + n  # the most recent: what followed it
                return [int(t) for t in history[j : j + k]]
        return []


class ScriptedDrafter:
    """A drafter for tests and `bench spec` (random weights make any real drafter's acceptance meaningless): it
    knows each sequence's continuation (`refs`: whole token lists, prompt and output) and proposes it with each
    token kept with probability `accept`, else replaced by another id; which tokens are replaced depends on the
    position alone (and `seed`), so a proposal made again after a rejection is the same."""

    name = "scripted"

    def __init__(self, refs, accept: float, seed: int = 0):
        self.refs = [np.asarray(r, np.int64) for r in refs]
        self.accept, self.seed = accept, seed

    def propose(self, history: np.ndarray, k: int) -> list[int]:
        L = len(history)
        for ref in self.refs:
            if len(ref) > L and np.array_equal(ref[:L], history):
                out = []
                for p in range(L, min(L + k, len(ref))):
                    t = int(ref[p])
                    keep = np.random.default_rng([self.seed, p]).random() < self.accept
                    out.append(t if keep else (t - 1 if t > 0 else t + 1))
                return out
        return []


def _mtp(args, backend):
    if not getattr(args, "has_mtp", False):
        raise MTPUnavailableError("spec_type 'mtp': this model's file has no multi-token-prediction block (use "
                                  "spec_type 'ngram' or 'none')")
    from .spec_mtp import MTPDrafter

    return MTPDrafter(backend)


# name -> a factory of the drafter for a model's args and backend (None: no drafts)
DRAFTERS = {"none": lambda args, backend: None, "ngram": lambda args, backend: NgramDrafter(), "mtp": _mtp}


def check_spec(spec_type: str | None, draft_max: int) -> str | None:
    """Refuse a bad --spec-type / --draft-max before the model is opened; the drafter's name (an alias resolved)."""
    spec_type = SPEC_ALIASES.get(spec_type, spec_type)
    if spec_type is not None and spec_type not in DRAFTERS:
        raise ParameterError(f"unknown spec_type {spec_type!r} (known: {', '.join([*DRAFTERS, *SPEC_ALIASES])})")
    if type(draft_max) is not int or not 1 <= draft_max <= MAX_DRAFT:
        raise ParameterError(f"draft_max must be a whole number in [1, {MAX_DRAFT}], got {draft_max!r}")
    return spec_type


def make_speculator(spec_type: str | None, draft_max: int, args, backend=None):
    """The Speculator of an engine, or None. spec_type None: the file's own drafter where it has one (its MTP
    block: "mtp"), else none."""
    name = check_spec(spec_type, draft_max) or ("mtp" if getattr(args, "has_mtp", False) else "none")
    drafter = DRAFTERS[name](args, backend)
    return None if drafter is None else Speculator(drafter, draft_max)


@dataclass
class SeqSpec:
    """One sequence's drafting: its acceptance estimate (per drafted token) and its counts."""

    accept: float = 0.6  # prior before any verify (the speculator's running acceptance, `Speculator.prior`)
    drafted: int = 0
    accepted: int = 0
    wait: int = 0  # steps left without drafts after a verify that accepted nothing
    backoff: int = 0  # that wait's length, doubled by each such verify in a row (up to MAX_BACKOFF)


class Speculator:
    """Drafts and verifies for the scheduler. Totals (`drafted`, `accepted`) as llama-server reports them.
    adaptive (default True): the step's draft length by spec_cost.plan_k over the measured step costs (0 while
    drafts do not pay for the batch); False: always draft_max (tests and `bench spec` measure the machinery at a
    fixed k)."""

    def __init__(self, drafter, draft_max: int, adaptive: bool = True, learned: Speculator | None = None):
        """learned: another speculator whose step costs and acceptance prior this one starts from (the same engine
        and drafter kind; `bench spec` runs many)."""
        self.drafter, self.draft_max, self.adaptive = drafter, draft_max, adaptive
        self.cost = learned.cost if learned is not None else SpecCost()
        self.record = learned.record if learned is not None else [0.0, 0.0]  # recent (hits, tries): `prior`
        self.drafted = self.accepted = 0
        self._t0, self._backend, self._recs = 0.0, None, 0
        self._splits: OrderedDict = OrderedDict()  # the splits of rows verified lately (recorded: replayed if again)

    @property
    def prior(self) -> float:
        """A new sequence's acceptance before its first verify: what this drafter's drafts have scored lately."""
        hits, tries = self.record
        return (hits + PRIOR * PRIOR_TRIES) / (tries + PRIOR_TRIES)

    @staticmethod
    def _split(seqs, caps, k: int) -> tuple:
        return tuple((id(s.state), 1 + min(k, c)) for s, c in zip(seqs, caps, strict=True))

    def start(self, backend) -> None:
        """A decode step begins (before `drafts`): its clock, and the backend's count of recorded steps, so that
        `timed` knows whether the step recorded one."""
        self._t0, self._backend = time.perf_counter(), backend
        self._recs = getattr(backend, "recordings", 0)

    def release(self, state) -> None:
        """The sequence of `state` has ended: the drafter lets go of what it keeps for it (its views of the
        state's buffers, which the engine reuses)."""
        forget = getattr(self.drafter, "release", None)
        if forget is not None:
            forget(state)

    def timed(self, rows: int, drafted: bool) -> None:
        """The step begun at `start` is done: `rows` rows, a verify step or not."""
        recorded = getattr(self._backend, "recordings", 0) != self._recs
        self.cost.add(rows, time.perf_counter() - self._t0, drafted, recorded)
        if not drafted:
            self.record[:] = [RECORD_FADE * v for v in self.record]

    def drafts(self, seqs) -> list[list[int]]:
        """Each sequence's drafts after its sampled next token (possibly none)."""
        observe = getattr(self.drafter, "observe", None)
        caps, rooms = [], []
        for s in seqs:
            sp = s.spec if s.spec is not None else SeqSpec(accept=self.prior)
            s.spec = sp
            left = s.handle.request.max_tokens - len(s.handle.generation.tokens)
            rooms.append(min(left, s.state.n_ctx - s.state.pos - 1))  # tokens it may still take
            cap = min(self.draft_max, rooms[-1])
            if self.adaptive and sp.wait > 0:  # backing off after wasted drafts: a wasted verify costs a step
                sp.wait -= 1
                cap = -1
            caps.append(cap)
        k = self.draft_max
        if self.adaptive:  # one k for the whole step, and only where it pays for the batch (spec_cost.plan_k)
            model, cap0 = self.cost.model(len(seqs)), [max(c, 0) for c in caps]
            seen = {j for j in range(1, self.draft_max + 1) if self._split(seqs, cap0, j) in self._splits}
            if model is None:  # the very first step drafts (it records its shape, as a plain first step would)
                k = self.draft_max if not self.cost.steps else 0  # then plain ones, until one is priced
            else:
                k = plan_k([s.spec.accept for s in seqs], cap0, *model, replayed=seen, left=max(min(rooms), 1))
            if k > 0 and len(seqs) > 1 and self.cost.verify.weight < MIN_EVIDENCE:
                # a probe (verify steps not priced, or not lately): one sequence drafts, the one likeliest to gain,
                # so the measuring step costs the batch B + k rows, not B (k + 1); every stream waits for it
                best = max(range(len(seqs)), key=lambda j: (caps[j] > 0, seqs[j].spec.accept))
                caps = [c if j == best or c < 0 else -2 for j, c in enumerate(caps)]  # -2: no drafts, no drift
        out = []
        for s, cap in zip(seqs, caps, strict=True):
            n = min(k, cap)
            if observe is not None:  # a drafter that follows the sequence's steps (mtp: its own K/V), once k is known
                observe(s, n > 0)
            if n <= 0:
                if cap >= 0:  # unprobed for a while: the prior comes back, a probe follows
                    s.spec.accept = ema(s.spec.accept, self.prior, 0.98)
                out.append([])
                continue
            if hasattr(self.drafter, "propose_seq"):
                out.append(self.drafter.propose_seq(s, n))
                continue
            hist = np.append(s.state.tokens[: s.state.pos], np.int32(s.next_tok))
            out.append(self.drafter.propose(hist, n))
        return out

    def verify(self, sched, go, drafts) -> list:
        """One forward pass over every sequence's [next token, drafts], then each sequence's accepted tokens; returns
        the sequences still running (a failed pass fails them all, as a failed decode step does)."""
        eng = sched.engine
        pos0 = [s.state.pos for s in go]
        split = tuple((id(s.state), 1 + len(d)) for s, d in zip(go, drafts, strict=True))
        self._splits[split] = self._splits.pop(split, None)
        while len(self._splits) > MAX_SPLITS:
            self._splits.popitem(last=False)
        try:
            rows, undos = eng.verify_rows([([s.next_tok] + d, s.state) for s, d in zip(go, drafts, strict=True)])
        except Exception as e:  # noqa: BLE001
            for s in go:
                sched._fail(s, e)
            return []
        keep = []
        for s, d, r, p0, undo in zip(go, drafts, rows, pos0, undos, strict=True):
            try:
                stop, end = self._accept(s, d, r, p0)
                undo(1 + stop)  # the state of the accepted rows alone (nothing to do when all were)
            except Exception as e:  # noqa: BLE001 - the sampler, the constraint or the text of this sequence
                sched._fail(s, e)
                continue
            if end:
                sched._end(s)
            else:
                keep.append(s)
        self.timed(sum(1 + len(d) for d in drafts), True)  # the whole step: drafts, pass, rollback, acceptance
        return keep

    def _accept(self, s, d: list[int], r: np.ndarray, p0: int) -> tuple[int, bool]:
        """Sample row by row while the samples equal the drafts. Returns (accepted drafts, ended); sets the
        sequence's logits (the row its next token comes from) and its pending token after a rejection."""
        sp, g = s.spec, s.handle.generation
        i = 0
        while i < len(d):
            if len(g.tokens) >= s.handle.request.max_tokens:
                s.logits = r[i]
                return i, True
            t, piece, end = s.sampler(r[i], SimpleNamespace(tokens=s.state.tokens, pos=p0 + 1 + i))
            s.handle._put(piece)
            if end or t != d[i]:  # (a draft equal to the token that ends the sequence was right: counted)
                s.logits = r[i]
                s.pending = None if end else t
                self._count(sp, len(d), i + (t == d[i]))
                return i, end
            i += 1
        s.logits = r[len(d)]
        self._count(sp, len(d), len(d))
        return len(d), False

    def _count(self, sp: SeqSpec, n: int, acc: int) -> None:
        if n == 0:
            return
        sp.drafted += n
        sp.accepted += acc
        self.drafted += n
        self.accepted += acc
        # a draft after a rejection is not looked at: the estimate takes acc successes in acc + 1 tries
        tries = min(acc + 1, n)
        sp.accept = ema(sp.accept, acc / tries, 0.8)
        self.record[:] = [RECORD_KEEP * self.record[0] + acc, RECORD_KEEP * self.record[1] + tries]
        sp.backoff = 0 if acc else min(MAX_BACKOFF, max(1, 2 * sp.backoff))
        sp.wait = sp.backoff
