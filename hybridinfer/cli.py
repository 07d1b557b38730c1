"""`hybridinfer run|logits|info|synth`: the command line. The only place that reads flags and the
environment."""

from __future__ import annotations

import argparse
import math
import os
import sys
import warnings
from collections import Counter

from .errors import BackendNotAvailableError, HybridInferError, ParameterError, ShapeError


class UsageError(SystemExit):
    """A command-line usage error: its one line is already on stderr; the process exits with status 2. A
    SystemExit, as argparse's own errors are, whose text is the message (not the status)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): `hybridinfer run: error: argument -n: ...`."""

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise UsageError(message)


def _usage(message: str) -> UsageError:
    print(f"hybridinfer: error: {message}", file=sys.stderr)
    return UsageError(message)


def _int_at_least(lo: int):
    """An argparse type: an integer >= lo (the flag's name comes with argparse's message)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {s!r}")
        return v

    return parse


def _finite(s: str) -> float:
    """An argparse type: a finite float (nan and inf pass float() but mean nothing as a sampling parameter)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def _add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("-m", "--model", required=required,
                   help="GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--backend", default=os.environ.get("HYBRIDINFER_BACKEND") or "auto",
                   choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend (default auto: GPU prefill where a card and pycuda are present, "
                        "else the CPU backend; decode always runs on the CPU; reference: the slow numpy oracle)")
    p.add_argument("--n-ctx", type=_int_at_least(1), default=4096, help="context size in tokens (default 4096)")
    p.add_argument("-t", "--threads", type=_int_at_least(1), default=None, help="CPU threads (default: all cores)")
    p.add_argument("--vram-budget", type=parse_size, default=None,
                   help="GPU memory the gpu backend may use, e.g. 6GiB (default: the card's free memory - 512MiB)")
    p.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA"),
                   help="force the SIMD path: scalar | ssse3 | avx2 | avx512vnni (env HYBRIDINFER_ISA)")
    p.add_argument("--weights", default="auto", choices=["auto", "copy", "mmap"],
                   help="where CPU decode reads the weights: a copy in huge pages (faster), the file's memory "
                        "mapping (no copy), or auto: a copy when it takes at most half the available memory")
    p.add_argument("--max-seqs", type=_int_at_least(1), default=8,
                   help="sequences decoded together at most by the scheduler (default 8)")
    p.add_argument("--state-budget", type=parse_size, default=None,
                   help="bytes of sequence states and K/V the scheduler may hold at once, e.g. 4GiB (default: no "
                        "limit); a request that cannot fit alone is refused")


def _add_cache(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("prefix cache (reuse of repeated prompt prefixes)")
    g.add_argument("--prefix-cache-ram", type=parse_size, default=parse_size("2GiB"),
                   help="RAM budget for state snapshots, e.g. 2GiB, 512MiB; 0 turns the cache off (default 2GiB)")
    g.add_argument("--prefix-cache-dir", default=os.environ.get("HYBRIDINFER_PREFIX_CACHE_DIR"),
                   help="directory of an on-disk snapshot store shared by processes (default: none)")
    g.add_argument("--prefix-cache-disk", type=parse_size, default=parse_size("16GiB"),
                   help="disk budget of --prefix-cache-dir (default 16GiB)")
    g.add_argument("--snapshot-stride", type=_int_at_least(0), default=None,
                   help="snapshot the state every N prompt tokens during prefill (default 256 on the CPU, 1024 with "
                        "GPU prefill; 0: only at prompt ends, chat turns and shared prefixes)")


def parse_size(s: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '4096' -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
             "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
    t = str(s).strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        v = float(num) * units[t[len(num):].strip()]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 2GiB, 512MiB, 1e9)") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 2GiB, 512MiB, 1e9)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {s!r}")
    return int(v)


