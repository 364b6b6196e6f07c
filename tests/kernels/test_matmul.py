"""Weight formats (doppler_py/gpu/weights.py) and the matmul kernels behind `Linear` (shaders/matmul.wgsl).

Tolerance: the kernels accumulate K products in f32, in a different order than numpy. A sum of K terms in
f32 is within K * 2^-24 * sum|term| of the exact sum, so results are compared with float64 references at
that bound. The q4 formats compute d * sum(q x) + m * sum(x) per block, so their terms are |q d x| and |m x|
(and |8 d x| for q4_0), which is what `_magnitude` sums.
"""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import DeviceLimitError, ModelFormatError, UnsupportedModelError
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import (
    BLOCK_BYTES,
    FORMATS,
    Weight,
    dequantize_blocks,
    quantize_blocks,
)
from doppler_py.ops.linear import GatedInput, InputNorm, Linear
from doppler_py.testing.references import gelu_tanh, rmsnorm, silu

U = 2.0**-24
ROW_COUNTS = (1, 2, 3, 5, 8, 13, 16, 17, 40)


def _random_weight(rng, n: int, k: int) -> np.ndarray:
    # Rows of different scales and an offset, so q4_1's m and every block's d differ.
    return (rng.standard_normal((n, k)) * rng.uniform(0.1, 2.0, (n, 1)) + rng.uniform(-0.5, 0.5, (n, 1))).astype(
        np.float32
    )


def _terms(raw: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """|w| as the kernel's summands see it: |q d| + |m| for q4_1, |q d| + |8 d| for q4_0, else |w|."""
    if fmt not in ("q4_0", "q4_1"):
        return np.abs(dequantize_blocks(raw, fmt, shape))
    n, k = shape
    blocks = raw.reshape(n * k // 32, BLOCK_BYTES[fmt])
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float64)
    packed = blocks[:, 4:] if fmt == "q4_1" else blocks[:, 2:]
    q = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.float64)
    offset = np.abs(blocks[:, 2:4].copy().view(np.float16).astype(np.float64)) if fmt == "q4_1" else 8 * np.abs(d)
    return (np.abs(q * d) + offset).reshape(n, k)


def _check(got: np.ndarray, x: np.ndarray, raw: np.ndarray, fmt: str, shape, expected: np.ndarray) -> None:
    bound = shape[1] * U * (np.abs(x).astype(np.float64) @ _terms(raw, fmt, shape).T) + 1e-30
    err = np.abs(got.astype(np.float64) - expected)
    worst = np.unravel_index(np.argmax(err / bound), err.shape)
    assert (err <= bound).all(), f"{fmt}: error {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"


def _run_linear(gpu, registry, w_raw, fmt, shape, x, *, rows, bias=None, out_init=None, **kwargs):
    n = shape[0]
    weight = Weight.from_gguf_blocks(
        gpu, w_raw, fmt, shape, name="w", max_part_bytes=kwargs.pop("max_part_bytes", None)
    )
    max_rows = kwargs.pop("max_rows", rows)
    x_t = Tensor.from_numpy(gpu, np.resize(x, (max_rows, np.shape(x)[1])).astype(np.float32))
    init = out_init if out_init is not None else np.full((max_rows, n), np.nan, np.float32)
    out = Tensor.from_numpy(gpu, init)
    bias_t = Tensor.from_numpy(gpu, bias) if bias is not None else None
    linear = Linear(registry, weight, x_t, out, max_rows=max_rows, bias=bias_t, **kwargs)
    linear.compile(rows)  # the call's own row tile, not the small tiles a CPU adapter runs until it is compiled
    rec = registry.recorder()
    linear.record(rec, rows)
    rec.submit()
    return out.numpy()


# -- host side: formats, quantisation, layout ---------------------------------------------------------
@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0", "f16"])
def test_quantisers_are_bit_exact_with_ggml_reference(fmt, rng):
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    w = _random_weight(rng, 20, 96)
    w[0, :32] = 0.0  # an all-zero block: d = 0 must not divide by zero
    w[1, :32] = np.arange(32) * (2.5 / 127)  # q8_0 rounding ties
    expected = np.asarray(gguf_quants.quantize(w, GGMLQuantizationType[fmt.upper()])).view(np.uint8).reshape(-1)
    np.testing.assert_array_equal(quantize_blocks(w, fmt), expected)


