"""Molt: reinforcement learning of language-model agents, compact and PyTorch-native."""

import os
from pathlib import Path

__version__ = "0.1.0"


def cache_root() -> Path:
    """Where Molt keeps what it builds once per machine (warm starts, compiled kernels): `$MOLT_CACHE`."""
    return Path(os.environ.get("MOLT_CACHE", Path.home() / ".cache" / "molt"))
