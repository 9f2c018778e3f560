"""Loading a chain of causal LMs that share one tokenizer.

A model is named by a local directory, a Hugging Face id already in the local cache (no
hub is reachable here), or a `.gguf` file (loaded through transformers + gguf). No model
named at all means the embedded default pair (backoff_core.models.default_pair).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from backoff_core.models.default_pair import DEFAULT_PAIR_NAMES, load_default_large, load_default_pair
from backoff_core.models.fp8 import check_quantize, quantize_model
from backoff_core.models.fp8_checkpoint import compressed_fp8_config, load_compressed_fp8
from backoff_core.models.gguf_cache import load_gguf
from backoff_core.models.kernels import converts, use_cpu_kernels

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


class TokenizerMismatch(ValueError):
    """Two models of a chain do not share a tokenizer."""


@dataclass(frozen=True)
class LoadSpec:
    device: str = "cpu"  # "cpu", "cuda", "cuda:1", or "auto" (cuda if present)
    dtype: str = "float32"
    device_map: str | None = None  # accelerate device map ("auto") for models bigger than a GPU
    cpu_kernels: str = "mkldnn"  # "mkldnn": oneDNN linear layers on CPU float32 (kernels.py); "default"
    # "fp8": the decoder's linear layers in e4m3 with 128 x 128 block scales (fp8.py, docs/fp8.md);
    # a medium model of a longer chain keeps the model's dtype
    quantize_small: str = "none"
    quantize_large: str = "none"

    def __post_init__(self) -> None:
        check_quantize(self.quantize_small, "quantize_small")
        check_quantize(self.quantize_large, "quantize_large")

    def quantize_at(self, level: int, num_levels: int) -> str:
        """The quantisation of the model at `level` (0 = M_S) of a chain of `num_levels`."""
        if level == 0:
            return self.quantize_small
        return self.quantize_large if level == num_levels - 1 else "none"

    def quantizes(self) -> bool:
        return "fp8" in (self.quantize_small, self.quantize_large)

    def torch_dtype(self) -> torch.dtype:
        try:
            return DTYPES[self.dtype]
        except KeyError:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose one of {', '.join(DTYPES)}") from None

    def torch_device(self) -> str:
        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} asked for, but no CUDA device is available")
        return self.device

    def converts_in_place(self) -> bool:
        """Whether use_cpu_kernels converts the models this spec loads in place (kernels.converts):
        then the default pair is loaded past its in-process cache (`private`). Quantising
        converts in place too."""
        return converts(self.torch_device(), self.torch_dtype(), self.cpu_kernels) or self.quantizes()


def _where(name: str) -> tuple[str, dict]:
    """(path or id, from_pretrained keywords) for a directory, a cached hub id or a .gguf file."""
    path = Path(name)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"no GGUF file at {path}")
        return str(path.parent), {"gguf_file": path.name}
    # a hub id: only from the local cache, never fetched
    return name, ({} if path.exists() else {"local_files_only": True})


def load_tokenizer(name: str):
    where, extra = _where(name)
    return AutoTokenizer.from_pretrained(where, **extra)


def _context_window(configs) -> int | None:
    """The chain's window: the shortest max_position_embeddings of its models (None: no limit known)."""
    sizes = [getattr(c, "max_position_embeddings", None) for c in configs]
    sizes = [s for s in sizes if s]
    return min(sizes) if sizes else None


def load_model(name: str, spec: LoadSpec = LoadSpec(), quantize: str = "none") -> tuple[PreTrainedModel, object]:
    """(model in eval mode, tokenizer) from a directory, a cached hub id or a .gguf file.

    A .gguf file is converted once and then read from the disk cache (gguf_cache.py),
    unless a device map asks transformers to place it. quantize "fp8": the decoder's linear
    layers in fp8 (fp8.py). A checkpoint stored in fp8 (compressed-tensors) loads as stored.
    """
    check_quantize(quantize)
    where, extra = _where(name)
    if "gguf_file" in extra and not spec.device_map:
        model, tokenizer = load_gguf(Path(name))
        model = model.to(device=spec.torch_device(), dtype=spec.torch_dtype())
        return _ready(model, spec, quantize), tokenizer
    tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    if Path(where).is_dir() and compressed_fp8_config(where) is not None:
        if spec.device_map:
            raise ValueError(f"{name}: an fp8 (compressed-tensors) checkpoint loads on one device, not a device map")
        model = load_compressed_fp8(where, spec.torch_dtype(), spec.torch_device())
        return _ready(model, spec, "none"), tokenizer
    kwargs = dict(extra, dtype=spec.torch_dtype())
    if spec.device_map:
        kwargs["device_map"] = spec.device_map
    model = AutoModelForCausalLM.from_pretrained(where, **kwargs)
    if not spec.device_map:
        model = model.to(spec.torch_device())
    return _ready(model, spec, quantize), tokenizer


