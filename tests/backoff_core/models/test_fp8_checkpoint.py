"""A checkpoint published in fp8 (compressed-tensors, as the Llama-3.1-*-FP8 releases) loads
as stored (backoff_core/models/fp8_checkpoint.py): written here by hand in that format from a
tiny model, read back into FP8Linear layers with the file's own bytes and scales."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from backoff_core.models.fp8 import FP8, FP8_MAX, FP8Linear, fp8_layers
from backoff_core.models.fp8_checkpoint import block_scales
from backoff_core.models.loading import LoadSpec, load_model
from tests.support.tiny import tiny_model, tiny_tokenizer

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantize_like_llm_compressor(w: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, weight_scale) as compressed-tensors stores them (scale in bf16)."""
    if strategy == "tensor":
        scale = w.abs().amax().reshape(1) / FP8_MAX
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    elif strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True) / FP8_MAX  # [N, 1]
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    else:  # block 16 x 16 (the tiny shapes; the releases use 128 x 128)
        n, k = w.shape
        blocks = w.view(n // 16, 16, k // 16, 16)
        scale = blocks.abs().amax(dim=(1, 3)) / FP8_MAX  # [N/16, K/16]
        q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(n, k)
    return q, scale.to(torch.bfloat16)


def _write(model, root, strategy: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The model saved in compressed-tensors fp8 (decoder linears quantised, lm_head ignored,
    static input scales present); returns what was written for each quantised layer."""
    tensors, written = {}, {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight" and module.rpartition(".")[2] in LINEARS:
            q, scale = _quantize_like_llm_compressor(t, strategy)
            tensors[name], tensors[f"{module}.weight_scale"] = q, scale
            tensors[f"{module}.input_scale"] = torch.ones(1, dtype=torch.bfloat16)
            written[module] = (q, scale)
        else:
            tensors[name] = t.to(torch.bfloat16)
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }
    (root / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(root)
    return written


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_compressed_tensors_fp8_loads_as_stored(tmp_path, strategy):
    source = tiny_model(4, hidden=64)
    written = _write(source, tmp_path, strategy)
    model, _ = load_model(str(tmp_path), LoadSpec(cpu_kernels="default"))
    layers = dict(model.named_modules())
    assert len(fp8_layers(model)) == len(written) == 7 * source.config.num_hidden_layers
    for name, (q, scale) in written.items():
        layer = layers[name]
        assert isinstance(layer, FP8Linear) and layer.weight.dtype == FP8
        assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8))  # the file's bytes, no round trip
        block, want = block_scales(q.shape, scale)
        assert layer.block == block and torch.equal(layer.weight_scale_inv, want)
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32
    # it computes the model whose weights are the stored q * scale (embeddings etc. from the file)
    reference = tiny_model(4, hidden=64)
    with torch.no_grad():
        for name, t in reference.state_dict().items():
            module = name.rpartition(".")[0]
            t.copy_(layers[module].dequantized() if module in written else t.to(torch.bfloat16).float())
        ids = torch.tensor([[1, 5, 9, 13, 17, 2]])
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


def test_compressed_tensors_other_than_fp8_is_refused_by_name(tmp_path):
    _write(tiny_model(4, hidden=64), tmp_path, "channel")
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"].update(num_bits=4, type="int")
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="4-bit int weights; only fp8"):
        load_model(str(tmp_path), LoadSpec(cpu_kernels="default"))
