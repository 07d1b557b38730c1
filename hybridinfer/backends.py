"""Backend construction: reference, cpu, gpu (GPU prefill + CPU decode) and auto (gpu when it can run here)."""

from __future__ import annotations

import warnings

from .errors import BackendNotAvailableError

BACKENDS = ("reference", "cpu", "gpu", "auto")


class GPUPrefillCPUDecode:
    """Prompts (more than `min_gpu_tokens` tokens) go through the GPU backend in one pass; single tokens
    (decode) through the CPU backend. They meet only in the host DecoderState."""

    single_pass = True

    def __init__(self, gpu, cpu, min_gpu_tokens: int = 2):
        self.gpu, self.cpu, self.min_gpu_tokens = gpu, cpu, min_gpu_tokens

    def new_state(self, n_ctx: int):
        return self.cpu.new_state(n_ctx)

    def forward(self, tokens, state, all_logits: bool = True, snapshot_at=(), on_snapshot=None):
        if len(tokens) >= self.min_gpu_tokens:
            return self.gpu.forward(tokens, state, all_logits=all_logits, snapshot_at=snapshot_at,
                                    on_snapshot=on_snapshot)
        return self.cpu.forward(tokens, state, all_logits=all_logits)


_warned = False


def make_backend(name: str, gm, args, options: dict, n_ctx: int):
    """The compute backend `name` for a loaded GGUF; pops the options it uses from `options`."""
    global _warned
    if name not in BACKENDS:
        raise BackendNotAvailableError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")
    gpu_opts = {k: options.pop(k) for k in ("vram_budget", "gpu_chunk", "device") if k in options}
    if name == "reference":
        from .reference import ReferenceModel

        return ReferenceModel(gm, args, cache_weights=options.pop("cache_weights", True),
                              act_quant=options.pop("act_quant", False), kv_f16=options.pop("kv_f16", False))
    from .cpu.backend import CPUModel
    from .cpu.simd import SimdLib

    simd = SimdLib(isa=options.pop("isa", None), n_threads=options.pop("n_threads", None),
                   prefetch=options.pop("prefetch", None))
    cpu = CPUModel(gm, args, simd, weights=options.pop("weights", "auto"))
    if name == "cpu":
        return cpu
    try:
        from .gpu.backend import DEFAULT_CHUNK, GPUModel

        gpu = GPUModel(gm, args, n_ctx, vram_budget=gpu_opts.get("vram_budget"),
                       chunk=gpu_opts.get("gpu_chunk", DEFAULT_CHUNK), device=gpu_opts.get("device", 0))
    except BackendNotAvailableError as e:
        if name == "gpu":
            raise
        if not _warned:
            warnings.warn(f"backend='auto': no usable GPU ({e}); prefill runs on the CPU", stacklevel=3)
            _warned = True
        return cpu
    return GPUPrefillCPUDecode(gpu, cpu)
