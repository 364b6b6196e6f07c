"""doppler-py: WebGPU inference for small LLMs with speculative decoding that stays on the GPU."""

from doppler_py.errors import DopplerError

__all__ = ["DopplerError", "__version__"]
__version__ = "0.1.0"
