"""A disk cache of converted GGUF models: dequantised weights and tokenizer, loaded in seconds.

transformers converts a GGUF on every load: for the default pair that is 35–50 s on 2 CPU
cores, ~26 s of it the gguf reader parsing the file's metadata three times (config,
tokenizer, weights). The converted model is ordinary fp32 safetensors plus tokenizer.json,
which load in about a second. So the first load converts and writes that; later loads read it.

Layout under the cache root (``$BACKOFF_CACHE_DIR``, default ``~/.cache/backoff-serve``)::

    gguf/hashes.json   {"<path>|<size>|<mtime_ns>": sha256}: a file is hashed once per version
    gguf/<key>/        config.json, generation_config.json, model.safetensors, tokenizer files,
                       manifest.json (written last: format, source hash, file sizes, tied names)
    gguf/<key>.lock    held while one process converts; the others wait and then read

``key`` = format version + the GGUF's sha256 + the transformers version (the conversion is
transformers' code): a changed file or a new converter misses, never reads a stale entry.

Invariants: an entry directory is complete or absent (it is built in a temporary directory
beside it and published by ``os.rename``, which fails if another process published first;
the loser drops its copy and the winner's is used). An entry whose manifest is missing, whose
file sizes differ, or that fails to load is ignored, removed and rebuilt. Where the root
cannot be written, one :class:`CacheWarning` line says so and the model is converted as before.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import pathlib
import shutil
import tempfile
import warnings
from typing import Callable

import filelock
import torch
import transformers
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

ROOT_ENV = "BACKOFF_CACHE_DIR"
DEFAULT_ROOT = pathlib.Path("~/.cache/backoff-serve")
FORMAT = 1  # bump when the entry layout or what is stored changes
MANIFEST = "manifest.json"
WEIGHTS = "model.safetensors"
LOCK_TIMEOUT_S = 900  # a converting process normally needs < 1 min; past this, convert alone
_HASH_CHUNK = 8 << 20
_HASHES_KEPT = 64

Loaded = tuple[PreTrainedModel, PreTrainedTokenizerBase]


class CacheWarning(UserWarning):
    """The model cache could not be used; the model is loaded the slow way."""


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT).expanduser()


def _stat_key(path: pathlib.Path) -> str:
    st = path.stat()
    return f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"


def file_sha256(path: pathlib.Path, root: pathlib.Path) -> str:
    """sha256 of ``path``, computed once per (path, size, mtime) and remembered under ``root``.

    Size + mtime alone would miss an in-place rewrite within the mtime resolution; the
    content hash is what keys the entry, the stat triple only saves recomputing it (~0.3 s
    for the 98 MB default GGUF).
    """
    hashes_file = root / "gguf" / "hashes.json"
    stat_key = _stat_key(path)
    try:
        hashes = json.loads(hashes_file.read_text())
        if isinstance(hashes, dict) and isinstance(hashes.get(stat_key), str):
            return hashes[stat_key]
    except (OSError, ValueError):
        hashes = {}
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    if _stat_key(path) != stat_key:  # changed while hashing: do not remember a torn hash
        return digest
    hashes = {k: v for k, v in hashes.items() if isinstance(v, str)} if isinstance(hashes, dict) else {}
    hashes[stat_key] = digest
    try:
        _write_text_atomically(hashes_file, json.dumps(dict(list(hashes.items())[-_HASHES_KEPT:]), indent=1))
    except OSError:
        pass  # an unwritable root is reported once, by the caller
    return digest


def entry_key(sha256: str) -> str:
    return f"v{FORMAT}-{sha256[:32]}-tf{transformers.__version__}"


def _write_text_atomically(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------


def _tied_names(model: PreTrainedModel) -> dict[str, str]:
    """{name: name it shares storage with} for tensors stored once (M_L's LM head is its embedding)."""
    first_by_ptr, tied = {}, {}
    for name, t in model.state_dict().items():
        ptr = (t.data_ptr(), t.shape, t.stride())
        if ptr in first_by_ptr:
            tied[name] = first_by_ptr[ptr]
        else:
            first_by_ptr[ptr] = name
    return tied


def write_entry(entry: pathlib.Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, source: dict) -> bool:
    """Publish ``model`` + ``tokenizer`` as ``entry``. False: another process published it first."""
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(dir=entry.parent, prefix=f".{entry.name}.tmp-"))
    try:
        config = copy.deepcopy(model.config)
        if hasattr(config, "quantization_config"):  # the GGUF marker: the entry is plain fp32
            del config.quantization_config
        config.save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tied = _tied_names(model)
        state = {n: t.detach().cpu().contiguous() for n, t in model.state_dict().items() if n not in tied}
        save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        tokenizer.save_pretrained(tmp)
        files = {p.name: p.stat().st_size for p in sorted(tmp.iterdir())}
        manifest = {"format": FORMAT, "transformers": transformers.__version__, "tied": tied, "files": files, **source}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        _share_with_other_users(tmp)
        try:
            os.rename(tmp, entry)  # atomic; refuses a non-empty existing entry
            return True
        except OSError:
            if not entry.is_dir():
                raise
            return False  # the winner's entry stays
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _share_with_other_users(tmp: pathlib.Path) -> None:
    """mkdtemp makes 0700 and safetensors 0600: give the entry the umask's usual modes instead."""
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)
    for p in tmp.iterdir():
        p.chmod(0o666 & ~umask)


