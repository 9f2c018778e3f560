"""Models: local checkpoints, GGUF files and the embedded default pair; CPU kernels; prompts."""

from backoff_core.models.loading import Chain, LoadSpec, SmallSide, load_chain, load_level, load_model, load_small_side

__all__ = ["Chain", "LoadSpec", "SmallSide", "load_chain", "load_level", "load_model", "load_small_side"]
