"""llama.cpp's vision encoder (libmtmd, through llama-cpp-python's `llama_cpp.mtmd_cpp`) on an mmproj GGUF: the
oracle of tests/test_vision_tower.py and the comparison of `hybridinfer bench vision`.

mtmd preprocesses the image itself (its own bicubic resize to multiples of patch·merge, within its token limits,
here set to the image's own count so a size already a multiple is not resized) and returns the projector's rows.
Flash attention is off: on it casts K and V to F16."""

from __future__ import annotations

import ctypes

import numpy as np


class MtmdEncoder:
    def __init__(self, mmproj: str, text_model: str, n_threads: int = 2, min_tokens: int = -1, max_tokens: int = -1):
        import llama_cpp
        from llama_cpp import mtmd_cpp as m

        self.llama_cpp, self.m = llama_cpp, m
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(text_model.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {text_model!r}")
        cp = m.mtmd_context_params_default()
        cp.use_gpu, cp.n_threads, cp.print_timings, cp.warmup = False, int(n_threads), False, False
        cp.flash_attn_type = 0  # LLAMA_FLASH_ATTN_TYPE_DISABLED
        cp.image_min_tokens, cp.image_max_tokens = int(min_tokens), int(max_tokens)
        self.ctx = m.mtmd_init_from_file(mmproj.encode(), self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"libmtmd could not load {mmproj!r}")
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))

    def encode_rgb(self, rgb: np.ndarray) -> np.ndarray:
        """An [H, W, 3] uint8 image -> the projector's rows [n_tokens, n_embd] (float32, a copy)."""
        m = self.m
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        h, w, _ = rgb.shape
        bmp = m.mtmd_bitmap_init(w, h, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = m.mtmd_input_chunks_init()
        try:
            text = m.mtmd_input_text(m.mtmd_default_marker(), len(m.mtmd_default_marker()), False, False)
            arr = (m.mtmd_bitmap_p_ctypes * 1)(bmp)
            rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(text), arr, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize failed ({rc})")
            for i in range(m.mtmd_input_chunks_size(chunks)):
                ch = m.mtmd_input_chunks_get(chunks, i)
                if m.mtmd_input_chunk_get_type(ch) != m.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    continue
                n = int(m.mtmd_input_chunk_get_n_tokens(ch))
                if m.mtmd_encode_chunk(self.ctx, ch) != 0:
                    raise RuntimeError("mtmd_encode_chunk failed")
                ptr = m.mtmd_get_output_embd(self.ctx)
                return np.ctypeslib.as_array(ptr, shape=(n * self.n_embd,)).reshape(n, self.n_embd).copy()
            raise RuntimeError("mtmd made no image chunk")
        finally:
            m.mtmd_input_chunks_free(chunks)
            m.mtmd_bitmap_free(bmp)

    def close(self) -> None:
        if self.ctx:
            self.m.mtmd_free(self.ctx)
            self.ctx = None
        if self.model:
            self.llama_cpp.llama_model_free(self.model)
            self.model = None
