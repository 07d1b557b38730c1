"""The public API: `Engine.load(path, backend=...)`, then logits / generate / stream."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections.abc import Iterator

import numpy as np

from ..backends import BACKENDS, make_backend  # noqa: F401  (BACKENDS: re-exported)
from ..backends.state import SpareBlocks
from ..errors import ContextLengthError, ParameterError
from ..format.gguf_model import GGUFModel
from ..models import model_args
from ..models.state_kinds import role_cache_type, with_cache_types
from .compute import Compute
from .context import choose_n_ctx, gpu_cut, room_beside
from .sampling import SamplingParams, check_int, check_stop
from .scheduler import DEFAULT_STEP_TOKENS, Handle, Request, Scheduler
from .spec import DEFAULT_DRAFT_MAX, check_spec, make_speculator
from .text import Text, boundary_points, chat_boundaries  # noqa: F401  (re-exported)
from .textstream import Generation

__all__ = ["Engine", "Generation", "model_cache_fingerprint"]

# Snapshot stride by measurement (2026-11-21). CPU prefill, Qwen3.5-0.8B-shaped Q4_K_M on 2 cores: a snapshot
# (18 MiB of recurrent state + its K/V segment) costs 16.6 ms to take = 1.6 tokens of prefill (10.7 ms/token),
# so every 256 tokens costs 0.6% of prefill and a prompt diverging between snapshots re-processes at most 255
# tokens (1.4 s on average there). GPU prefill of the 35B-A3B (0.63 ms/token under a 6 GiB budget on an H100)
# against a ~64 ms snapshot (61 MiB recurrent + K/V): one snapshot costs ~100 tokens, so the GPU default is 1024
# (~10% of prefill). None picks by backend.
DEFAULT_SNAPSHOT_STRIDE = None
CPU_SNAPSHOT_STRIDE, GPU_SNAPSHOT_STRIDE = 256, 1024


def model_cache_fingerprint(gm: GGUFModel, numeric_path: str = "", hash_dir: str | None = None,
                            hash_threads: int | None = None) -> str:
    """The key prefix-cache snapshots are filed under: the model and the numeric path of the backend that makes
    them (a snapshot restored into another path's run would print that path's answer). With `hash_dir` (a disk
    store shared by processes and models) the model is a hash of every byte of the file with its metadata
    fingerprint, computed once per file and remembered in hash_dir; without, a cache lives in this process and the
    file's identity names its content."""
    from .prefix.model_key import content_key, identity_key

    if hash_dir:
        model = content_key(gm.path, gm.fingerprint(), hash_dir, hash_threads)
    else:
        model = identity_key(gm.path, gm.fingerprint())
    return f"{model}/{numeric_path}"


def _check_load_args(n_ctx, prefill_chunk, snapshot_stride, step_tokens, max_seqs, kv_types, options: dict) -> None:
    """Refuse bad values before the model is opened (a user waits for no load to learn of a typo)."""
    if n_ctx is not None:
        check_int("n_ctx", n_ctx, 1)
    for role, name in zip("kv", kv_types, strict=True):  # before the model is opened
        role_cache_type(role, name)
    if type(max_seqs) is not int or max_seqs < 1:  # the scheduler's own words; the context choice needs it first
        raise ParameterError(f"max_seqs must be a whole number >= 1, got {max_seqs!r}")
    check_int("step_tokens", step_tokens, 1)
    check_int("prefill_chunk", prefill_chunk, 1)
    if snapshot_stride is not None:
        check_int("snapshot_stride", snapshot_stride, 0)
    if options.get("n_threads") is not None:
        from ..backends.cpu.simd_native import MAX_THREADS

        check_int("n_threads", options["n_threads"], 1, MAX_THREADS)
    if options.get("card_profile") is not None:
        from ..backends.gpu.cards import PROFILES

        if options["card_profile"] not in PROFILES:
            raise ParameterError(f"unknown card_profile {options['card_profile']!r} (known: {', '.join(PROFILES)})")
    if options.get("devices") is not None or isinstance(options.get("vram_budget"), (list, tuple)):
        from ..backends.gpu.multi_gpu import check_devices

        check_devices(options.get("devices"), options.get("vram_budget"), options.get("device"))
    if options.get("split_mode") is not None:
        from ..backends.gpu.expert_card import check_split_mode

        mode = check_split_mode(options["split_mode"])
        if options.get("devices") is None:
            raise ParameterError(f"split_mode {mode!r} splits a prefill over several cards: it needs devices=[...]")
        if mode == "expert" and options.get("micro_batch") is not None:
            raise ParameterError(f"micro_batch {options['micro_batch']!r} is the layer pipeline's; split_mode "
                                 "'expert' runs every card over the whole pass")
    if options.get("kv_stream") not in (None, True, False):
        raise ParameterError(f"kv_stream must be None, True or False, got {options['kv_stream']!r}")
    if options.get("bus_bw") is not None:
        from ..backends.gpu.pacing import check_bus_bw

        check_bus_bw(options["bus_bw"])
    if options.get("isa") is not None:
        from ..backends.cpu.simd_native import ISAS

        if options["isa"] not in ISAS:
            raise ParameterError(f"unknown isa {options['isa']!r} (known: {', '.join(ISAS)})")


