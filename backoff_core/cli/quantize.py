"""`backoff quantize`: a model's fp8 checkpoint written once, offline (GPTQ's or
round-to-nearest's e4m3 values, compressed-tensors), then served as stored with
`--large DIR` / the Serve config's model name (docs/fp8.md; backoff_core/models/fp8_export.py).

The model: a directory, a cached hub id, a .gguf file, or the default pair's `default-large` /
`default-small`. GPTQ's calibration text: the corpus' train split by default, never its held-out
split (what benchmarks/fp8_quality.py measures on), or the user's .txt / .md files.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from backoff_core.models.default_pair import DEFAULT_PAIR_NAMES


@dataclass(frozen=True)
class Calibration:
    """GPTQ's inputs: `per_source` evenly spaced windows of `seq_len` tokens a source of `texts`
    (a .txt file or a directory of .txt / .md files: one source; None: the corpus' train split)."""

    texts: str | None = None
    per_source: int = 24
    seq_len: int = 128


def calibration_windows(tokenizer, calib: Calibration = Calibration(), texts_per_source: int = 400):
    """[n, seq_len] token windows evenly spread over each source (of the corpus' train split: at
    most texts_per_source texts of each of its sources)."""
    import torch

    from backoff_core.learning import corpus

    if calib.texts is None:
        sources = [texts[:: max(1, len(texts) // texts_per_source)] for texts in corpus.corpus_texts("train").values()]
    else:
        sources = [_read_texts(Path(calib.texts))]
    windows = [
        corpus.evenly_spaced_windows(corpus.token_stream(tokenizer, texts), calib.seq_len, calib.per_source)
        for texts in sources
    ]
    windows = [w for w in windows if len(w)]
    if not windows:
        raise ValueError(f"calibration text {calib.texts}: fewer than {calib.seq_len} tokens")
    return torch.cat(windows)


def _read_texts(path: Path) -> list[str]:
    if path.is_file():
        return [path.read_text(errors="replace")]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".txt", ".md") and p.is_file())
        if files:
            return [p.read_text(errors="replace") for p in files]
        raise FileNotFoundError(f"calibration text {path}: a directory with no .txt or .md files")
    raise FileNotFoundError(f"calibration text {path}: no such file or directory")


def _load(name: str, dtype: str, device: str):
    """(a private copy of the model, its tokenizer, its source directory or None)."""
    import copy

    from backoff_core.models.fp8 import fp8_layers
    from backoff_core.models.loading import LoadSpec, load_chain, load_model

    spec = LoadSpec(device=device, dtype=dtype, cpu_kernels="default")  # plain nn.Linear layers to quantise
    if name in DEFAULT_PAIR_NAMES:
        chain = load_chain(None, None, spec=spec)
        model = copy.deepcopy(chain.models[DEFAULT_PAIR_NAMES.index(name)])  # the process's cached pair untouched
        return model, chain.tokenizer, None
    path = Path(name)
    if not path.exists():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = path.suffix != ".gguf" and isinstance(try_to_load_from_cache(name, "config.json"), str)
        except ValueError:  # not a hub id's form (a path, say)
            cached = False
        if not cached:
            raise FileNotFoundError(
                f"model {name}: no such directory or file, nor a cached hub id "
                f"(give a model directory, a .gguf file, or {' / '.join(DEFAULT_PAIR_NAMES)})"
            )
    model, tokenizer = load_model(name, spec)
    if fp8_layers(model):
        raise ValueError(f"model {name}: already an fp8 checkpoint")
    return model, tokenizer, (str(path) if path.is_dir() else None)


def write_fp8_checkpoint(
    name: str,
    out: str | Path,
    method: str = "gptq",
    calib: Calibration = Calibration(),
    dtype: str = "float32",
    device: str = "cpu",
) -> Path:
    """`name`'s model quantised to fp8 by `method` and written to `out` as a compressed-tensors
    checkpoint (fp8_export.save_fp8_checkpoint)."""
    from backoff_core.models.fp8_export import METHODS, checkpoint_record, quantize_fp8, save_fp8_checkpoint

    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    if Path(name).exists() and Path(out).resolve() == Path(name).resolve():
        raise ValueError(f"{out}: the output directory is the model's own; write elsewhere")
    if calib.texts is not None and not Path(calib.texts).exists():
        raise FileNotFoundError(f"calibration text {calib.texts}: no such file or directory")
    model, tokenizer, source = _load(name, dtype, device)
    windows = calibration_windows(tokenizer, calib) if method == "gptq" else None
    quantize_fp8(model, method, windows)
    calibration = None
    if windows is not None:
        calibration = dict(asdict(calib), texts=calib.texts or "corpus train split", windows=len(windows))
    return save_fp8_checkpoint(model, tokenizer, out, source, checkpoint_record(name, method, dtype, calibration))


def register(sub) -> None:
    p = sub.add_parser(
        "quantize",
        help="write a model's fp8 checkpoint (compressed-tensors; GPTQ or round-to-nearest) to serve as stored",
        description="Loads a model, chooses its decoder linears' e4m3 values (128 x 128 block scales) and "
        "writes a compressed-tensors fp8 checkpoint directory that `--large DIR` / `--small DIR` and the Serve "
        "config load as stored.",
    )
    p.add_argument("out", help="the checkpoint directory to write")
    p.add_argument(
        "--model",
        default=DEFAULT_PAIR_NAMES[1],
        help=f"a model directory, cached hub id or .gguf file, or {' / '.join(DEFAULT_PAIR_NAMES)} "
        f"(the default pair's; default {DEFAULT_PAIR_NAMES[1]})",
    )
    p.add_argument(
        "--method",
        choices=("gptq", "rtn"),
        default="gptq",
        help="gptq: values chosen against calibration text (default); rtn: round to nearest (what quantize: fp8 loads)",
    )
    p.add_argument(
        "--calibration",
        default=None,
        metavar="PATH",
        help="GPTQ's calibration text: a .txt file or a directory of .txt / .md files "
        "(default: the corpus' train split, never its held-out split)",
    )
    p.add_argument("--calib-windows", type=int, default=24, help="calibration windows a source (default 24)")
    p.add_argument("--calib-seq-len", type=int, default=128, help="tokens a calibration window (default 128)")
    p.add_argument(
        "--dtype", default="float32", help="the dtype of the tensors that stay unquantised (default float32)"
    )
    p.add_argument("--device", default="cpu", help="where to quantise: cpu, cuda, cuda:1, auto (default cpu)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=_quantize)


def _quantize(args) -> int:
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ValueError(f"{out} exists: give --overwrite to replace it, or another directory")
    if args.calib_windows < 1 or args.calib_seq_len < 2:
        raise ValueError("--calib-windows must be >= 1 and --calib-seq-len >= 2")
    calib = Calibration(args.calibration, args.calib_windows, args.calib_seq_len)
    written = write_fp8_checkpoint(args.model, out, args.method, calib, args.dtype, args.device)
    size = sum(f.stat().st_size for f in written.iterdir()) / 2**20
    print(
        f"wrote {written} ({args.method}, {size:.0f} MiB): serve it as stored with --large {written} (an M_S: --small)"
    )
    return 0