def _engine(a):
    from .api import Engine

    opts = {}
    if a.backend in ("cpu", "auto", "gpu"):
        opts = {"isa": a.isa, "n_threads": a.threads, "weights": a.weights}
    if a.backend in ("auto", "gpu") and a.vram_budget is not None:
        opts["vram_budget"] = a.vram_budget
    cache = None
    if getattr(a, "prefix_cache_ram", 0) or getattr(a, "prefix_cache_dir", None):
        cache = {"ram_bytes": a.prefix_cache_ram, "disk_dir": a.prefix_cache_dir,
                 "disk_bytes": a.prefix_cache_disk if a.prefix_cache_dir else None}
        opts["snapshot_stride"] = a.snapshot_stride
    return Engine.load(a.model, backend=a.backend, n_ctx=a.n_ctx, progress=sys.stderr.isatty(),
                       prefix_cache=cache, max_seqs=a.max_seqs, state_budget=a.state_budget or None, **opts)


def _sampling(a) -> dict:
    """The generation options of the flags, checked as the library checks them (before the model loads)."""
    from .sampling import SamplingParams, check_stop

    SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                   repeat_penalty=a.repeat_penalty, seed=a.seed)
    check_stop(a.stop)
    return dict(max_tokens=a.n, temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, seed=a.seed, stop=a.stop or None,
                enable_thinking=False if a.no_think else None)


