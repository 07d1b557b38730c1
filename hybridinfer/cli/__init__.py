"""`hybridinfer run|logits|info|synth`: the command line. The only place that reads flags and the
environment."""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from collections import Counter

from ..errors import HybridInferError, NonFiniteWeightsError, ParameterError, ShapeError
from .args import (  # noqa: F401  (UsageError, parse_size: re-exported for callers of hybridinfer.cli)
    UsageError,
    _add_cache,
    _add_model,
    _add_sampling,
    _check_output,
    _int_at_least,
    _parse_tokens,
    _Parser,
    _usage,
    add_card_profile,
    add_model_source,
    parse_size,
    resolve_hf,
    show_progress,
    write_output,
)
from .batch import add_batch_parser
from .bench import add_bench_parsers
from .plan import add_plan_parser
from .serve import add_serve_parser


def _engine(a, quiet: bool = False):
    """The engine of the model flags; --numa placed first, what it did said on stderr unless quiet."""
    from ..engine.api import Engine
    from .numa import apply_numa

    def say(line: str) -> None:
        if not quiet:
            print(f"hybridinfer: numa: {line}", file=sys.stderr)

    placement = apply_numa(a, say)
    opts = {}
    if a.backend in ("cpu", "auto", "gpu"):
        opts = {"isa": a.isa, "n_threads": a.threads, "weights": a.weights}
        if placement is not None:
            opts["numa"] = placement
        if getattr(a, "ram_budget", None) is not None:
            opts.update(ram_budget=a.ram_budget, expert_io=a.expert_io)
    if a.backend in ("auto", "gpu") and a.vram_budget is not None:
        opts["vram_budget"] = a.vram_budget
    if a.backend in ("auto", "gpu") and getattr(a, "devices", None):
        opts["devices"] = a.devices
    if a.backend in ("auto", "gpu") and getattr(a, "split_mode", None):
        opts["split_mode"] = a.split_mode
    if a.backend in ("auto", "gpu") and getattr(a, "card_profile", None):
        opts["card_profile"] = a.card_profile
    if a.backend in ("auto", "gpu") and getattr(a, "no_kv_offload", False):
        opts["kv_stream"] = True
    cache = None
    if getattr(a, "prefix_cache_ram", 0) or getattr(a, "prefix_cache_dir", None):
        cache = {"ram_bytes": a.prefix_cache_ram, "disk_dir": a.prefix_cache_dir,
                 "disk_bytes": a.prefix_cache_disk if a.prefix_cache_dir else None}
        opts["snapshot_stride"] = a.snapshot_stride
    template = None
    if getattr(a, "chat_template_file", None):
        from ..format.chat_template import read_template_file

        template = read_template_file(a.chat_template_file, "--chat-template-file")
    eng = Engine.load(a.model, backend=a.backend, n_ctx=a.n_ctx, progress=show_progress(a) and not quiet,
                      prefix_cache=cache, chat_template=template, max_seqs=a.max_seqs,
                      step_tokens=a.step_tokens, state_budget=a.state_budget or None,
                      special_in_content=getattr(a, "special_in_content", False), cache_type_k=a.cache_type_k,
                      cache_type_v=a.cache_type_v, cache_rotate=not a.no_cache_rotate, spec_type=a.spec_type,
                      draft_max=a.draft_max, mmproj=getattr(a, "mmproj", None),
                      image_min_tokens=getattr(a, "image_min_tokens", None),
                      image_max_tokens=getattr(a, "image_max_tokens", None), **opts)
    note = getattr(eng, "ctx_note", "")
    if note and not quiet:
        print(f"hybridinfer: {note}", file=sys.stderr)
    be = getattr(eng, "backend", None)
    plan = getattr(getattr(be, "cpu", be), "ram_plan", None)
    if plan is not None and not quiet:
        split = getattr(getattr(be, "gpu", None), "ram_split", None)
        if split is not None:
            print(f"hybridinfer: {split.summary()}", file=sys.stderr)
        print(f"hybridinfer: {plan.summary()}", file=sys.stderr)
    if "numa" in opts:
        for line in getattr(eng.backend, "cpu", eng.backend).replicas.describe():
            say(line)
    gpu = getattr(getattr(eng, "backend", None), "gpu", None)
    if gpu is not None and not quiet:
        from ..backends.gpu.loader import describe_compiles

        line = describe_compiles(gpu.compiled)
        if line:
            print(f"hybridinfer: {line}", file=sys.stderr)
    return eng


