"""fp8 checkpoints written offline (backoff_core/models/fp8_export.py, `backoff quantize`) and
loaded as served (fp8_checkpoint.py through load_model): the written directory reads back as the
in-memory GPTQ model's own bytes, scales and logits, at block shapes that do not divide the
widths (the default pair's 576 in 128s), tied or not, in one file or in shards."""

from __future__ import annotations

import json

import pytest
import torch

from backoff_core.cli.main import main
from backoff_core.cli.quantize import Calibration, calibration_windows
from backoff_core.models.fp8 import FP8Linear, fp8_layers
from backoff_core.models.fp8_export import RECORD, save_fp8_checkpoint
from backoff_core.models.fp8_gptq import gptq_quantize_model
from backoff_core.models.loading import LoadSpec, load_chain, load_model
from tests.support.tiny import tied_tiny, tiny_model, tiny_tokenizer

SPEC = LoadSpec(cpu_kernels="default")


def _windows(n: int = 6, seq_len: int = 24) -> torch.Tensor:
    return torch.randint(2, 48, (n, seq_len), generator=torch.Generator().manual_seed(0))


def _same_model(loaded, model) -> None:
    """The loaded model holds model's FP8Linear bytes, scales and block, its other tensors, its logits."""
    want, got = fp8_layers(model), fp8_layers(loaded)
    assert len(got) == len(want) == 7 * model.config.num_hidden_layers
    for a, b in zip(want, got):
        assert b.block == a.block and b.weight.dtype == a.weight.dtype
        assert torch.equal(b.weight.view(torch.uint8), a.weight.view(torch.uint8))
        assert torch.equal(b.weight_scale_inv, a.weight_scale_inv)
    dense = {n: p for n, p in model.named_parameters()}
    for name, param in loaded.named_parameters():
        assert torch.equal(param, dense[name]), name
    ids = _windows(2, 16)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    "make, block, shard_bytes",
    [
        (lambda: tiny_model(0, hidden=48), (32, 32), 5 * 2**30),  # 48 and 24 wide: scales [2, 2], [1, 2]
        (lambda: tied_tiny()[0], (16, 16), 4096),  # a tied head, in shards
    ],
    ids=["blocks-not-dividing", "tied-sharded"],
)
def test_written_checkpoint_loads_as_the_gptq_models_bytes(tmp_path, make, block, shard_bytes):
    model = gptq_quantize_model(make(), _windows(), block=block)
    out = save_fp8_checkpoint(model, tiny_tokenizer(), tmp_path / "fp8", max_shard_bytes=shard_bytes)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    weights = qc["config_groups"]["group_0"]["weights"]
    assert (qc["quant_method"], weights["strategy"], weights["block_structure"]) == (
        "compressed-tensors",
        "block",
        list(block),
    )
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert (len(shards) > 1) == (shard_bytes == 4096) and (out / "model.safetensors.index.json").exists() == (
        len(shards) > 1
    )
    loaded, tokenizer = load_model(str(out), SPEC)  # every loader's path for a directory
    _same_model(loaded, model)
    assert tokenizer.get_vocab() == tiny_tokenizer().get_vocab()


def test_quantize_command_writes_what_gptq_computes_in_memory(tmp_path, capsys):
    source = tmp_path / "model"
    tiny_model(1, hidden=48).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    text = tmp_path / "calib.txt"
    text.write_text(" ".join(f"w{i % 40 + 2}" for i in range(7 * 300)))
    calib = ["--calibration", str(text), "--calib-windows", "8", "--calib-seq-len", "32"]
    assert main(["quantize", str(tmp_path / "fp8"), "--model", str(source), *calib]) == 0
    assert "--large" in capsys.readouterr().out
    out = tmp_path / "fp8"
    assert (out / "tokenizer.json").read_bytes() == (source / "tokenizer.json").read_bytes()  # copied
    record = json.loads((out / RECORD).read_text())
    assert record["method"] == "gptq" and record["calibration"]["windows"] == 8

    reference, tokenizer = load_model(str(source), SPEC)
    windows = calibration_windows(tokenizer, Calibration(str(text), 8, 32))  # [8, 32]
    _same_model(load_model(str(out), SPEC)[0], gptq_quantize_model(reference, windows))
    chain = load_chain(str(out), str(out), spec=LoadSpec())  # a chain loads it as any directory
    assert all(isinstance(m.model.layers[0].self_attn.q_proj, FP8Linear) for m in chain.models)


def test_rtn_checkpoint_is_quantize_fp8s_model(tmp_path):
    source = tmp_path / "model"
    tiny_model(2).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    assert main(["quantize", str(tmp_path / "fp8"), "--model", str(source), "--method", "rtn"]) == 0
    want = load_model(str(source), SPEC, quantize="fp8")[0]  # what `--quantize-large fp8` loads
    _same_model(load_model(str(tmp_path / "fp8"), SPEC)[0], want)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--model", "/no/such/model"], "model /no/such/model: no such directory or file"),
        (["--model", "no-org/no-such-model"], "nor a cached hub id"),
        (["--model", "MODEL", "--calibration", "/no/such.txt"], "calibration text /no/such.txt: no such file"),
        (["--model", "MODEL", "--calibration", "EMPTY"], "a directory with no .txt or .md files"),
        (["--model", "MODEL", "--overwrite"], "the output directory is the model's own"),
    ],
)
def test_bad_inputs_are_one_clear_error(tmp_path, capsys, args, words):
    source = tmp_path / "model"
    tiny_model(2).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    (tmp_path / "empty").mkdir()
    args = [str(source) if a == "MODEL" else str(tmp_path / "empty") if a == "EMPTY" else a for a in args]
    out = source if "--overwrite" in args else tmp_path / "fp8"
    assert main(["quantize", str(out), *args]) == 2
    err = capsys.readouterr().err
    last = err.strip().split("\n")[-1]  # after the fixture's save_pretrained progress bars
    assert last.startswith("backoff: error: ") and words in last and "Traceback" not in err
    assert not (tmp_path / "fp8").exists() and (source / "config.json").exists()


def test_an_existing_output_needs_overwrite(tmp_path, capsys):
    (tmp_path / "fp8").mkdir()
    assert main(["quantize", str(tmp_path / "fp8"), "--model", "/no/such/model"]) == 2
    assert "exists: give --overwrite" in capsys.readouterr().err
