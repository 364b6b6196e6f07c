"""Run the JS original's WGSL kernels (doppler-gpu@0.5.1) through wgpu-py, set up as its JS wrappers set them up.

Nothing of the package is copied into this repository. Its `.wgsl` files and its kernel registry
(`src/config/kernels/registry.json`: per op and variant the shader file, entry point, workgroup size, binding
list and uniform field layout) are read from the fetched package (`doppler_py.parity.npm.fetch_package`) when a
test or benchmark runs. This module is the generic part: compile a shader, build a pipeline (WebGPU "auto"
layout, as the package's pipeline cache does, or an explicit one where its wrapper passes one), pack uniforms
either by the registry's field list (as its `unifiedKernelWrapper` does through `writeUniformsFromObject`) or
field by field (the wrappers that fill a DataView themselves), bind buffers by binding index, and record
dispatches. What each wrapper computes per call (uniform values, grid, override constants, placeholder buffers)
is reproduced by the callers, next to a note naming the JS function it follows.

naga (wgpu-py's compiler) rejects `enable subgroups;`, which Tint requires; like our own registry, the directive
is stripped before compiling (the builtins still work). Any other naga error is raised as `DopplerShaderError`
with the compiler's message. Also here: a numpy packer and reader of the package's Q4_K weight format (ggml's
block_q4_K, 144 bytes per 256 weights), written from the format's definition, so a matrix can be quantised
for its fused Q4 kernels.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from doppler_py.gpu.device import Gpu
from doppler_py.gpu.kernels import source_for_naga
from doppler_py.gpu.tensor import Tensor

KERNEL_DIR = Path("src/gpu/kernels")
REGISTRY = Path("src/config/kernels/registry.json")

_PACK_FORMATS = {"u32": "I", "i32": "i", "f32": "f"}


class DopplerShaderError(RuntimeError):
    """naga (or pipeline validation) rejected one of the package's shaders."""


@dataclass(frozen=True)
class UniformField:
    name: str
    kind: str  # "u32", "i32" or "f32"
    offset: int


@dataclass(frozen=True)
class Variant:
    """One op/variant of the package's kernel registry."""

    op: str
    name: str
    wgsl: str
    entry: str
    workgroup: tuple[int, int, int]
    uniform_size: int
    uniform_fields: tuple[UniformField, ...]
    metadata: dict = field(default_factory=dict)


@dataclass(eq=False)
class Pipeline:
    variant: Variant
    pipeline: object
    layout: object  # bind group layout 0


@dataclass(eq=False)
class Dispatch:
    """A pipeline with its bind group and grid: the unit `record` encodes."""

    pipeline: Pipeline
    bind_group: object
    grid: tuple[int, int, int]
    resources: dict = field(default_factory=dict)  # keeps the bound buffers alive


def pack(*fields: tuple[str, float | int], size: int | None = None) -> bytes:
    """Little-endian 4-byte scalars in order, zero-padded to `size` (a wrapper's DataView, field by field)."""
    data = b"".join(struct.pack("<" + _PACK_FORMATS[kind], value) for kind, value in fields)
    return data.ljust(size or len(data), b"\0")


