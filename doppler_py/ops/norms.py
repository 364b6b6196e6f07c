"""RMSNorm (HF LlamaRMSNorm semantics, computed in f32): over rows, or per attention head in place."""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry, Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows


class RMSNorm:
    """out[t] (+)= x[t] / sqrt(mean(x[t]^2) + eps) * weight, for rows t < rows of [max_rows, dim] tensors.

    `accumulate=True` adds into out (Gemma's post-attention and post-MLP norms: x += rmsnorm(y))."""

    def __init__(
        self,
        registry: KernelRegistry,
        x: Tensor,
        weight: Tensor,
        out: Tensor,
        *,
        dim: int,
        eps: float,
        max_rows: int,
        accumulate: bool = False,
    ):
        require_f32(x, max_rows * dim, "RMSNorm x")
        require_f32(weight, dim, "RMSNorm weight")
        require_f32(out, max_rows * dim, "RMSNorm out")
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("rmsnorm", ACCUMULATE=accumulate),
            params={"dim": dim, "eps": eps},
            src=x,
            weight=weight,
            out=out,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "RMSNorm")
        rec.dispatch(self.bound, rows)


class HeadRMSNorm:
    """Per-head RMSNorm in place (Qwen3 / Gemma 3 q_norm, k_norm) over rows of `qkv` [max_rows, row_stride]:
    heads 0 .. q_heads - 1 (the q heads) use weight[:head_dim], the next k_heads heads (the k heads, which
    follow q in the fused [q | k | v] row) weight[head_dim:]. The v heads are left alone."""

    def __init__(
        self,
        registry: KernelRegistry,
        qkv: Tensor,
        weight: Tensor,
        *,
        q_heads: int,
        k_heads: int,
        head_dim: int,
        row_stride: int,
        eps: float,
        max_rows: int,
    ):
        require_f32(qkv, max_rows * row_stride, "HeadRMSNorm qkv")
        require_f32(weight, 2 * head_dim, "HeadRMSNorm weight")
        if (q_heads + k_heads) * head_dim > row_stride:
            raise ValueError(f"HeadRMSNorm: {q_heads} + {k_heads} heads of {head_dim} exceed the row ({row_stride})")
        self.max_rows = max_rows
        self.n_heads = q_heads + k_heads
        self.bound = registry.bind(
            registry.kernel("rmsnorm", entry="heads"),
            params={"dim": head_dim, "eps": eps, "q_heads": q_heads, "row_stride": row_stride},
            weight=weight,
            out=qkv,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "HeadRMSNorm")
        rec.dispatch(self.bound, self.n_heads, rows)

    def release(self, registry: KernelRegistry) -> None:
        """Give back the uniform slot (an op bound to a sequence's buffers, freed with them)."""
        registry.release_slot(self.bound.params)
