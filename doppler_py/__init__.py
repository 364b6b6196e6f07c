"""doppler-py: WebGPU inference for small LLMs with speculative decoding that stays on the GPU."""

from __future__ import annotations

from typing import TYPE_CHECKING

from doppler_py.errors import DopplerError

if TYPE_CHECKING:
    from doppler_py.api import Engine

__all__ = ["DopplerError", "__version__", "load"]
__version__ = "0.1.0"


def load(*args, **kwargs) -> Engine:
    """Load a model onto the GPU; see `doppler_py.api.load` (imported lazily: wgpu starts only when used)."""
    from doppler_py.api import load as _load

    return _load(*args, **kwargs)
