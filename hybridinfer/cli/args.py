"""Command-line argument types and groups shared by the subcommands (hybridinfer.cli)."""

from __future__ import annotations

import argparse
import copy
import math
import os
import re
import sys
from types import SimpleNamespace

from ..backends.cpu.simd_native import MAX_THREADS
from ..engine.compute import DEFAULT_STEP_TOKENS
from ..errors import ParameterError
from ..format.files import check_regular
from ..format.quant_types import CACHE_TYPES

# every --backend says what "gpu" means: the card is the prefill device, decode stays on the CPU
BACKEND_HELP = ("reference (the slow numpy oracle), cpu, gpu (prefill on the card; decode stays on the CPU) or auto "
                "(gpu where a card and pycuda are present, else cpu)")


class UsageError(SystemExit):
    """A command-line usage error: its one line is already on stderr; the process exits with status 2. A
    SystemExit, as argparse's own errors are, whose text is the message (not the status)."""

    def __init__(self, message: str):
        super().__init__(2)
        self.message = message

    def __str__(self) -> str:
        return self.message


class _HelpFormatter(argparse.HelpFormatter):
    """--help names every option's default: "(default: X)" after its help, unless the help already says what the
    default is or there is none to name (an option that is unset, off or empty by default). Sizes are shown in the
    units one would type (16MiB, not 16777216)."""

    @staticmethod
    def _note(action) -> str:
        d = action.default
        if (not action.option_strings or "default" in (action.help or "").lower() or d is None or d is False
                or d is argparse.SUPPRESS or (isinstance(d, list | tuple) and not d)):
            return ""
        return f"(default: {size_text(d) if action.type is parse_size else '%(default)s'})"

    def _get_help_string(self, action):
        note = self._note(action)
        return f"{action.help} {note}" if note else action.help

    def _format_action(self, action):
        if not action.help and self._note(action):  # argparse prints no help line for an option without help
            action = copy.copy(action)
            action.help = self._note(action)
        return super()._format_action(action)


class _Parser(argparse.ArgumentParser):
    """argparse with a one-line error (no usage block): `hybridinfer run: error: argument -n: ...`; every value must
    be UTF-8 text (bytes that are not arrive as lone surrogates, which no prompt, path or output can carry); a --help
    that names each option's default (_HelpFormatter; subcommands' parsers are _Parsers too)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise UsageError(message)

    def _get_value(self, action, arg_string):
        if isinstance(arg_string, str):
            try:
                arg_string.encode("utf-8")
            except UnicodeEncodeError:
                raise argparse.ArgumentError(action, f"not UTF-8 text: {arg_string!r}") from None
        return super()._get_value(action, arg_string)


def _usage(message: str) -> UsageError:
    print(f"hybridinfer: error: {message}", file=sys.stderr)
    return UsageError(message)


INT64_MAX = (1 << 63) - 1


def _int_in(lo: int, hi: int):
    """An argparse type: an integer in [lo, hi] (the flag's name comes with argparse's message)."""

    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:  # not a number, or more digits than int() converts
            raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {s!r}")
        if v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {s!r}")
        return v

    parse.bounds = (lo, hi)  # read by the tests that try every numeric flag past its ends
    return parse


def _int_at_least(lo: int):
    """An argparse type: an integer >= lo that a 64-bit signed integer holds (what the numeric code takes)."""
    return _int_in(lo, INT64_MAX)


# -t/--threads: at most the SIMD library's pool (hi_ctx_new refuses more)
threads_int = _int_in(1, MAX_THREADS)

# a seed: any 64-bit pattern, signed or not (the sampler keeps its low 64 bits)
seed_int = _int_in(-(1 << 63), (1 << 64) - 1)


def _finite(s: str) -> float:
    """An argparse type: a finite float (nan and inf pass float() but mean nothing as a sampling parameter)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {s!r}") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {s!r}")
    return v


