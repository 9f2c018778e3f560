"""The `backoff generate` CLI and model loading, on tiny models saved to local directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from backoff_core.cli.main import main
from backoff_core.models.loading import (
    LoadSpec,
    TokenizerMismatch,
    chain_names,
    check_same_tokenizer,
    load_chain,
    load_level,
    load_small_side,
)
from tests.support.helpers import hf_greedy
from tests.support.tiny import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, pair, tokenizer):
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, model in zip(("small", "large"), pair):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        paths[name] = str(root / name)
    other = tiny_model(5, vocab=40)
    other.save_pretrained(root / "other")
    tiny_tokenizer(vocab=40).save_pretrained(root / "other")
    # same tokenizer, but a model whose output layer is wider: logits not comparable
    wide = tiny_model(6, vocab=64)
    wide.save_pretrained(root / "wide")
    tokenizer.save_pretrained(root / "wide")
    paths["wide"] = str(root / "wide")
    # same tokenizer, a shorter context window than the others
    short = tiny_model(7)
    short.config.max_position_embeddings = 128
    short.save_pretrained(root / "short")
    tokenizer.save_pretrained(root / "short")
    paths["short"] = str(root / "short")
    paths["other"] = str(root / "other")
    return paths


def _cli(*args):
    """`python -m backoff_core.cli.main ARGS`, the entry point itself (a process of its own)."""
    return subprocess.run(
        [sys.executable, "-m", "backoff_core.cli.main", *args], capture_output=True, text=True, timeout=300
    )


def _main(capsys, *args) -> tuple[int, str, str]:
    """backoff_core.cli.main.main(ARGS) in this process: (exit code, stdout, stderr)."""
    try:
        code = main(list(args))
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code or 0, out.out, out.err


def test_generate_json(model_dirs, pair):
    _, large = pair
    out = _cli(
        "generate",
        "--small",
        model_dirs["small"],
        "--large",
        model_dirs["large"],
        "--prompt",
        "w3 w4 w5",
        "--max-tokens",
        "10",
        "--router",
        "always-large",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    prompt_ids = [5, 6, 7]  # w3 w4 w5 in the tiny vocabulary (2 specials first)
    assert data["token_ids"] == list(hf_greedy(large, prompt_ids, 10))
    assert data["sources"] == [1] * 10 and data["backoff_rate"] == 0.0 and data["large_calls"] == 10
    for key in ("text", "first_token_latency_s", "tokens_per_s", "catch_up_lengths", "c_S_median_s"):
        assert key in data


def test_generate_speculative_and_human_view(model_dirs, capsys):
    code, stdout, stderr = _main(
        capsys,
        "generate",
        "--small",
        model_dirs["small"],
        "--large",
        model_dirs["large"],
        "--prompt",
        "w3 w4",
        "--max-tokens",
        "8",
        "--mode",
        "speculative",
        "--draft-tokens",
        "3",
    )
    assert code == 0, stderr
    assert "backoff rate" in stdout and "\033[" in stdout


def test_bad_arguments_give_a_clear_error(model_dirs, capsys):
    code, _, stderr = _main(
        capsys,
        "generate",
        "--small",
        model_dirs["small"],
        "--large",
        model_dirs["large"],
        "--prompt",
        "w3",
        "--router",
        "nonsense",
    )
    assert code == 2 and "unknown router 'nonsense'" in stderr
    code, _, stderr = _main(capsys, "generate", "--small", model_dirs["small"], "--prompt", "w3")
    assert code == 2 and "name both --small and --large" in stderr


def test_mismatched_tokenizers_are_refused(model_dirs):
    with pytest.raises(TokenizerMismatch, match="vocabulary sizes differ"):
        load_chain(model_dirs["small"], model_dirs["other"])


def test_mismatched_output_sizes_are_refused(model_dirs):
    with pytest.raises(TokenizerMismatch, match="output vocabulary"):
        load_chain(model_dirs["small"], model_dirs["wide"])


def test_tokenizer_check_names_the_special_token(tokenizer):
    other = tiny_tokenizer()
    other.eos_token = "w7"
    with pytest.raises(TokenizerMismatch, match="eos_token_id"):
        check_same_tokenizer(["a", "b"], [tokenizer, other])


def test_load_spec_refuses_unknown_dtype_and_missing_cuda():
    with pytest.raises(ValueError, match="unknown dtype"):
        LoadSpec(dtype="int3").torch_dtype()
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA"):
            LoadSpec(device="cuda").torch_device()


def test_small_side_checks_the_whole_chain(model_dirs, pair):
    names = chain_names(model_dirs["small"], model_dirs["large"], [model_dirs["short"]])
    side = load_small_side(names, LoadSpec(cpu_kernels="default"))
    assert side.context_window == 128  # the short model's, read from its config alone
    assert side.hidden_size == pair[0].config.hidden_size
    torch.testing.assert_close(side.model.lm_head.weight, pair[0].lm_head.weight)
    with pytest.raises(TokenizerMismatch, match="vocabulary sizes differ"):
        load_small_side(chain_names(model_dirs["small"], model_dirs["other"]))


def test_load_level_loads_that_model_alone(model_dirs, pair):
    names = chain_names(model_dirs["small"], model_dirs["large"])
    large = load_level(names, 1, LoadSpec(cpu_kernels="default"))
    torch.testing.assert_close(large.lm_head.weight, pair[1].lm_head.weight)
    with pytest.raises(ValueError, match="name both"):
        chain_names(model_dirs["small"], None)
