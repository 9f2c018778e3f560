"""The model pairs and prompts the serving benchmarks share (serve_load.py, serve_overhead.py,
soak.py): `--pair tiny` (random tiny models, seconds), `smollm-skip` (SmolLM2-135M as M_L and
a copy of its first and last layer as M_S: a 2-layer student's cost) or `default` (the
embedded default pair), built once under a folder of runs/."""

from __future__ import annotations

from pathlib import Path

PROMPTS = [
    "Write a short paragraph about the history of the Python programming language.",
    "Give three tips for writing readable code, with one sentence each.",
    "Explain what a hash table is to a new programmer.",
    "Describe the water cycle in simple words.",
]


def prepare_pair(kind: str, root: Path) -> tuple[str | None, str | None]:
    """Model directories for --pair (built once under root)."""
    if kind == "default":
        return None, None
    small, large = root / kind / "small", root / kind / "large"
    if not (large / "config.json").exists():
        if kind == "tiny":
            import sys

            sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support
            from tests.support.tiny import tiny_model, tiny_tokenizer

            tok, models = tiny_tokenizer(), (tiny_model(1), tiny_model(2, hidden=64, layers=4))
        else:  # smollm-skip: M_L = SmolLM2-135M; M_S = its first and last layer (same cost as a 2-layer student)
            import copy

            from transformers import LlamaForCausalLM

            from backoff_core.models.default_pair import build_small, large_layer_state, load_default_large

            big, tok = load_default_large()
            n = big.config.num_hidden_layers
            config = copy.deepcopy(big.config)
            del config.quantization_config  # dequantised already; the GGUF marker blocks saving
            plain = LlamaForCausalLM(config)
            plain.load_state_dict(big.state_dict())
            models = (build_small(big, large_layer_state(big, [0, n - 1]), 2), plain)
        for model, where in zip(models, (small, large)):
            model.save_pretrained(where)
            tok.save_pretrained(where)
    return str(small), str(large)
