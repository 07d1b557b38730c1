"""Models by name: `REPO[:QUANT|:FILE]` on the Hugging Face Hub resolved to a GGUF file in huggingface_hub's cache,
as llama.cpp's `-hf`. huggingface_hub does the transfer and keeps the cache (resumed after a dropped connection,
its progress bar); it also reads its own environment: HF_ENDPOINT, HF_HUB_OFFLINE, HF_HUB_CACHE / HF_HOME and
HF_TOKEN (or the token `hf auth login` saved)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ..errors import HubError

# llama.cpp's choice when the name gives no quant: Q4_K_M, else the first GGUF of the repository
DEFAULT_QUANT = "Q4_K_M"

# the quant tag at the end of a GGUF's name: Q4_K_M, IQ2_XXS, UD-Q4_K_XL, TQ1_0, MXFP4_MOE, BF16, F16, F32
_TAG = re.compile(r"(?i)(?:^|[-._])((?:UD-)?(?:I?Q\d|TQ\d|MXFP4|BF16|F16|F32)[A-Z0-9_]*)$")
# a split GGUF's parts: NAME-00001-of-00003.gguf
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class HubSpec:
    """One parsed `-hf` value: the repository, and a quant tag or a file in it (both None: the default)."""

    repo: str
    quant: str | None = None
    file: str | None = None


def parse_spec(spec: str, file: str | None = None) -> HubSpec:
    """`owner/name`, `owner/name:Q4_K_M` or `owner/name:path/to/file.gguf` (and llama.cpp's -hff FILE, which wins
    over a quant); a HubError naming the value when it is none of these."""
    repo, _, rest = str(spec).strip().partition(":")
    parts = repo.split("/")
    if len(parts) != 2 or not all(parts) or any(c.isspace() for c in repo):
        raise HubError(f"-hf wants OWNER/REPO[:QUANT|:FILE.gguf], got {spec!r}")
    if file:
        return HubSpec(repo, None, file)
    if not rest:
        return HubSpec(repo)
    if rest.lower().endswith(".gguf"):
        return HubSpec(repo, None, rest)
    return HubSpec(repo, rest, None)


def quant_tag(path: str) -> str | None:
    """The quant tag a GGUF's name ends with ("Qwen3.5-9B-UD-Q4_K_XL.gguf" -> "UD-Q4_K_XL"), or None."""
    stem = _SPLIT.sub("", os.path.basename(path))
    stem = stem[:-5] if stem.lower().endswith(".gguf") else stem
    m = _TAG.search(stem)
    return m.group(1) if m else None


def _models(files: list[str]) -> list[str]:
    """The model GGUFs of a listing (a vision projector, mmproj-*.gguf, is no language model)."""
    return sorted(f for f in files if f.lower().endswith(".gguf") and "mmproj" not in os.path.basename(f).lower())


def _split_group(first: str, files: list[str]) -> list[str]:
    """Every part of the split GGUF `first` belongs to (just [first] when it is one file), in order."""
    m = _SPLIT.search(first)
    if not m:
        return [first]
    head, count = first[:m.start()], m.group(2)
    return sorted(f for f in files if (n := _SPLIT.search(f)) and n.group(2) == count and f[:n.start()] == head)


def _one_file(spec: HubSpec, names: list[str]) -> list[str]:
    """`names` when it is one file; a split GGUF is refused before any part downloads (GGUFModel reads one-file
    GGUFs)."""
    if len(names) > 1:
        raise HubError(f"{spec.repo}: {names[0]} is a split GGUF in {len(names)} parts, which hybridinfer does not "
                       f"read: pick a quant in one file, or merge the parts with llama.cpp's "
                       f"`llama-gguf-split --merge` and pass -m")
    return names