def seconds(s: str) -> float:
    """An argparse type: a positive finite number of seconds."""
    v = _finite(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"a time in seconds must be > 0, got {s!r}")
    return v


def gb_per_s(s: str) -> float:
    """An argparse type: a positive finite rate in GB/s (10^9 bytes/s), returned in bytes/s."""
    v = _finite(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"a rate in GB/s must be > 0, got {s!r}")
    return v * 1e9


def add_card_profile(p: argparse.ArgumentParser) -> None:
    from ..backends.gpu.cards import PROFILES

    p.add_argument("--card-profile", default=None, choices=sorted(PROFILES),
                   help="GPU prefill compiled and tiled as for that class of old card (63 registers a thread for "
                        "fermi, its launch bounds, 48 KiB of shared memory a block), on this card")


def _atoi(s: str) -> int:
    """C's atoi, as llama.cpp reads its numeric environment variables: the leading integer, 0 without one."""
    m = re.match(r"\s*[+-]?\d+", s)
    return int(m.group()) if m else 0


def add_cache_types(p: argparse.ArgumentParser, rotate: bool = False, default: str | None = "f32",
                    note: str = "") -> None:
    """llama.cpp's -ctk / -ctv (the K/V cache types) and, with `rotate`, --no-cache-rotate; note: said after each
    type flag's help (where the default is not f32)."""
    names = list(CACHE_TYPES)
    for role, flags in (("K", ("-ctk", "--cache-type-k")), ("V", ("-ctv", "--cache-type-v"))):
        p.add_argument(*flags, default=default, choices=names, metavar="TYPE",
                       help=f"type the {role} cache rows are kept in: {', '.join(names)} (as llama.cpp's "
                            f"{flags[0]}){note}")
    if rotate:
        p.add_argument("--no-cache-rotate", action="store_true",
                       default=_atoi(os.environ.get("LLAMA_ATTN_ROT_DISABLE", "")) != 0,
                       help="keep quantized K/V rows unrotated (default: Walsh-Hadamard rotated as llama.cpp "
                            "does, unless the env LLAMA_ATTN_ROT_DISABLE is a nonzero number, as there)")


def add_model_source(p, required: bool = False, model_help: str | None = None) -> None:
    """-m/--model and llama.cpp's -hf/-hff/-hft (a model on the Hugging Face Hub), one of -m and -hf at most
    (`required`: exactly one)."""
    g = p.add_mutually_exclusive_group(required=required)
    g.add_argument("-m", "--model",
                   help=model_help or "GGUF file (default: the embedded SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("-hf", "-hfr", "--hf-repo", dest="hf_repo", metavar="OWNER/REPO[:QUANT|:FILE]",
                   help="a GGUF on the Hugging Face Hub, downloaded once into its cache (HF_HOME, HF_ENDPOINT and "
                        "HF_HUB_OFFLINE=1 are honoured): QUANT a tag such as Q4_K_M, any case (none: Q4_K_M, else "
                        "the first GGUF), or a FILE.gguf in the repository")
    p.add_argument("-hff", "--hf-file", default=None, metavar="FILE",
                   help="with -hf: this file of the repository (instead of a QUANT)")
    p.add_argument("-hft", "--hf-token", default=None, metavar="TOKEN",
                   help="the Hub token sent with -hf (default: huggingface_hub's: the env HF_TOKEN, else the saved "
                        "login)")


