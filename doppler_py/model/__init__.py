"""Models: configuration, GGUF conversion and the catalog of known models."""

from doppler_py.model.config import ModelConfig

__all__ = ["ModelConfig"]
