"""The public API: `Engine.load(path, backend=...)`, then logits / generate / stream."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from .backends import BACKENDS, make_backend  # noqa: F401  (BACKENDS: re-exported)
from .errors import ContextLengthError, HybridInferError
from .gguf_model import GGUFModel
from .models import model_args
from .sampling import SamplingParams
from .state import DecoderState

# Snapshot stride by measurement (2026-11-21). CPU prefill, Qwen3.5-0.8B-shaped Q4_K_M on 2 cores: a snapshot
# (18 MiB of recurrent state + its K/V segment) costs 16.6 ms to take = 1.6 tokens of prefill (10.7 ms/token),
# so every 256 tokens costs 0.6% of prefill and a prompt diverging between snapshots re-processes at most 255
# tokens (1.4 s on average there). GPU prefill of the 35B-A3B (0.63 ms/token under a 6 GiB budget on an H100)
# against a ~64 ms snapshot (61 MiB recurrent + K/V): one snapshot costs ~100 tokens, so the GPU default is 1024
# (~10% of prefill). None picks by backend.
DEFAULT_SNAPSHOT_STRIDE = None
CPU_SNAPSHOT_STRIDE, GPU_SNAPSHOT_STRIDE = 256, 1024


def model_cache_fingerprint(gm: GGUFModel) -> str:
    """The GGUF's metadata/layout fingerprint plus a sample of tensor data, so two files of one layout but
    different weights (random models of one shape) never share snapshots."""
    import hashlib

    h = hashlib.sha256(gm.fingerprint().encode())
    for t in list(gm.tensors.values())[:: max(1, len(gm.tensors) // 8)]:
        h.update(np.asarray(t.raw()[:4096]).tobytes())
    return h.hexdigest()[:32]


def _make_prefix_cache(spec, gm: GGUFModel, args):
    if spec is None or spec is False:
        return None
    from .prefix import PrefixCache

    if isinstance(spec, PrefixCache):
        return spec
    opts = {} if spec is True else dict(spec)
    return PrefixCache(model_cache_fingerprint(gm), tuple(args.layer_types), **opts)


@dataclass
class Generation:
    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (EOS or a stop string) | "length"
    timings: dict = field(default_factory=dict)


class Engine:
    """A loaded model. `backend` computes; the tokenizer and chat template come from the GGUF."""

    def __init__(self, gm: GGUFModel, args, backend, tokenizer, n_ctx: int, progress: bool,
                 prefill_chunk: int, prefix_cache=None, snapshot_stride: int | None = DEFAULT_SNAPSHOT_STRIDE):
        self.gm, self.args, self.backend, self.tokenizer = gm, args, backend, tokenizer
        self.n_ctx, self.progress, self.prefill_chunk = n_ctx, progress, prefill_chunk
        if snapshot_stride is None:
            snapshot_stride = GPU_SNAPSHOT_STRIDE if getattr(backend, "single_pass", False) else CPU_SNAPSHOT_STRIDE
        if snapshot_stride < 0:
            raise ValueError(f"snapshot_stride must be >= 0 (0: no stride snapshots), got {snapshot_stride}")
        self.snapshot_stride = snapshot_stride
        self.prefix_cache = _make_prefix_cache(prefix_cache, gm, args)

    @classmethod
    def load(cls, path: str | None = None, backend: str = "reference", *, n_ctx: int = 4096,
             progress: bool = False, prefill_chunk: int = 512, prefix_cache=None,
             snapshot_stride: int | None = DEFAULT_SNAPSHOT_STRIDE, **options) -> Engine:
        """Open a GGUF (default: the embedded SmolLM2-135M-Instruct) on `backend`.

        n_ctx caps the context (at most the model's trained context_length); prefill_chunk is the number
        of prompt tokens processed per forward call. prefix_cache: None (off), True (RAM, 2 GiB), a dict of
        PrefixCache options (ram_bytes, disk_dir, disk_bytes, block_size) or a PrefixCache; prompts then reuse
        the longest cached prefix, and snapshots are taken every `snapshot_stride` prompt tokens (None: 256
        on the CPU, 1024 with GPU prefill), at the end of each prompt, before a chat's generation prompt,
        where a prompt leaves a cached one, and at the end of generation. Unknown options raise TypeError.
        """
        from .tokenizer import Tokenizer

        if path is None:
            from .default_model import default_model_path

            path = default_model_path()
        gm = GGUFModel(path)
        args = model_args(gm)
        n_ctx = int(min(n_ctx, args.context_length))
        be = make_backend(backend, gm, args, options, n_ctx)
        if options:
            raise TypeError(f"unknown Engine option(s): {', '.join(sorted(options))}")
        if progress and hasattr(be, "preload"):
            be.preload(progress=True)
        return cls(gm, args, be, Tokenizer.from_gguf(gm), n_ctx, progress, prefill_chunk, prefix_cache,
                   snapshot_stride)

    # tokens ---------------------------------------------------------------------------------------
    def _tok(self):
        if self.tokenizer is None:
            raise HybridInferError(f"{self.gm.path!r} has no vocabulary; pass token ids instead of text")
        return self.tokenizer

    def tokenize(self, text: str, add_bos: bool | None = None, parse_special: bool = True) -> list[int]:
        return self._tok().encode(text, add_bos=add_bos, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self._tok().decode([int(i) for i in ids])

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True,
                    enable_thinking: bool | None = None, tools=None) -> str:
        from .chat_template import default_template, render_chat

        tok = self._tok()
        template = self.gm.meta("tokenizer.chat_template", None) or default_template()
        return render_chat(template, messages, add_generation_prompt=add_generation_prompt,
                           bos_token=tok.token_text(tok.bos_id) if tok.bos_id is not None else "",
                           eos_token=tok.token_text(tok.eos_id) if tok.eos_id is not None else "",
                           enable_thinking=enable_thinking, tools=tools)

    def encode_prompt(self, prompt, enable_thinking: bool | None = None) -> list[int]:
        """A str is completed raw; a list of {role, content} messages is chat-templated; a list of ints
        is taken as token ids."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if isinstance(prompt, list | tuple) and all(isinstance(t, int | np.integer) for t in prompt):
            return [int(t) for t in prompt]
        if isinstance(prompt, list | tuple) and all(isinstance(m, dict) for m in prompt):
            return self._encode_chat(prompt, enable_thinking)
        raise TypeError(f"prompt must be a str, a list of messages or a list of token ids, not "
                        f"{type(prompt).__name__}")

    def _encode_chat(self, messages, enable_thinking, add_generation_prompt: bool = True) -> list[int]:
        text = self.chat_prompt(list(messages), add_generation_prompt=add_generation_prompt,
                                enable_thinking=enable_thinking)
        tok = self._tok()
        bos_text = tok.token_text(tok.bos_id) if tok.bos_id is not None else None
        return self.tokenize(text, add_bos=False if bos_text and text.startswith(bos_text) else None)

    def _turn_boundary(self, prompt, ids: list[int], enable_thinking) -> int | None:
        """For a chat prompt: the token position where the generation prompt starts (the history before it
        is the next turn's prefix), when the history's tokens are a prefix of `ids`."""
        if not (isinstance(prompt, list | tuple) and prompt and all(isinstance(m, dict) for m in prompt)):
            return None
        hist = self._encode_chat(prompt, enable_thinking, add_generation_prompt=False)
        return len(hist) if 0 < len(hist) < len(ids) and ids[: len(hist)] == hist else None

    # compute --------------------------------------------------------------------------------------
    def new_state(self) -> DecoderState:
        return self.backend.new_state(self.n_ctx)

    def prefill(self, ids: list[int], state: DecoderState, all_logits: bool = False,
                snapshot_at=(), on_snapshot=None) -> np.ndarray:
        """Feed prompt tokens in chunks; returns logits of every token (all_logits) or of the last.

        snapshot_at: absolute positions (state.pos < p <= state.pos + len(ids)) where the state is handed to
        on_snapshot(state, last_logits) as prefill passes them: chunks end there, so no second pass."""
        state.check_room(len(ids))
        p0 = state.pos
        if getattr(self.backend, "single_pass", False):  # the GPU: one pass, chunking inside each layer
            lg = self.backend.forward(ids, state, all_logits=all_logits, snapshot_at=snapshot_at,
                                      on_snapshot=on_snapshot)
            if on_snapshot is not None and state.pos in set(snapshot_at):
                on_snapshot(state, lg[-1])
            return lg
        cuts = set(range(self.prefill_chunk, len(ids), self.prefill_chunk)) | {len(ids)}
        cuts |= {p - p0 for p in snapshot_at if p0 < p <= p0 + len(ids)}
        bounds = sorted(cuts)
        it = zip([0] + bounds[:-1], bounds, strict=True)
        if self.progress and len(ids) > self.prefill_chunk:
            from tqdm import tqdm

            it = tqdm(it, total=len(bounds), desc="prefill", unit="chunk", leave=False)
        outs, snaps = [], set(snapshot_at)
        for a, b in it:
            lg = self.backend.forward(ids[a:b], state, all_logits=all_logits)
            outs.append(lg.copy() if all_logits else lg)  # a backend may return a view of its buffers
            if on_snapshot is not None and p0 + b in snaps:
                on_snapshot(state, lg[-1])
        return np.concatenate(outs, axis=0) if all_logits else outs[-1]

    def start(self, ids: list[int], state: DecoderState, turn_boundary: int | None = None) -> tuple[np.ndarray, dict]:
        """Bring a fresh `state` to the end of `ids` and return (last-token logits, stats), reusing the longest
        cached prefix and taking snapshots on the way when a prefix cache is on. Their disk copies (with a disk
        store) wait for `prefix_cache.flush()`, which `stream` calls once the answer is out."""
        t0 = time.perf_counter()
        stats = {"prompt_tokens": len(ids), "reused_tokens": 0, "restore_s": 0.0}
        cache = self.prefix_cache
        if cache is None:
            lg = self.prefill(ids, state)[-1]
            stats["prefilled_tokens"] = len(ids)
            return lg, stats
        state.check_room(len(ids))
        hit = cache.lookup(ids, max_pos=len(ids))
        if hit is not None and hit.pos == len(ids) and not hit.has_logits:
            hit = cache.lookup(ids, max_pos=len(ids) - 1)
        lg = None
        if hit is not None:
            lg = cache.restore(hit, state)
            stats["reused_tokens"] = hit.pos
            stats["restore_s"] = time.perf_counter() - t0
        n = len(ids)
        stats["prefilled_tokens"] = n - state.pos
        if state.pos < n:
            stride = self.snapshot_stride
            at = set(range(stride, n, stride)) if stride else set()
            if turn_boundary is not None:
                at.add(turn_boundary)
            shared = cache.known_prefix(ids)  # where this prompt leaves a cached one: the next may share it too
            if state.pos < shared < n:
                at.add(shared)
            at.add(n)
            lg = self.prefill(ids[state.pos :], state, snapshot_at=sorted(at),
                              on_snapshot=lambda st, last: cache.save(st, last if st.pos == n else None,
                                                                      defer_disk=True))
            lg = lg[-1]
        return lg, stats

    def logits(self, ids) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32 for every position, from a fresh state."""
        ids = [int(i) for i in ids]
        if not ids:
            raise ValueError("logits() needs at least one token id")
        if len(ids) > self.n_ctx:
            raise ContextLengthError(f"{len(ids)} tokens exceed the context size n_ctx={self.n_ctx}")
        return self.prefill(ids, self.new_state(), all_logits=True)

    # generation -----------------------------------------------------------------------------------
    def stream(self, prompt, max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40,
               top_p: float = 0.95, seed: int | None = None, stop: list[str] | str | None = None,
               min_p: float = 0.05, repeat_penalty: float = 1.0, enable_thinking: bool | None = None,
               _result: Generation | None = None) -> Iterator[str]:
        """Yield text pieces as they are generated (stop strings are never emitted)."""
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed)
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        ids = self.encode_prompt(prompt, enable_thinking)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + max_tokens > self.n_ctx:
            raise ContextLengthError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceeds the context size "
                f"n_ctx={self.n_ctx}")
        res = _result if _result is not None else Generation("", [], len(ids), "length")
        res.prompt_tokens = len(ids)
        t0 = time.perf_counter()
        state = self.new_state()
        logits, cstats = self.start(ids, state, self._turn_boundary(prompt, ids, enable_thinking))
        t1 = time.perf_counter()
        # numba sampler (tested against sampling.Sampler): scratch made once, no per-token float64 copy or sort
        from .cpu.sampling_nb import SampleScratch, rng_new, sample

        scratch, rng = SampleScratch(logits.shape[-1]), rng_new(params.seed)
        tok = self._tok()
        dec = tok.stream_decoder()
        text, emitted = "", 0
        hold = max((len(s) for s in stops), default=0)
        for _ in range(max_tokens):
            t = int(sample(logits, params.temperature, params.top_k, params.top_p, params.min_p,
                           params.repeat_penalty, params.presence_penalty, state.tokens, state.pos,
                           params.repeat_last_n, rng, scratch.xs, scratch.idx))
            if t in tok.stop_ids:
                res.finish_reason = "stop"
                break
            res.tokens.append(t)
            text += dec.feed(t)
            cut = min((text.find(s) for s in stops if s in text), default=-1)
            if cut >= 0:
                text = text[:cut]
                res.finish_reason = "stop"
                break
            safe = len(text) - hold if hold else len(text)
            if safe > emitted:
                yield text[emitted:safe]
                emitted = safe
            if len(res.tokens) == max_tokens:
                break
            logits = self.backend.forward([t], state, all_logits=False)[-1]  # valid until the next call
        if res.finish_reason == "length":
            text += dec.flush()  # bytes of a character cut off by the token limit
        if len(text) > emitted:
            yield text[emitted:]
        if self.prefix_cache is not None:
            if state.pos > len(ids):  # end of generation: the next turn starts from the reply
                self.prefix_cache.save(state, logits, defer_disk=True)
            self.prefix_cache.flush()  # disk copies, after the answer (not in the time to first token)
        t2 = time.perf_counter()
        res.text = text
        n = max(len(res.tokens), 1)
        res.timings = {**cstats, "prefill_s": t1 - t0, "decode_s": t2 - t1, "prompt_tok_per_s": len(ids) / (t1 - t0),
                       "decode_tok_per_s": n / (t2 - t1) if t2 > t1 else 0.0}

    def generate(self, prompt, max_tokens: int = 128, **kw) -> Generation:
        res = Generation("", [], 0, "length")
        for _ in self.stream(prompt, max_tokens, _result=res, **kw):
            pass
        return res