@pytest.mark.parametrize("fmt", ["q4_0", "q4_1", "q8_0"])
def test_quantisation_error_is_within_half_a_step(fmt, rng):
    w = _random_weight(rng, 16, 64)
    raw = quantize_blocks(w, fmt)
    blocks = raw.reshape(-1, BLOCK_BYTES[fmt])
    d = np.abs(blocks[:, 0:2].copy().view(np.float16).astype(np.float32)).repeat(32).reshape(w.shape)
    # Rounding to the f16 scale moves the grid by up to 2^-11 relative per step (15 or 127 steps).
    slack = {"q4_0": 8, "q4_1": 15, "q8_0": 127}[fmt] * 2.0**-11 * d + 1e-7
    # q4_0 puts the largest magnitude at q = 0 and clamps the other extreme at 15: up to one step there.
    step = d if fmt == "q4_0" else d / 2
    assert (np.abs(dequantize_blocks(raw, fmt, w.shape) - w) <= step + slack).all()


def test_formats_keep_ggml_bits_per_weight_on_the_gpu(gpu, rng):
    for rows, padded in [(16, 16), (6, 8)]:  # parts are padded with zero rows to a multiple of 8
        for fmt in FORMATS:
            weight = Weight.from_numpy(gpu, _random_weight(rng, rows, 64), fmt)
            assert weight.nbytes == padded * 2 * BLOCK_BYTES[fmt], fmt


