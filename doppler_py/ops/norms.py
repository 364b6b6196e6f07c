"""RMSNorm (HF LlamaRMSNorm semantics, computed in f32): over rows, or per attention head in place."""

from __future__ import annotations

from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows


class RMSNorm:
    """out[t] (+)= x[t] / sqrt(mean(x[t]^2) + eps) * weight, for rows t < rows of [max_rows, dim] tensors.

    `accumulate=True` adds into out (Gemma's post-attention and post-MLP norms: x += rmsnorm(y)), then multiplies
    the sum by `out_scale` (Gemma 4's layer_scalar on the layer's last add: x = (x + rmsnorm(y)) * s)."""

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
        out_scale: float = 1.0,
    ):
        if out_scale != 1.0 and not accumulate:
            raise ValueError("RMSNorm: out_scale scales the accumulated sum; it needs accumulate=True")
        require_f32(x, max_rows * dim, "RMSNorm x")
        require_f32(weight, dim, "RMSNorm weight")
        require_f32(out, max_rows * dim, "RMSNorm out")
        self.max_rows = max_rows
        self.bound = registry.bind(
            registry.kernel("rmsnorm", ACCUMULATE=accumulate),
            params={"dim": dim, "eps": eps, "out_scale": out_scale},
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
    follow q in the fused [q | k | v] row) weight[head_dim:2 head_dim]. The v heads are left alone, unless
    `v_heads` > 0 (Gemma 4's v_norm): then the v_heads heads after k use weight[2 head_dim:3 head_dim]."""

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
        v_heads: int = 0,
    ):
        if v_heads and not k_heads:
            raise ValueError("HeadRMSNorm: v heads follow k heads in the row")
        sections = 3 if v_heads else 2 if k_heads else 1
        require_f32(qkv, max_rows * row_stride, "HeadRMSNorm qkv")
        require_f32(weight, sections * head_dim, "HeadRMSNorm weight")
        if (q_heads + k_heads + v_heads) * head_dim > row_stride:
            raise ValueError(
                f"HeadRMSNorm: {q_heads} + {k_heads} + {v_heads} heads of {head_dim} exceed the row ({row_stride})"
            )
        self.max_rows = max_rows
        self.n_heads = q_heads + k_heads + v_heads
        self.bound = registry.bind(
            registry.kernel("rmsnorm", entry="heads"),
            params={"dim": head_dim, "eps": eps, "q_heads": q_heads, "row_stride": row_stride, "k_heads": k_heads},
            weight=weight,
            out=qkv,
        )

    def record(self, rec: Recorder, rows: int) -> None:
        require_rows(rows, self.max_rows, "HeadRMSNorm")
        rec.dispatch(self.bound, self.n_heads, rows)

    def release(self, registry: KernelRegistry) -> None:
        """Give back the uniform slot (an op bound to a sequence's buffers, freed with them)."""
        registry.release_slot(self.bound.params)
