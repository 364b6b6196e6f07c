"""Typed errors raised by doppler-py.

Every error says what went wrong (file, tensor, shape, value) and what to do about it. Callers can catch
`DopplerError` for everything or a subclass for one kind of problem.
"""

from __future__ import annotations


class DopplerError(Exception):
    """Base class of every error doppler-py raises on purpose.

    A class may carry `advice`, what to do about every error of its kind; it is appended to the message.
    A raise site whose message already says what to do passes its own `advice` ("" for none).
    """

    advice: str = ""

    def __init__(self, message: str = "", *, advice: str | None = None):
        super().__init__(message)
        if advice is not None:
            self.advice = advice

    def __str__(self) -> str:
        message = super().__str__()
        return f"{message}; {self.advice}" if self.advice else message


# --- adapter and device -------------------------------------------------------------------------------
class DeviceError(DopplerError):
    """The WebGPU adapter or device cannot do what was asked."""


class NoAdapterError(DeviceError):
    """No WebGPU adapter was found (or none matched the requested backend/name)."""


class WebGpuImplementationError(DeviceError):
    """The WebGPU implementation asked for (wgpu-native or Dawn) is unknown or not installed."""


class DeviceLimitError(DeviceError):
    """A buffer, binding or dispatch exceeds the device's limits."""

    advice = "split the tensor or use a smaller weight format or model (or a device with higher limits)"


class ShaderError(DeviceError):
    """A WGSL shader failed to compile or to build a pipeline."""


# --- models -------------------------------------------------------------------------------------------
class ModelFormatError(DopplerError):
    """A model file is malformed: missing or truncated file, missing tensor, wrong shape or dtype."""

    advice = "the files are damaged, incomplete or not in the expected format: download or convert the model again"


class UnsupportedModelError(DopplerError):
    """The model uses an architecture, dtype or quantisation type this engine does not implement."""

    advice = (
        "doppler-py runs LLaMA, SmolLM, Mistral, Qwen2, Qwen3, Qwen 3.5 (text), Gemma 2, Gemma 3 and Gemma 4 (text) "
        "with f32/f16/bf16 weights or Q4_0/Q4_1/Q8_0 blocks: use such a model, or convert this one to a supported "
        "format"
    )


class VocabularyMismatchError(DopplerError):
    """A draft model's vocabulary does not match the target model's."""


# --- LoRA adapters ------------------------------------------------------------------------------------
class AdapterError(DopplerError):
    """A LoRA adapter folder cannot be used with this model: a missing or malformed file, a PEFT option this engine
    does not implement, or weights whose modules, shapes or layers do not match the base model's."""

    advice = "use a PEFT LoRA adapter trained on this base model (adapter_config.json + adapter_model.safetensors)"


# --- generation ---------------------------------------------------------------------------------------
class CapacityError(DopplerError):
    """The request does not fit the KV cache or the model's context window."""


class GenerationOptionError(DopplerError, ValueError):
    """A generation option is out of range (temperature, top_p, top_k, draft length, token ids, ...).

    `option`: the request option to blame (a field of `doppler_py.options.GenerationOptions`, which sets it), or
    None; the server names it as the 400's `param`.
    """

    def __init__(self, message: str = "", *, option: str | None = None, advice: str | None = None):
        super().__init__(message, advice=advice)
        self.option = option


class NumericalError(DopplerError):
    """NaN or infinite values appeared where a probability distribution was expected."""


class InternalError(DopplerError):
    """An engine invariant broke (e.g. a KV cache out of step with the committed tokens): a bug, not bad input."""

    advice = "this is a bug in doppler-py: please report it with the model, prompt and options that caused it"


class UnknownAdapterError(GenerationOptionError):
    """A request or call names a LoRA adapter that is not loaded (the server answers 400 naming it)."""
