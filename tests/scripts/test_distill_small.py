"""The distillation script of the default small model (scripts/distill_small.py): evenly
spaced initial layers, a grown student that starts as the student it grows from, and a run
stopped and resumed from its checkpoint that ends on the weights of an uninterrupted one."""

from __future__ import annotations

import argparse
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scripts import distill_small
from scripts.distill_small import add_more_labels, evenly_spaced, init_student


def test_evenly_spaced_layers_include_both_ends():
    assert evenly_spaced(2, 30) == [0, 29]
    assert evenly_spaced(6, 30) == [0, 6, 12, 17, 23, 29]
    assert evenly_spaced(1, 30) == [0]
    assert evenly_spaced(30, 30) == list(range(30))


def _labels(run_dir: Path, x: torch.Tensor, minutes: float) -> dict:
    data = {"train_x": x, "train_h": x[..., None].half().expand(-1, -1, 3).clone(), "val_x": [x[0]]}
    data |= {"teacher_minutes": minutes, "chat_minutes": minutes / 2}
    if run_dir is not None:
        run_dir.mkdir()
        torch.save(data, run_dir / "teacher.pt")
    return data


def test_more_labels_append_other_runs_windows_with_their_labels_and_keep_this_runs_held_out_set(tmp_path):
    own = _labels(None, torch.arange(10).view(2, 5), 4.0)
    _labels(tmp_path / "a", torch.arange(100, 115).view(3, 5), 1.0)
    _labels(tmp_path / "b", torch.arange(200, 205).view(1, 5), 2.0)
    data = add_more_labels(own, f"{tmp_path / 'a'},{tmp_path / 'b'}")
    assert data["train_x"][:, 0].tolist() == [0, 5, 100, 105, 110, 200]
    assert torch.equal(data["train_h"][..., 1].long(), data["train_x"])  # each window keeps its own labels
    assert data["teacher_minutes"] == 7.0 and data["chat_minutes"] == 3.5
    assert data["val_x"] is own["val_x"] and own["teacher_minutes"] == 4.0  # own left as it was
    assert add_more_labels(own, None) is own


def test_more_labels_of_another_window_length_or_without_labels_are_refused(tmp_path):
    _labels(tmp_path / "a", torch.arange(12).view(2, 6), 1.0)
    with pytest.raises(SystemExit, match="windows of 6 tokens, not 5"):
        add_more_labels(_labels(None, torch.arange(10).view(2, 5), 1.0), str(tmp_path / "a"))
    with pytest.raises(SystemExit, match="no teacher.pt there"):
        add_more_labels(_labels(None, torch.arange(10).view(2, 5), 1.0), str(tmp_path / "missing"))


@pytest.mark.real_pair
def test_a_grown_student_starts_as_the_student_it_grows_from():
    from backoff_core.models.default_pair import (
        STUDENT_DIR,
        load_default_large,
        load_default_small,
        read_student_config,
    )

    large, tokenizer = load_default_large()
    shipped = load_default_small(large)
    depth = read_student_config()["num_hidden_layers"]
    args = argparse.Namespace(layers=depth + 2, layers_init=None, grow_from=STUDENT_DIR)
    grown, layers_init, init = init_student(large, args)
    assert len(grown.model.layers) == depth + 2 and layers_init == evenly_spaced(depth + 2, 30)
    slots = evenly_spaced(depth, depth + 2)
    assert f"slots {slots}" in init
    # the new slots are M_L's layers, their residual branches silenced; the old ones are the shipped layers
    new = sorted(set(range(depth + 2)) - set(slots))
    assert len(new) == 2
    for slot in new:
        torch.testing.assert_close(
            grown.model.layers[slot].self_attn.q_proj.weight,
            large.model.layers[layers_init[slot]].self_attn.q_proj.weight,
        )
        assert not grown.model.layers[slot].mlp.down_proj.weight.any()
    for j, slot in enumerate(slots):
        torch.testing.assert_close(
            grown.model.layers[slot].mlp.up_proj.weight, shipped.model.layers[j].mlp.up_proj.weight
        )
    ids = tokenizer("def add(a, b):\n    return a + b  # the sum", return_tensors="pt").input_ids  # [1, T]
    with torch.inference_mode():
        torch.testing.assert_close(grown.eval()(ids).logits, shipped(ids).logits, rtol=0, atol=1e-5)


def _distill(run_dir: Path, *extra: str) -> None:
    """One session of the script, in this process (as `python -m scripts.distill_small` would
    run it): what it sets for the process -- torch's threads and seed, a SIGTERM handler
    that checkpoints -- is put back after."""
    tiny_run = ["--steps", "4", "--teacher-windows", "6", "--chat-samples", "0", "--seq-len", "32", "--batch-size", "2"]
    tiny_run += [
        "--eval-every",
        "2",
        "--ckpt-every",
        "2",
        "--eval-windows",
        "1",
        "--kl-positions",
        "16",
        "--layers",
        "2",
    ]
    tiny_run += ["--keep-weight", "1", "--threads", "1", "--device", "cpu"]
    threads, rng, sigterm = torch.get_num_threads(), torch.get_rng_state(), signal.getsignal(signal.SIGTERM)
    try:
        distill_small.main([*tiny_run, "--run-dir", str(run_dir), "--out", str(run_dir / "final"), *extra])
    finally:
        torch.set_num_threads(threads)
        torch.set_rng_state(rng)
        signal.signal(signal.SIGTERM, sigterm)


@pytest.mark.real_pair  # its runs distill from the default M_L
def test_a_stopped_and_resumed_run_ends_where_an_uninterrupted_one_does(tmp_path):
    _distill(tmp_path / "straight")
    _distill(tmp_path / "stopped", "--stop-after-minutes", "1e-9")  # stops after its first step
    assert not (tmp_path / "stopped" / "final").exists()
    assert torch.load(tmp_path / "stopped" / "ckpt.pt", weights_only=False)["step"] == 1
    _distill(tmp_path / "stopped", "--resume")
    a = load_file(tmp_path / "straight" / "final" / "model.safetensors")
    b = load_file(tmp_path / "stopped" / "final" / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert (tmp_path / "stopped" / "best" / "model.safetensors").is_file()
