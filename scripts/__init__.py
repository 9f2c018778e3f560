"""Pipelines run as scripts (`python scripts/distill_small.py ...`) or as modules
(`python -m scripts.distill_small ...`); tests import them as `scripts.<name>`."""