class DopplerKernels:
    """The package's kernel registry and shaders on one `Gpu`, with compiled modules and pipelines cached."""

    def __init__(self, gpu: Gpu, package_dir: Path):
        self.gpu = gpu
        self.package_dir = package_dir
        self.registry = json.loads((package_dir / REGISTRY).read_text())["operations"]
        self._modules: dict[str, object] = {}
        self._pipelines: dict[tuple, Pipeline] = {}

    def variant(self, op: str, name: str) -> Variant:
        schema = self.registry[op]
        spec = schema["variants"][name]
        uniforms = spec.get("uniformsOverride") or schema["baseUniforms"]
        fields = tuple(UniformField(f["name"], f["type"], f["offset"]) for f in uniforms["fields"])
        # getUniformByteLength: the declared size, or more if a field reaches past it.
        size = max([uniforms.get("size", 0)] + [f.offset + 4 for f in fields])
        return Variant(
            op=op,
            name=name,
            wgsl=spec["wgsl"],
            entry=spec["entryPoint"],
            workgroup=tuple(spec["workgroup"]),
            uniform_size=size,
            uniform_fields=fields,
            metadata=spec.get("variantMetadata") or {},
        )

    def source(self, wgsl: str) -> str:
        return (self.package_dir / KERNEL_DIR / wgsl).read_text()

    def module(self, wgsl: str):
        if wgsl not in self._modules:
            try:
                self._modules[wgsl] = self.gpu.device.create_shader_module(
                    code=source_for_naga(self.source(wgsl)), label=f"doppler {wgsl}"
                )
            except Exception as exc:  # wgpu raises its own error types carrying naga's message
                raise DopplerShaderError(f"naga rejects {wgsl}: {exc}") from exc
        return self._modules[wgsl]

    def pipeline(
        self,
        op: str,
        name: str,
        constants: dict[str, float | int | bool] | None = None,
        layout: Iterable[tuple[int, str]] | None = None,
    ) -> Pipeline:
        """A compute pipeline for a registry variant; `layout` lists (binding, buffer type) for an explicit
        bind group layout, None means "auto" (the package's default)."""
        import wgpu

        constants = dict(constants or {})
        layout = tuple(layout) if layout is not None else None
        key = (op, name, tuple(sorted(constants.items())), layout)
        if key in self._pipelines:
            return self._pipelines[key]
        variant = self.variant(op, name)
        stage = {"module": self.module(variant.wgsl), "entry_point": variant.entry}
        if constants:  # normalizePipelineConstants: booleans become 1 / 0
            stage["constants"] = {k: float(v) for k, v in constants.items()}
        device = self.gpu.device
        if layout is None:
            pipeline_layout = wgpu.enums.AutoLayoutMode.auto
        else:
            entries = [
                {"binding": i, "visibility": wgpu.ShaderStage.COMPUTE, "buffer": {"type": kind}} for i, kind in layout
            ]
            bgl = device.create_bind_group_layout(entries=entries)
            pipeline_layout = device.create_pipeline_layout(bind_group_layouts=[bgl])
        try:
            pipeline = device.create_compute_pipeline(layout=pipeline_layout, compute=stage, label=f"{op}/{name}")
        except Exception as exc:
            raise DopplerShaderError(f"pipeline {op}/{name} ({variant.wgsl}:{variant.entry}) fails: {exc}") from exc
        result = Pipeline(variant, pipeline, pipeline.get_bind_group_layout(0))
        self._pipelines[key] = result
        return result

    def registry_uniforms(self, variant: Variant, **values: float | int) -> bytes:
        """The uniform bytes `unifiedKernelWrapper` writes: only the registry's fields, the rest stays zero
        (a value for a name the registry does not list is dropped, as in the JS)."""
        data = bytearray(variant.uniform_size)
        for f in variant.uniform_fields:
            if f.name in values:
                struct.pack_into("<" + _PACK_FORMATS[f.kind], data, f.offset, values[f.name])
        return bytes(data)

    def uniform_buffer(self, data: bytes):
        import wgpu

        buffer = self.gpu.device.create_buffer(
            size=len(data), usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST
        )
        self.gpu.queue.write_buffer(buffer, 0, data)
        return buffer

    def placeholder(self) -> Tensor:
        """A 4-byte storage buffer holding 0, like the wrappers' fallback bindings (kv_len, page table, prenorm)."""
        return Tensor.from_numpy(self.gpu, np.zeros(1, np.uint32))

    def bind(self, pipeline: Pipeline, grid: int | tuple[int, ...], uniforms: bytes, **buffers: Tensor) -> Dispatch:
        """Bind group 0: the uniform bytes at binding 0 and `b<index>=tensor` storage buffers (whole buffers,
        as the wrappers bind them)."""
        ubuf = self.uniform_buffer(uniforms)
        entries = [{"binding": 0, "resource": {"buffer": ubuf, "offset": 0, "size": ubuf.size}}]
        for key, tensor in sorted(buffers.items(), key=lambda kv: int(kv[0][1:])):
            entries.append(
                {
                    "binding": int(key[1:]),
                    "resource": {"buffer": tensor.buffer, "offset": 0, "size": tensor.buffer.size},
                }
            )
        bind_group = self.gpu.device.create_bind_group(layout=pipeline.layout, entries=entries)
        grid = (grid, 1, 1) if isinstance(grid, int) else (*grid, 1, 1)[:3]
        return Dispatch(pipeline, bind_group, grid, {"uniforms": ubuf, **buffers})


