"""`hybridinfer bench ...`: the benchmark subcommands (markdown table, JSON and PNG each)."""

from __future__ import annotations

import argparse
import os

from ..errors import BackendNotAvailableError, HybridInferError, ParameterError
from .args import (
    BACKEND_HELP,
    _int_at_least,
    add_cache_types,
    add_card_profile,
    add_model_source,
    device_list,
    gb_per_s,
    parse_size,
    positive_ints,
    seconds,
    seed_int,
    split_modes,
    threads_int,
)


def _bench_model(a) -> str:
    """-m's file, or the embedded default model; a ParameterError naming a path that is not a file."""
    model = a.model
    if model is None:
        from ..format.default_model import default_model_path

        model = default_model_path()
    if not os.path.isfile(model):
        raise ParameterError(f"-m/--model {model!r}: no such file")
    return model


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

    from ..tools.benchmarks import decode

    isas = tuple(x.strip() for x in a.isa.split(",") if x.strip())
    weights = tuple(x.strip() for x in a.weights.split(",") if x.strip())
    bad = [w for w in weights if w not in ("auto", "copy", "mmap")]
    if bad or not weights:
        raise ParameterError(f"--weights takes a comma-separated subset of auto,copy,mmap, got {a.weights!r}")
    _check_tools(a, "--llama-bench", "--llama-bench-sse")
    res = decode.run(a.model, a.threads, a.n, a.context, isas, a.llama_bench, a.llama_bench_sse, weights=weights,
                     llama_no_mmap=a.llama_no_mmap, segments=a.segments, kv=_kv(a))
    print(decode.markdown(res))
    _save_bench(a.out_dir, f"decode-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: decode.plot(res, png))
    return 0


def cmd_bench_batch(a) -> int:
    import json

    from ..tools.benchmarks import batch

    sizes = positive_ints("--batch-sizes", a.batch_sizes, "sequence counts")
    _check_tools(a, "--llama-batched-bench", "--llama-bench", "--llama-bench-sse")
    res = batch.run(a.model, a.threads, sizes, a.steps, a.prompt_len, a.llama_batched_bench,
                    prefill_tokens=a.prefill_tokens, llama_bench=a.llama_bench, llama_bench_sse=a.llama_bench_sse,
                    kv=_kv(a))
    print(batch.markdown(res))
    _save_bench(a.out_dir, f"batch-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: batch.plot(res, png))
    return 0


def cmd_bench_prefix(a) -> int:
    from ..tools.benchmarks import prefix

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

    from ..tools.benchmarks import prefill

    prompts = positive_ints("--prompts", a.prompts, "token counts")
    _check_tools(a, "--llama-bench", "--llama-bench-cuda")
    try:
        res = prefill.run(a.model, prompts, a.vram_budget or None, not a.no_resident, a.threads, a.llama_bench,
                          a.llama_bench_cuda, bus_bw=a.bus_bw, card_profile=a.card_profile,
                          kv_stream=True if a.no_kv_offload else None, devices=a.devices,
                          split_modes=split_modes(a.split_mode))
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "pycuda":
            raise
        raise BackendNotAvailableError(f"bench prefill measures the GPU backend, which needs pycuda ({e})") from e
    print(prefill.markdown(res))
    _save_bench(a.out_dir, f"prefill-{_model_stem(a.model)}", json.dumps(res, indent=1),
                lambda png: prefill.plot(res, png))
    return 0


def cmd_bench_serve(a) -> int:
    import json

    from ..tools.benchmarks import serve, serve_plot

    conc = positive_ints("--concurrency", a.concurrency, "client counts")
    _check_tools(a, "--llama-server")
    if a.chat_template_file:  # what both servers will read: a regular file of UTF-8 text, no larger than a template
        from ..format.chat_template import read_template_file

        read_template_file(a.chat_template_file, "--chat-template-file")
    res = serve.run(a.model, a.threads, a.max_seqs, conc, a.requests, a.max_tokens, a.conversations, a.turns,
                    a.system_tokens, a.shared_system, a.n_ctx, a.backend, a.llama_server,
                    a.chat_template_file and os.path.abspath(a.chat_template_file), a.prefix_cache_ram)
    print(serve.markdown(res))
    _save_bench(a.out_dir, f"serve-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: serve_plot.plot(res, png))
    return 0


def cmd_bench_batch_job(a) -> int:
    import json

    from ..tools.benchmarks import batch_job, batch_job_report

    policies = batch_job.parse_policies(a.numa_policies)
    configs = batch_job.parse_configs(a.configs)
    qt = positive_ints("--question-tokens", a.question_tokens, "token counts")
    if len(qt) != 2 or qt[0] > qt[1]:
        raise ParameterError(f"--question-tokens must be LO,HI with LO <= HI, got {a.question_tokens!r}")
    _check_tools(a, "--llama-server")
    model = _bench_model(a)
    res = batch_job.run(model, a.threads, a.requests, a.system_tokens, a.max_tokens, a.max_seqs, a.llama_server,
                        policies, configs, a.seed, a.n_ctx, a.llama_np, a.backend, qt)
    print(batch_job_report.markdown(res))
    _save_bench(a.out_dir, f"batch-job-{_model_stem(model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: batch_job_report.plot(res, png))
    return 0


def cmd_bench_context(a) -> int:
    import json

    from ..tools.benchmarks import context, context_report

    depths = positive_ints("--depths", a.depths, "token counts")
    types = context.parse_cache_types(a.cache_types)
    if a.llama_bench and a.llama_bench_cuda:
        raise ParameterError("give --llama-bench (a CPU build) or --llama-bench-cuda (a CUDA build), not both")
    _check_tools(a, "--llama-bench", "--llama-bench-cuda")
    model = _bench_model(a)
    isa = None if a.isa in (None, "", "native") else a.isa
    res = context.run(model, a.threads, depths, types, a.p, a.n, a.backend, isa, a.llama_bench, a.reps,
                      a.probe_bytes, llama_bench_cuda=a.llama_bench_cuda)
    print(context_report.markdown(res))
    _save_bench(a.out_dir, f"context-{_model_stem(model)}-t{a.threads}", json.dumps(res, indent=1),
                lambda png: context_report.plot(res, png))
    return 0


def cmd_bench_spec(a) -> int:
    import json

    from ..tools.benchmarks import spec

    ks = positive_ints("--draft-max", a.draft_max, "draft lengths")
    accepts = tuple(float(x) for x in a.acceptance.split(",") if x.strip())
    if not accepts or any(not 0 <= x <= 1 for x in accepts):
        raise ParameterError(f"--acceptance takes comma-separated fractions in [0, 1], got {a.acceptance!r}")
    if a.llama_server and a.batch > 1:
        raise ParameterError(f"--llama-server runs one sequence: it takes --batch 1, got --batch {a.batch}")
    _check_tools(a, "--llama-server")
    model = _bench_model(a)
    isa = None if a.isa in (None, "", "native") else a.isa
    res = spec.run(model, a.threads, a.n, ks, accepts, a.p, isa, a.seed, a.reps, a.llama_server, a.batch,
                   not a.auto_only)
    print(spec.markdown(res))
    _save_bench(a.out_dir, f"spec-{_model_stem(model)}-t{a.threads}" + (f"-b{a.batch}" if a.batch > 1 else ""),
                json.dumps(res, indent=1),
                lambda png: spec.plot(res, png))
    return 0


def cmd_bench_disk(a) -> int:
    import json

    from ..tools.benchmarks import disk

    budgets = [parse_size(x) for x in a.ram_budgets.split(",") if x.strip()]
    modes = tuple(x.strip() for x in a.expert_io.split(",") if x.strip())
    if not budgets or not modes or any(m not in ("pread", "direct") for m in modes):
        raise ParameterError(f"--ram-budgets takes sizes and --expert-io a subset of pread,direct, got "
                             f"{a.ram_budgets!r} and {a.expert_io!r}")
    _check_tools(a, "--llama-bench")
    res = disk.run(a.model, budgets, a.threads, a.n, a.context, modes, a.llama_bench, llama_timeout=a.llama_timeout,
                   llama_fill=a.llama_fill_memory)
    print(disk.markdown(res))
    _save_bench(a.out_dir, f"disk-{_model_stem(a.model)}-t{a.threads}", json.dumps(res, indent=1), lambda png: False)
    return 0


def cmd_bench_vision(a) -> int:
    import json

    from ..tools.benchmarks import vision

    sizes = vision.parse_sizes(a.sizes)
    if a.mmproj is None and not a.synth:
        raise ParameterError("bench vision needs --mmproj FILE or --synth (a random Qwen3.5-shaped mmproj)")
    for flag, path in (("--mmproj", a.mmproj), ("-m/--model", a.model)):
        if path is not None and not os.path.isfile(path):
            raise ParameterError(f"{flag} {path!r}: no such file")
    isa = None if a.isa in (None, "", "native") else a.isa
    res = vision.run(a.mmproj, a.model, a.threads, sizes, a.reps, isa, not a.no_llama, a.synth_width,
                     a.synth_depth, a.seed, a.gpu, a.card_profile, a.llama_mtmd_cli)
    print(vision.markdown(res))
    name = ("synth" if a.mmproj is None else _model_stem(a.mmproj)) + ("-gpu" if a.gpu else "")
    _save_bench(a.out_dir, f"vision-{name}-t{a.threads}", json.dumps(res, indent=1), lambda png: vision.plot(res, png))
    return 0


def _kv(a) -> dict | None:
    """The K/V flags as Engine.load's keywords for both engines (None: neither type named, each engine's own)."""
    if a.cache_type_k is None and a.cache_type_v is None and not a.no_cache_rotate:
        return None
    return {"cache_type_k": a.cache_type_k or "f32", "cache_type_v": a.cache_type_v or "f32",
            "cache_rotate": not a.no_cache_rotate}


def _add_kv(b: argparse.ArgumentParser) -> None:
    """-ctk / -ctv / --no-cache-rotate for a benchmark that runs this engine beside llama.cpp: given, both get them
    (llama.cpp with flash attention for any type but f32, as this engine then attends in its order)."""
    add_cache_types(b, rotate=True, default=None,
                    note="; given, llama.cpp gets it too (default: each engine's own, f32 here, f16 in llama.cpp)")


def _bench_parser(bsub, name: str, help: str, fn, threads_help: str | None = None,
                  model_required: bool = True) -> argparse.ArgumentParser:
    """A `bench` subcommand with the options every benchmark takes: the model, threads and output folder."""
    b = bsub.add_parser(name, help=help)
    add_model_source(b, model_required, "GGUF file" if model_required else None)
    b.add_argument("-t", "--threads", type=threads_int, default=os.cpu_count(), help=threads_help)
    b.add_argument("--out-dir", default="bench/results")
    b.set_defaults(fn=fn)
    return b


def add_bench_parsers(sub) -> None:
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
    _add_kv(b)
    b = _bench_parser(bsub, "disk", "decode tok/s under RAM budgets with the routed experts read from the file: "
                      "bytes read per token against the disk's floor, the cache's hit rate, and llama.cpp under the "
                      "same memory limit", cmd_bench_disk)
    b.add_argument("--ram-budgets", default="6GiB,10GiB,16GiB", help="comma-separated RAM budgets to time")
    b.add_argument("--llama-timeout", type=seconds, default=180.0,
                   help="seconds each llama-bench run may take under its limit (past it: its speed is below n/that)")
    b.add_argument("--llama-fill-memory", action="store_true",
                   help="where no cgroup or systemd-run limit can be set: fill the host's memory until the limit is "
                   "left while llama-bench runs (host-wide: run nothing else beside it). Default: off")
    b.add_argument("--expert-io", default="pread,direct", help="comma-separated read modes: pread,direct")
    b.add_argument("-n", type=_int_at_least(1), default=32, help="decode steps timed per budget")
    b.add_argument("--context", type=_int_at_least(1), default=16, help="prompt tokens before timing")
    b.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench, run under each budget as a memory "
                   "limit (cgroup v2 memory.max, else systemd-run MemoryMax)")
    b = _bench_parser(bsub, "batch", "batched decode (one token for each of B sequences per step) tok/s vs B, "
                      "and llama.cpp's llama-batched-bench", cmd_bench_batch)
    b.add_argument("--batch-sizes", default="1,2,4,8,16", help="comma-separated sequences per step (B)")
    b.add_argument("--steps", type=_int_at_least(1), default=32, help="decode steps timed per B")
    b.add_argument("--prompt-len", type=_int_at_least(1), default=128, help="prompt tokens of each sequence")
    b.add_argument("--llama-batched-bench", default=None, help="llama.cpp's llama-batched-bench, run with the same "
                   "B, prompt length and steps")
    b.add_argument("--prefill-tokens", type=_int_at_least(0), default=512,
                   help="also time CPU prefill of one prompt this long, at the best ISA and at SSSE3 (0: skip)")
    b.add_argument("--llama-bench", default=None, help="llama-bench (native build), run with -p PREFILL_TOKENS -n 0")
    b.add_argument("--llama-bench-sse", default=None, help="llama-bench built for SSE4.2 (no AVX), the same")
    _add_kv(b)
    b = _bench_parser(bsub, "prefix", "time to first token cold/warm with the prefix cache, and llama.cpp's server",
                      cmd_bench_prefix)
    b.add_argument("--backend", default="cpu", choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend: " + BACKEND_HELP + " (default cpu)")
    b.add_argument("--workloads", default="a,b,c,d", help="comma-separated subset of a,b,c,d")
    b.add_argument("--n-prompts", type=_int_at_least(1), default=100, help="prompts in workload d (default 100)")
    b.add_argument("--snapshot-stride", type=_int_at_least(0), default=None)
    b.add_argument("--cache-dir", default=None, help="also write snapshots to an on-disk store under this dir")
    b.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, run on the same GGUF")
    b = _bench_parser(bsub, "serve", "HTTP serving: streaming clients' TTFT, inter-token latency and tok/s, and an "
                      "agent workload's prefix reuse, against llama.cpp's llama-server", cmd_bench_serve)
    b.add_argument("--max-seqs", type=_int_at_least(1), default=16, help="server parallelism (llama-server -np)")
    b.add_argument("--concurrency", default="1,4,16", help="comma-separated concurrent streaming clients")
    b.add_argument("--requests", type=_int_at_least(1), default=4, help="requests each client sends per level")
    b.add_argument("--max-tokens", type=_int_at_least(1), default=64, help="max_tokens of every request")
    b.add_argument("--conversations", type=_int_at_least(0), default=10, help="agent conversations (0: skip)")
    b.add_argument("--turns", type=_int_at_least(1), default=5, help="turns of each agent conversation")
    b.add_argument("--system-tokens", type=_int_at_least(0), default=2000,
                   help="agent system prompt size in tokens, the tool definitions included (approximate)")
    b.add_argument("--shared-system", action="store_true",
                   help="one system prompt for all conversations (default: one per conversation, cold first turns)")
    b.add_argument("--n-ctx", type=_int_at_least(256), default=4096,
                   help="context per sequence (llama-server: -c max_seqs * n_ctx)")
    b.add_argument("--backend", default="cpu", choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend: " + BACKEND_HELP + " (default cpu)")
    b.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, run on the same GGUF")
    b.add_argument("--chat-template-file", default=None,
                   help="a chat template both servers render (llama-server with --jinja), so both see the same "
                        "prompt tokens, tools included (e.g. bench/qwen35_chat_template.jinja)")
    b.add_argument("--prefix-cache-ram", type=parse_size, default=None,
                   help="this engine's snapshot cache in RAM (default: serve's, 2GiB); llama-server keeps each slot's "
                        "state and its context checkpoints, which this cache stands for")
    b = _bench_parser(bsub, "batch-job", "a batch job end to end: N requests sharing a long system prompt through "
                      "`hybridinfer batch` (one at a time, the scheduler, 2 shards, each --numa policy) and "
                      "llama.cpp's llama-server fed the same requests", cmd_bench_batch_job, model_required=False)
    b.add_argument("--requests", type=_int_at_least(1), default=200, help="requests in the job (default 200)")
    b.add_argument("--system-tokens", type=_int_at_least(0), default=2000,
                   help="tokens of the system prompt every request shares (approximate; default 2000)")
    b.add_argument("--question-tokens", default="30,100", help="LO,HI tokens of each request's question")
    b.add_argument("--max-tokens", type=_int_at_least(1), default=64, help="max_tokens of every request")
    b.add_argument("--max-seqs", type=_int_at_least(1), default=8, help="the scheduler configuration's --max-seqs")
    b.add_argument("--configs", default="one,scheduler,shards",
                   help="this engine's configurations: one (--max-seqs 1), scheduler, shards (2 at once)")
    b.add_argument("--numa-policies", default="off,interleave,bind:0,replicate,auto",
                   help="comma-separated --numa policies run with the scheduler configuration ('' for none; off "
                        "is the scheduler row)")
    b.add_argument("--n-ctx", type=_int_at_least(256), default=None,
                   help="context per sequence (default: the longest prompt + max_tokens, rounded up to 256)")
    b.add_argument("--seed", type=seed_int, default=0, help="the questions' words and lengths")
    b.add_argument("--backend", default="cpu", choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend: " + BACKEND_HELP + " (default cpu)")
    b.add_argument("--llama-server", default=None, help="llama.cpp's llama-server binary, run on the same GGUF")
    b.add_argument("--llama-np", type=_int_at_least(1), default=8,
                   help="llama-server's slots (-np) and the client's requests in flight (default 8)")
    b = _bench_parser(bsub, "context", "prefill and decode tok/s at context depths for each K/V cache type, K/V bytes "
                      "per token and in all, against llama-bench -d", cmd_bench_context, model_required=False)
    b.add_argument("--backend", default="cpu", choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend: " + BACKEND_HELP + " (default cpu)")
    b.add_argument("--depths", default="1024,8192,32768,131072",
                   help="comma-separated context depths in tokens; one beyond the trained context or the memory "
                        "available is skipped, and the table says so")
    b.add_argument("--cache-types", default="f32,f16,q8_0,q4_0",
                   help="comma-separated K/V cache types, each for both K and V, or K/V pairs such as q8_0/q4_0")
    b.add_argument("-p", type=_int_at_least(1), default=512, help="prompt tokens prefilled (timed) at each depth")
    b.add_argument("-n", type=_int_at_least(1), default=32, help="decode steps timed at each depth")
    b.add_argument("-r", "--reps", type=_int_at_least(1), default=2, help="timed runs of each (both engines)")
    b.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA", "native"),
                   help="SIMD path: native, scalar, ssse3, avx2, avx512vnni")
    b.add_argument("--llama-bench", default=None, help="llama.cpp's llama-bench, run with -d at each depth, the same "
                   "types, flash attention off and on")
    b.add_argument("--llama-bench-cuda", default=None, metavar="EXE",
                   help="instead of --llama-bench: a CUDA build of llama-bench, run with -ngl 99,0 --no-host 1 -p 0 at "
                   "each depth, so the card prefills the depth once (a CPU build takes hours at 128K) and "
                   "llama-bench's depth cache restores it into the -ngl 0 instance, which decodes on the CPU with its "
                   "weights repacked as a CPU build's; only its n_gpu_layers 0 rows count (tg only: a prompt batch "
                   "at -ngl 0 is offloaded to the card)")
    b.add_argument("--probe-bytes", type=parse_size, default=None,
                   help="buffer of the read-bandwidth probe behind the decode floor (default: 8x the last-level "
                        "cache, at least 1GiB; 0: no probe, no floor)")
    b = _bench_parser(bsub, "spec", "speculative decoding: decode tok/s against acceptance for each draft length "
                      "(a drafter proposing the known greedy continuation, part of it replaced), and a verify step's "
                      "cost against a decode step", cmd_bench_spec, model_required=False)
    b.add_argument("-n", type=_int_at_least(1), default=64, help="tokens generated per run")
    b.add_argument("-p", type=_int_at_least(1), default=128, help="prompt tokens before them")
    b.add_argument("--draft-max", default="1,2,3,4", help="comma-separated draft lengths k")
    b.add_argument("--acceptance", default="0,0.5,0.7,0.9,1", help="comma-separated draft acceptances")
    b.add_argument("--batch", type=_int_at_least(1), default=1,
                   help="sequences decoded together through the scheduler (Engine.generate_batch), each with its own "
                        "prompt and drafts; tok/s summed over them")
    b.add_argument("--auto-only", action="store_true", help="only the auto<=K rows (no fixed draft lengths)")
    b.add_argument("-r", "--reps", type=_int_at_least(1), default=3, help="runs of each (the best is kept)")
    b.add_argument("--llama-server", default=None, help="llama.cpp's llama-server: the same prompt on the same file "
                   "and threads without drafts and with --spec-type draft-mtp at each draft length, after ours")
    b.add_argument("--seed", type=seed_int, default=0, help="the prompt's tokens")
    b.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA", "native"),
                   help="SIMD path: native, scalar, ssse3, avx2, avx512vnni")
    b = _bench_parser(bsub, "vision", "vision tower: ms per image and images/s on the CPU, and llama.cpp's libmtmd on "
                      "the same mmproj", cmd_bench_vision, model_required=False)
    b.add_argument("-mm", "--mmproj", default=None, metavar="FILE", help="the mmproj GGUF timed")
    b.add_argument("--synth", action="store_true",
                   help="time a random mmproj of Qwen3.5's published vision shape (depth 27, width 1152, 16 heads, "
                        "MLP 4304, patch 16, merge 2) instead, projecting to -m's width (else --synth-width)")
    b.add_argument("--synth-width", type=_int_at_least(1), default=2048,
                   help="the synthetic projector's output width without -m (default 2048, Qwen3.5-35B-A3B's)")
    b.add_argument("--synth-depth", type=_int_at_least(1), default=None, help="fewer layers than 27 (quick runs)")
    b.add_argument("--sizes", default="448x448,1024x768", help="comma-separated image sizes WxH")
    b.add_argument("-r", "--reps", type=_int_at_least(1), default=3, help="timed encodes of each size (median)")
    b.add_argument("--no-llama", action="store_true", help="skip llama.cpp's libmtmd")
    b.add_argument("--llama-mtmd-cli", default=None, metavar="EXE",
                   help="compare with this llama-mtmd-cli's reported encode time (one run a timed encode) instead of "
                        "llama-cpp-python's libmtmd in this process")
    b.add_argument("--gpu", action="store_true", help="the tower's products on the card (gemm.cu), the rest on the "
                   "host; llama.cpp's mtmd stays on the CPU")
    b.add_argument("--card-profile", default=None, choices=["fermi", "kepler", "maxwell", "pascal"],
                   help="with --gpu: kernels compiled and tiles chosen as for that card class (default: the card)")
    b.add_argument("--seed", type=seed_int, default=0, help="the random images (and synthetic weights)")
    b.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA", "native"),
                   help="SIMD path: native, scalar, ssse3, avx2, avx512vnni")
    b = _bench_parser(bsub, "prefill", "GPU prefill tok/s vs transfer and compute floors, and llama.cpp",
                      cmd_bench_prefill, threads_help="threads for llama.cpp's CPU runs")
    b.add_argument("--prompts", default="128,947,4096")
    b.add_argument("--vram-budget", type=parse_size, default=parse_size("6GiB"), help="0: skip the budget run")
    b.add_argument("--no-resident", action="store_true", help="skip the whole-model-resident run")
    b.add_argument("--devices", type=device_list, default=None, metavar="0,1,...",
                   help="also prefill on the first device alone and over all of them (as --split-mode says), "
                        "each under --vram-budget")
    b.add_argument("-sm", "--split-mode", default="auto", metavar="MODE[,MODE]",
                   help="with --devices: layer, expert or auto (the time model's choice), or several, e.g. "
                        "layer,expert: a run of the cards in each (default auto)")
    b.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="stream every pass's K/V through the card from host memory (default: only passes too long "
                        "to keep them on the card)")
    add_card_profile(b)
    b.add_argument("--llama-bench", default=None, help="llama-bench, CPU build")
    b.add_argument("--llama-bench-cuda", default=None, help="llama-bench, CUDA build")
    b.add_argument("--bus-bw", type=gb_per_s, default=None, metavar="GB/s",
                   help="pace the weight stream to this rate (an old card's bus: 6 for PCIe 2.0 x16, 12 for 3.0)")
