"""llama.cpp's vision encoder (libmtmd, through llama-cpp-python's `llama_cpp.mtmd_cpp`) on an mmproj GGUF: the
oracle of tests/test_vision_tower.py and the comparison of `hybridinfer bench vision`.

mtmd preprocesses the image itself (its own bicubic resize to multiples of patch·merge, within its token limits,
here set to the image's own count so a size already a multiple is not resized) and returns the projector's rows.
Flash attention is off: on it casts K and V to F16. `capture` names graph tensors (clip.cpp's names, e.g.
"patch_bias", "ffn_gelu-0") whose F32 values an encode keeps in `captured`, through ggml's eval callback: how
tests/test_vision_tower.py attributes the tower's difference from this engine's to llama.cpp's F16 roundings."""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import subprocess

import numpy as np

from ...errors import ParameterError


class _GgmlTensor(ctypes.Structure):
    """ggml.h's `struct ggml_tensor` (GGML_MAX_DIMS 4, GGML_MAX_OP_PARAMS 64, GGML_MAX_SRC 10, GGML_MAX_NAME 64)."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


class MtmdEncoder:
    def __init__(self, mmproj: str, text_model: str, n_threads: int = 2, min_tokens: int = -1, max_tokens: int = -1,
                 capture=()):
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
        self.capture, self.captured = frozenset(capture), {}
        if self.capture:  # the callback object must outlive the context
            self._observer = cp.cb_eval = llama_cpp.ggml_backend_sched_eval_callback(self._observe)
        self.ctx = m.mtmd_init_from_file(mmproj.encode(), self.model, cp)
        if not self.ctx:
            llama_cpp.llama_model_free(self.model)
            raise RuntimeError(f"libmtmd could not load {mmproj!r}")
        self.n_embd = int(llama_cpp.llama_model_n_embd(self.model))

    def _observe(self, tensor, ask, _user) -> bool:
        t = ctypes.cast(tensor, ctypes.POINTER(_GgmlTensor)).contents
        name = t.name.decode(errors="replace")
        if ask:
            return name in self.capture
        ne, n = [int(x) for x in t.ne], 1
        contiguous = True
        for i in range(4):
            contiguous &= t.nb[i] == 4 * n
            n *= ne[i]
        if t.type == 0 and contiguous:  # F32 (on the CPU backend, in host memory)
            a = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n,))
            self.captured[name] = a.reshape(-1, ne[0]).copy()  # one row per ne[0] values
        return True

    @contextlib.contextmanager
    def tokenized(self, rgb: np.ndarray, text: str | None = None):
        """mtmd's chunks of `text` (default: the media marker alone) with the [H, W, 3] uint8 image at its marker
        (parse_special on, no BOS): a text chunk, the image's chunk, a text chunk; freed on exit."""
        m = self.m
        self.captured = {}
        rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
        h, w, _ = rgb.shape
        raw = (m.mtmd_default_marker() if text is None else text.encode())
        bmp = m.mtmd_bitmap_init(w, h, rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)))
        chunks = m.mtmd_input_chunks_init()
        try:
            txt = m.mtmd_input_text(raw, len(raw), False, True)
            arr = (m.mtmd_bitmap_p_ctypes * 1)(bmp)
            rc = m.mtmd_tokenize(self.ctx, chunks, ctypes.byref(txt), arr, 1)
            if rc != 0:
                raise RuntimeError(f"mtmd_tokenize failed ({rc})")
            yield chunks
        finally:
            m.mtmd_input_chunks_free(chunks)
            m.mtmd_bitmap_free(bmp)

    def encode_rgb(self, rgb: np.ndarray) -> np.ndarray:
        """An [H, W, 3] uint8 image -> the projector's rows [n_tokens, n_embd] (float32, a copy)."""
        m = self.m
        with self.tokenized(rgb) as chunks:
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

    def close(self) -> None:
        if self.ctx:
            self.m.mtmd_free(self.ctx)
            self.ctx = None
        if self.model:
            self.llama_cpp.llama_model_free(self.model)
            self.model = None


class MtmdCli:
    """llama.cpp's `llama-mtmd-cli` as the comparison where llama-cpp-python is not installed (a build for the
    host's ISA carried in): one run a timed encode, its own report of the image's encode ("mtmd batch encoding
    done in N ms"; older builds: "image slice encoded in N ms"). That leaves out its preprocessing and model load,
    while ours includes the preprocessing, so the comparison leans to llama.cpp. No rows come back, so there is no
    `rel diff`."""

    PATTERN = re.compile(r"(?:batch encoding done|slice encoded) in (\d+) ms")

    def __init__(self, exe: str, mmproj: str, text_model: str, n_threads: int, timeout: float = 300.0):
        if not os.access(exe, os.X_OK):
            raise ParameterError(f"--llama-mtmd-cli {exe!r}: not an executable file")
        self.exe, self.mmproj, self.text, self.threads, self.timeout = exe, mmproj, text_model, n_threads, timeout

    def encode_ms(self, image, folder: str) -> float:
        """Milliseconds llama-mtmd-cli reports for encoding `image` (a PIL image), one run."""
        path = os.path.join(folder, "mtmd-image.png")
        image.save(path)
        cmd = [self.exe, "-m", self.text, "--mmproj", self.mmproj, "--image", path, "-p", "x", "-n", "1",
               "-t", str(self.threads), "--temp", "0", "--chat-template", "chatml", "--no-warmup"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise ParameterError(f"--llama-mtmd-cli {self.exe!r} took over {self.timeout:.0f} s on {path}") from None
        got = self.PATTERN.findall(r.stdout + r.stderr)
        if r.returncode or not got:
            tail = (r.stderr or r.stdout).strip().splitlines()[-3:]
            raise ParameterError(f"--llama-mtmd-cli {self.exe!r} exited {r.returncode} without an encode time: "
                                 f"{' | '.join(tail)}")
        return float(sum(int(x) for x in got))  # an image cut into slices reports each
