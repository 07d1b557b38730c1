"""Backend construction: reference, cpu, gpu and auto (gpu when it can run here).

The name "gpu" names the prefill device only: the card runs the prompts' forward pass and decode stays on the CPU
(GPUPrefillCPUDecode: prompts through gpu/backend.py's GPUModel, every decode step through a CPUBackend)."""

from __future__ import annotations

import warnings
from abc import ABC, abstractmethod

import numpy as np

from ..errors import BackendNotAvailableError, MTPUnavailableError, ParameterError
from .state import copy_each

BACKENDS = ("reference", "cpu", "gpu", "auto")


class Backend(ABC):
    """What the Engine needs of a compute backend. A backend is not thread-safe: the Engine serializes calls.

    single_pass: prefill is one call over the whole prompt (the GPU streams each layer's weights once), taking
    `snapshot_at` / `on_snapshot`; otherwise the Engine cuts the prompt into chunks itself.
    numeric_path: names the float operations the backend runs, so prefix-cache snapshots made by one numeric
    path are never restored into another (a restored run then equals a cold run of the same engine)."""

    single_pass = False
    last_pass: dict | None = None  # single-pass backends: the last pass's timing (wall_s, copy_s, tokens)
    recordings = 0  # steps recorded for replay so far (the first of a shape: dearer than its replays)

    @property
    @abstractmethod
    def numeric_path(self) -> str: ...

    @abstractmethod
    def new_state(self, n_ctx: int): ...

    @abstractmethod
    def forward(self, tokens, state, all_logits: bool = True, **kw):
        """Consume `tokens` from `state`; logits (T, n_vocab), or (1, n_vocab) of the last token. The array may
        be a view of the backend's buffers, valid until its next call."""

    def hidden(self, tokens, state) -> np.ndarray:
        """Consume `tokens` from `state` as forward does; the final norm's output of every token (what the head
        reads: the model's embedding of each position), (T, n_embd) float32. For Engine.embed."""
        raise NotImplementedError(f"the {type(self).__name__} backend computes no hidden states")

    def copied(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        """Copies of `arrays` (logits the caller keeps past the backend's next call, whose buffers it reuses)."""
        return [np.array(a, copy=True) for a in arrays]

    def copy_into(self, dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
        """dst[...] = src for each pair of one dtype and shape (a prefix-cache restore's state arrays)."""
        copy_each(dsts, srcs)

    keep_hidden = False  # set (by the MTP drafter) on a backend whose hidden_rows keep what its calls compute

    def hidden_rows(self, state):
        """With keep_hidden set: (first position, rows) of the final-norm output (what the head reads) that the last
        call over `state` computed (every row it ran, or the last of a prompt chunk), or None (none kept)."""
        return None

    mtp_rows = False  # set (by the MTP drafter): each new_state also holds the MTP block's rows (state_kinds.MTP_ROWS)

    def new_mtp_state(self, n_ctx: int):
        """A fresh state of the model's MTP block (its own K/V; models/graph.mtp_state_args)."""
        raise MTPUnavailableError(f"the {type(self).__name__} backend cannot run a multi-token-prediction block")

    def mtp(self, h, tokens, state, head: bool = True) -> tuple[np.ndarray | None, np.ndarray]:
        """The MTP block over T rows (models/graph.MTP): row r takes the trunk's final-norm output h[r] (what
        `hidden` returns for a position) and tokens[r] (the token after it), attends over the block's own K/V in
        `state` (new_mtp_state; advanced by T); returns (logits (T, n_vocab), the block's hidden output (T, n_embd),
        the next draft step's h), arrays that are the caller's; head False: no logits (None), the head's product
        not run."""
        raise MTPUnavailableError(f"the {type(self).__name__} backend cannot run a multi-token-prediction block")

    def mtp_write(self, h, tokens, state) -> None:
        """What `mtp` writes into `state` (the block's K/V rows of T positions), nothing returned: the drafter's
        catch-up over accepted positions reads no output. A backend may skip every product the rows do not need."""
        self.mtp(h, tokens, state, head=False)

    def preload(self, progress: bool = False) -> None:
        """Make the weights ready now (with a progress bar) instead of at first use."""
        return None  # nothing to prepare unless a backend says so

    def prefill_many(self, prompts) -> list[np.ndarray]:
        """Single-pass backends: prefill several prompts, each (ids, state, snapshot_at, on_snapshot), and return
        each one's last-token logits (1, n_vocab). This default runs one pass per prompt; the GPU prefills them in
        one pass. (The Engine chunks prompts itself for the other backends and never calls this on them.)"""
        return [np.array(self.forward(ids, st, all_logits=False, snapshot_at=at, on_snapshot=cb)[-1:], copy=True)
                for ids, st, at, cb in prompts]

    def forward_many(self, chunks) -> np.ndarray:
        """Chunking backends: one prompt chunk of each of several sequences, each (ids, state), in one pass where
        the backend can (their rows share every product, each weight read once for all); the last-token logits of
        each chunk, (n, n_vocab), an array that is the caller's. This default runs them one after another."""
        return np.stack([np.array(self.forward(ids, st, all_logits=False)[-1], copy=True) for ids, st in chunks])

    def forward_rows(self, chunks, undo: bool = False):
        """The decode path's pass over a few tokens of each of several sequences, each (ids, state) (speculative
        verify rows): every row's logits, one (len(ids), n_vocab) array per chunk, the caller's; row i equal to what
        a one-token decode step at that position gives. undo: also one state.RowsUndo per chunk, which puts its
        state back to after any number of its rows. This default runs them one token at a time."""
        from .state import RowsUndo

        out, undos = [], []
        for ids, st in chunks:
            u = RowsUndo(st, len(ids)) if undo else None
            rows = []
            for t in ids:
                rows.append(np.array(self.forward([t], st, all_logits=False)[-1], copy=True))
                if u is not None and u.saved:
                    u.snap()
            out.append(np.stack(rows))
            undos.append(u)
        return (out, undos) if undo else out

    def release(self, state) -> None:  # noqa: B027 (a no-op unless the backend keeps something per state)
        """Forget what the backend keeps for this sequence's state (recorded steps, bound calls), so that its memory
        goes as soon as its owner drops it."""

    def close(self) -> None:  # noqa: B027 (a no-op unless the backend holds more than its Python objects)
        """Let go of what the backend holds beyond its objects (thread pools, work buffers, weight copies): after
        this it computes no more."""

    def decode_batch(self, tokens, states) -> np.ndarray:
        """One token for each of several sequences: logits (B, n_vocab), row j as forward([tokens[j]], states[j])
        gives it. This default runs them one by one; a backend that reads its weights once for all overrides it."""
        return np.stack([np.array(self.forward([t], st, all_logits=False)[-1], copy=True)
                         for t, st in zip(tokens, states, strict=True)])


class GPUPrefillCPUDecode(Backend):
    """backend="gpu": prompts (at least `min_gpu_tokens` tokens) are prefilled on the GPU in one pass; decode
    (single tokens) always runs on the CPU backend. They meet only in the host DecoderState. Snapshots taken
    after GPU prefill are restored into CPU decode by design (the hand-off is this backend's own path)."""

    single_pass = True

    def __init__(self, gpu, cpu, min_gpu_tokens: int = 2):
        self.gpu, self.cpu, self.min_gpu_tokens = gpu, cpu, min_gpu_tokens

    @property
    def numeric_path(self) -> str:
        return f"gpu-prefill+{self.cpu.numeric_path}"

    def new_state(self, n_ctx: int):
        return self.cpu.new_state(n_ctx)

    def decode_batch(self, tokens, states) -> np.ndarray:
        return self.cpu.decode_batch(tokens, states)

    @property
    def keep_hidden(self) -> bool:
        return self.cpu.keep_hidden

    @keep_hidden.setter
    def keep_hidden(self, on: bool) -> None:
        self.cpu.keep_hidden = on
        # a prompt pass's rows come down to the CPU's kept rows, where decode (and the MTP block) reads them
        self.gpu.hidden_to = self.cpu.keep_rows if on else None

    @property
    def mtp_rows(self) -> bool:
        return self.cpu.mtp_rows

    @mtp_rows.setter
    def mtp_rows(self, on: bool) -> None:
        self.cpu.mtp_rows = on

    def hidden_rows(self, state):
        # a GPU prompt pass hands its rows down to the CPU's (keep_hidden), so they are the state's latest rows too
        # (rows past the position, a rejected verify's, are never read: the drafter reads positions < pos)
        return self.cpu.hidden_rows(state)

    def new_mtp_state(self, n_ctx: int):
        return self.cpu.new_mtp_state(n_ctx)

    def mtp(self, h, tokens, state, head: bool = True):
        """The MTP block runs where decode does: on the CPU model (drafting is decode work)."""
        return self.cpu.mtp(h, tokens, state, head)

    def mtp_write(self, h, tokens, state) -> None:
        self.cpu.mtp_write(h, tokens, state)

    def copied(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return self.cpu.copied(arrays)

    def copy_into(self, dsts: list[np.ndarray], srcs: list[np.ndarray]) -> None:
        self.cpu.copy_into(dsts, srcs)

    def forward_rows(self, chunks, undo: bool = False):
        return self.cpu.forward_rows(chunks, undo)  # verify rows are decode work: the CPU's, as every decode step

    @property
    def last_pass(self) -> dict | None:
        return getattr(self.gpu, "last_timing", None)

    @property
    def recordings(self) -> int:
        return self.cpu.recordings  # decode and verify steps are recorded where they run

    def release(self, state) -> None:
        self.cpu.release(state)

    def close(self) -> None:
        self.cpu.close()
        gpu, self.gpu = self.gpu, None
        if gpu is None:
            return
        from .gpu import loader

        if loader._ctx is None:  # no card context was ever made (a device stand-in): nothing of CUDA's to free
            if hasattr(gpu, "close"):
                gpu.close()
            return
        # the card's buffers were made on the scheduler's worker thread: PyCUDA frees them only where the context
        # is current, so they go here, inside it, and not at a later collection on whichever thread runs it
        with loader.on_this_thread():
            if hasattr(gpu, "close"):
                gpu.close()
            del gpu

    def prefill_many(self, prompts) -> list[np.ndarray]:
        """(ids, state, snapshot_at, on_snapshot) each: all in one streamed GPU pass where the buffers allow (each
        layer's weights cross the bus once for all); each prompt's last-token logits (1, n_vocab)."""
        if all(len(p[0]) >= self.min_gpu_tokens for p in prompts):
            if hasattr(self.gpu, "forward_many"):  # several cards (gpu/multi_gpu.py)
                return self.gpu.forward_many(prompts)
            from .gpu.multi import forward_many

            return forward_many(self.gpu, prompts)
        return super().prefill_many(prompts)

    def hidden(self, tokens, state) -> np.ndarray:
        # embeddings are computed by the CPU backend (the card's walk ends in the head), in CPU decode's numerics
        return self.cpu.hidden(tokens, state)

    def forward(self, tokens, state, all_logits: bool = True, snapshot_at=(), on_snapshot=None):
        if len(tokens) >= self.min_gpu_tokens:
            return self.gpu.forward(tokens, state, all_logits=all_logits, snapshot_at=snapshot_at,
                                    on_snapshot=on_snapshot)
        return self.cpu.forward(tokens, state, all_logits=all_logits)


_warned = False


def make_backend(name: str, gm, args, options: dict, n_ctx: int, fit_n_ctx: bool = False, progress: bool = False):
    """The compute backend `name` for a loaded GGUF; pops the options it uses from `options`. fit_n_ctx: a GPU
    prefill may take fewer than n_ctx tokens a pass, as many as fit its VRAM budget (its n_ctx says). progress:
    a bar while the CPU backend copies (and repacks) the weights and while a card's weights are uploaded or staged."""
    global _warned
    if name not in BACKENDS:
        raise BackendNotAvailableError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    gpu_opts = {k: options.pop(k) for k in ("vram_budget", "gpu_chunk", "device", "card_profile", "bus_bw",
                                                   "kv_stream", "devices", "micro_batch", "split_mode")
                if k in options}
    placement = options.pop("numa", None)
    if placement is not None and not hasattr(placement, "mode"):
        raise ParameterError(f"numa must be a hybridinfer.backends.numa.Plan (numa.plan(...)) or None, "
                             f"got {placement!r}")
    from .cpu.expert_setup import ExpertOptions

    experts = ExpertOptions.of(options)
    if experts is not None and name == "reference":
        raise ParameterError("ram_budget is an option of the cpu and gpu backends (backend='reference')")
    if name == "reference":
        if placement is not None and placement.mode == "replicate":
            raise ParameterError("numa replicate: the reference backend has no per-node weight copies (use the cpu "
                                 "backend)")
        from .reference import ReferenceModel

        return ReferenceModel(gm, args, cache_weights=options.pop("cache_weights", True),
                              act_quant=options.pop("act_quant", False))
    from .cpu.backend import CPUModel
    from .cpu.simd import SimdLib

    simd = SimdLib(isa=options.pop("isa", None), n_threads=options.pop("n_threads", None),
                   prefetch=options.pop("prefetch", None))
    weights = options.pop("weights", "auto")

    def make_cpu(opts):
        return CPUModel(gm, args, simd, weights=weights, numa=placement, progress=progress, experts=opts)

    if name == "cpu":
        return make_cpu(experts)
    cpu = make_cpu(None) if experts is None else None  # under a budget the GPU's share is known first
    disk = None
    if experts is not None:  # the routed experts a card does not pin are read from the file on every pass
        from .gpu.disk_stage import DiskSource

        disk = DiskSource(str(gm.path), experts.expert_io, experts.readers, experts.read_timeout, experts.drop_cache)
    on_disk = {"disk": disk} if disk is not None else {}
    try:
        from .gpu.backend import DEFAULT_CHUNK, GPUModel

        if gpu_opts.get("devices") is not None:  # prefill over several cards: layer ranges or expert shares
            from .gpu.multi_gpu import open_cards

            gpu = open_cards(gm, args, n_ctx, gpu_opts["devices"], split_mode=gpu_opts.get("split_mode"),
                             vram_budget=gpu_opts.get("vram_budget"), chunk=gpu_opts.get("gpu_chunk", DEFAULT_CHUNK),
                             card_profile=gpu_opts.get("card_profile"), bus_bw=gpu_opts.get("bus_bw"),
                             fit_n_ctx=fit_n_ctx, kv_stream=gpu_opts.get("kv_stream"),
                             micro_batch=gpu_opts.get("micro_batch"), **on_disk)
        else:
            gpu = GPUModel(gm, args, n_ctx, vram_budget=gpu_opts.get("vram_budget"),
                           chunk=gpu_opts.get("gpu_chunk", DEFAULT_CHUNK), device=gpu_opts.get("device", 0),
                           card_profile=gpu_opts.get("card_profile"), bus_bw=gpu_opts.get("bus_bw"),
                           fit_n_ctx=fit_n_ctx, kv_stream=gpu_opts.get("kv_stream"), progress=progress,
                           **on_disk)
    except BackendNotAvailableError as e:
        if name == "gpu":
            raise
        if not _warned:
            warnings.warn(f"backend='auto': no usable GPU ({e}); prefill runs on the CPU", stacklevel=3)
            _warned = True
        return cpu if cpu is not None else make_cpu(experts)
    if cpu is not None:
        return GPUPrefillCPUDecode(gpu, cpu)
    try:
        cpu = _split_ram(gm, gpu, experts, make_cpu)
    except BaseException:
        GPUPrefillCPUDecode(gpu, _Closed()).close()  # the card's buffers and the reader go
        raise
    return GPUPrefillCPUDecode(gpu, cpu)


class _Closed:
    def close(self) -> None:
        pass


def _split_ram(gm, gpu, experts, make_cpu):
    """GPU prefill and CPU decode under one RAM budget (ram_split.py): the CPU backend plans under what the GPU's
    streamer leaves (every card's streamer, with several: gpu.host_need() is then one GpuHost a card), then the GPU
    keeps host copies of the cold experts of the layers the rest holds. The CPU backend, made; gpu.ram_split says the
    split."""
    from dataclasses import replace

    from ..errors import RamBudgetError
    from .cpu.expert_store import unmap
    from .ram_split import cpu_share, refuse, split_cards, split_ram

    budget, need = experts.ram_budget, gpu.host_need()
    try:
        cpu = make_cpu(replace(experts, ram_budget=cpu_share(budget, need)))
    except RamBudgetError as e:
        raise refuse(e, budget, need) from None
    try:
        split = split_cards if isinstance(need, tuple) else split_ram
        gpu.ram_split = split(budget, need, cpu.ram_plan.resident_bytes)
        gpu.hold(gpu.ram_split.held)
    except BaseException:
        cpu.close()
        raise
    gpu.tok_embd = cpu.tok_embd  # the CPU's copy (a budget keeps it in RAM): the file's mapping is not read for it
    unmap(gm)  # the pages the card's uploads and the host copies touched leave this process's memory
    return cpu