def record(encoder, dispatches: Iterable[Dispatch]) -> None:
    """Encode the dispatches in order in one compute pass (WebGPU orders them; storage writes are visible)."""
    compute = encoder.begin_compute_pass()
    for d in dispatches:
        compute.set_pipeline(d.pipeline.pipeline)
        compute.set_bind_group(0, d.bind_group)
        compute.dispatch_workgroups(*d.grid)
    compute.end()


def run(gpu: Gpu, dispatches: Iterable[Dispatch]) -> None:
    """Record the dispatches into one command buffer and submit it (readbacks wait for it)."""
    encoder = gpu.device.create_command_encoder()
    record(encoder, dispatches)
    gpu.queue.submit([encoder.finish()])


# --- the package's Q4_K weight format (ggml block_q4_K) --------------------------------------------------------
QK_K = 256  # weights per super-block
Q4K_BLOCK_BYTES = 144  # f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of nibbles


def quantize_q4k(w: np.ndarray) -> np.ndarray:
    """W [N, K] → uint8 [N, ceil(K/256), 144]: rows padded with zeros to whole super-blocks.

    Each sub-block j of 32 weights decodes as w = d * sc[j] * q - dmin * m[j] with 6-bit sc, m and 4-bit q.
    This packer takes each sub-block's range [min(x, 0), max(x)] over 15 steps, stores d and dmin as f16 so the
    largest step and offset map to 63, rounds sc and m to nearest, then rounds each q to nearest (clamped).
    """
    n, k = w.shape
    blocks_per_row = -(-k // QK_K)
    padded = np.zeros((n, blocks_per_row * QK_K), np.float32)
    padded[:, :k] = w
    x = padded.reshape(n * blocks_per_row, 8, 32).astype(np.float64)
    lo = np.minimum(x.min(axis=2), 0.0)
    step = (x.max(axis=2) - lo) / 15
    d = (step.max(axis=1) / 63).astype(np.float16)
    dmin = ((-lo).max(axis=1) / 63).astype(np.float16)
    d64, dmin64 = d.astype(np.float64)[:, None], dmin.astype(np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        sc = np.where(d64 > 0, np.clip(np.rint(step / d64), 0, 63), 0).astype(np.uint8)
        m = np.where(dmin64 > 0, np.clip(np.rint(-lo / dmin64), 0, 63), 0).astype(np.uint8)
        scale = (d64 * sc)[:, :, None]
        offset = (dmin64 * m)[:, :, None]
        q = np.where(scale > 0, np.clip(np.rint((x + offset) / scale), 0, 15), 0).astype(np.uint8)
    out = np.zeros((len(x), Q4K_BLOCK_BYTES), np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(-1, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(-1, 2)
    out[:, 4:16] = _pack_scales(sc, m)
    # Nibbles: chunk c of 64 weights is 32 bytes; byte l holds weight 64c + l (low) and 64c + 32 + l (high).
    q = q.reshape(-1, 4, 2, 32)
    out[:, 16:] = (q[:, :, 0, :] | (q[:, :, 1, :] << 4)).reshape(-1, 128)
    return out.reshape(n, blocks_per_row, Q4K_BLOCK_BYTES)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins → 12 bytes: sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and
    4-7 (mins); sub-blocks 4-7 as nibbles of bytes 8-11 (scale low, min high) plus 2 high bits each in the
    top bits of bytes 0-3 (scales) and 4-7 (mins)."""
    packed = np.zeros((len(sc), 12), np.uint8)
    packed[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return packed


def dequantize_q4k(raw: np.ndarray, k: int) -> np.ndarray:
    """uint8 [N, blocks, 144] → float64 [N, k] (the inverse of the layout above, read byte by byte)."""
    n, blocks_per_row, _ = raw.shape
    b = raw.reshape(-1, Q4K_BLOCK_BYTES)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float64)[:, :, None]
    dmin = b[:, 2:4].copy().view(np.float16).astype(np.float64)[:, :, None]
    s = b[:, 4:16].astype(np.uint32)
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 15) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    m = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    qs = b[:, 16:].reshape(-1, 4, 32)
    q = np.stack([qs & 15, qs >> 4], axis=2).reshape(-1, 8, 32).astype(np.float64)
    w = d * sc[:, :, None] * q - dmin * m[:, :, None]
    return w.reshape(n, blocks_per_row * QK_K)[:, :k]


# --- the JS wrappers' set-up, op by op ----------------------------------------------------------------------------
# Each function returns the dispatches one call of the named JS function records, for f32 activations on a
# device like ours (WebGPU default limits, subgroups and shader-f16 available). Callers own the tensors.
SUBGROUP_OPS_SMALL_THRESHOLD = 256  # kernel-thresholds.schema.js: softmax and rmsnorm smallThreshold
ARGMAX_SINGLE_PASS_VOCAB = 65536  # kernel-thresholds.schema.js: sample argmaxReduceVocabThreshold
SAMPLE_WORKGROUP = 256  # constants.js WORKGROUP_SIZES.DEFAULT
NO_PAD_TOKEN = 0xFFFFFFFF  # sample.js: padTokenId null
ATTENTION_SMALL_BLOCK = 32  # constants.js TILE_SIZES.ATTENTION_SMALL_BLOCK_SIZE


def reduce_variant(size: int, subgroups: bool) -> str:
    """softmax.rules.json / rmsnorm.rules.json `variant` for f32 data without a fused residual."""
    small = size <= SUBGROUP_OPS_SMALL_THRESHOLD
    return {(True, True): "small_subgroup", (True, False): "subgroup", (False, True): "small"}.get(
        (subgroups, small), "default"
    )


def matmul(dk: DopplerKernels, variant: str, a: Tensor, b: Tensor, c: Tensor, m: int, n: int, k: int) -> Dispatch:
    """matmul.js executeMatmul with B stored [N, K] (transposeB true), alpha 1, no kernel-path constants.

    Variants: "f32" (f32 weights; also at M = 1), "gemv" / "gemv_subgroup_multicol" (f16 weights, M = 1) and
    "q4_fused_multicol" / "q4_fused_gemv" (Q4_K weights, M = 1). Grid as calculateMatmulDispatch, uniforms
    as createMatmulUniformBuffer (word 4: transpose_b, or blocks per row for Q4_K; word 5: workgroups_x).
    """
    v = dk.variant("matmul", variant)
    q4k = variant.startswith("q4_fused")
    workgroups_x = 0
    if q4k or variant.startswith("gemv_subgroup"):
        grid = (-(-n // v.metadata["colsPerWg"]), 1, 1)
        workgroups_x = grid[0] if variant.startswith("gemv_subgroup") else 0
    elif variant.startswith("gemv"):
        grid = (n, 1, 1)
    else:
        wg_x, wg_y, _ = v.workgroup
        grid = (-(-m // wg_x), -(-n // wg_y), 1)
    word4 = -(-k // QK_K) if q4k else 1
    uniforms = pack(("u32", m), ("u32", n), ("u32", k), ("f32", 1.0), ("u32", word4), ("u32", workgroups_x), size=32)
    return dk.bind(dk.pipeline("matmul", variant), grid, uniforms, b1=a, b2=b, b3=c)


def softmax(dk: DopplerKernels, variant: str, x: Tensor, out: Tensor, rows: int, cols: int, temperature: float):
    """softmax.js _softmax: one workgroup per row."""
    v = dk.variant("softmax", variant)
    uniforms = dk.registry_uniforms(v, inner_size=cols, outer_size=rows, temperature=temperature)
    return dk.bind(dk.pipeline("softmax", variant), rows, uniforms, b1=x, b2=out)


# sample.js getSampleBindGroupLayout: one explicit layout for every sampling entry point.
SAMPLE_LAYOUT = ((0, "uniform"), (1, "read-only-storage"), (2, "storage"), (3, "storage"), (4, "storage"))


@dataclass(eq=False)
class SampleBuffers:
    """The sampler's output token and its two 256-entry scratch buffers (sample.js acquires them per call)."""

    out: Tensor
    topk_indices: Tensor
    topk_logits: Tensor

    @classmethod
    def create(cls, gpu: Gpu) -> SampleBuffers:
        return cls(
            Tensor.empty(gpu, 1, "u32"),
            Tensor.empty(gpu, SAMPLE_WORKGROUP, "u32"),
            Tensor.empty(gpu, SAMPLE_WORKGROUP, "f32"),
        )

    def bound(self, logits: Tensor) -> dict[str, Tensor]:
        return {"b1": logits, "b2": self.out, "b3": self.topk_indices, "b4": self.topk_logits}


def argmax(dk: DopplerKernels, logits: Tensor, vocab: int, bufs: SampleBuffers) -> list[Dispatch]:
    """sample.js executeArgmaxRecord (padTokenId null, no softcap, output index 0): one single-workgroup pass
    up to 65536 tokens, else per-workgroup maxima and a reduce."""
    uniforms = pack(
        ("u32", vocab), ("u32", 1), ("f32", 1.0), ("f32", 0.0), ("u32", NO_PAD_TOKEN), ("f32", 0.0), ("u32", 0),
        size=32,
    )  # fmt: skip
    resources = bufs.bound(logits)
    if vocab <= ARGMAX_SINGLE_PASS_VOCAB:
        return [dk.bind(dk.pipeline("sample", "single_pass", layout=SAMPLE_LAYOUT), 1, uniforms, **resources)]
    groups = min(SAMPLE_WORKGROUP, -(-vocab // SAMPLE_WORKGROUP))
    return [
        dk.bind(dk.pipeline("sample", "argmax", layout=SAMPLE_LAYOUT), groups, uniforms, **resources),
        dk.bind(dk.pipeline("sample", "argmax_reduce", layout=SAMPLE_LAYOUT), 1, uniforms, **resources),
    ]


def sample_top_k(
    dk: DopplerKernels, logits: Tensor, vocab: int, top_k: int, temperature: float, u: float, bufs: SampleBuffers
) -> list[Dispatch]:
    """sample.js recordGPUSample (top_k > 1, temperature above the greedy threshold): phase 1 keeps one
    maximum per workgroup (every logit when one workgroup covers the vocabulary), phase 2 sorts those
    candidates and keeps top_k, phase 3 samples them. `u` is the uniform draw the JS derives from its seed."""
    uniforms = pack(
        ("u32", vocab), ("u32", top_k), ("f32", temperature), ("f32", u), ("u32", NO_PAD_TOKEN), ("f32", 0.0),
        ("u32", 0), size=32,
    )  # fmt: skip
    resources = bufs.bound(logits)
    groups = min(SAMPLE_WORKGROUP, -(-vocab // SAMPLE_WORKGROUP))
    phases = (("find_topk_phase1", groups), ("find_topk_phase2", 1), ("softmax_and_sample", 1))
    return [dk.bind(dk.pipeline("sample", name, layout=SAMPLE_LAYOUT), g, uniforms, **resources) for name, g in phases]


def rmsnorm(
    dk: DopplerKernels, variant: str, x: Tensor, weight: Tensor, out: Tensor, rows: int, dim: int, eps: float
) -> Dispatch:
    """rmsnorm.js recordRMSNorm without residual: the input is bound again as the unused residual, a 4-byte
    placeholder as the pre-norm output; one workgroup per token."""
    v = dk.variant("rmsnorm", variant)
    uniforms = dk.registry_uniforms(
        v, hidden_size=dim, num_tokens=rows, eps=eps, has_residual=0, token_stride=rows, output_scale=1.0
    )
    constants = {"RMS_NORM_OFFSET": False, "WEIGHT_IS_F16": False, "PRE_RESIDUAL": False, "OUTPUT_PRENORM": False}
    pipeline = dk.pipeline("rmsnorm", variant, constants)
    return dk.bind(pipeline, rows, uniforms, b1=x, b2=weight, b3=out, b4=x, b5=dk.placeholder())


def rope(
    dk: DopplerKernels, x: Tensor, cos: Tensor, sin: Tensor, rows: int, heads: int, head_dim: int, start_pos: int
) -> Dispatch:
    """rope.js _rope, f32, rotate-half over the whole head: x [rows, heads, head_dim] rotated in place with
    cos/sin tables [positions, head_dim / 2]."""
    v = dk.variant("rope", "default")
    uniforms = dk.registry_uniforms(
        v, seq_len=rows, num_heads=heads, head_dim=head_dim, rotary_dim=head_dim, start_pos=start_pos,
        rope_base=10000.0, rope_scale=1.0, interleaved=0, pair_span_dim=head_dim,
    )  # fmt: skip
    grid = -(-(rows * heads * head_dim // 2) // SAMPLE_WORKGROUP)
    return dk.bind(dk.pipeline("rope", "default"), grid, uniforms, b1=x, b2=cos, b3=sin)


def silu(dk: DopplerKernels, x: Tensor, out: Tensor, size: int, gate: Tensor | None = None) -> Dispatch:
    """silu.js runSiLU (f32, no vec4): silu(x), or with a gate — as its dense FFN calls it, inputActivation
    "identity" and no swigluLimit — silu(gate) * x. Without a gate the input is bound again as the gate."""
    constants = {"HAS_GATE": True, "INPUT_USE_IDENTITY": True} if gate is not None else {}
    stride = min(size, 65535 * SAMPLE_WORKGROUP)
    grid = (min(65535, -(-stride // SAMPLE_WORKGROUP)), -(-size // (65535 * SAMPLE_WORKGROUP)), 1)
    uniforms = pack(("u32", size), ("u32", stride), ("f32", 0.0), ("f32", 0.0))
    pipeline = dk.pipeline("silu", "default", constants)
    return dk.bind(pipeline, grid, uniforms, b1=x, b2=out, b3=gate if gate is not None else x)


def residual(dk: DopplerKernels, variant: str, a: Tensor, b: Tensor, out: Tensor, size: int) -> Dispatch:
    """residual.js _residualAdd: out = (a + b) * 1; "vec4" (the default) or "default". The JS also passes
    the dispatch stride as `_pad1`, which the registry's field list lacks, so it is never written."""
    v = dk.variant("residual", variant)
    stride = min(size, 65535 * SAMPLE_WORKGROUP)
    grid = (-(-stride // SAMPLE_WORKGROUP), -(-size // stride), 1)
    uniforms = dk.registry_uniforms(v, size=size, scale=1.0, _pad1=stride, _pad2=0)
    return dk.bind(dk.pipeline("residual", variant), grid, uniforms, b1=a, b2=b, b3=out)


def gather(dk: DopplerKernels, ids: Tensor, table: Tensor, out: Tensor, rows: int, dim: int, vocab: int) -> Dispatch:
    """gather.js _gather, f32 table [vocab, dim] with dim % 4 == 0 (the vec4 variant it then picks)."""
    v = dk.variant("gather", "vec4")
    uniforms = dk.registry_uniforms(
        v, num_tokens=rows, hidden_size=dim, vocab_size=vocab, transpose=0, index_offset=0, input_hidden_size=dim,
        hidden_offset=0,
    )  # fmt: skip
    return dk.bind(dk.pipeline("gather", "vec4"), -(-(rows * dim) // 256), uniforms, b1=ids, b2=table, b3=out)


def attention(
    dk: DopplerKernels,
    variant: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    *,
    rows: int,
    start_pos: int,
    n_heads: int,
    n_kv_heads: int,
    head_dim: int,
) -> Dispatch:
    """attention.js executeAttention, causal, contiguous f32 KV over positions 0 .. start_pos + rows - 1.

    Under WebGPU default limits with subgroups it picks "prefill_small" for rows > 1 (tiled_small tier: one
    workgroup per 32 queries and head) and "decode_subgroup" for rows == 1 (one workgroup per head); "decode"
    is the tiled_large decode kernel it picks where 20 KiB of workgroup memory is available and subgroups are
    not. kv_len and page table are the wrapper's 4-byte fallback buffers.
    """
    kv_len = start_pos + rows
    uniforms = pack(
        ("u32", n_heads), ("u32", n_kv_heads), ("u32", head_dim), ("u32", kv_len), ("u32", rows),
        ("f32", 1.0 / float(np.sqrt(head_dim))), ("u32", 1), ("u32", start_pos), size=80,
    )  # fmt: skip
    grid = n_heads if variant.startswith("decode") else -(-rows // ATTENTION_SMALL_BLOCK) * n_heads
    return dk.bind(
        dk.pipeline("attention", variant), grid, uniforms,
        b1=q, b2=k, b3=v, b4=out, b5=dk.placeholder(), b6=dk.placeholder(),
    )  # fmt: skip
