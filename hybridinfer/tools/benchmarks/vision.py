"""Vision tower benchmark (`hybridinfer bench vision`): ms per image and images/s of the mmproj's tower on the CPU
(SIMD products), at each image size, beside llama.cpp's libmtmd on the same file in the same process, timed the
same way (an RGB array in, the projector's rows out: preprocessing included, the embedding cache not used).

Sizes should be multiples of 32 (patch 16 x merge 2) within both sides' pixel limits, so that both encode the
same grid; the table's `rel diff` is the largest difference of the two outputs over the largest value of ours (a
few 1e-4 on F32 files: llama.cpp's tower is not transformers' float for float; docs/vision.md)."""

from __future__ import annotations

import os
import tempfile
import time

import numpy as np

from ...errors import ParameterError
from . import pyplot

SIZES = ((448, 448), (1024, 768))


def parse_sizes(text: str) -> tuple[tuple[int, int], ...]:
    out = []
    for part in (p.strip() for p in str(text).split(",") if p.strip()):
        try:
            w, h = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise ParameterError(f"--sizes takes WxH pairs separated by commas, got {part!r}") from None
        if w < 1 or h < 1:
            raise ParameterError(f"--sizes: {part!r} is empty")
        out.append((w, h))
    if not out:
        raise ParameterError(f"--sizes names no size: {text!r}")
    return tuple(out)


def _image(w: int, h: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


def _median_s(fn, reps: int) -> tuple[float, object]:
    out = fn()  # a first call: weights copied, kernels compiled
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), out


def run(mmproj: str | None, text_model: str | None, threads: int, sizes, reps: int = 3, isa: str | None = None,
        llama: bool = True, synth_width: int = 2048, synth_depth: int | None = None, seed: int = 0,
        gpu: bool = False, card_profile: str | None = None, mtmd_cli: str | None = None) -> dict:
    """mmproj None: a synthetic Qwen3.5-shaped one (tools/synth_vision) of output width `synth_width` (the text
    model's, when one is given), made in a temporary folder; `synth_depth` overrides its 27 layers. gpu: the
    whole tower on the card (backends/gpu/vision.py) instead of the CPU, compiled and tiled as for `card_profile`
    (None: the card itself); each row then also gives the products' FLOP/s on the card (kernel time between events,
    the products enqueued back to back with the rest of the tower) and their fraction of its measured FMA peak.
    mtmd_cli: llama.cpp's llama-mtmd-cli instead of llama-cpp-python's libmtmd (vision_mtmd.MtmdCli)."""
    from ...backends.cpu.simd import SimdLib
    from ...backends.vision import load_image_encoder
    from ...format.gguf_model import GGUFModel
    from ..synth_vision import synth_mmproj, synth_text_of_width

    with tempfile.TemporaryDirectory() as tmp:
        width = synth_width
        if text_model is not None:
            gm = GGUFModel(text_model)
            try:
                width = int(gm.meta(f"{gm.arch}.embedding_length"))
            finally:
                gm.close()
        shape = None
        if mmproj is None:
            mmproj = os.path.join(tmp, "mmproj-synth.gguf")
            shape = synth_mmproj(mmproj, width, {"depth": synth_depth} if synth_depth else None, seed=seed)
        lib = SimdLib(isa=isa, n_threads=threads)
        peak = None
        if gpu:
            from ...backends.gpu import loader
            from ...backends.gpu.k_peak import fma_peak_flops

            loader.init()
            loader.configure(card_profile)
            peak = fma_peak_flops()
        enc = load_image_encoder(mmproj, None, lib, gpu=gpu)
        res = {"mmproj": mmproj if shape is None else "synthetic", "shape": shape, "threads": threads,
               "isa": f"gpu tower ({card_profile or 'the card'})" if gpu else lib.isa, "out_width": enc.n_embd,
               "reps": reps, "rows": [], "fma_peak_tflops": None if peak is None else peak / 1e12}
        mt = cli = None
        if llama:
            from .vision_mtmd import MtmdCli, MtmdEncoder

            if text_model is None:
                text_model = os.path.join(tmp, "text.gguf")
                synth_text_of_width(text_model, enc.n_embd)
            if mtmd_cli:
                cli = MtmdCli(mtmd_cli, mmproj, text_model, threads)
                res["llama"] = "llama-mtmd-cli's encode time (its preprocessing and load left out)"
            else:
                mt = MtmdEncoder(mmproj, text_model, n_threads=threads)
        try:
            for w, h in sizes:
                img = _image(w, h, seed)
                if gpu:  # the counters from here: the first encode of a size compiles and uploads
                    enc.encode(img)
                    enc.ops.reset_counters()
                ours_s, ours = _median_s(lambda img=img: enc.encode(img), reps)
                row = {"size": f"{w}x{h}", "tokens": ours.n_tokens, "grid": list(ours.grid), "ms": ours_s * 1e3,
                       "img_s": 1 / ours_s}
                if gpu and enc.ops.product_s > 0:
                    fl = enc.ops.product_flops / enc.ops.product_s
                    row |= {"product_tflops": fl / 1e12, "product_peak_frac": fl / peak,
                            "products": {n: {"tflops": f / t / 1e12 if t else 0.0, "seconds": t, "tile": list(tile)}
                                         for n, (f, t, tile) in sorted(enc.ops.by_product.items())}}
                if mt is not None:
                    rgb = np.asarray(img)
                    ll_s, ll = _median_s(lambda rgb=rgb: mt.encode_rgb(rgb), reps)
                    row |= {"llama_ms": ll_s * 1e3, "llama_img_s": 1 / ll_s, "llama_tokens": int(ll.shape[0])}
                    if ll.shape == ours.rows.shape:
                        row["rel_diff"] = float(np.abs(ll - ours.rows).max() / np.abs(ours.rows).max())
                elif cli is not None:
                    ll_ms = float(np.median([cli.encode_ms(img, tmp) for _ in range(reps)]))
                    row |= {"llama_ms": ll_ms, "llama_img_s": 1e3 / ll_ms}
                res["rows"].append(row)
        finally:
            if mt is not None:
                mt.close()
            enc.close()
            lib.close()
    return res


