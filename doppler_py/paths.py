"""Where doppler-py keeps files it makes: converted models, fetched npm packages for parity tests."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(*parts: str) -> Path:
    """`$DOPPLER_CACHE`, else `$XDG_CACHE_HOME/doppler-py`, else `~/.cache/doppler-py`; created on demand."""
    root = os.environ.get("DOPPLER_CACHE")
    if root:
        base = Path(root)
    else:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = (Path(xdg) if xdg else Path.home() / ".cache") / "doppler-py"
    path = base.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