def _ggml_blocks_in_gpu_order(rows: int, blocks_per_row: int) -> list[tuple[int, int] | None]:
    """(row, block column) of each GPU block slot: groups of 8 rows, then block columns, then rows; None = padding."""
    order = []
    for group in range(-(-rows // 8)):
        for j in range(blocks_per_row):
            order += [(r, j) if r < rows else None for r in range(8 * group, 8 * group + 8)]
    return order


def test_q4_1_blocks_are_regrouped_by_8_rows_into_quant_words_and_scale_words(gpu, rng):
    rows, per_row = 10, 2
    raw = rng.integers(0, 256, rows * per_row * 20, dtype=np.uint8)
    part = Weight.from_gguf_blocks(gpu, raw, "q4_1", (rows, 32 * per_row)).parts[0]
    ggml = raw.reshape(rows, per_row, 20)
    quants, scales = [], []
    for slot in _ggml_blocks_in_gpu_order(rows, per_row):
        block = ggml[slot] if slot else np.zeros(20, np.uint8)
        quants.append(block[4:])
        scales.append(block[:4])  # d then m: d in the low half of the word
    np.testing.assert_array_equal(part.weights.numpy().view(np.uint8), np.concatenate(quants))
    np.testing.assert_array_equal(part.scales.numpy().view(np.uint8), np.concatenate(scales))


def test_q8_0_packs_two_block_scales_per_word(gpu, rng):
    rows, per_row = 3, 3
    raw = rng.integers(0, 256, rows * per_row * 34, dtype=np.uint8)
    part = Weight.from_gguf_blocks(gpu, raw, "q8_0", (rows, 32 * per_row)).parts[0]
    ggml = raw.reshape(rows, per_row, 34)
    slots = [ggml[slot] if slot else np.zeros(34, np.uint8) for slot in _ggml_blocks_in_gpu_order(rows, per_row)]
    np.testing.assert_array_equal(part.scales.numpy().view(np.uint8), np.concatenate([b[:2] for b in slots]))
    np.testing.assert_array_equal(part.weights.numpy().view(np.uint8), np.concatenate([b[2:] for b in slots]))


def test_unsupported_format_raises(gpu):
    with pytest.raises(UnsupportedModelError, match="q5_0"):
        Weight.from_numpy(gpu, np.zeros((2, 32), np.float32), "q5_0", name="blk.0.ffn_up")


@pytest.mark.parametrize("fmt", ["q4_1", "f16"])
def test_k_not_a_multiple_of_32_is_a_model_format_error(gpu, fmt):
    with pytest.raises(ModelFormatError, match=r"output\.weight.*multiple of 32"):
        Weight.from_numpy(gpu, np.zeros((4, 48), np.float32), fmt, name="output.weight")


def test_block_bytes_that_do_not_match_the_shape_name_the_tensor(gpu):
    raw = np.zeros(3 * 20 - 1, np.uint8)
    with pytest.raises(ModelFormatError, match=r"token_embd.weight: q4_1 data for shape \[3, 32\] must be 60"):
        Weight.from_gguf_blocks(gpu, raw, "q4_1", (3, 32), name="token_embd.weight")
    with pytest.raises(ModelFormatError, match="uint8"):
        Weight.from_gguf_blocks(gpu, np.zeros(15, np.float32), "q4_1", (3, 32), name="t")
    with pytest.raises(ModelFormatError, match="2-D"):
        Weight.from_gguf_blocks(gpu, np.zeros(60, np.uint8), "q4_1", (3, 32, 1), name="t")


def test_a_row_group_larger_than_a_binding_is_a_device_limit_error(gpu):
    with pytest.raises(DeviceLimitError, match="group of 8 rows"):
        Weight.from_numpy(gpu, np.zeros((2, 64), np.float32), "f32", max_part_bytes=2000)


# -- GPU: every format and row count against the numpy reference ---------------------------------------
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", ROW_COUNTS)
def test_matmul_matches_numpy_for_every_format_and_row_count(gpu, registry, rng, fmt, rows):
    # N = 523 is neither a multiple of 8 weight rows per invocation nor of the GEMM's 64; K = 96 is 3 blocks.
    n, k = 523, 96
    raw = quantize_blocks(_random_weight(rng, n, k), fmt)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, fmt, (n, k), x, rows=rows)
    _check(got, x, raw, fmt, (n, k), x.astype(np.float64) @ dequantize_blocks(raw, fmt, (n, k)).T.astype(np.float64))


@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 608), (65, 32)])
@pytest.mark.parametrize("rows", [1, 5])
def test_awkward_shapes(gpu, registry, rng, n, k, rows):
    raw = quantize_blocks(_random_weight(rng, n, k), "q4_1")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, "q4_1", (n, k), x, rows=rows)
    _check(got, x, raw, "q4_1", (n, k), x.astype(np.float64) @ dequantize_blocks(raw, "q4_1", (n, k)).T)


@pytest.mark.parametrize("simd_lanes", [1, 4, 8, 16])
@pytest.mark.parametrize(("n", "rows"), [(1061, 1), (1061, 3), (203, 1), (40, 2)])
def test_every_row_is_computed_whatever_simd_width_spreads_the_lanes(gpu, registry, rng, simd_lanes, n, rows):
    """The register kernels give SIMD lanes row groups spread apart (matmul.wgsl first_col): 1061 rows make 133
    groups of 8 (whole chunks of lanes x 16 plus leftovers), 203 rows a spread below 16, 40 rows fewer groups
    than lanes. Every row must be written once with its own dot product (out starts as NaN)."""
    k = 64
    raw = quantize_blocks(_random_weight(rng, n, k), "f16")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    weight = Weight.from_gguf_blocks(gpu, raw, "f16", (n, k))
    out = Tensor.from_numpy(gpu, np.full((rows, n), np.nan, np.float32))
    linear = Linear(registry, weight, Tensor.from_numpy(gpu, x), out, max_rows=rows, tiled_gemm=False)
    linear.device_flags = {**linear.device_flags, "SIMD_LANES": simd_lanes}
    rec = registry.recorder()
    linear.record(rec, rows)
    rec.submit()
    _check(out.numpy(), x, raw, "f16", (n, k), x.astype(np.float64) @ dequantize_blocks(raw, "f16", (n, k)).T)


