"""Where torchtitan keeps what it measures or builds once per machine (CPU peak, compiled kernels)."""

import os
from pathlib import Path


def cache_dir() -> Path:
    """$TORCHTITAN_CACHE_DIR, else $XDG_CACHE_HOME/torchtitan, else ~/.cache/torchtitan."""
    if root := os.environ.get("TORCHTITAN_CACHE_DIR"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtitan"