def resolve_hf(a) -> None:
    """A -hf model (-hf/-hff/-hft) downloaded or found in the cache, its path put in a.model (so every command,
    and each --ray shard, sees a file); a progress bar on a terminal. `a.env_hf` (serve: LLAMA_ARG_HF_REPO and
    LLAMA_ARG_HF_FILE) stands in for -hf/-hff when neither -m nor -hf is given."""
    repo, file = getattr(a, "hf_repo", None), getattr(a, "hf_file", None)
    env_repo, env_file = getattr(a, "env_hf", (None, None))
    if env_repo and not repo and a.model is None:
        repo, file = env_repo, file or env_file
    if file and not repo:
        raise _usage(f"-hff/--hf-file {file!r} needs -hf OWNER/REPO")
    if not repo:
        return
    from ..format.hub import resolve_pair

    # the vision projector beside the model comes too (llama.cpp's -hf), unless --mmproj names one or --no-mmproj
    want = hasattr(a, "mmproj") and a.mmproj is None and not getattr(a, "no_mmproj", False)
    a.model, mm = resolve_pair(repo, file=file, token=a.hf_token, progress=show_progress(a), mmproj=want)
    if mm is not None:
        a.mmproj = mm
    a.hf_repo = a.hf_file = None


def env_defaults(p: argparse.ArgumentParser, table: dict[str, str]) -> None:
    """llama-server's environment variables (LLAMA_ARG_CTX_SIZE=4096 ...): each one set is its flag's default, so
    a flag on the command line wins, as there; its value is checked as the flag's (a bad one is a usage error
    naming the variable) and --help names the variable."""
    actions = {a.dest: a for a in p._actions}
    for var, dest in table.items():
        act = actions[dest]
        act.help = f"{act.help} [env {var}]" if act.help else f"[env {var}]"
        val = os.environ.get(var)
        if val is None:
            continue
        act.default = val  # argparse converts a string default with the flag's type when the flag is absent
        if act.type is not None:
            act.type = _named_env(act.type, var, val)


def _named_env(conv, var: str, val: str):
    def parse(s: str):
        try:
            return conv(s)
        except (argparse.ArgumentTypeError, ValueError) as e:
            if s != val:
                raise
            raise argparse.ArgumentTypeError(f"{e} (the value of the env {var})") from None

    parse.__name__ = getattr(conv, "__name__", "value")
    if hasattr(conv, "bounds"):
        parse.bounds = conv.bounds
    return parse


def add_model_names(p: argparse.ArgumentParser) -> None:
    """-a/--alias (llama-server's; --model-name, the earlier name, kept) and --strict-model-name, for serve and
    batch."""
    p.add_argument("-a", "--alias", "--model-name", dest="alias", action="append", default=[], metavar="NAME",
                   help="the model's name in answers and /v1/models (repeatable: the first is reported, each is "
                        "listed; default: the GGUF's file name without .gguf)")
    p.add_argument("--strict-model-name", action="store_true",
                   help="a request's `model` must be the served name or an alias, else 404 (as vLLM's "
                        "--served-model-name); by default the one loaded model answers whatever name is given, "
                        "as llama-server does")


def show_progress(a) -> bool:
    """Progress bars (a download, the weights' copy, a long prefill) go to stderr when it is a terminal, unless
    --no-progress."""
    return sys.stderr.isatty() and not getattr(a, "no_progress", False)


