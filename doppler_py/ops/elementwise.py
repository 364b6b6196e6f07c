"""The element-wise ops of a transformer (SwiGLU / GeGLU, Qwen 3.5's attention gate, Gemma 4's per-layer input gate,
Gemma 2's logit soft-capping, an EAGLE head's feature standardisation) and the shape checks all ops share.

The residual adds are folded into the matmuls (`Linear(accumulate=True)`); the standalone residual op only the
tests run is tests/support/residual.py's `Residual`.
"""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor


def require_f32(tensor: Tensor, min_elements: int, what: str) -> None:
    """An op binds `tensor` once for its largest call; it must be f32 and hold at least `min_elements`."""
    if tensor.dtype != "f32":
        raise ValueError(f"{what} must be an f32 tensor, got {tensor.dtype}")
    if tensor.numel < min_elements:
        raise ValueError(f"{what} holds {tensor.numel} elements; this op needs at least {min_elements}")


def require_rows(rows: int, max_rows: int, what: str) -> None:
    if not 1 <= rows <= max_rows:
        raise ValueError(f"{what}: rows must be in 1..{max_rows} (the op's max_rows), got {rows}")


ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # the ACTIVATION override of shaders/swiglu.wgsl


class SwiGLU:
    """out[t, j] = act(gate_up[t, j]) * gate_up[t, ffn_dim + j]: gate in columns [0, ffn_dim), up after it.

    act is silu (SwiGLU) or, with activation="gelu_pytorch_tanh", the tanh-approximated GELU (Gemma's GeGLU)."""

    def __init__(
        self,
        registry: KernelRegistry,
        gate_up: Tensor,
        out: Tensor,
        *,
        ffn_dim: int,
        max_rows: int,
        activation: str = "silu",
    ):
        require_f32(gate_up, max_rows * 2 * ffn_dim, "SwiGLU gate_up")
        require_f32(out, max_rows * ffn_dim, "SwiGLU out")
        self.ffn_dim = ffn_dim
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("swiglu", ACTIVATION=ACTIVATIONS[activation]),
            params={"ffn_dim": ffn_dim},
            gate_up=gate_up,
            out=out,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "SwiGLU")
        rec.dispatch(self.bound, workgroups(self.ffn_dim, 256), rows)


class SigmoidGate:
    """out[t, j] *= sigmoid(gate[t, j]) in place over rows of [max_rows, width] tensors (Qwen 3.5's gated
    attention output, shaders/swiglu.wgsl's `sigmoid_gate`)."""

    def __init__(self, registry: KernelRegistry, gate: Tensor, out: Tensor, *, width: int, max_rows: int):
        require_f32(gate, max_rows * width, "SigmoidGate gate")
        require_f32(out, max_rows * width, "SigmoidGate out")
        self.width = width
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("swiglu", entry="sigmoid_gate"), params={"ffn_dim": width}, gate_up=gate, out=out
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "SigmoidGate")
        rec.dispatch(self.bound, workgroups(self.width, 256), rows)


class Standardize:
    """x[t, i] = (x[t, i] - mean[i]) / std[i] in place over rows of x [max_rows, width] (shaders/standardize.wgsl:
    why an EAGLE head standardises its input features before its input projection)."""

    def __init__(self, registry: KernelRegistry, mean: Tensor, std: Tensor, x: Tensor, *, max_rows: int):
        width = mean.numel
        require_f32(mean, width, "Standardize mean")
        require_f32(std, width, "Standardize std")
        require_f32(x, max_rows * width, "Standardize x")
        self.width, self.max_rows = width, max_rows
        self.bound = registry.bind(registry.kernel("standardize"), params={"width": width}, mean=mean, spread=std, x=x)

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "Standardize")
        rec.dispatch(self.bound, workgroups(self.width, 256), rows)


class PerLayerGate:
    """gate[t, j] = act(gate[t, j]) * inputs[t, layer * width + j] for j < width, in place: Gemma 4's per-layer
    input step, act(per_layer_input_gate(x)) * per_layer_input, with `inputs` [max_rows, n_layers * width]
    holding every layer's per-layer inputs and `gate` [max_rows, width] this layer's gate projection."""

    def __init__(
        self,
        registry: KernelRegistry,
        inputs: Tensor,
        gate: Tensor,
        *,
        width: int,
        layer: int,
        n_layers: int,
        max_rows: int,
        activation: str,
    ):
        if not 0 <= layer < n_layers:
            raise ValueError(f"PerLayerGate: layer {layer} is not one of the {n_layers} layers")
        require_f32(inputs, max_rows * n_layers * width, "PerLayerGate inputs")
        require_f32(gate, max_rows * width, "PerLayerGate gate")
        self.width = width
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("swiglu", entry="per_layer_gate", ACTIVATION=ACTIVATIONS[activation]),
            params={"ffn_dim": width, "up_stride": n_layers * width, "up_offset": layer * width},
            gate_up=inputs,
            out=gate,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "PerLayerGate")
        rec.dispatch(self.bound, workgroups(self.width, 256), rows)


MAX_SOFTCAP_WORKGROUPS = 65535  # WebGPU's default per-dimension limit; logit_softcap.wgsl strides past it


class LogitSoftCap:
    """logits[:rows] = cap * tanh(logits[:rows] / cap) in place (Gemma 2's final_logit_softcapping); `logits`
    is [max_rows, vocab]."""

    def __init__(self, registry: KernelRegistry, logits: Tensor, *, vocab: int, max_rows: int, cap: float):
        if not cap > 0:
            raise ValueError(f"LogitSoftCap: cap must be positive, got {cap}")
        require_f32(logits, max_rows * vocab, "LogitSoftCap logits")
        self.vocab = vocab
        self.max_rows = max_rows
        self.bound = registry.bind(registry.kernel("logit_softcap"), params={"cap": cap}, logits=logits)

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "LogitSoftCap")
        n = rows * self.vocab
        self.bound.params.set(n=n)
        rec.dispatch(self.bound, min(workgroups(n, 256), MAX_SOFTCAP_WORKGROUPS))
