"""The context length an engine is made with when none is given (Engine.load's n_ctx=None). choose_n_ctx is pure
arithmetic over the state the mixer kinds declare (tested without hardware); room_beside measures the memory it is
given, and gpu_cut takes what a GPU prefill's VRAM budget left of it."""

from __future__ import annotations

from dataclasses import dataclass

from ..models.state_kinds import cache_types, state_bytes

CTX_STEP = 256  # a chosen length below the trained one is a multiple of this (as llama.cpp pads its context)
MIN_CTX = 256  # below this no chat template and prompt fit anyway: the least chosen, fitting or not


@dataclass(frozen=True)
class ContextChoice:
    """n_ctx, and one line saying why it is less than asked for ("" when it is what was asked for)."""

    n_ctx: int
    note: str = ""


def size_text(n: int) -> str:
    """Bytes in the largest binary unit below them, one decimal (for the one-line notes)."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n / unit:.1f} {name}"
    return f"{n} B"


def longest_fitting(fixed: int, per_token: int, room: int) -> int:
    """The most tokens n with fixed + per_token * n <= room (state_bytes is affine in the tokens: the recurrent
    arrays, then one row per token of each per-token array); 0 where not even the fixed part fits."""
    if room < fixed:
        return 0
    return (room - fixed) // per_token if per_token else 1 << 62


def choose_n_ctx(args, max_seqs: int, available_bytes: int | None, requested: int | None = None) -> ContextChoice:
    """The context of each sequence for a model of `args` (its cache types counted): `requested`, at most the
    model's trained args.context_length; or, with none requested, the trained length where the state of `max_seqs`
    sequences at that length fits `available_bytes` (None: unknown, taken to fit), else the longest that fits, a
    multiple of CTX_STEP and at least MIN_CTX (or the trained length where that is less)."""
    trained = int(args.context_length)
    if requested is not None:
        n = min(int(requested), trained)
        return ContextChoice(n, "" if n == requested else
                             f"n_ctx {n}: the {requested} asked for is beyond the model's trained context")
    need = max_seqs * state_bytes(args, trained)
    if available_bytes is None or need <= available_bytes:
        return ContextChoice(trained)
    fixed = max_seqs * state_bytes(args, 0)
    per = max_seqs * state_bytes(args, 1) - fixed
    n = longest_fitting(fixed, per, int(available_bytes)) // CTX_STEP * CTX_STEP
    n = min(max(n, MIN_CTX), trained)
    k, v = cache_types(args)
    why = (f"the state of {max_seqs} sequences (max_seqs) at the trained {trained} tokens would take "
           f"{size_text(need)} ({k}/{v} K/V), more than the {size_text(max(0, available_bytes))} of memory available")
    fits = max_seqs * state_bytes(args, n) <= available_bytes
    return ContextChoice(n, f"n_ctx {n}: {why}" + ("" if fits else "; even this does not fit"))


def gpu_cut(ctx: ContextChoice, gpu) -> ContextChoice:
    """The choice as a GPU prefill left it (gpu: its backend, or None): the card holds a pass's hidden rows and its
    K/V (every layer's, or one layer's at a time where they stream), so GPUModel(fit_n_ctx=True) may have taken
    fewer tokens to fit its VRAM budget."""
    n = getattr(gpu, "n_ctx", None)
    if type(n) is not int or n >= ctx.n_ctx:
        return ctx
    return ContextChoice(n, f"n_ctx {n}: a GPU prefill of a longer context would not fit its K/V (streamed one "
                            f"attention layer at a time) and hidden rows in the VRAM budget of "
                            f"{size_text(gpu.vram_budget)} beside the least weight staging")


def room_beside(model_bytes: int) -> int | None:
    """Memory available for sequence states: what the OS calls available (MemAvailable) less the model file, which
    the weights take either way (copied, or held in the page cache a mapping reads); None where unknown."""
    from ..backends.cpu.weights import mem_available

    avail = mem_available()
    return None if avail is None else max(0, avail - int(model_bytes))