def _add_model(p: argparse.ArgumentParser, required: bool = False) -> None:
    add_model_source(p, required)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bars on stderr (a -hf download, the weights' copy and repacking, a long "
                        "prefill); by default they are shown when stderr is a terminal")
    p.add_argument("--backend", default=os.environ.get("HYBRIDINFER_BACKEND") or "auto",
                   choices=["reference", "cpu", "gpu", "auto"],
                   help="compute backend: " + BACKEND_HELP + " (default auto)")
    p.add_argument("-c", "--ctx-size", "--n-ctx", dest="n_ctx", type=_int_at_least(1), default=None,
                   help="context of each sequence in tokens, at most the model's trained length (default: the "
                        "trained length where the K/V of --max-seqs sequences that long fits the available memory "
                        "and, with GPU prefill, a pass's K/V the VRAM budget; else the longest that fits, said on "
                        "stderr)")
    add_cache_types(p, rotate=True)
    p.add_argument("-t", "--threads", type=threads_int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--vram-budget", type=parse_sizes, default=None,
                   help="GPU memory the gpu backend may use, e.g. 6GiB, or one a device with --devices, e.g. "
                        "5GiB,11GiB (default: the card's free memory - 512MiB)")
    p.add_argument("--devices", type=device_list, default=None, metavar="0,1,...",
                   help="GPU prefill over these CUDA devices, shared as --split-mode says, the rows crossing through "
                        "pinned host memory (a repeated index: another context on that card)")
    p.add_argument("-sm", "--split-mode", type=split_mode, default=None, help=SPLIT_HELP)
    p.add_argument("-nkvo", "--no-kv-offload", action="store_true",
                   help="GPU prefill keeps every pass's K/V in host memory and streams each attention layer's "
                        "through the card (default: only a pass too long for its K/V to stay on the card beside "
                        "the weights does)")
    add_card_profile(p)
    p.add_argument("--isa", default=os.environ.get("HYBRIDINFER_ISA"),
                   help="force the SIMD path: scalar | ssse3 | avx2 | avx512vnni (env HYBRIDINFER_ISA)")
    p.add_argument("--weights", default="auto", choices=["auto", "copy", "mmap"],
                   help="where CPU decode reads the weights: a copy in huge pages (faster), the file's memory "
                        "mapping (no copy), or auto: a copy when it takes at most half the available memory")
    p.add_argument("--ram-budget", type=parse_size, default=None,
                   help="host memory the weights may take, e.g. 64GiB: every tensor but the routed experts stays "
                        "resident with the most used experts, the others are read from the GGUF when routing selects "
                        "them, into a usage-counted cache (GPU prefill: the experts the card does not keep are read "
                        "each prompt pass, and the budget is split with CPU decode); without it the whole model is in "
                        "RAM")
    p.add_argument("--expert-io", default="pread", choices=["pread", "direct"],
                   help="how --ram-budget reads experts: pread through the page cache, or direct (O_DIRECT, "
                        "bypassing it) (default pread)")
    p.add_argument("-np", "--parallel", "--max-seqs", dest="max_seqs", type=_int_at_least(1), default=8,
                   help="sequences decoded together at most by the scheduler (llama.cpp's -np/--parallel; "
                        "default 8)")
    p.add_argument("--step-tokens", type=_int_at_least(1), default=DEFAULT_STEP_TOKENS,
                   help="tokens one scheduler step computes: each running sequence's next token, then chunks of "
                        "waiting prompts up to this (as llama.cpp's --batch-size); a long prompt delays running "
                        f"streams by one step at a time (default {DEFAULT_STEP_TOKENS})")
    p.add_argument("--state-budget", type=parse_size, default=None,
                   help="bytes of sequence states and K/V the scheduler may hold at once, e.g. 4GiB (default: no "
                        "limit); a request that cannot fit alone is refused")
    p.add_argument("--chat-template-file", default=None,
                   help="a Jinja chat template used instead of the GGUF's (as llama-server's --chat-template-file)")
    p.add_argument("-mm", "--mmproj", default=None, metavar="FILE",
                   help="an mmproj GGUF: the vision tower that turns images into the model's rows (as llama.cpp's "
                        "--mmproj; refused unless it was made for this model's width). With -hf, the repository's "
                        "mmproj beside the model is taken unless this or --no-mmproj is given")
    p.add_argument("--no-mmproj", action="store_true",
                   help="with -hf: do not fetch or load the repository's vision projector (llama.cpp's --no-mmproj)")
    p.add_argument("--image-min-tokens", type=_int_at_least(1), default=None,
                   help="an image is resized to give at least this many tokens (default: Qwen3.5's processor, 64)")
    p.add_argument("--image-max-tokens", type=_int_at_least(1), default=None,
                   help="and at most this many; a larger image is scaled down (default: Qwen3.5's processor, 16384; "
                        "llama.cpp takes 4096)")
    from ..engine.spec import DEFAULT_DRAFT_MAX, MAX_DRAFT, SPEC_ALIASES, SPEC_TYPES

    p.add_argument("--spec-type", default=None, choices=[*SPEC_TYPES, *SPEC_ALIASES],
                   help="speculative decoding: mtp (drafts by the file's multi-token-prediction block; llama.cpp's "
                        "draft-mtp), ngram (drafts by prompt lookup, no extra weights; llama.cpp's ngram-simple names "
                        "it too) or none; the output is the same tokens as without (default: mtp where the file has "
                        "the block, else none)")
    p.add_argument("--draft-max", "--spec-draft-n-max", dest="draft_max", type=_int_in(1, MAX_DRAFT),
                   default=DEFAULT_DRAFT_MAX,
                   help=f"tokens drafted at most per step, 1-{MAX_DRAFT} (default {DEFAULT_DRAFT_MAX})")
    from .numa import add_numa_flag

    add_numa_flag(p)