@pytest.mark.parametrize("fmt", ["f32", "q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("tiled_gemm", [False, True])
def test_input_norm_matches_rmsnorm_then_matmul(gpu, registry, rng, fmt, rows, tiled_gemm):
    """RMS_NORM in the register kernels (and the separate norm before the tiled GEMM) equals HF's RMSNorm
    followed by the projection, with bias and a residual to accumulate into; K = 608 is 19 blocks."""
    n, k, eps = 203, 608, 1e-5
    raw = quantize_blocks(_random_weight(rng, n, k), fmt)
    x = (rng.standard_normal((rows, k)) * rng.uniform(0.01, 30.0, (rows, 1))).astype(np.float32)
    gain = rng.uniform(-2.0, 2.0, k).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    residual = rng.standard_normal((rows, n)).astype(np.float32)
    scratch = Tensor.empty(gpu, (rows, k))
    norm = InputNorm(Tensor.from_numpy(gpu, gain), eps, scratch)
    got = _run_linear(
        gpu,
        registry,
        raw,
        fmt,
        (n, k),
        x,
        rows=rows,
        bias=bias,
        out_init=residual,
        accumulate=True,
        tiled_gemm=tiled_gemm,
        norm=norm,
    )
    xn = rmsnorm(x, gain, eps)
    w = dequantize_blocks(raw, fmt, (n, k)).astype(np.float64)
    product = xn @ w.T
    # The dot product's bound, the rms's own rounding (k squares summed) and three more f32 roundings.
    bound = k * U * (np.abs(xn) @ _terms(raw, fmt, (n, k)).T) + (k + 8) * U * np.abs(product)
    bound += 2 * U * (np.abs(bias) + np.abs(residual))
    err = np.abs(got - (product + bias + residual))
    assert (err <= bound).all(), f"worst error {err.max():.3g}"


@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("fmt", ["f32", "q4_1"])
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("tiled_gemm", [False, True])
def test_glu_input_matches_the_gated_activation_then_matmul(gpu, registry, rng, activation, fmt, rows, tiled_gemm):
    """GLU (the down projection with the gated MLP's activation folded into its loads): x rows are [gate | up]
    and the product's input is act(gate) * up, as swiglu.wgsl computes it; gates of +-100 pass exp's cut-off.
    40 rows take the other path: a SwiGLU dispatch into the scratch, then the plain kernel."""
    n, k = 203, 608
    raw = quantize_blocks(_random_weight(rng, n, k), fmt)
    gate = rng.standard_normal((rows, k)) * 6
    gate[:, :4] = [100.0, -100.0, 90.0, -90.0]
    up = rng.standard_normal((rows, k))
    x = np.concatenate([gate, up], axis=1).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    residual = rng.standard_normal((rows, n)).astype(np.float32)
    got = _run_linear(
        gpu, registry, raw, fmt, (n, k), x, rows=rows, bias=bias, out_init=residual, accumulate=True,
        tiled_gemm=tiled_gemm, glu=GatedInput(activation, Tensor.empty(gpu, (rows, k))),
    )  # fmt: skip
    g, u = x[:, :k].astype(np.float64), x[:, k:].astype(np.float64)
    act = (silu(g) if activation == "silu" else gelu_tanh(g)) * u
    w = dequantize_blocks(raw, fmt, (n, k)).astype(np.float64)
    product = act @ w.T
    # act carries the activation's own error (2e-6 relative, tests/kernels/test_swiglu.py), then the dot
    # product's bound and the roundings of the bias and residual adds.
    bound = 2e-6 * (np.abs(act) @ np.abs(w).T) + k * U * (np.abs(act) @ _terms(raw, fmt, (n, k)).T)
    bound += 2 * U * (np.abs(bias) + np.abs(residual) + np.abs(product))
    err = np.abs(got - (product + bias + residual))
    assert (err <= bound).all(), f"worst error {err.max():.3g}"


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_bias_and_accumulate_add_to_the_product(gpu, registry, rng, rows):
    n, k = 77, 64
    raw = quantize_blocks(_random_weight(rng, n, k), "f16")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    residual = rng.standard_normal((rows, n)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, "f16", (n, k), x, rows=rows, bias=bias, out_init=residual, accumulate=True)
    w = dequantize_blocks(raw, "f16", (n, k)).astype(np.float64)
    product = x.astype(np.float64) @ w.T
    # The dot product's bound plus two more f32 roundings (adding bias, adding the residual).
    bound = k * U * (np.abs(x) @ np.abs(w).T) + 2 * U * (np.abs(product) + np.abs(bias) + np.abs(residual))
    assert (np.abs(got - (product + bias + residual)) <= bound).all()


def test_rows_past_the_count_are_left_untouched(gpu, registry, rng):
    n, k = 40, 32
    raw = quantize_blocks(_random_weight(rng, n, k), "q8_0")
    init = rng.standard_normal((8, n)).astype(np.float32)
    got = _run_linear(
        gpu, registry, raw, "q8_0", (n, k), rng.standard_normal((3, k)), rows=3, max_rows=8, out_init=init
    )
    np.testing.assert_array_equal(got[3:], init[3:])


@pytest.mark.parametrize("fmt", ["f32", "q4_0", "q8_0"])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_weights_split_along_n_give_the_same_result(gpu, registry, rng, fmt, rows):
    # Parts of 24 rows (a multiple of 8), the last one 13 rows padded to 16.
    n, k = 61, 96
    raw = quantize_blocks(_random_weight(rng, n, k), fmt)
    part_bytes = 24 * 3 * {"f32": 128, "q4_0": 16, "q8_0": 32}[fmt] + 100
    weight = Weight.from_gguf_blocks(gpu, raw, fmt, (n, k), max_part_bytes=part_bytes)
    assert [p.rows for p in weight.parts] == [24, 24, 13]
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, fmt, (n, k), x, rows=rows, max_part_bytes=part_bytes)
    _check(got, x, raw, fmt, (n, k), x.astype(np.float64) @ dequantize_blocks(raw, fmt, (n, k)).T)


@pytest.mark.parametrize("tiled_gemm", [True, False])
def test_prefill_kernels_agree(gpu, registry, rng, tiled_gemm):
    n, k, rows = 130, 64, 40
    raw = quantize_blocks(_random_weight(rng, n, k), "q4_1")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, "q4_1", (n, k), x, rows=rows, tiled_gemm=tiled_gemm)
    _check(got, x, raw, "q4_1", (n, k), x.astype(np.float64) @ dequantize_blocks(raw, "q4_1", (n, k)).T)