def _check_cache_dir(disk_dir) -> None:
    """An existing prefix-cache folder must be one this process can list and write; one that does not exist yet
    is made when the cache opens (a failure there names it too)."""
    if disk_dir and os.path.exists(disk_dir):
        if not os.path.isdir(disk_dir):
            raise ParameterError(f"prefix cache folder {disk_dir!r} is not a directory")
        if not os.access(disk_dir, os.R_OK | os.W_OK | os.X_OK):
            raise ParameterError(f"prefix cache folder {disk_dir!r} is not readable and writable by this user")


def _make_prefix_cache(spec, gm: GGUFModel, args, backend):
    if spec is None or spec is False:
        return None
    from ..errors import SnapshotError
    from .prefix import PrefixCache, StateLayout

    layout = StateLayout.of_state(backend.new_state(1), args.n_vocab)
    npath = backend.numeric_path
    if isinstance(spec, PrefixCache):
        # a cache made elsewhere must have been made for this model and numeric path, or its snapshots are wrong
        want = model_cache_fingerprint(gm, npath, spec.disk.dir if spec.disk is not None else None)
        if spec.fingerprint != want:
            raise SnapshotError(f"the prefix cache passed is keyed {spec.fingerprint!r}, not this model and backend's "
                                f"{want!r} (make it with hybridinfer.engine.api.model_cache_fingerprint)")
        spec.use_layout(layout)
        return spec
    opts = {} if spec is True else dict(spec)
    _check_cache_dir(opts.get("disk_dir"))
    try:
        fp = model_cache_fingerprint(gm, npath, opts.get("disk_dir"))
        return PrefixCache(fp, layout.layer_types, state_layout=layout, **opts)  # the state's (MTP rows too)
    except OSError as e:
        raise ParameterError(f"prefix cache folder {opts.get('disk_dir')!r} cannot be used: {e}") from e
    except ValueError as e:  # a budget out of range (the cache's own check)
        raise ParameterError(f"prefix cache: {e}") from e