def _ready(model: PreTrainedModel, spec: LoadSpec, quantize: str) -> PreTrainedModel:
    """The loaded model for inference: eval mode, quantised where asked, then the CPU kernels
    (oneDNN for the linear layers that stay dense: the LM head of an fp8 model)."""
    model = model.eval()
    if quantize == "fp8":
        quantize_model(model)
    return use_cpu_kernels(model, spec.cpu_kernels)


def check_same_tokenizer(names: list[str], tokenizers: list) -> None:
    """Refuse a chain whose tokenizers differ, naming the first difference."""
    ref_name, ref = names[0], tokenizers[0]
    for name, tok in zip(names[1:], tokenizers[1:]):
        if len(tok) != len(ref):
            raise TokenizerMismatch(f"vocabulary sizes differ: {ref_name} has {len(ref)}, {name} has {len(tok)}")
        for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
            a, b = getattr(ref, attr, None), getattr(tok, attr, None)
            if a != b:
                raise TokenizerMismatch(f"special token {attr} differs: {ref_name} has {a}, {name} has {b}")
        va, vb = ref.get_vocab(), tok.get_vocab()
        if va != vb:
            diff = sorted(set(va.items()) ^ set(vb.items()))[:3]
            raise TokenizerMismatch(f"vocabularies of {ref_name} and {name} differ, e.g. {diff}")


@dataclass(frozen=True)
class Chain:
    models: tuple[PreTrainedModel, ...]  # smallest first
    tokenizer: object
    names: tuple[str, ...]

    @property
    def context_window(self) -> int | None:
        return _context_window([m.config for m in self.models])


def chain_names(small: str | None, large: str | None, medium: list[str] = ()) -> tuple[str, ...] | None:
    """The models' names smallest first; None when none is named: the embedded default pair."""
    if small is None and large is None and not medium:
        return None
    if small is None or large is None:
        raise ValueError("name both --small and --large, or neither (the embedded default pair)")
    return (small, *medium, large)


def _default_pair(spec: LoadSpec) -> tuple[PreTrainedModel, PreTrainedModel, object]:
    # converted in place: then a pair of our own, so the process's cached M_L stays as it was
    private = spec.converts_in_place()
    small, large, tok = load_default_pair(device=spec.torch_device(), dtype=spec.torch_dtype(), private=private)
    # M_S keeps sharing M_L's embeddings, norm and head (none of them quantised)
    return _ready(small, spec, spec.quantize_small), _ready(large, spec, spec.quantize_large), tok


def load_chain(small: str | None, large: str | None, medium: list[str] = (), spec: LoadSpec = LoadSpec()) -> Chain:
    """The models smallest first. small and large both None: the embedded default pair."""
    names = chain_names(small, large, medium)
    if names is None:
        small_model, large_model, tok = _default_pair(spec)
        return Chain((small_model, large_model), tok, DEFAULT_PAIR_NAMES)
    loaded = [load_model(n, spec, spec.quantize_at(i, len(names))) for i, n in enumerate(names)]
    check_same_tokenizer(names, [t for _, t in loaded])
    widths = [m.get_output_embeddings().weight.shape[0] for m, _ in loaded]
    if len(set(widths)) > 1:
        raise TokenizerMismatch(
            "output vocabulary sizes differ: " + ", ".join(f"{n} has {w}" for n, w in zip(names, widths))
        )
    return Chain(tuple(m for m, _ in loaded), loaded[0][1], tuple(names))


@dataclass(frozen=True)
class SmallSide:
    """What the replica of the smallest level holds: M_S, the chain's tokenizer and context window."""

    model: PreTrainedModel
    tokenizer: object
    context_window: int | None
    hidden_size: int  # M_S's hidden states, the classifier head's input


def load_small_side(names: tuple[str, ...] | None, spec: LoadSpec = LoadSpec()) -> SmallSide:
    """M_S of the chain `names` (chain_names), with the tokenizer check and context window of
    the whole chain read from the larger models' tokenizer and config files, not their weights."""
    if names is None:
        small, _, tokenizer = _default_pair(spec)
        configs = [small.config]  # M_S is M_L's config with fewer layers
    else:
        small, tokenizer = load_model(names[0], spec, spec.quantize_small)
        check_same_tokenizer(list(names), [tokenizer, *map(load_tokenizer, names[1:])])
        configs = [small.config, *(AutoConfig.from_pretrained(w, **x) for w, x in map(_where, names[1:]))]
    return SmallSide(small, tokenizer, _context_window(configs), small.config.hidden_size)


def load_level(names: tuple[str, ...] | None, level: int, spec: LoadSpec = LoadSpec()) -> PreTrainedModel:
    """The model at `level` (0 = M_S) of the chain `names` (chain_names), loaded alone."""
    if names is not None:
        return load_model(names[level], spec, spec.quantize_at(level, len(names)))[0]
    if level == 0:
        return _default_pair(spec)[0]
    private = spec.converts_in_place()
    large = load_default_large(device=spec.torch_device(), dtype=spec.torch_dtype(), private=private)[0]
    return _ready(large, spec, spec.quantize_large)