def _add_cache(p: argparse.ArgumentParser, snapshot_stride: int | None = None) -> None:
    """The prefix-cache flags; snapshot_stride: the command's default for --snapshot-stride (None: by backend)."""
    g = p.add_argument_group("prefix cache (reuse of repeated prompt prefixes)")
    g.add_argument("--prefix-cache-ram", type=parse_size, default=parse_size("2GiB"),
                   help="RAM budget for state snapshots, e.g. 2GiB, 512MiB; 0 turns the cache off (default 2GiB)")
    g.add_argument("--prefix-cache-dir", default=os.environ.get("HYBRIDINFER_PREFIX_CACHE_DIR"),
                   help="directory of an on-disk snapshot store shared by processes (default: none)")
    g.add_argument("--prefix-cache-disk", type=parse_size, default=parse_size("16GiB"),
                   help="disk budget of --prefix-cache-dir (default 16GiB)")
    stride = "256 on the CPU, 1024 with GPU prefill" if snapshot_stride is None else str(snapshot_stride)
    g.add_argument("--snapshot-stride", type=_int_at_least(0), default=snapshot_stride,
                   help=f"snapshot the state every N prompt tokens during prefill (default {stride}; 0: only at "
                        "prompt ends, chat turns and shared prefixes)")


def parse_sizes(s: str):
    """One size ('6GiB') or a comma list of them ('5GiB,11GiB': one a device) -> bytes or a list of bytes."""
    parts = str(s).split(",")
    return parse_size(parts[0]) if len(parts) == 1 else [parse_size(x) for x in parts]


def split_mode(s: str) -> str:
    """--split-mode: auto, layer or expert (gpu/expert_card.SPLIT_MODES)."""
    from ..backends.gpu.expert_card import check_split_mode

    try:
        return check_split_mode(str(s).strip())
    except ParameterError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def split_modes(text: str) -> list[str]:
    """bench's --split-mode: one mode or several, comma-separated, each at most once."""
    from ..backends.gpu.expert_card import check_split_mode

    modes = [check_split_mode(x.strip()) for x in str(text).split(",")]
    if len(set(modes)) != len(modes):
        raise ParameterError(f"--split-mode {text!r} names a mode twice")
    return modes


SPLIT_HELP = ("how --devices share a prefill: layer (a range of layers each, pipelined), expert (every card on every "
              "layer, each with its share of the routed experts; a MoE model), or auto (the time model's choice: "
              "expert where the weight stream bounds the prefill) (default auto)")


def device_list(s: str) -> list[int]:
    """'0,1' -> [0, 1]: CUDA device indices (a repeat is allowed: another context on that card)."""
    try:
        out = [int(x) for x in str(s).split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of device indices: {s!r} (e.g. 0,1)") from None
    if min(out) < 0:
        raise argparse.ArgumentTypeError(f"device indices are >= 0, got {s!r}")
    return out


def parse_size(s: str) -> int:
    """'2GiB', '512MiB', '1.5GB', '4096' -> bytes."""
    units = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
             "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
    t = str(s).strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    try:
        unit = units[t[len(num):].strip()]
        try:
            v: float = int(num) * unit  # exact, up to the last byte of the int64 bound
        except ValueError:
            v = float(num) * unit
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 2GiB, 512MiB, 1e9)") from None
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 2GiB, 512MiB, 1e9)")
    if v < 0:
        raise argparse.ArgumentTypeError(f"a size must be >= 0, got {s!r}")
    if v > INT64_MAX:
        raise argparse.ArgumentTypeError(f"a size must be at most {INT64_MAX} bytes, got {s!r}")
    return int(v)