def markdown(res: dict) -> str:
    lines = [f"vision tower, {res['mmproj']} (out width {res['out_width']}; {res['isa']}, {res['threads']} threads, "
             f"median of {res['reps']})", ""]
    if res.get("fma_peak_tflops"):
        lines += [f"products on the card: FMA peak {res['fma_peak_tflops']:.1f} TFLOP/s (measured)", ""] + [
            f"- {r['size']}: products {r['product_tflops']:.2f} TFLOP/s, {100 * r['product_peak_frac']:.1f}% of peak"
            + "".join(f"; {n} {p['tflops']:.1f} ({p['seconds'] * 1e3:.0f} ms, tile {tuple(p['tile'])})"
                      for n, p in r.get("products", {}).items())
            for r in res["rows"] if "product_tflops" in r] + [""]
    if res.get("llama"):
        lines += [f"llama.cpp: {res['llama']}", ""]
    lines += [
             "| size | tokens | hybridinfer ms | img/s | llama.cpp mtmd ms | img/s | x llama.cpp | rel diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        ll = (f"{r['llama_ms']:.1f} | {r['llama_img_s']:.3f} | {r['llama_ms'] / r['ms']:.2f}"
              if "llama_ms" in r else "- | - | -")
        diff = f"{r['rel_diff']:.1e}" if "rel_diff" in r else "-"
        lines.append(f"| {r['size']} | {r['tokens']} | {r['ms']:.1f} | {r['img_s']:.3f} | {ll} | {diff} |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    rows = res["rows"]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(x - 0.2, [r["img_s"] for r in rows], 0.4, label="hybridinfer")
    if any("llama_img_s" in r for r in rows):
        ax.bar(x + 0.2, [r.get("llama_img_s", 0) for r in rows], 0.4, label="llama.cpp mtmd")
    ax.set_xticks(x, [r["size"] for r in rows])
    ax.set_ylabel("images/s")
    ax.set_title(f"vision tower, {res['threads']} threads")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
