"""Tensor parallelism: a model sharded over ranks (sharding.py), driven as one runner (ranks.py)."""