def size_text(n: int) -> str:
    """A byte count as parse_size reads it back: the largest binary unit that divides it (2GiB), else bytes."""
    for unit, name in ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n and n % unit == 0:
            return f"{n // unit}{name}"
    return str(n)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=_int_at_least(0), default=64, help="max new tokens (default 64)")
    p.add_argument("--temp", type=_finite, default=0.0,
                   help="sampling temperature (default 0: greedy, so a command gives the same answer each time; "
                        "e.g. 0.8 to sample. Engine.generate and a server request without `temperature` take "
                        "llama.cpp's 0.8: an API caller chooses per request)")
    p.add_argument("--top-k", type=_int_at_least(0), default=40, help="0: off")
    p.add_argument("--top-p", type=_finite, default=0.95)
    p.add_argument("--min-p", type=_finite, default=0.05)
    p.add_argument("--repeat-penalty", type=_finite, default=1.0)
    p.add_argument("--seed", type=seed_int, default=None)
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message (chat mode)")
    p.add_argument("--no-think", action="store_true", help="enable_thinking=false for Qwen templates")
    p.add_argument("--stats", action="store_true",
                   help="print prompt/reused/prefilled tokens and speeds to stderr after each answer")


def _check_output(path: str, flag: str) -> None:
    """An output file's folder must exist and the path must be a regular file if it exists (not a folder, a FIFO or
    a device such as /dev/full): said before any work is done."""
    if os.path.isdir(path):
        raise ParameterError(f"{flag} {path!r} is a directory, not a file name")
    if os.path.exists(path):
        check_regular(path, os.stat(path).st_mode, flag)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ParameterError(f"{flag} {path!r}: the folder {folder!r} does not exist")


def write_output(path: str, flag: str, write) -> None:
    """write(sink) into `path`, exactly that name (sink.write(bytes)), opened for binary writing: created, or
    truncated once it is known to be a regular file (O_NONBLOCK, so a FIFO put there cannot block the open). A write
    that fails (a full disk) leaves no partial file and is an OSError naming the path."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0), 0o666)
    try:
        check_regular(path, os.fstat(fd).st_mode, flag)
        os.set_blocking(fd, True)
        os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    f = os.fdopen(fd, "wb")
    try:
        # write() gets an object with only .write: np.save writes a real file with fwrite (ndarray.tofile), whose
        # failure loses errno; through .write a failure says why (no space left on device)
        write(SimpleNamespace(write=f.write))
        f.close()
    except OSError as e:
        try:
            f.close()
        except OSError:
            pass  # the buffer it could not flush: the error is the write's, already in hand
        try:
            os.unlink(path)
        except OSError:
            pass
        raise OSError(e.errno, e.strerror, path) from None


def positive_ints(flag: str, value: str, what: str) -> tuple[int, ...]:
    """A flag's comma-separated positive integers ("128,947,4096"), each at most INT64_MAX."""
    try:
        out = tuple(int(x) for x in value.split(","))
    except ValueError:
        raise ParameterError(f"{flag} must be comma-separated integers, got {value!r}") from None
    if not out or min(out) < 1 or max(out) > INT64_MAX:
        raise ParameterError(f"{flag} must be positive {what} (at most {INT64_MAX}), got {value!r}")
    return out


def _parse_tokens(s: str) -> list[int]:
    try:
        return [int(x) for x in s.replace(" ", "").split(",") if x]
    except ValueError:
        raise ParameterError(f"--tokens must be comma-separated integers, got {s!r}") from None