def _matches(path: str, quant: str) -> bool:
    """Whether a file is of this quant, case-insensitive: its tag is it, or it sits in a folder named so (large
    repositories keep each quant's split parts in a folder: Q4_K_M/NAME-00001-of-00002.gguf); UD-Q4_K_XL answers
    Q4_K_XL too."""
    q = quant.lower()
    tag = (quant_tag(path) or "").lower()
    folders = [d.lower() for d in path.split("/")[:-1]]
    return q in (tag, tag.removeprefix("ud-")) or q in folders


def pick_files(spec: HubSpec, files: list[str]) -> list[str]:
    """The file(s) of the repository listing `files` that `spec` names: a file by its path, else the GGUF(s) of
    the quant (default Q4_K_M, else the first GGUF, as llama.cpp); a split GGUF gives all its parts. A HubError
    naming what is missing and listing what exists."""
    models = _models(files)
    if spec.file is not None:
        if spec.file not in files:
            raise HubError(f"{spec.repo} has no file {spec.file!r}; its GGUF files: {_listing(models)}")
        return _split_group(spec.file, files)
    if not models:
        raise HubError(f"{spec.repo} holds no GGUF file (its files: {_listing(sorted(files))})")
    quant = spec.quant or DEFAULT_QUANT
    hits = [f for f in models if _matches(f, quant)]
    if not hits and spec.quant is None:
        hits = models
    if not hits:
        raise HubError(f"{spec.repo} has no {spec.quant} GGUF; its quants: {_listing(available_quants(models))}")
    # an exact tag before a UD- one, a single file before split parts, then by name
    hits.sort(key=lambda f: ((quant_tag(f) or "").lower() != quant.lower(), bool(_SPLIT.search(f)), f))
    return _split_group(hits[0], files)


def _quant_bits(path: str) -> int:
    """The bit width in a GGUF name's quant tag (Q4_K_M -> 4, F16 -> 16, BF16 -> 16), 0 without one."""
    m = re.search(r"\d+", quant_tag(path) or "")
    return int(m.group()) if m else 0


def best_mmproj(files: list[str], model: str, quant: str | None = None) -> str | None:
    """The vision projector (a GGUF whose name holds "mmproj") beside `model` in a repository listing, as llama.cpp's
    -hf picks it: in the model's folder or one above it, the deepest such folder first, then a name with the exact
    quant tag asked for, then the closest quant width to that tag's (else to the model's); None when there is none."""
    model_dirs = model.split("/")[:-1]
    want = _quant_bits(f"x-{quant}.gguf") if quant else _quant_bits(model)
    best, best_key = None, None
    for f in files:
        if not f.lower().endswith(".gguf") or "mmproj" not in f.lower():
            continue
        dirs = f.split("/")[:-1]
        if dirs != model_dirs[: len(dirs)]:
            continue  # not in a folder the model sits in
        exact = bool(quant) and f"-{quant.upper()}." in f.upper()
        key = (len(dirs), exact, -abs(_quant_bits(f) - want))
        if best_key is None or key > best_key:
            best, best_key = f, key
    return best


def available_quants(models: list[str]) -> list[str]:
    tags = {quant_tag(f) or os.path.basename(f) for f in models}
    return sorted(tags, key=str.lower)


def _listing(items: list[str], most: int = 40) -> str:
    if not items:
        return "none"
    more = f", ... ({len(items) - most} more)" if len(items) > most else ""
    return ", ".join(items[:most]) + more


def _cached_files(repo: str, revision: str, cache_dir: str | None) -> tuple[list[str], str | None]:
    """The files of `repo` at `revision` that huggingface_hub's cache holds (its documented layout:
    models--OWNER--NAME/refs/REVISION names a snapshot folder), and the cache folder looked in."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    root = os.path.join(cache_dir or constants.HF_HUB_CACHE, repo_folder_name(repo_id=repo, repo_type="model"))
    try:
        with open(os.path.join(root, "refs", revision)) as f:
            commit = f.read().strip()
    except OSError:
        commit = revision  # a commit hash given as the revision has no ref file
    snap = os.path.join(root, "snapshots", commit)
    out = []
    for dirpath, _, names in os.walk(snap):
        for n in names:
            out.append(os.path.relpath(os.path.join(dirpath, n), snap).replace(os.sep, "/"))
    return out, root


def _quiet_tqdm():
    from tqdm.auto import tqdm

    class Quiet(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Quiet


def resolve(spec: str | HubSpec, *, file: str | None = None, token: str | None = None, revision: str = "main",
            cache_dir: str | None = None, progress: bool = True) -> str:
    """The model's GGUF only: resolve_pair(...)[0]."""
    return resolve_pair(spec, file=file, token=token, revision=revision, cache_dir=cache_dir, progress=progress,
                        mmproj=False)[0]