def _sampling(a) -> dict:
    """The generation options of the flags, checked as the library checks them (before the model loads)."""
    from ..engine.sampling import SamplingParams, check_stop

    SamplingParams(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                   repeat_penalty=a.repeat_penalty, seed=a.seed)
    check_stop(a.stop)
    return dict(max_tokens=a.n, temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                repeat_penalty=a.repeat_penalty, seed=a.seed, stop=a.stop or None,
                enable_thinking=False if a.no_think else None)


def _print_stats(res, eng) -> None:
    t = res.timings
    line = (f"[prompt {t.get('prompt_tokens', res.prompt_tokens)} tok, reused {t.get('reused_tokens', 0)}, "
            f"prefilled {t.get('prefilled_tokens', res.prompt_tokens)} in {t['prefill_s'] * 1e3:.0f} ms; "
            f"{len(res.tokens)} generated at {t['decode_tok_per_s']:.1f} tok/s"
            + (f", drafts accepted {t['draft_n_accepted']}/{t['draft_n']}" if "draft_n" in t else "") + "]")
    print(line, file=sys.stderr)


MAX_PROMPT_BYTES = 64 << 20


def _read_prompt(a) -> str:
    """-p TEXT, -p - / -f - (stdin) or -f FILE, as UTF-8 text; one trailing newline dropped from what is read."""
    if a.file is None and a.prompt != "-":
        if not a.prompt:
            raise ParameterError(f"-p/--prompt is empty: {a.prompt!r}")
        return a.prompt
    flag = "-f/--file" if a.file is not None else "-p/--prompt"
    if (a.file or "-") == "-":
        data = sys.stdin.buffer.read(MAX_PROMPT_BYTES + 1)
        if len(data) > MAX_PROMPT_BYTES:
            raise ParameterError(f"{flag} -: stdin holds over {MAX_PROMPT_BYTES} bytes")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ParameterError(f"{flag} -: stdin is not UTF-8 text ({e.reason} at byte {e.start})") from None
        where = f"{flag} - (stdin)"
    else:
        from ..format.files import read_text

        text, where = read_text(a.file, flag, MAX_PROMPT_BYTES), f"{flag} {a.file!r}"
    text = text[:-1] if text.endswith("\n") else text
    if not text:
        raise ParameterError(f"{where} gives an empty prompt")
    return text


def cmd_run(a) -> int:
    opts = _sampling(a)
    a.prompt = _read_prompt(a)
    eng = _engine(a)
    if a.raw:
        prompt = a.prompt
    else:
        prompt = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
    h = eng.submit(prompt, images=a.image, **opts)  # through the scheduler, so --state-budget holds here too
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
    from ..engine.api import Generation

    opts = _sampling(a)
    eng = _engine(a)
    system = [{"role": "system", "content": a.system}] if a.system else []
    history: list[dict] = []
    tty = sys.stdin.isatty()
    if hasattr(sys.stdin, "reconfigure"):  # bytes that are not UTF-8 come as lone surrogates, said below, not raised
        sys.stdin.reconfigure(errors="surrogateescape")
    if tty:
        print("hybridinfer chat: /image FILE adds an image to your next message, /reset clears the history, /stats "
              "shows the prefix cache, /exit quits", file=sys.stderr)
    images: list = []  # /image files for the next message
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
            images.clear()
            continue
        if text.startswith("/image"):
            from ..format.image_input import open_image

            path = text[len("/image"):].strip()
            try:
                images.append({"type": "image", "image": open_image(path, what=f"/image {path!r}")})
            except HybridInferError as e:
                print(f"hybridinfer: error: {e}", file=sys.stderr)
            continue
        if text.strip() == "/stats":
            print(eng.prefix_cache.stats if eng.prefix_cache is not None else "prefix cache off", file=sys.stderr)
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            print(f"hybridinfer: error: the line is not UTF-8 text, skipped: {text!r}", file=sys.stderr)
            continue
        history.append({"role": "user", "content": images + [{"type": "text", "text": text}] if images else text})
        res = Generation("", [], 0, "length")
        try:
            for piece in eng.stream(system + history, _result=res, **opts):
                sys.stdout.write(piece)
                sys.stdout.flush()
        except HybridInferError as e:  # e.g. the history outgrew the context: say so, keep the session
            history.pop()
            print(f"hybridinfer: error: {e}", file=sys.stderr)
            continue
        images = []
        sys.stdout.write("\n")
        sys.stdout.flush()
        history.append({"role": "assistant", "content": res.text})
        if a.stats:
            _print_stats(res, eng)
    return 0


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
    write_output(a.output, "-o/--output", lambda f: np.save(f, lg))  # the name given (np.save(name) adds .npy)
    print(f"wrote {a.output}: logits {lg.shape} float32 for {len(ids)} tokens")
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return ""


