"""Linear layer: out[t, :] (+)= x[t, :] @ W.T (+ bias) for the first `rows` rows (shaders/matmul.wgsl).

Kernel per row count (each distinct row tile is one pipeline, ~0.4-2 s to compile on lavapipe, so a tile's
pipeline and bind groups are made the first time a call needs it and reused ever after; layers sharing a
weight format share the pipeline through the registry):
  rows == 1       GEMV: an invocation owns 8 weight rows (one group of the weight layout) and reads each
                  weight once.
  2 <= rows <= 16 register tiling: an invocation also owns a tile of x rows (2, 4 or 8: the row count rounded
                  up to a power of two, in tiles of 8 beyond 8), so a weight loaded once serves every row of the
                  tile; rows past `rows` are computed on duplicated data and never stored.
  rows > 16       tiled GEMM in workgroup memory on GPUs; on CPU adapters (lavapipe, SwiftShader), where
                  workgroup memory is no faster than a buffer and the register kernel measured 2-4x faster,
                  the register kernel in equal tiles of at most 8 rows. `tiled_gemm=` overrides the choice.
A weight split into parts (larger than one storage binding) is one dispatch per part.

`norm=InputNorm(...)` applies an RMSNorm to x first: inside the register kernels (no dispatch of its own), or
as a separate rmsnorm dispatch into `InputNorm.scratch` before the tiled GEMM, which cannot fuse it.
`glu=GatedInput(...)` takes x as a gated MLP's [gate | up] rows of 2K and multiplies by act(gate) * up: for
calls of up to FUSED_GLU_MAX_ROWS rows (decoding, verification) computed as x is loaded, so the down projection
needs no SwiGLU dispatch; for longer calls (prefill) by a SwiGLU dispatch into `GatedInput.scratch` first, since
there every invocation recomputing the activation of its whole row tile measured slower (SmolLM2 q4_1 prefill
on lavapipe: 157 against 186 tok/s).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from doppler_py.gpu.kernels import Bound, Kernel, KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.subgroups import simd_lanes, smallest_subgroup_size
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.ops.elementwise import ACTIVATIONS, SwiGLU
from doppler_py.ops.norms import RMSNorm

SHADER = "matmul"
COLS = 8  # weight rows per invocation (register kernels)
# Invocations per workgroup of the register kernels. CPU adapters run workgroups on a few threads: small
# groups keep them all busy when N is small (576 rows: 1.5x faster on lavapipe with 16 than with 64).
WORKGROUP_SIZE = {"cpu": 16, "gpu": 64}
MAX_TILE_ROWS = 8  # x rows per invocation (register kernels)
GEMM_TILE_ROWS, GEMM_TILE_COLS = 32, 64  # per workgroup of the tiled GEMM (fixed in the shader)
REGISTER_TILED_MAX_ROWS = 16
FUSED_GLU_MAX_ROWS = 16  # longer calls run the gated activation as its own dispatch (module docstring)
# CPU adapters: a call of more rows whose own tile (4 or 8 rows) is not compiled runs in tiles of this many rows
# instead, and a first generation's prompt of fewer than LONG_PROMPT_ROWS rows compiles only those (`row_tile`).
SMALL_TILE_ROWS = 2
LONG_PROMPT_ROWS = 512


def row_tile(rows: int, tiled_gemm: bool) -> int:
    """x rows per invocation for `rows` rows; 0 means the tiled GEMM.

    The row count rounded up to a power of two, at most 8 (3 rows → a tile of 4, 9 rows → 2 tiles of 8). Every
    tile is a pipeline per matmul shape and weight format, and on lavapipe each costs 0.4-2 s to create (Mesa's
    NIR passes over the unrolled tile, more for more rows) and again about as much at its first dispatch (LLVM):
    exact tiles 1..8 made a first process's verification compile 26 target and 32 EAGLE-head pipelines
    (`tools/bench_compile.py`). Tiles 1, 2, 4 and 8 halve that, for masked rows that cost a SmolLM2 q4_1 forward
    of 3, 5, 6 or 7 rows on lavapipe within 0.98-1.05x of the exact tile.

    On CPU adapters this is the tile a call runs once its pipeline is compiled (`Linear.tile`): until then a call
    of more rows runs in tiles of SMALL_TILE_ROWS. There an 8-row q4_1 tile takes ~2.3 s to create alone (8.7 s
    each when a first generation creates its six pipelines at once) and as much again in LLVM at its first
    dispatch, a 2-row tile ~1 s; a 48-row prefill in 2-row tiles took 1.3-1.7x as long as in 8-row ones (SmolLM2
    q4_1 matmuls, `tools/bench_tiles.py`), 6-18 ms more per prompt row, so a prompt repays the 8-row tiles only
    past several hundred rows (LONG_PROMPT_ROWS). Verification compiles its own tiles ahead of use (calibration).
    The converse, a 2-row call in the 8-row tile, costs 1.8-2.4x the 2-row tile: lavapipe computes every row.
    """
    if rows > REGISTER_TILED_MAX_ROWS and tiled_gemm:
        return 0
    return min(MAX_TILE_ROWS, 1 << (rows - 1).bit_length())


def compile_rows(linears: Sequence[Linear], stop: threading.Event | None = None, max_rows: int | None = None) -> None:
    """Compile the pipeline of every row count each of `linears` may run with, up to `max_rows` (None: all; row
    counts ascending, so the shortest calls, a drafter's first, are ready first); thread-safe, e.g. in a warm-up
    thread, which `stop` ends after the row count being compiled. A drafter's matmuls in a format of their own
    (f32, or f16 beside a float target) share no pipeline with the target's, and compiled on first use
    mid-generation."""
    last = REGISTER_TILED_MAX_ROWS + 1  # past the register tiles, one tiled GEMM for any count
    for rows in range(1, min(last, max_rows or last) + 1):
        if stop is not None and stop.is_set():
            return
        for linear in linears:
            if rows <= linear.max_rows:
                linear.compile(rows)


def compile_at_once(calls: Iterable[tuple[Linear, int]], *, small_tiles: bool = False) -> None:
    """Compile the pipelines of these (linear, rows) calls that are not compiled yet, several at once, a thread per
    core: a CPU adapter compiles each with LLVM on one core (0.4-1.8 s on lavapipe), and a first generation needs
    about six (its prompt's row tile and decoding's, each with and without the fused norm, and the LM head's), which
    one after the other held its first token back by ~6 s. `small_tiles`: on a CPU adapter, the tiles the calls run
    until their own are compiled (`row_tile`), e.g. for a short prompt."""
    missing: dict[tuple, tuple[Linear, int]] = {}
    for linear, rows in calls:
        key = linear.pipeline_key(rows, small=small_tiles)
        if key not in missing and not linear.registry.compiled(key):
            missing[key] = (linear, rows)
    if len(missing) < 2:
        for linear, rows in missing.values():
            linear.compile(rows, small=small_tiles)
        return
    with ThreadPoolExecutor(min(len(missing), os.cpu_count() or 1), thread_name_prefix="doppler-compile") as pool:
        for done in [pool.submit(linear.compile, rows, small=small_tiles) for linear, rows in missing.values()]:
            done.result()


def _check_tensor(name: str, tensor: Tensor, min_elements: int, what: str) -> None:
    if tensor.dtype != "f32":
        raise ValueError(f"Linear: {name} must be f32, got {tensor.dtype}")
    if tensor.numel < min_elements:
        raise ValueError(f"Linear: {name} has {tensor.numel} elements, needs at least {min_elements} ({what})")


def _overlap(a: Tensor, b: Tensor) -> bool:
    return a.buffer is b.buffer and a.offset < b.offset + b.binding_size and b.offset < a.offset + a.binding_size


@dataclass(frozen=True)
class InputNorm:
    """RMSNorm of Linear's input, x[t] / sqrt(mean(x[t]^2) + eps) * weight (HF LlamaRMSNorm)."""

    weight: Tensor  # f32 [K]
    eps: float
    scratch: Tensor  # f32 [>= max_rows, K]: the normalised rows, written only for the tiled GEMM


@dataclass(frozen=True)
class GatedInput:
    """Linear's x is a gated MLP's [gate | up] output (rows of 2K); the product's input is act(gate) * up."""

    activation: str  # "silu" (SwiGLU) or "gelu_pytorch_tanh" (GeGLU)
    scratch: Tensor  # f32 [>= max_rows, K]: act(gate) * up, written only by calls over more than 16 rows


class Linear:
    """out[t, n] (+)= sum_k x[t, k] * W[n, k] (+ bias[n]) for t < rows, with x f32 [>= max_rows, K] and out
    f32 [>= max_rows, N] (row-major, row strides K and N). `accumulate=True` adds into out (residual fold);
    `norm` normalises x first; `glu` reads x as [gate | up] rows of 2K (see the module docstring)."""

    def __init__(
        self,
        registry: KernelRegistry,
        weight: Weight,
        x: Tensor,
        out: Tensor,
        *,
        max_rows: int,
        bias: Tensor | None = None,
        accumulate: bool = False,
        tiled_gemm: bool | None = None,
        norm: InputNorm | None = None,
        glu: GatedInput | None = None,
    ):
        n, k = weight.shape
        if max_rows < 1:
            raise ValueError(f"Linear: max_rows must be >= 1, got {max_rows}")
        if glu is not None and (glu.activation not in ACTIVATIONS or norm is not None):
            raise ValueError(
                f"Linear: the gated activation must be one of {sorted(ACTIVATIONS)} and not combined with a norm, "
                f"got {glu.activation!r}"
            )
        label = weight.name or "weight"
        x_width = 2 * k if glu is not None else k
        _check_tensor("x", x, max_rows * x_width, f"max_rows={max_rows} x {x_width} of {label}")
        _check_tensor("out", out, max_rows * n, f"max_rows={max_rows} x N={n} of {label}")
        if bias is not None:
            _check_tensor("bias", bias, n, f"N={n} of {label}")
        if _overlap(x, out) or (bias is not None and _overlap(bias, out)):
            raise ValueError("Linear: out must not share memory with x or bias (WebGPU forbids the aliasing)")
        if norm is not None:
            _check_tensor("norm weight", norm.weight, k, f"K={k} of {label}")
            _check_tensor("norm scratch", norm.scratch, max_rows * k, f"max_rows={max_rows} x K={k} of {label}")
            if _overlap(norm.scratch, out) or _overlap(norm.scratch, x) or _overlap(norm.weight, out):
                raise ValueError(
                    "Linear: the norm's scratch must not share memory with x or out, nor its weight with out"
                )
        gpu = registry.gpu
        if tiled_gemm is None:
            tiled_gemm = not gpu.on_cpu
        self.group = WORKGROUP_SIZE["cpu" if gpu.on_cpu else "gpu"]
        self.registry = registry
        self.weight = weight
        self.max_rows = max_rows
        self.tiled_gemm = tiled_gemm
        self.flags = {"FORMAT": weight.format_id}
        self.glu = glu
        self._glu_op = None
        if glu is not None:
            _check_tensor("glu scratch", glu.scratch, max_rows * k, f"max_rows={max_rows} x K={k} of {label}")
            if _overlap(glu.scratch, out) or _overlap(glu.scratch, x):
                raise ValueError("Linear: the gated activation's scratch must not share memory with x or out")
            if max_rows > FUSED_GLU_MAX_ROWS:
                self._glu_op = SwiGLU(registry, x, glu.scratch, ffn_dim=k, max_rows=max_rows, activation=glu.activation)
        self.switches = {"has_bias": int(bias is not None), "accumulate": int(accumulate)}
        self.tensors = {"x": x, "out": out, "bias": bias if bias is not None else registry.placeholder(1)}
        self.norm = norm
        self.norm_weight = norm.weight if norm is not None else registry.placeholder(4)
        # The tiled GEMM cannot fuse the norm: it reads the rows this dispatch writes into the scratch.
        self._tiled_norm = (
            RMSNorm(registry, x, norm.weight, norm.scratch, dim=k, eps=norm.eps, max_rows=max_rows)
            if norm is not None and tiled_gemm
            else None
        )
        self.entry = "main_subgroups" if gpu.has_subgroups else "main"
        # Overrides that describe the device, not the computation (the register kernels only).
        self.device_flags = {"SIMD_LANES": simd_lanes(registry)}
        if gpu.has_subgroups:
            self.device_flags["SUBGROUP_MIN"] = smallest_subgroup_size(registry)
        # (row tile, gated activation fused) -> [(bound, grid x)] per weight part
        self._variants: dict[tuple[int, bool], list[tuple[Bound, int]]] = {}

    def compile(self, rows: int, *, small: bool = False) -> None:
        """Compile the pipeline a call of `rows` rows runs (and nothing else: no bind group, no uniform), so
        another thread may do it ahead of the first such call (~0.6-1.4 s each on lavapipe). `small`: the tile
        such a call runs until its own is compiled (CPU adapters, `row_tile`)."""
        self._kernel(self._tile(rows, small), self._fuses_glu(rows))

    def pipeline_key(self, rows: int, *, small: bool = False) -> tuple:
        """The pipeline a call of `rows` rows runs (`KernelRegistry.kernel_key`): matmuls of one shape share it."""
        return self._key(self._tile(rows, small), self._fuses_glu(rows))

    def tile(self, rows: int) -> int:
        """The row tile a call of `rows` rows runs now: `row_tile`'s, or on a CPU adapter, while that tile's
        pipeline is not compiled, SMALL_TILE_ROWS (the reason is in `row_tile`)."""
        tile = row_tile(rows, self.tiled_gemm)
        small = self._tile(rows, small=True)
        if small == tile or (tile, self._fuses_glu(rows)) in self._variants:  # bound, so compiled: no key to build
            return tile
        return tile if self.registry.compiled(self._key(tile, self._fuses_glu(rows))) else small

    def _tile(self, rows: int, small: bool) -> int:
        tile = row_tile(rows, self.tiled_gemm)
        if small and self.registry.gpu.on_cpu and tile > SMALL_TILE_ROWS:
            return SMALL_TILE_ROWS
        return tile

    def _key(self, tile: int, fused_glu: bool) -> tuple:
        entry, constants = self._pipeline(tile, fused_glu)
        return self.registry.kernel_key(SHADER, entry, **constants)

    def _fuses_glu(self, rows: int) -> bool:
        return self.glu is not None and rows <= FUSED_GLU_MAX_ROWS

    def _kernel(self, tile: int, fused_glu: bool) -> Kernel:
        entry, constants = self._pipeline(tile, fused_glu)
        return self.registry.kernel(SHADER, entry, **constants)

    def _pipeline(self, tile: int, fused_glu: bool) -> tuple[str, dict]:
        """The entry point and override constants of the pipeline for a row tile (0: the tiled GEMM)."""
        if tile == 0:
            return "gemm_tiled", dict(self.flags)
        input_flags = {"RMS_NORM": True} if self.norm is not None else {}
        if fused_glu:
            input_flags["GLU"] = ACTIVATIONS[self.glu.activation] + 1
        constants = dict(ROWS=tile, COLS=COLS, WORKGROUP_SIZE=self.group)
        return self.entry, constants | self.flags | self.device_flags | input_flags

    def _variant(self, tile: int, fused_glu: bool) -> list[tuple[Bound, int]]:
        if (tile, fused_glu) not in self._variants:
            registry, (n, k) = self.registry, self.weight.shape
            tensors = dict(self.tensors)
            if self.glu is not None and not fused_glu:
                tensors["x"] = self.glu.scratch
            kernel = self._kernel(tile, fused_glu)
            if tile == 0:
                if self.norm is not None:
                    tensors["x"] = self.norm.scratch
            else:
                tensors["norm_weight"] = self.norm_weight
            eps = self.norm.eps if self.norm is not None else 0.0
            bounds = []
            for part in self.weight.parts:
                params = {
                    "rows": 1,
                    "k": k,
                    "n": part.rows,
                    "n_offset": part.row_start,
                    "n_total": n,
                    "eps": eps,
                    **self.switches,
                }
                bound = registry.bind(kernel, params, weights=part.weights, scales=part.scales, **tensors)
                grid_x = (
                    workgroups(part.rows, GEMM_TILE_COLS) if tile == 0 else workgroups(part.rows, COLS * self.group)
                )
                bounds.append((bound, grid_x))
            self._variants[(tile, fused_glu)] = bounds
        return self._variants[(tile, fused_glu)]

    def record(self, rec: Recorder, rows: int) -> None:
        if not 1 <= rows <= self.max_rows:
            raise ValueError(
                f"Linear({self.weight.name or 'weight'}): rows must be in [1, {self.max_rows}], got {rows}"
            )
        tile = self.tile(rows)
        grid_y = workgroups(rows, tile or GEMM_TILE_ROWS)
        if tile == 0 and self._tiled_norm is not None:
            self._tiled_norm.record(rec, rows)
        fused_glu = self._fuses_glu(rows)
        if self.glu is not None and not fused_glu:
            self._glu_op.record(rec, rows)
        for bound, grid_x in self._variant(tile, fused_glu):
            bound.params.set(rows=rows)
            rec.dispatch(bound, grid_x, grid_y)