class Engine(Text, Compute):
    """A loaded model. `backend` computes; the tokenizer and chat template come from the GGUF.

    Thread-safe: one Engine may be called from many threads, and each call gets the answer it would get alone.
    Every generating call (generate, stream, submit, generate_batch) is a request on the engine's scheduler, whose
    one worker thread computes. Backends share work buffers, so every backend call and prefix-cache operation runs
    under the engine's lock (`lock`); the worker holds it for each step, and the direct calls that are not
    generation (logits, prefill, start) take it too. `close()` (or leaving `with Engine.load(...) as e:`) ends
    it."""

    def __init__(self, gm: GGUFModel, args, backend, tokenizer, n_ctx: int, progress: bool,
                 prefill_chunk: int, prefix_cache=None, snapshot_stride: int | None = DEFAULT_SNAPSHOT_STRIDE,
                 max_seqs: int = 8, state_budget: int | None = None, step_tokens: int = DEFAULT_STEP_TOKENS):
        self.gm, self.args, self.backend, self.tokenizer = gm, args, backend, tokenizer
        self.chat_template = None  # None: the GGUF's own (or ChatML where it has none)
        self.special_in_content = False  # True: message text may make control tokens (llama-server's behaviour)
        self.max_seqs, self.state_budget, self.step_tokens = max_seqs, state_budget, step_tokens
        self._scheduler = None
        self.spares = SpareBlocks(max_seqs)  # released states' buffers (Compute.new_state / release)
        self.spec = None  # speculative decoding (spec.Speculator), or None
        self.image_encoder = None  # the mmproj's vision tower (engine/image_encoder.CachedImageEncoder), or None
        self.n_ctx, self.progress, self.prefill_chunk = n_ctx, progress, prefill_chunk
        self.ctx_note = ""  # why n_ctx is less than asked for, in one line (Engine.load)
        self.lock = threading.RLock()
        if snapshot_stride is None:
            snapshot_stride = GPU_SNAPSHOT_STRIDE if backend.single_pass else CPU_SNAPSHOT_STRIDE
        self.snapshot_stride = check_int("snapshot_stride", snapshot_stride, 0)
        self.prefix_cache = _make_prefix_cache(prefix_cache, gm, args, backend)
        # an engine still open at exit is closed then (its worker stopped first): the interpreter's own teardown
        # would free a card's buffers on a thread where their context is not current (PyCUDA warns that
        # it "could not be cleaned up") and drop the prefix cache's snapshots still waiting for the disk
        self._at_exit = _closer(weakref.ref(self))
        atexit.register(self._at_exit)
        # and one dropped without close() lets go of its backend when it is collected (its worker holds it only
        # during a step): the parts live in a list the finalizer shares, emptied by close()
        self._parts = [backend, gm, self.prefix_cache]
        # not at exit: the hook above does that, stopping the worker first (finalizers would run before it, with
        # the worker perhaps mid-step)
        weakref.finalize(self, _let_go, self._parts).atexit = False

    @classmethod
    def load(cls, path: str | None = None, backend: str = "auto", *, n_ctx: int | None = None,
             progress: bool = False, prefill_chunk: int = 512, prefix_cache=None,
             snapshot_stride: int | None = DEFAULT_SNAPSHOT_STRIDE, max_seqs: int = 8,
             state_budget: int | None = None, step_tokens: int = DEFAULT_STEP_TOKENS,
             chat_template: str | None = None, special_in_content: bool = False, cache_type_k: str = "f32",
             cache_type_v: str = "f32", cache_rotate: bool = True, hf: str | None = None,
             hf_token: str | None = None, spec_type: str | None = None, draft_max: int = DEFAULT_DRAFT_MAX,
             mmproj: str | None = None, image_min_tokens: int | None = None,
             image_max_tokens: int | None = None, **options) -> Engine:
        """Open a GGUF file and make its engine. Every keyword has a default:

        path (default None: the embedded SmolLM2-135M-Instruct Q4_1, unless hf names a model).
        hf (default None): a model on the Hugging Face Hub instead of a path, as llama.cpp's -hf: "OWNER/REPO",
            "OWNER/REPO:QUANT" (a quant tag such as Q4_K_M, any case; without one Q4_K_M, else the repository's
            first GGUF) or "OWNER/REPO:FILE.gguf"; downloaded into huggingface_hub's cache unless it is there
            (format/hub.py; huggingface_hub reads HF_ENDPOINT, HF_HUB_OFFLINE, HF_HOME and HF_TOKEN itself).
            hf_token (default None: huggingface_hub's own) is the token sent.
        backend (default "auto": GPU prefill with CPU decode where a card and pycuda are present, else "cpu");
            "cpu", "gpu" (prefill on the card, decode on the CPU) or "reference" (the exact numpy oracle, slow by
            design).
        n_ctx (default None: chosen): the context of each sequence, at most the model's trained context_length.
            None takes the trained length where the state (K/V in the cache types) of max_seqs sequences that long
            fits the memory available beside the model, else the longest that fits (a multiple of 256, at least
            256; engine/context.choose_n_ctx); a GPU prefill also keeps a pass's K/V of that many tokens on the
            card, so there it is at most what fits the VRAM budget beside the least weight staging. `ctx_note` says
            in one line why n_ctx is less than asked for ("" when it is not).
        progress (default False): progress bars on stderr while the model downloads (hf), the weights are copied
            and repacked (CPU) or loaded (GPU), and long prompts prefill.
        prefill_chunk (default 512): prompt tokens per forward call on the CPU and reference backends.
        prefix_cache (default None: off): True (RAM, 2 GiB), a dict of PrefixCache options (ram_bytes, disk_dir,
            disk_bytes, block_size) or a PrefixCache; prompts then reuse their longest cached prefix.
        snapshot_stride (default None: 256 on the CPU, 1024 with GPU prefill): with a prefix cache, a snapshot
            every that many prompt tokens (0: none), besides those at the end of each prompt, before a chat's
            generation prompt, where a prompt leaves a cached one, and at the end of generation.
        max_seqs (default 8): sequences the scheduler behind `submit` and `generate_batch` decodes together.
        state_budget (default None: no limit): bytes of sequence states and K/V the scheduler holds at once.
        step_tokens (default 256): tokens one scheduler step computes: every running sequence's next token, then
            chunks of waiting prompts up to this (llama.cpp's n_batch); a long prompt holds running streams up
            by one step at a time. A GPU prefill takes every waiting prompt whole in one pass.
        chat_template (default None: the GGUF's `tokenizer.chat_template`): Jinja text used instead (as
            llama-server's --chat-template-file), checked to compile now.
        special_in_content (default False): the text of chat messages may make control tokens such as
            `<|im_start|>` (llama-server's behaviour); by default it is tokenized as text, and only the template's
            own markup makes them.
        cache_type_k (default "f32"), cache_type_v (default "f32"): the type the K and V cache rows are kept in,
            llama.cpp's -ctk / -ctv names: f32, f16, q8_0, q4_0, and this engine's rotated lm3 / lm4
            (docs/numerics.md). F32 K/V attend in llama.cpp's order without flash
            attention; any other in the order of its CPU flash attention, which reads the quantized rows directly
            (so a run compares with llama.cpp at the same types with flash attention on). Sequence states, snapshots and
            the scheduler's state budget hold the rows in these types; a prefix-cache snapshot of other types is
            a miss.
        cache_rotate (default True): quantized K/V rows (q8_0, q4_0) are Walsh-Hadamard rotated before they are
            kept, as llama.cpp does unless LLAMA_ATTN_ROT_DISABLE is set (state_kinds.kv_rotation); False keeps them
            as they are.
        spec_type (default None: "mtp" where the file has the multi-token-prediction block, else "none"),
            draft_max (default 3): "mtp" drafts up to draft_max (1-4) tokens with the block, "ngram" by prompt
            lookup, checked in one pass: the same tokens as without (engine/spec.py).
        mmproj (default None; with hf, the repository's projector beside the model, as llama.cpp's -hf; False:
            none): an mmproj GGUF (llama.cpp's --mmproj) whose vision tower becomes `image_encoder`, refused unless
            its rows are as wide as the model's embeddings (engine/image_encoder.py, docs/vision.md).
            image_min_tokens (default None: Qwen3.5's processor, 64), image_max_tokens (default None: 16384): an image
            is resized to hold that many tokens at least and at most (llama.cpp's --image-min/max-tokens).

        Backend options, each left to its backend when not given:
        CPU ("cpu", and decode under "gpu" and "auto"): isa (the widest SIMD unit this CPU has: scalar, ssse3,
            avx2, avx512vnni), n_threads (all cores), weights ("auto": a copy in huge pages when it takes at most
            half the available memory, else "mmap"; or "copy"), prefetch (4096 bytes of weight stream ahead with
            4 threads or more, else 0), numa (None: no placement; a hybridinfer.backends.numa.Plan), ram_budget
            (None: every weight in RAM; bytes: the routed experts that do not fit read from the file when selected,
            docs/architecture.md; under "gpu" and "auto" split with the GPU prefill's page-locked copies and staging,
            every card's with devices=[...], backends/ram_split.py), expert_io ("pread" or "direct": O_DIRECT),
            read_timeout (30 s), readers (8 threads; each card's own under GPU prefill), prefetch_layers (1),
            expert_counts (None; (layer, expert) -> uses: the experts pinned), drop_cache (False; True: each range
            read is dropped from the page cache).
        GPU ("gpu", "auto"): vram_budget (the card's free memory less 512 MiB), gpu_chunk (1024 tokens per kernel
            call), device (0), card_profile (None: the card itself; fermi | kepler | maxwell | pascal: kernels
            compiled and tiles chosen as for that class, the weight stream paced to its bus), bus_bw (None: the
            profile's bus; bytes/s the weight stream is paced to), kv_stream (None: a pass keeps its K/V on the card
            where they fit beside the weights, else it streams each attention layer's K/V through the card from
            the host state; True: every pass streams them, as llama.cpp's --no-kv-offload keeps them on the host),
            devices (a list such as [0, 1]: prefill over those cards, gpu/multi_gpu.py; vram_budget then one for all
            or one a device), split_mode (None or "auto": the time model's choice; "layer": a range of layers each,
            pipelined; "expert": every card on every layer, the routed experts split between them,
            gpu/expert_gpu.py), micro_batch (the layer pipeline's rows; None: the time model's choice).
        Reference: cache_weights (True), act_quant (False: float activations; True: llama.cpp's Q8 rounding).
        Unknown options raise TypeError.
        """
        from ..format.tokenizer import Tokenizer

        if hf is not None:
            if path is not None:
                raise ParameterError(f"give a path or hf, not both: {path!r} and hf={hf!r}")
            from ..format.hub import resolve_pair

            path, found = resolve_pair(hf, token=hf_token, progress=progress, mmproj=mmproj is None)
            mmproj = mmproj if found is None else found  # the projector beside it, as llama.cpp's -hf
        if path is None:
            from ..format.default_model import default_model_path

            path = default_model_path()
        _check_load_args(n_ctx, prefill_chunk, snapshot_stride, step_tokens, max_seqs, (cache_type_k, cache_type_v),
                         options)
        check_spec(spec_type, draft_max)
        gm = GGUFModel(path)
        gm.check_finite()  # a damaged file (NaN scales) is refused here, not answered with nothing
        args = with_cache_types(model_args(gm), cache_type_k, cache_type_v, cache_rotate)
        ctx = choose_n_ctx(args, max_seqs, None if n_ctx is not None else room_beside(gm.file_size), n_ctx)
        be = make_backend(backend, gm, args, options, ctx.n_ctx, fit_n_ctx=n_ctx is None, progress=progress)
        ctx = gpu_cut(ctx, getattr(be, "gpu", None))
        if options:
            raise TypeError(f"unknown Engine option(s): {', '.join(sorted(options))}")
        if progress:
            be.preload(progress=True)
        spec = make_speculator(spec_type, draft_max, args, be)  # before the prefix cache: it may add state arrays
        eng = cls(gm, args, be, Tokenizer.from_gguf(gm), ctx.n_ctx, progress, prefill_chunk, prefix_cache,
                  snapshot_stride, max_seqs, state_budget, step_tokens)
        eng.ctx_note = ctx.note
        eng.spec = spec
        if mmproj is not None and mmproj is not False:
            from .image_encoder import load_encoder

            eng.image_encoder = load_encoder(mmproj, args.n_embd, be, cache_bytes=0, min_tokens=image_min_tokens,
                                             max_tokens=image_max_tokens)  # cached once, by the ImageStore
        _ = eng.scheduler  # its limits checked now, not at the first request
        if chat_template is not None:
            from ..format.chat_template import check_template

            eng.chat_template = check_template(chat_template)
        eng.special_in_content = bool(special_in_content)
        return eng

    # compute (engine/compute.py: restore, prefill_step, prefill_whole, decode_step, snapshot, release) -----------
    def logits(self, ids) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32 for every position, from a fresh state."""
        self._open()
        ids = self._check_ids([int(i) for i in ids])
        if not ids:
            raise ParameterError("logits() needs at least one token id, got none")
        if len(ids) > self.n_ctx:
            raise ContextLengthError(f"{len(ids)} tokens exceed the context size n_ctx={self.n_ctx}")
        return self.prefill(ids, self.new_state(), all_logits=True)

    # generation -----------------------------------------------------------------------------------
    def make_request(self, prompt, max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
                     top_p: float = 0.95, seed: int | None = None, stop: list[str] | str | None = None,
                     min_p: float = 0.05, repeat_penalty: float = 1.0, presence_penalty: float = 0.0,
                     frequency_penalty: float = 0.0, enable_thinking: bool | None = None, constraint=None,
                     logprobs: int | None = None, images=None) -> Request:
        """Check a request's parameters and make its prompt into token ids (typed errors naming a bad value).

        max_tokens (default 128). Sampling: temperature (default 0.8; 0: greedy), top_k (default 40; 0: off),
        top_p (default 0.95), min_p (default 0.05), repeat_penalty (default 1.0), presence_penalty (default 0.0),
        frequency_penalty (default 0.0), seed (default None: drawn from the OS). stop (default None): a string or
        list of strings that end the reply (never emitted). enable_thinking (default None: the template's own
        choice). constraint (default None): structured output, an object with mask(logits) and accept(token)
        (scheduler.Request). logprobs (default None: off): record each generated token's log-probability and
        this many alternatives (Generation.logprobs). images (default None): images beside the prompt (bytes, paths,
        data: URLs, PIL images), also taken from chat messages' image parts (engine/images.py)."""
        from . import images as im

        prompt, sources = im.prepare(prompt, images)
        if logprobs is not None:
            check_int("logprobs", logprobs, 0)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, seed=seed)
        max_tokens = check_int("max_tokens", max_tokens, 0)
        stops = check_stop(stop)
        ids = self.encode_prompt(prompt, enable_thinking)
        boundary, spans = self._turn_boundary(prompt, ids, enable_thinking), ()
        if sources:  # each image's slot widened to its rows
            ids, spans = im.attach(self, ids, im.embed(self, sources))
            boundary = im.map_points(boundary, spans)
        if not ids:
            raise ParameterError(f"the prompt {prompt!r} gives no tokens")
        if len(ids) + max_tokens > self.n_ctx:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the context size "
                f"n_ctx={self.n_ctx}")
        return Request(ids, params, max_tokens, stops, boundary, constraint, logprobs, images=spans)

    def stream(self, prompt, max_tokens: int = 128, _result: Generation | None = None, **kw) -> Iterator[str]:
        """Yield text pieces as they are generated (stop strings are never emitted). Sampling parameters as
        `make_request` takes them. The request runs on the scheduler like any other; leaving the loop early
        cancels it. _result, when given, receives the Generation's fields at the end."""
        h = self.submit(prompt, max_tokens, **kw)
        try:
            yield from h
        finally:
            if not h.done():
                h.cancel()
            if _result is not None:
                _result.__dict__.update(vars(h.generation))

    def generate(self, prompt, max_tokens: int = 128, **kw) -> Generation:
        """The whole Generation of one request (through the scheduler, as `submit(...).result()`)."""
        return self.submit(prompt, max_tokens, **kw).result()

    # many sequences -------------------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        """The continuous-batching scheduler behind `submit` and `generate_batch` (made at first use)."""
        with self.lock:
            if self._scheduler is None:
                self._open()
                self._scheduler = Scheduler(self, self.max_seqs, self.state_budget, step_tokens=self.step_tokens)
            return self._scheduler

    def close(self) -> None:
        """Stop the scheduler's worker (every request queued or running ends with EngineClosed), write the prefix
        cache's waiting snapshots, and let go of the backend's memory. Later calls raise EngineClosed; closing
        twice is harmless."""
        atexit.unregister(self._at_exit)
        if self._scheduler is not None:
            self._scheduler.close()
        close = getattr(self.image_encoder, "close", None)  # the ImageEncoder protocol does not require one
        if close is not None:
            close()
        with self.lock:
            self.backend = None
            self.spares.trim(None)
            _let_go(self._parts)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def submit(self, prompt, max_tokens: int = 128, **kw) -> Handle:
        """Queue a request on the scheduler and return at once: iterate the Handle for text pieces as they are
        made, `result()` for the Generation, `cancel()` to stop it. Thread-safe; parameters as `make_request`."""
        return self.scheduler.submit(self.make_request(prompt, max_tokens, **kw))

    def generate_batch(self, requests, **defaults) -> list[Generation]:
        """Run many requests together (continuous batching, up to max_seqs at once) and return their Generations in
        input order. Each request is a prompt (a string, a list of chat messages or of token ids) or a dict of
        `prompt` (or `messages`) and per-request parameters, which override `defaults`. Every request is checked
        before any runs. Each result equals what `generate` gives for the same request."""
        reqs = []
        for i, r in enumerate(requests):
            kw = dict(defaults)
            if isinstance(r, dict):
                r = dict(r)
                if ("prompt" in r) == ("messages" in r):
                    raise ParameterError(f"request {i} must have exactly one of 'prompt' and 'messages': {r!r}")
                prompt = r.pop("prompt") if "prompt" in r else r.pop("messages")
                kw.update(r)
            else:
                prompt = r
            try:
                reqs.append(self.make_request(prompt, **kw))
            except TypeError as e:
                raise ParameterError(f"request {i}: {e}") from None
        handles = self.scheduler.submit_many(reqs)
        try:
            return [h.result() for h in handles]
        finally:
            for h in handles:
                if not h.done():
                    h.cancel()


def _closer(ref):
    """Engine.close of the engine behind the weak reference `ref`, if it still exists (an atexit hook that does not
    keep its engine alive)."""
    def close() -> None:
        e = ref()
        if e is not None:
            e.close()
    return close


def _let_go(parts: list) -> None:
    """Close an engine's parts (backend, GGUF file, prefix cache) once: the cache's waiting snapshots written, the
    backend's memory freed (a card's inside its context: GPUPrefillCPUDecode.close), the file unmapped."""
    if not parts:
        return
    be, gm, cache = parts
    parts.clear()
    try:
        if cache is not None:
            cache.flush()
    finally:
        be.close()
        gm.close()