def cmd_info(a) -> int:
    from ..format.default_model import default_model_path
    from ..format.gguf_model import GGUFModel
    from ..models import model_args
    from ..models.base import describe
    from ..models.state_kinds import kind_of

    if a.gpu or a.compile:
        from ..backends.gpu.info import report

        for line in report(a.card_profile, compile_ahead=a.compile):
            print(line)
        return 0
    if a.model and a.model_file and a.model != a.model_file:
        raise ParameterError(f"info takes one model: -m {a.model!r} and {a.model_file!r} differ")
    gm = GGUFModel(a.model or a.model_file or default_model_path())
    args = model_args(gm)
    print(f"file:          {gm.path} ({_fmt_bytes(gm.file_size)})")
    print(f"architecture:  {gm.arch}   name: {gm.meta('general.name', '?')}")
    pattern = "".join(kind_of(k).letter for k in args.layer_types)
    mtp = "  + a multi-token-prediction block (drafts: --spec-type mtp)" if getattr(args, "has_mtp", False) else ""
    print(f"layers:        {args.n_layer}  pattern {pattern}{mtp}")
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
    try:
        gm.check_finite()
        print("weights:       no NaN or infinity in the blocks sampled")
    except NonFiniteWeightsError as e:
        print(f"weights:       damaged: {e}")
    toks = gm.meta("tokenizer.ggml.tokens", None)
    print(f"tokenizer:     {gm.meta('tokenizer.ggml.model', 'none')} / pre "
          f"{gm.meta('tokenizer.ggml.pre', '-')}, {len(toks) if toks else 0} tokens; chat template: "
          f"{'yes' if gm.meta('tokenizer.chat_template', None) else 'no'}")
    _print_cpu(os.environ.get("HYBRIDINFER_ISA"))
    from .numa import print_topology

    print_topology(gm.file_size)
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
        from ..backends.cpu.simd import best_isa, supported_isas

        path = forced or best_isa()
        print(f"simd path:     {path}{' (forced by HYBRIDINFER_ISA)' if forced else ''}; "
              f"available: {', '.join(supported_isas())}")
    except ImportError as e:
        print(f"simd path:     unavailable ({e})")


def _residual_scale(s: str) -> str | float:
    if s == "auto":
        return s
    try:
        return float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"wants a number in (0, 1] or 'auto', got {s!r}") from None


