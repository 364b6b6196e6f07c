"""Typed errors raised by doppler-py.

Every error says what went wrong (file, tensor, shape, value) and what to do about it. Callers can catch
`DopplerError` for everything or a subclass for one kind of problem.
"""

from __future__ import annotations


class DopplerError(Exception):
    """Base class of every error doppler-py raises on purpose."""


# --- adapter and device -------------------------------------------------------------------------------
class DeviceError(DopplerError):
    """The WebGPU adapter or device cannot do what was asked."""


class NoAdapterError(DeviceError):
    """No WebGPU adapter was found (or none matched the requested backend/name)."""


class DeviceLimitError(DeviceError):
    """A buffer, binding or dispatch exceeds the device's limits."""


class DeviceLostError(DeviceError):
    """The device was lost (driver reset, out of memory); results in flight are gone."""


class ShaderError(DeviceError):
    """A WGSL shader failed to compile or to build a pipeline."""


# --- models -------------------------------------------------------------------------------------------
class ModelFormatError(DopplerError):
    """A model file is malformed: missing or truncated file, missing tensor, wrong shape or dtype."""


class UnsupportedModelError(DopplerError):
    """The model uses an architecture, dtype or quantisation type this engine does not implement."""


class VocabularyMismatchError(DopplerError):
    """A draft model's vocabulary does not match the target model's."""


# --- generation ---------------------------------------------------------------------------------------
class CapacityError(DopplerError):
    """The request does not fit the KV cache or the model's context window."""


class GenerationOptionError(DopplerError, ValueError):
    """A generation option is out of range (temperature, top_p, top_k, draft length, token ids, ...)."""


class NumericalError(DopplerError):
    """NaN or infinite values appeared where a probability distribution was expected."""