@pytest.mark.parametrize("rows", [1, 5])
def test_fallback_without_subgroups_matches(gpu, registry, rng, monkeypatch, rows):
    monkeypatch.setattr(type(gpu), "has_subgroups", property(lambda self: False))
    n, k = 37, 64
    raw = quantize_blocks(_random_weight(rng, n, k), "q4_0")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    got = _run_linear(gpu, registry, raw, "q4_0", (n, k), x, rows=rows)
    _check(got, x, raw, "q4_0", (n, k), x.astype(np.float64) @ dequantize_blocks(raw, "q4_0", (n, k)).T)


@pytest.mark.parametrize("rows", [5, 40])
def test_a_call_whose_row_tile_is_not_compiled_runs_in_small_tiles_on_a_cpu_adapter(
    gpu, registry, rng, monkeypatch, rows
):
    """On a CPU adapter a call of more rows than SMALL_TILE_ROWS whose own tile (8 rows here) is not compiled runs in
    tiles of SMALL_TILE_ROWS, compiling only that pipeline (seconds less on lavapipe), with every row's result bit
    for bit the own tile's; once the own tile is compiled, calls run it. On a GPU the own tile is compiled on use."""
    from doppler_py.gpu.kernels import PipelineCache
    from doppler_py.ops.linear import SMALL_TILE_ROWS, row_tile

    cache = registry.pipelines
    fresh = PipelineCache()  # the compiled pipelines but the matmuls'
    fresh.modules = cache.modules
    fresh.kernels = {key: kernel for key, kernel in cache.kernels.items() if key[0] != "matmul"}
    monkeypatch.setattr(registry, "pipelines", fresh)
    n, k = 70, 64
    raw = quantize_blocks(_random_weight(rng, n, k), "q4_1")
    weight = Weight.from_gguf_blocks(gpu, raw, "q4_1", (n, k), name="w")
    x = rng.standard_normal((rows, k)).astype(np.float32)
    outs = [Tensor.empty(gpu, (rows, n)) for _ in range(2)]
    linears = [Linear(registry, weight, Tensor.from_numpy(gpu, x), out, max_rows=rows) for out in outs]
    own = row_tile(rows, tiled_gemm=False)

    def tiles_compiled() -> set[int]:
        return {dict(key[2])["ROWS"] for key in fresh.kernels if key[0] == "matmul"}

    rec = registry.recorder()
    linears[0].record(rec, rows)
    rec.submit()
    small = gpu.on_cpu
    assert tiles_compiled() == ({SMALL_TILE_ROWS} if small else {own})
    linears[1].compile(rows)
    assert linears[1].tile(rows) == own
    rec = registry.recorder()
    linears[1].record(rec, rows)
    rec.submit()
    got = [out.numpy() for out in outs]
    np.testing.assert_array_equal(got[0], got[1])
    _check(got[0], x, raw, "q4_1", (n, k), x.astype(np.float64) @ dequantize_blocks(raw, "q4_1", (n, k)).T)


