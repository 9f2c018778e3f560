"""The `backoff` command line (entry point `backoff_core.cli:main`)."""

from backoff_core.cli.main import main

__all__ = ["main"]
