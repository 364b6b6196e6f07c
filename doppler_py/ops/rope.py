"""Rotary position embeddings (HF LLaMA "rotate half" convention): the host-side cos/sin table and the op.

The table reproduces HF transformers' float32 arithmetic step by step (`modeling_rope_utils`): float32
operations in the same order, with torch's scalar conventions — `scalar / tensor` is evaluated as
`tensor.reciprocal() * scalar`, and a Python scalar meets a float32 tensor as a float32. pow, cos and sin are
evaluated in float64 and rounded once, i.e. correctly rounded. Checked against torch 2.13 (CPU): inverse
frequencies and angles are bit-identical for SmolLM2 (theta 1e5) and Llama 3.2 (llama3 scaling); torch's own
float32 pow/cos/sin are not always correctly rounded, so rare pow results (1 of 48 frequencies at head_dim 96)
and ~5% of cos/sin entries differ from torch's by one ulp.
"""

from __future__ import annotations

import math

import numpy as np

from doppler_py.errors import UnsupportedModelError
from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.uniforms import UniformSlot
from doppler_py.ops.elementwise import require_f32, require_rows
from doppler_py.ops.tree import MAX_TREE_ROWS

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "proportional")

_F32 = np.float32


def rope_inv_freq(
    head_dim: int, theta: float, rope_scaling: dict | None = None, rotary_dim: int | None = None
) -> np.ndarray:
    """The float32 inverse frequencies [head_dim // 2] that HF computes for `rope_scaling` (a config.json dict).

    Partial RoPE (`rotary_dim` < head_dim, Qwen 3.5): HF rotates dims i and i + rotary_dim / 2 for i < rotary_dim / 2
    and passes the rest through. The kernels rotate dims i and i + head_dim / 2 instead, so the loader moves each q
    and k head's dims to those slots (`partial_rotary_order`) and the frequencies here are HF's rotary_dim / 2, then
    zeros: angle 0, a rotation that leaves the passed-through dims alone."""
    if head_dim <= 0 or head_dim % 2:
        raise UnsupportedModelError(f"RoPE needs a positive even head_dim, got {head_dim}")
    if rotary_dim is not None and rotary_dim != head_dim:
        if not 0 < rotary_dim < head_dim or rotary_dim % 2:
            raise UnsupportedModelError(f"partial RoPE needs an even rotary_dim below {head_dim}, got {rotary_dim}")
        padded = np.zeros(head_dim // 2, dtype=_F32)
        padded[: rotary_dim // 2] = rope_inv_freq(rotary_dim, theta, rope_scaling)
        return padded
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(_F32) / _F32(head_dim)
    # numpy's float32 pow is an ulp off where torch's is right; float64 rounded once matches torch.
    inv_freq = _reciprocal(np.power(np.float64(_F32(theta)), exponents.astype(np.float64)).astype(_F32))
    rope_type = _rope_type(rope_scaling)
    if rope_type == "linear":
        return inv_freq / _F32(_scaling_value(rope_scaling, "factor"))
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    if rope_type == "proportional":
        return _proportional_inv_freq(inv_freq, head_dim, rope_scaling)
    return inv_freq


def _proportional_inv_freq(inv_freq: np.ndarray, head_dim: int, rope_scaling: dict) -> np.ndarray:
    """Gemma 4's partial RoPE (HF `_compute_proportional_rope_parameters`): the first partial_rotary_factor of
    the head's frequency pairs keep their frequencies (exponents over the WHOLE head_dim), the rest get 0, so
    their cos is 1 and sin 0 at every position: the rotate-half kernels leave those dims as they are, with no
    rotary_dim of their own. Then every frequency is divided by `factor`."""
    fraction = float(rope_scaling.get("partial_rotary_factor", 1.0))
    kept = inv_freq.copy()
    kept[int(fraction * head_dim // 2) :] = 0
    return kept / _F32(rope_scaling.get("factor", 1.0))


def rope_table(
    head_dim: int, max_positions: int, theta: float, rope_scaling: dict | None = None, rotary_dim: int | None = None
) -> np.ndarray:
    """cos/sin of every (position, frequency): float32 [max_positions, head_dim // 2, 2], [..., 0] = cos."""
    inv_freq = rope_inv_freq(head_dim, theta, rope_scaling, rotary_dim)
    angles = np.arange(max_positions, dtype=_F32)[:, None] * inv_freq[None, :]  # float32 product, as in HF
    table = np.empty((max_positions, head_dim // 2, 2), dtype=_F32)
    table[..., 0] = np.cos(angles.astype(np.float64))
    table[..., 1] = np.sin(angles.astype(np.float64))
    return table


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """For each slot of a head as the kernels hold it, the HF dim stored there (`rope_inv_freq`): HF's rotated
    pairs (i, i + rotary_dim / 2) move to (i, i + head_dim / 2), the passed-through dims fill the other slots in
    order. q and k (and their norm weights) are permuted alike, so every score q·k is unchanged."""
    half, rot_half = head_dim // 2, rotary_dim // 2
    order = np.empty(head_dim, dtype=np.int64)
    order[:rot_half] = np.arange(rot_half)
    order[half : half + rot_half] = np.arange(rot_half, rotary_dim)
    rest = iter(range(rotary_dim, head_dim))
    for slot in [*range(rot_half, half), *range(half + rot_half, head_dim)]:
        order[slot] = next(rest)
    return order


def _reciprocal(x: np.ndarray) -> np.ndarray:
    return _F32(1.0) / x


def _rope_type(rope_scaling: dict | None) -> str:
    if rope_scaling is None:
        return "default"
    # Older configs spell the key "type"; HF accepts both.
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope_scaling type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    return rope_type


def _scaling_value(rope_scaling: dict, key: str) -> float:
    if key not in rope_scaling:
        raise UnsupportedModelError(f"rope_scaling {rope_scaling} lacks {key!r}")
    return float(rope_scaling[key])


def _llama3_inv_freq(inv_freq: np.ndarray, rope_scaling: dict) -> np.ndarray:
    """Llama 3.1+ frequency scaling: long wavelengths divided by `factor`, short ones kept, a smooth blend
    between (HF `_compute_llama3_parameters`)."""
    factor = _scaling_value(rope_scaling, "factor")
    low_freq_factor = _scaling_value(rope_scaling, "low_freq_factor")
    high_freq_factor = _scaling_value(rope_scaling, "high_freq_factor")
    old_context_len = _scaling_value(rope_scaling, "original_max_position_embeddings")
    low_freq_wavelen = _F32(old_context_len / low_freq_factor)
    high_freq_wavelen = _F32(old_context_len / high_freq_factor)

    wavelen = _reciprocal(inv_freq) * _F32(2 * math.pi)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / _F32(factor), inv_freq)
    smooth = (_reciprocal(wavelen) * _F32(old_context_len) - _F32(low_freq_factor)) / _F32(
        high_freq_factor - low_freq_factor
    )
    smoothed = (_F32(1.0) - smooth) * scaled / _F32(factor) + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(_F32)


class RoPE:
    """Applies RoPE to the fused QKV projection output and writes the new tokens' keys and values to the cache.

    `qkv` is [max_rows, (n_heads + 2 * n_kv_heads) * head_dim] laid out per row as [q heads | k heads | v heads];
    row t is the token at position start_pos + t. One dispatch rotates the q heads in place, writes the rotated
    k heads to `k_cache` and copies the v heads to `v_cache` (caches [max_seq, n_kv_heads, head_dim]); qkv's
    k and v sections are left as they are. `cos_sin` is a `rope_table` uploaded as a tensor. A row at a
    position past the table or >= max_seq writes nothing (the caller checks capacity). `tree`: a token tree's
    layout (u32, `ops.tree.layout_words`); calls with `tree=True` rotate row t for position
    start_pos + depth(t) and still write slot start_pos + t. A call's `row0` places its row t at qkv row row0 + t
    (several sequences' rows in one buffer, each sequence with its own cache and op)."""

    def __init__(
        self,
        registry: KernelRegistry,
        qkv: Tensor,
        cos_sin: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        max_seq: int,
        max_rows: int,
        tree: Tensor | None = None,
    ):
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RoPE: head_dim must be positive and even, got {head_dim}")
        half = head_dim // 2
        kv_size = n_kv_heads * head_dim
        require_f32(qkv, max_rows * (n_heads * head_dim + 2 * kv_size), "RoPE qkv")
        require_f32(k_cache, max_seq * kv_size, "RoPE k_cache")
        require_f32(v_cache, max_seq * kv_size, "RoPE v_cache")
        require_f32(cos_sin, 2 * half, "RoPE cos_sin")
        if cos_sin.numel % (2 * half):
            raise ValueError(f"RoPE: cos_sin must be a rope_table shaped [positions, {half}, 2], got {cos_sin.shape}")
        self.max_rows = max_rows
        self.n_pairs = (n_heads + n_kv_heads) * half
        params = {
            "start_pos": 0,
            "n_heads": n_heads,
            "n_kv_heads": n_kv_heads,
            "half": half,
            "pos_limit": min(cos_sin.numel // (2 * half), max_seq),
            "tree": 0,
            "row0": 0,
        }
        self.has_tree = tree is not None
        self.bound = registry.bind(
            registry.kernel("rope"),
            params=params,
            cos_sin=cos_sin,
            qkv=qkv,
            k_cache=k_cache,
            v_cache=v_cache,
            tree=tree if tree is not None else registry.placeholder(2 * MAX_TREE_ROWS),
        )

    def release(self, registry: KernelRegistry) -> None:
        """Give back the op's uniform slot (its tensors belong to the caller)."""
        registry.release_slot(self.bound.params)

    def record(self, rec: Recorder, rows: int, start_pos: int, *, tree: bool = False, row0: int = 0) -> UniformSlot:
        """Record the call; returns the uniform slot it used (the op's own, or its phase copy)."""
        require_rows(rows, self.max_rows, "RoPE")
        if row0 < 0 or row0 + rows > self.max_rows:
            raise ValueError(f"RoPE: row0={row0}: rows {row0}..{row0 + rows - 1} must lie in 0..{self.max_rows - 1}")
        if start_pos < 0:
            raise ValueError(f"RoPE: start_pos must be >= 0, got {start_pos}")
        if tree and not (self.has_tree and rows <= MAX_TREE_ROWS):
            raise ValueError(f"RoPE: a tree call needs the op's tree layout tensor and rows <= {MAX_TREE_ROWS}")
        self.bound.params.set(start_pos=start_pos, tree=int(tree), row0=row0)
        return rec.dispatch(self.bound, workgroups(self.n_pairs, 64), rows).params
