"""An fp8 checkpoint written once, offline, and served as stored (docs/fp8.md): the way
llm-compressor writes a compressed-tensors checkpoint and vLLM loads it.

`quantize_fp8` chooses a model's decoder linears' e4m3 values (`gptq`:
fp8_gptq.gptq_quantize_model against calibration windows; `rtn`: round to nearest, what
`quantize: fp8` does at load) and `save_fp8_checkpoint` writes the model as a directory
(`backoff quantize`, backoff_core/cli/quantize.py, does both) that fp8_checkpoint.load_compressed_fp8
(every loader's path for a directory, so `--large DIR` and the Serve config's model names) reads
back as the same bytes:

    config.json          the model's config + quantization_config (compressed-tensors,
                         float-quantized, weights strategy "block", block_structure [128, 128],
                         activations dynamic per 1 x 128 group, lm_head ignored): the layout
                         of the public *-FP8 block releases
    model*.safetensors   each quantised linear's `weight` (float8_e4m3fn [N, K]) and
                         `weight_scale` (float32 [N/128, K/128], the multiplier that
                         dequantises); every other tensor in the model's dtype; shards of at
                         most 5 GiB with model.safetensors.index.json beyond one
    tokenizer files      the source directory's, copied (else the tokenizer saved)
    fp8_quantize.json    how it was made: method, calibration, source

"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from backoff_core.models.fp8 import fp8_layers, quantize_model
from backoff_core.models.fp8_checkpoint import QUANT_METHOD
from backoff_core.models.fp8_gptq import ACT_ORDER, DAMP, gptq_quantize_model

METHODS = ("gptq", "rtn")
MAX_SHARD_BYTES = 5 * 2**30
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
RECORD = "fp8_quantize.json"


def quantization_config(block: tuple[int, int]) -> dict:
    """compressed-tensors' quantization_config for fp8 weights in `block`s with dynamic
    activations per 1 x block[1] group (llm-compressor's FP8_BLOCK scheme)."""
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": "block"}
    weights.update(block_structure=list(block), group_size=None, actorder=None, observer="minmax")
    activations = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": True, "strategy": "group"}
    activations.update(group_size=block[1], block_structure=None, actorder=None, observer=None)
    group = {"targets": ["Linear"], "weights": weights, "input_activations": activations, "output_activations": None}
    group["format"] = "float-quantized"
    return {
        "quant_method": QUANT_METHOD,
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": group},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
        "sparsity_config": {},
    }


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors as the checkpoint stores them: an FP8Linear `x` as x.weight (e4m3)
    and x.weight_scale (float32), a tied LM head once (as the embedding)."""
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.endswith(".weight_scale_inv"):
            name = name[: -len("_inv")]
        tensors[name] = tensor.detach().contiguous()
    if getattr(model.config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)
    return tensors


def save_shards(tensors: dict[str, torch.Tensor], out: Path, max_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """tensors as model.safetensors, or model-0000i-of-0000n.safetensors and their index when
    they pass max_bytes; returns the files' names."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.clone() if t.untyped_storage().nbytes() != nbytes else t  # no shared storage
        size += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    for file, shard in tqdm(list(zip(names, shards)), desc="writing", unit="shard", disable=len(shards) == 1):
        save_file(shard, str(out / file), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())}}
        index["weight_map"] = {name: file for file, shard in zip(names, shards) for name in shard}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return names


def save_fp8_checkpoint(
    model: nn.Module,
    tokenizer,
    out: str | Path,
    source: str | None = None,
    record: dict | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> Path:
    """Writes the fp8 model (its decoder linears FP8Linear, one block shape) as a
    compressed-tensors checkpoint directory `out` (written beside it, then moved into place)."""
    layers = fp8_layers(model)
    blocks = {layer.block for layer in layers}
    if len(blocks) != 1:
        raise ValueError(
            f"an fp8 checkpoint needs every decoder linear in fp8 with one block shape, got {sorted(blocks)}"
        )
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.config.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["quantization_config"] = quantization_config(blocks.pop())
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_shards(checkpoint_tensors(model), tmp, max_shard_bytes)
    copied = [f for f in TOKENIZER_FILES if source and (Path(source) / f).is_file()]
    for name in copied:
        shutil.copy2(Path(source) / name, tmp / name)
    if "tokenizer_config.json" not in copied:
        tokenizer.save_pretrained(tmp)
    (tmp / RECORD).write_text(json.dumps(record or {}, indent=2) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@torch.no_grad()
def quantize_fp8(model: nn.Module, method: str, windows: torch.Tensor | None) -> nn.Module:
    """The model's decoder linears as FP8Linear, their e4m3 values by `method`, in place."""
    if method == "gptq":
        return gptq_quantize_model(model, windows)
    if method == "rtn":
        return quantize_model(model, progress=True)
    raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")


def checkpoint_record(name: str, method: str, dtype: str, calibration: dict | None = None) -> dict:
    """fp8_quantize.json: how a checkpoint was made (calibration: GPTQ's text and windows)."""
    record = {"source": name, "method": method, "dtype": dtype}
    if calibration is not None:
        record["calibration"] = calibration
        record["gptq"] = {"damp": DAMP, "act_order": ACT_ORDER}
    return record