def cmd_synth(a) -> int:
    from ..tools.synth import synth_model

    overrides = []
    for item in a.tensor_type:
        pat, sep, name = item.rpartition("=")
        if not sep or not pat or not name:
            raise _usage(f"--tensor-type wants PATTERN=TYPE, got {item!r}")
        overrides.append((pat, name))
    _check_output(a.output, "-o/--output")
    rs = a.residual_scale
    if rs == "auto":
        from ..tools.synth import depth_scale
        from ..tools.synth_shapes import resolve_shape

        rs = depth_scale(resolve_shape(a.arch, a.shape)["n_layer"])
    summary = synth_model(a.output, a.arch, a.shape, quant=a.quant, seed=a.seed, vocab_from=a.vocab_from,
                          progress=sys.stderr.isatty(), tensor_types=overrides, residual_scale=rs,
                          mtp=not a.no_mtp, quiet_pads=a.quiet_pads)
    print(f"wrote {a.output}: {summary}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    ap = _Parser(prog="hybridinfer", description="Qwen3.5 hybrid MoE inference for old GPUs")
    ap.add_argument("--version", action="version", version=f"hybridinfer {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)

    p = sub.add_parser("run", help="generate a completion (chat-templated unless --raw)")
    _add_model(p)
    _add_cache(p)
    _add_sampling(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("-p", "--prompt", help="the prompt; - reads it from stdin")
    g.add_argument("-f", "--file", help="read the prompt from this file (UTF-8; - : stdin); one trailing newline "
                                        "is dropped, as llama.cpp does")
    p.add_argument("--raw", action="store_true", help="complete the prompt as is, no chat template")
    p.add_argument("--image", action="append", metavar="FILE",
                   help="an image for the prompt (repeatable; needs --mmproj); with --raw, each <__media__> in the "
                        "prompt is one, else they go first")
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

    p = sub.add_parser("info", help="architecture, shapes, layer pattern, tensor types and bytes; the CPU, the NUMA "
                                    "topology and the placement each --numa policy would give the model")
    add_model_source(p)
    p.add_argument("model_file", nargs="?", metavar="MODEL", help="the GGUF file (as -m)")
    p.add_argument("--tensors", action="store_true", help="list every tensor")
    p.add_argument("--gpu", action="store_true", help="the card, its class, the tiles it will use and whether its "
                                                      "kernels are cached (no model needed)")
    p.add_argument("--compile", action="store_true", help="with --gpu: compile the kernels ahead into the cache")
    add_card_profile(p)
    p.set_defaults(fn=cmd_info)

    p = sub.add_parser("synth", help="write a synthetic GGUF with published (or custom) shapes")
    p.add_argument("--arch", required=True, help="qwen35 | qwen35moe | llama")
    p.add_argument("--shape", required=True, help="e.g. 0.8b, 9b, 35b-a3b, 122b-a10b, or a JSON dict")
    p.add_argument("--quant", default="q4_k_m", help="q4_k_m | q8_0 | q4_0 | f16 | f32")
    p.add_argument("--seed", type=_int_at_least(0), default=0)
    p.add_argument("--vocab-from", default=None, help="borrow tokens from this GGUF")
    p.add_argument("--quiet-pads", action="store_true",
                   help="with --vocab-from: zero rows in the output head for the padding tokens (up to the shape's "
                        "vocabulary size), so greedy output never picks them, as a trained model never emits unused "
                        "tokens; without it a random model's output is mostly padding, which is no text (serving "
                        "benchmarks: a stream's deltas then merge tokens)")
    p.add_argument("--tensor-type", action="append", default=[], metavar="PATTERN=TYPE",
                   help="as llama-quantize's: tensors whose name matches the regex PATTERN get TYPE (e.g. "
                        "attn_qkv=q8_0); repeatable, the first match wins")
    p.add_argument("--residual-scale", default=None, metavar="S|auto", type=_residual_scale,
                   help="depth-scaled weights, as in a trained network: unit-std token embeddings and residual "
                        "branch output projections at S x the usual std (auto: 1/sqrt(2 n_layer)); without it a "
                        "deep random model is chaotic (engines that round differently disagree on top-1 tokens)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the multi-token-prediction block (qwen35 / qwen35moe write it by default, as "
                        "llama.cpp's converter does without its --no-mtp)")
    p.add_argument("-o", "--output", required=True)
    p.set_defaults(fn=cmd_synth)
    add_serve_parser(sub)
    add_batch_parser(sub)
    add_bench_parsers(sub)
    add_plan_parser(sub)
    return ap


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
        resolve_hf(a)
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