def _check_output(path: str, flag: str) -> None:
    """An output file's folder must exist and the path must not be a folder: said before any work is done."""
    if os.path.isdir(path):
        raise ParameterError(f"{flag} {path!r} is a directory, not a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ParameterError(f"{flag} {path!r}: the folder {folder!r} does not exist")


def _print_stats(res, eng) -> None:
    t = res.timings
    line = (f"[prompt {t.get('prompt_tokens', res.prompt_tokens)} tok, reused {t.get('reused_tokens', 0)}, "
            f"prefilled {t.get('prefilled_tokens', res.prompt_tokens)} in {t['prefill_s'] * 1e3:.0f} ms; "
            f"{len(res.tokens)} generated at {t['decode_tok_per_s']:.1f} tok/s]")
    print(line, file=sys.stderr)


def cmd_run(a) -> int:
    opts = _sampling(a)
    if not a.prompt:
        raise ParameterError(f"-p/--prompt is empty: {a.prompt!r}")
    eng = _engine(a)
    if a.raw:
        prompt = a.prompt
    else:
        prompt = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
    h = eng.submit(prompt, **opts)  # through the scheduler, so --state-budget holds here too
    try:
        for piece in h:
            sys.stdout.write(piece)
            sys.stdout.flush()
    finally:
        h.cancel()  # a no-op once it has finished; on Ctrl-C or a closed pipe it stops the sequence
    sys.stdout.write("\n")
    if a.stats:
        _print_stats(h.result(), eng)
    return 0


def cmd_chat(a) -> int:
    """An interactive multi-turn chat; each turn re-uses the cached history (only new tokens are processed)."""
    from .api import Generation

    opts = _sampling(a)
    eng = _engine(a)
    system = [{"role": "system", "content": a.system}] if a.system else []
    history: list[dict] = []
    tty = sys.stdin.isatty()
    if tty:
        print("hybridinfer chat: /reset clears the history, /stats shows the prefix cache, /exit quits",
              file=sys.stderr)
    while True:
        if tty:
            sys.stderr.write("> ")
            sys.stderr.flush()
        line = sys.stdin.readline()
        if not line:
            break
        text = line.rstrip("\n")
        if not text.strip():
            continue
        if text.strip() in ("/exit", "/quit"):
            break
        if text.strip() == "/reset":
            history.clear()
            continue
        if text.strip() == "/stats":
            print(eng.prefix_cache.stats if eng.prefix_cache is not None else "prefix cache off", file=sys.stderr)
            continue
        history.append({"role": "user", "content": text})
        res = Generation("", [], 0, "length")
        try:
            for piece in eng.stream(system + history, _result=res, **opts):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except HybridInferError as e:  # e.g. the history outgrew the context: say so, keep the session
            history.pop()
            print(f"hybridinfer: error: {e}", file=sys.stderr)
            continue
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": res.text})
        if a.stats:
            _print_stats(res, eng)
    return 0


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ParameterError(f"--tokens must be comma-separated integers, got {s!r}") from None


def cmd_logits(a) -> int:
    import numpy as np

    _check_output(a.output, "-o/--output")
    if a.tokens is not None and not _parse_tokens(a.tokens):
        raise ParameterError(f"--tokens names no token ids: {a.tokens!r}")
    if a.text is not None and not a.text:
        raise ParameterError(f"--text is empty: {a.text!r}")
    eng = _engine(a)
    ids = _parse_tokens(a.tokens) if a.tokens else eng.tokenize(a.text)
    if not ids:
        raise ParameterError(f"--text {a.text!r} gives no tokens")
    lg = eng.logits(ids)
    np.save(a.output, lg)
    print(f"wrote {a.output}: logits {lg.shape} float32 for {len(ids)} tokens")
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def cmd_info(a) -> int:
    from .default_model import default_model_path
    from .gguf_model import GGUFModel
    from .models import model_args
    from .models.base import describe

    gm = GGUFModel(a.model or default_model_path())
    args = model_args(gm)
    print(f"file:          {gm.path} ({_fmt_bytes(gm.file_size)})")
    print(f"architecture:  {gm.arch}   name: {gm.meta('general.name', '?')}")
    pattern = "".join({"gdn": "G", "attention": "A"}[k] for k in args.layer_types)
    print(f"layers:        {args.n_layer}  pattern {pattern}")
    for k, v in describe(args).items():
        if k != "layer_types":
            print(f"  {k:<18} {v}")
    by_type: Counter = Counter()
    n_by_type: Counter = Counter()
    for t in gm.tensors.values():
        by_type[t.type_name] += t.nbytes
        n_by_type[t.type_name] += 1
    print(f"tensors:       {len(gm.tensors)}, {_fmt_bytes(sum(by_type.values()))}")
    for name, nb in by_type.most_common():
        print(f"  {name:<6} {n_by_type[name]:>5} tensors  {_fmt_bytes(nb):>12}")
    toks = gm.meta("tokenizer.ggml.tokens", None)
    print(f"tokenizer:     {gm.meta('tokenizer.ggml.model', 'none')} / pre "
          f"{gm.meta('tokenizer.ggml.pre', '-')}, {len(toks) if toks else 0} tokens; chat template: "
          f"{'yes' if gm.meta('tokenizer.chat_template', None) else 'no'}")
    _print_cpu(os.environ.get("HYBRIDINFER_ISA"))
    if a.tensors:
        for t in gm.tensors.values():
            print(f"  {t.name:<40} {t.type_name:<6} {list(t.ne)}  {_fmt_bytes(t.nbytes)}")
    return 0


def _print_cpu(forced: str | None) -> None:
    import cpuinfo

    info = cpuinfo.get_cpu_info()
    flags = set(info.get("flags", []))
    shown = [f for f in ("ssse3", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
                         "avx512_vnni", "avx_vnni") if f in flags]
    print(f"cpu:           {info.get('brand_raw', '?')}, {os.cpu_count()} threads; flags: {' '.join(shown)}")
    try:
        from .cpu.simd import best_isa, supported_isas

        path = forced or best_isa()
        print(f"simd path:     {path}{' (forced by HYBRIDINFER_ISA)' if forced else ''}; "
              f"available: {', '.join(supported_isas())}")
    except ImportError as e:
        print(f"simd path:     unavailable ({e})")


def cmd_synth(a) -> int:
    from .synth import synth_model

    overrides = []
    for item in a.tensor_type:
        pat, sep, name = item.rpartition("=")
        if not sep or not pat or not name:
            raise _usage(f"--tensor-type wants PATTERN=TYPE, got {item!r}")
        overrides.append((pat, name))
    _check_output(a.output, "-o/--output")
    summary = synth_model(a.output, a.arch, a.shape, quant=a.quant, seed=a.seed, vocab_from=a.vocab_from,
                          progress=sys.stderr.isatty(), tensor_types=overrides)
    print(f"wrote {a.output}: {summary}")
    return 0


def _save_bench(out_dir: str, name: str, text: str, plot) -> None:
    """Write a benchmark's JSON (`text`) and PNG (plot(path) -> False without matplotlib) as out_dir/name.*"""
    os.makedirs(out_dir, exist_ok=True)
    stem = os.path.join(out_dir, name)
    with open(stem + ".json", "w") as f:
        f.write(text)
    plotted = plot(stem + ".png")
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if plotted else " (no plot: matplotlib missing)"))