def resolve_pair(spec: str | HubSpec, *, file: str | None = None, token: str | None = None, revision: str = "main",
                 cache_dir: str | None = None, progress: bool = True, mmproj: bool = True) -> tuple[str, str | None]:
    """The local path of the GGUF `spec` names (see parse_spec), downloaded into huggingface_hub's cache unless it
    is there already (a split GGUF is refused: hybridinfer reads one-file GGUFs). token: None lets
    huggingface_hub find one (HF_TOKEN, the saved login). progress: huggingface_hub's bar while a file transfers.
    Offline (HF_HUB_OFFLINE=1) only the cache is read. A HubError when the repository, the file or the quant does
    not exist, or when offline (or the Hub cannot be reached) and the cache lacks it. With `mmproj`, also the
    vision projector beside it when the repository has one (best_mmproj, as llama.cpp's -hf): (model, mmproj or
    None)."""
    try:
        import huggingface_hub as hh
        from huggingface_hub import constants, errors
    except ModuleNotFoundError:
        raise HubError("models by name (-hf) need huggingface_hub: pip install huggingface_hub") from None
    spec = spec if isinstance(spec, HubSpec) else parse_spec(spec, file)
    offline = getattr(constants, "is_offline_mode", lambda: constants.HF_HUB_OFFLINE)()
    where = f"{spec.repo} on {constants.ENDPOINT}"
    files: list[str] | None = None
    reason = "HF_HUB_OFFLINE is set"
    if not offline:
        try:
            files = hh.HfApi(token=token).list_repo_files(spec.repo, revision=revision)
        except errors.RevisionNotFoundError:
            raise HubError(f"{where} has no revision {revision!r}") from None
        except errors.RepositoryNotFoundError:
            raise HubError(f"no model repository {where} (or it is private or gated and no token with access "
                           f"was given: set HF_TOKEN or pass -hft)") from None
        except (errors.HfHubHTTPError, OSError) as e:  # the Hub unreachable: the cache may still have it
            reason = f"the Hub could not be reached ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    if files is None:  # offline: what the cache holds stands for the listing
        files, root = _cached_files(spec.repo, revision, cache_dir)
        if not files:
            raise HubError(f"{spec.repo} is not in the cache ({root}) and {reason}")
        try:
            names = _one_file(spec, pick_files(spec, files))
        except HubError as e:
            raise HubError(f"{e} (in the cache, {reason})") from None
    else:
        names = _one_file(spec, pick_files(spec, files))
    name = names[0]
    extra = best_mmproj(files, name, spec.quant) if mmproj else None
    return tuple(_download(hh, errors, spec, n, revision, token, cache_dir, progress, where, reason) if n else None
                 for n in (name, extra))


def _download(hh, errors, spec: HubSpec, name: str, revision: str, token, cache_dir, progress: bool, where: str,
              reason: str) -> str:
    try:
        return hh.hf_hub_download(spec.repo, name, revision=revision, token=token, cache_dir=cache_dir,
                                  tqdm_class=None if progress else _quiet_tqdm())
    except errors.LocalEntryNotFoundError:
        raise HubError(f"{name} of {spec.repo} is not in the cache and {reason}") from None
    except errors.EntryNotFoundError:
        raise HubError(f"{where} has no file {name!r}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise HubError(f"{name} of {spec.repo} could not be downloaded: {str(e).splitlines()[0]}") from None
