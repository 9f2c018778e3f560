"""Models: local checkpoints, GGUF files and the embedded default pair; CPU kernels; prompts."""

from backoff_core.models.loading import Chain, LoadSpec, load_chain, load_model

__all__ = ["Chain", "LoadSpec", "load_chain", "load_model"]