def _check_tools(a, *flags: str) -> None:
    """A llama.cpp binary named by a flag must exist (on PATH or as a file), not be skipped in silence."""
    import shutil

    for flag in flags:
        exe = getattr(a, flag.lstrip("-").replace("-", "_"))
        if exe and not shutil.which(exe) and not os.path.isfile(exe):
            raise ParameterError(f"{flag} {exe!r}: no such program")


def _model_stem(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def cmd_bench_decode(a) -> int:
    import json

    from .benchmarks import decode

    isas = tuple(x.strip() for x in a.isa.split(",") if x.strip())
    weights = tuple(x.strip() for x in a.weights.split(",") if x.strip())
    bad = [w for w in weights if w not in ("auto", "copy", "mmap")]
    if bad or not weights:
        raise ParameterError(f"--weights takes a comma-separated subset of auto,copy,mmap, got {a.weights!r}")
    _check_tools(a, "--llama-bench", "--llama-bench-sse")
    res = decode.run(a.model, a.threads, a.n, a.context, isas, a.llama_bench, a.llama_bench_sse, weights=weights,
                     llama_no_mmap=a.llama_no_mmap, segments=a.segments)
    print(decode.markdown(res))
    _save_bench(a.out_dir, f"decode-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: decode.plot(res, png))
    return 0


def cmd_bench_batch(a) -> int:
    import json

    from .benchmarks import batch

    try:
        sizes = tuple(int(x) for x in a.batch_sizes.split(","))
    except ValueError:
        raise ParameterError(f"--batch-sizes must be comma-separated integers, got {a.batch_sizes!r}") from None
    if not sizes or min(sizes) < 1:
        raise ParameterError(f"--batch-sizes must be positive sequence counts, got {a.batch_sizes!r}")
    _check_tools(a, "--llama-batched-bench")
    res = batch.run(a.model, a.threads, sizes, a.steps, a.prompt_len, a.llama_batched_bench)
    print(batch.markdown(res))
    _save_bench(a.out_dir, f"batch-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: batch.plot(res, png))
    return 0


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=_int_at_least(0), default=64, help="max new tokens (default 64)")
    p.add_argument("--temp", type=_finite, default=0.0,
                   help="sampling temperature (default 0: greedy, reproducible; e.g. 0.8 to sample)")
    p.add_argument("--top-k", type=_int_at_least(0), default=40, help="0: off")
    p.add_argument("--top-p", type=_finite, default=0.95)
    p.add_argument("--min-p", type=_finite, default=0.05)
    p.add_argument("--repeat-penalty", type=_finite, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument("--no-think", action="store_true", help="enable_thinking=false for Qwen templates")
    p.add_argument("--stats", action="store_true",
                   help="print prompt/reused/prefilled tokens and speeds to stderr after each answer")

def cmd_bench_prefix(a) -> int:
    from .benchmarks import prefix

    wl = tuple(w.strip() for w in a.workloads.split(",") if w.strip())
    bad = [w for w in wl if w not in prefix.WORKLOADS]
    if bad:
        raise HybridInferError(f"unknown workload(s) {bad}; choose from {','.join(prefix.WORKLOADS)}")
    rows, meta = prefix.run(a.model, wl, a.n_prompts, a.threads, a.llama_server, a.cache_dir, a.backend,
                            a.snapshot_stride)
    print(prefix.markdown(rows, meta))
    _save_bench(a.out_dir, f"prefix-{_model_stem(a.model)}", prefix.to_json(rows, meta),
                lambda png: prefix.plot(rows, png))
    return 0


def cmd_bench_prefill(a) -> int:
    import json

    from .benchmarks import prefill

    try:
        prompts = tuple(int(x) for x in a.prompts.split(","))
    except ValueError:
        raise ParameterError(f"--prompts must be comma-separated integers, got {a.prompts!r}") from None
    if not prompts or min(prompts) < 1:
        raise ParameterError(f"--prompts must be positive token counts, got {a.prompts!r}")
    _check_tools(a, "--llama-bench", "--llama-bench-cuda")
    try:
        res = prefill.run(a.model, prompts, a.vram_budget or None, not a.no_resident, a.threads, a.llama_bench,
                          a.llama_bench_cuda)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "pycuda":
            raise
        raise BackendNotAvailableError(f"bench prefill measures the GPU backend, which needs pycuda ({e})") from e
    print(prefill.markdown(res))
    _save_bench(a.out_dir, f"prefill-{_model_stem(a.model)}", json.dumps(res, indent=1),
                lambda png: prefill.plot(res, png))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="hybridinfer", description="Qwen3.5 hybrid MoE inference for old GPUs")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="generate a completion (chat-templated unless --raw)")
    _add_model(p)
    _add_cache(p)
    _add_sampling(p)
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("--raw", action="store_true", help="complete the prompt as is, no chat template")
    p.set_defaults(fn=cmd_run)

    p = sub.add_parser("chat", help="interactive multi-turn chat on stdin/stdout (history reused from the cache)")
    _add_model(p)
    _add_cache(p)
    _add_sampling(p)
    p.set_defaults(fn=cmd_chat)



    p = sub.add_parser("logits", help="write logits of every position to a .npy file")
    _add_model(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma-separated token ids")
    g.add_argument("--text", help="text to tokenize")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(fn=cmd_logits)

    p = sub.add_parser("info", help="architecture, shapes, layer pattern, tensor types and bytes")
    p.add_argument("-m", "--model")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("synth", help="write a synthetic GGUF with published (or custom) shapes")
    p.add_argument("--arch", required=True, help="qwen35 | qwen35moe | llama")
    p.add_argument("--shape", required=True, help="e.g. 0.8b, 9b, 35b-a3b, 122b-a10b, or a JSON dict")
    p.add_argument("--quant", default="q4_k_m", help="q4_k_m | q8_0 | q4_0 | f16 | f32")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--vocab-from", default=None, help="borrow tokens from this GGUF")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="as llama-quantize's: tensors whose name matches the regex PATTERN get TYPE (e.g. "
                        "attn_qkv=q8_0); repeatable, the first match wins")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(fn=cmd_synth)
    p = sub.add_parser("bench", help="benchmarks (markdown table + PNG)")
    bsub = p.add_subparsers(dest="bench", required=True)
    b = _bench_parser(bsub, "decode", "decode tok/s vs the memory-bandwidth floor, and llama.cpp", cmd_bench_decode)
    b.add_argument("-n", type=_int_at_least(1), default=32, help="decode steps timed")
    b.add_argument("--context", type=_int_at_least(0), default=0, help="prompt tokens before timing")
    b.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA", "native"),
                   help="comma-separated: native,scalar,ssse3,avx2,avx512vnni")
    b.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench (native build)")
    b.add_argument("--llama-bench-sse", default=None, help="llama-bench built without AVX")
    b.add_argument("--weights", default="auto", help="comma-separated weights modes to time: auto,copy,mmap")
    b.add_argument("--llama-no-mmap", action="store_true", help="also time llama.cpp with -lm none (no mmap)")
    b.add_argument("--segments", type=_int_at_least(1), default=4,
                   help="runs of timed steps with a bandwidth reading between each (each run's floor at the "
                        "mean of the two readings around it)")
    b = _bench_parser(bsub, "batch", "batched decode (one token for each of B sequences per step) tok/s vs B, "
                      "and llama.cpp's llama-batched-bench", cmd_bench_batch)
    b.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated sequences per step (B)")
    b.add_argument("--steps", type=_int_at_least(1), default=32, help="decode steps timed per B")
    b.add_argument("--prompt-len", type=_int_at_least(1), default=128, help="prompt tokens of each sequence")
    b.add_argument("--llama-batched-bench", default=None, help="llama.cpp's llama-batched-bench, run with the same "
                   "B, prompt length and steps")
    b = _bench_parser(bsub, "prefix", "time to first token cold/warm with the prefix cache, and llama.cpp's server",
                      cmd_bench_prefix)
    b.add_argument("--backend", default="cpu", choices=["reference", "cpu", "gpu", "auto"])
    b.add_argument("--workloads", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    b.add_argument("--n-prompts", type=_int_at_least(1), default=100, help="prompts in workload d (default 100)")
    b.add_argument("--snapshot-stride", type=_int_at_least(0), default=None)
    b.add_argument("--cache-dir", default=None, help="also write snapshots to an on-disk store under this dir")
    b.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, run on the same GGUF")
    b = _bench_parser(bsub, "prefill", "GPU prefill tok/s vs transfer and compute floors, and llama.cpp",
                      cmd_bench_prefill, threads_help="threads for llama.cpp's CPU runs")
    b.add_argument("--prompts", default="128,947,4096")
    b.add_argument("--vram-budget", type=parse_size, default=parse_size("6GiB"), help="0: skip the budget run")
    b.add_argument("--no-resident", action="store_true", help="skip the whole-model-resident run")
    b.add_argument("--llama-bench", default=None, help="llama-bench, CPU build")
    b.add_argument("--llama-bench-cuda", default=None, help="llama-bench, CUDA build")
    return ap


def _bench_parser(bsub, name: str, help: str, fn, threads_help: str | None = None) -> argparse.ArgumentParser:
    """A `bench` subcommand with the options every benchmark takes: the model, threads and output folder."""
    b = bsub.add_parser(name, help=help)
    b.add_argument("-m", "--model", required=True)
    b.add_argument("-t", "--threads", type=_int_at_least(1), default=os.cpu_count(), help=threads_help)
    b.add_argument("--out-dir", default="bench/results")
    b.set_defaults(fn=fn)
    return b


def main(argv: list[str] | None = None) -> int:
    """Run one command. Every error in what the user gave (flags, files, folders) is one line on stderr and
    status 2; an exception of any other kind is a bug and keeps its traceback."""
    try:
        a = build_parser().parse_args(argv)
    except UsageError:  # its line is out already
        return 2
    with warnings.catch_warnings():
        warnings.showwarning = _show_warning
        return _run(a)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning (no GPU, so the CPU backend; a damaged cache entry) is one line for a user, not a
    source location."""
    print(f"hybridinfer: note: {message}", file=sys.stderr)


def _run(a) -> int:
    try:
        if getattr(a, "shape", None) and a.shape.lstrip().startswith("{"):
            import json

            try:
                a.shape = json.loads(a.shape)
            except ValueError as e:
                raise ShapeError(f"--shape is not valid JSON ({e}): {a.shape!r}") from None
        return a.fn(a)
    except HybridInferError as e:
        print(f"hybridinfer: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader went away (`| head`): Python's documented way out, with the shell's status for SIGPIPE;
        # stdout goes to devnull so the interpreter's final flush finds no broken pipe
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):  # stdout is no file (captured in-process)
            pass
        return 141
    except OSError as e:  # a file or folder named on the command line that cannot be read or written
        where = f"{e.filename!r}: " if e.filename is not None else ""
        print(f"hybridinfer: error: {where}{e.strerror or e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
