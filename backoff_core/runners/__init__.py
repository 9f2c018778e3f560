"""Running one model over sessions: per-session caches (dynamic) or static KV slots with CUDA graphs."""