def read_entry(entry: pathlib.Path) -> Loaded:
    """(model in eval mode, fp32 on the CPU; tokenizer). Raises on a missing, partial or corrupt entry."""
    manifest = json.loads((entry / MANIFEST).read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"format {manifest.get('format')} != {FORMAT}")
    for name, size in manifest["files"].items():
        if (entry / name).stat().st_size != size:
            raise ValueError(f"{name}: {(entry / name).stat().st_size} bytes, manifest says {size}")
    tokenizer = AutoTokenizer.from_pretrained(entry)
    model = AutoModelForCausalLM.from_pretrained(entry, dtype=torch.float32).eval()
    state = model.state_dict()
    for name, target in manifest["tied"].items():
        if state[name].data_ptr() != state[target].data_ptr():
            raise ValueError(f"{name} should share {target}'s storage")
    return model, tokenizer


def _discard(entry: pathlib.Path) -> None:
    """Remove a broken entry: renamed away first, so no reader sees it half deleted."""
    trash = entry.parent / f".{entry.name}.trash-{os.getpid()}"
    try:
        os.rename(entry, trash)
    except FileNotFoundError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def _try_read(entry: pathlib.Path, warn: bool = True) -> Loaded | None:
    """The entry's model, or None for a missing one or (with a CacheWarning) a broken one."""
    if not (entry / MANIFEST).is_file():
        return None
    try:
        return read_entry(entry)
    except Exception as e:  # noqa: BLE001 - any failure to read means "rebuild", never a crash
        if warn:
            warnings.warn(
                f"ignoring a broken model cache entry {entry} ({e}); rebuilding it", CacheWarning, stacklevel=3
            )
        return None


# ---------------------------------------------------------------------------------------
# the cached load
# ---------------------------------------------------------------------------------------


def load_converted(source: pathlib.Path, convert: Callable[[], Loaded], root: pathlib.Path | None = None) -> Loaded:
    """``convert()``'s (model, tokenizer) for the file ``source``, from the cache when it holds
    the conversion of this exact file, else converted once and cached (with progress)."""
    root = cache_root() if root is None else root
    sha256 = file_sha256(source, root)
    entry = root / "gguf" / entry_key(sha256)
    if (hit := _try_read(entry)) is not None:
        return hit
    seen_broken = (entry / MANIFEST).is_file()  # already reported
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        lock = filelock.FileLock(str(entry) + ".lock", timeout=LOCK_TIMEOUT_S)
        lock.acquire()
    except (OSError, filelock.Timeout) as e:
        warnings.warn(
            f"model cache {root} not usable ({e}); converting {source.name} the slow way "
            f"(set {ROOT_ENV} to a writable folder)",
            CacheWarning,
            stacklevel=2,
        )
        return convert()
    try:
        if (hit := _try_read(entry, warn=not seen_broken)) is not None:  # converted while we waited
            return hit
        if entry.exists():
            _discard(entry)
        with tqdm(total=2, desc=f"{source.name}: first load, converting once", unit="step") as bar:
            model, tokenizer = convert()
            bar.update(1)
            bar.set_postfix_str(f"writing {entry}")
            try:
                write_entry(entry, model, tokenizer, {"source": str(source), "sha256": sha256})
            except OSError as e:
                warnings.warn(
                    f"model cache {root} not writable ({e}); the next load converts again "
                    f"(set {ROOT_ENV} to a writable folder)",
                    CacheWarning,
                    stacklevel=2,
                )
            bar.update(1)
        return model, tokenizer
    finally:
        lock.release()


def convert_gguf(path: pathlib.Path) -> Loaded:
    """transformers' own GGUF conversion (dequantised to fp32): the slow path."""
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def load_gguf(path: pathlib.Path, root: pathlib.Path | None = None) -> Loaded:
    """(fp32 model on the CPU in eval mode, tokenizer) of a GGUF file, through the cache."""
    path = pathlib.Path(path)
    return load_converted(path, lambda: convert_gguf(path), root)