def test_one_recorder_runs_decode_and_verify_with_their_own_uniforms(gpu, registry, rng):
    n, k = 50, 64
    w = _random_weight(rng, n, k)
    weight = Weight.from_numpy(gpu, w, "f32")
    x = rng.standard_normal((5, k)).astype(np.float32)
    x_t = Tensor.from_numpy(gpu, x)
    out1, out5 = Tensor.empty(gpu, (5, n)), Tensor.empty(gpu, (5, n))
    decode = Linear(registry, weight, x_t, out1, max_rows=5)
    verify = Linear(registry, weight, x_t, out5, max_rows=5)
    rec = registry.recorder()
    decode.record(rec, 1)
    verify.record(rec, 5)
    rec.submit()
    np.testing.assert_allclose(out1.numpy()[0], x[0] @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out5.numpy(), x @ w.T, rtol=1e-5, atol=1e-5)


# -- malformed use -------------------------------------------------------------------------------------
def test_linear_rejects_bad_tensors_and_row_counts(gpu, registry):
    """Pipelines are built lazily per row tile; a row count outside 1..max_rows is refused."""
    weight = Weight.from_numpy(gpu, np.zeros((8, 32), np.float32), "f32", name="q_proj")
    x = Tensor.empty(gpu, (4, 32))
    out = Tensor.empty(gpu, (4, 8))
    with pytest.raises(ValueError, match=r"x has 128 elements.*q_proj"):
        Linear(registry, weight, x, out, max_rows=5)
    with pytest.raises(ValueError, match="out must be f32"):
        Linear(registry, weight, x, Tensor.empty(gpu, (4, 8), "u32"), max_rows=4)
    with pytest.raises(ValueError, match="bias"):
        Linear(registry, weight, x, out, max_rows=4, bias=Tensor.empty(gpu, 7))
    with pytest.raises(ValueError, match="aliasing"):
        Linear(registry, weight, x, x.view((4, 8)), max_rows=4)
    with pytest.raises(ValueError, match=r"x has 128 elements.*4 x 64"):  # [gate | up] rows are 2K wide
        Linear(registry, weight, x, out, max_rows=4, glu=GatedInput("silu", Tensor.empty(gpu, (4, 32))))
    with pytest.raises(ValueError, match="gated activation must be one of"):
        Linear(registry, weight, Tensor.empty(gpu, (4, 64)), out, max_rows=4, glu=GatedInput("relu", x))
    with pytest.raises(ValueError, match=r"glu scratch has 32 elements"):
        Linear(registry, weight, Tensor.empty(gpu, (4, 64)), out, max_rows=4, glu=GatedInput("silu", x.view((1, 32))))
    linear = Linear(registry, weight, x, out, max_rows=4)
    for rows in (0, 5):
        with pytest.raises(ValueError, match=r"rows must be in \[1, 4\]"):
            linear.record(registry.recorder(), rows)
