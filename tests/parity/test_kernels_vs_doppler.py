"""Our kernels and the JS original's (doppler-gpu@0.5.1) side by side, each against a float64 numpy reference.

The package's own WGSL runs through wgpu-py with the uniforms, grids, constants and placeholder bindings its JS
wrappers use (tests/parity/doppler_kernels.py, which names the JS function each set-up follows), on the same
inputs as our ops. Each kernel is held to its own correct reference where the two define the op differently:

* matmul: its `matmul_f32` (what it runs for f32 weights, even at M = 1), its f16 GEMVs and its fused Q4_K
  kernels; ours is `Linear` for f32 / f16 / q4_0 / q4_1. Quantised kernels are compared with their OWN
  dequantised weights (Q4_K is its format, q4_0 / q4_1 ours); the formats' own rounding is reported apart.
* sampling: its argmax is exact (ties to the lowest id, as ours). Its top-k is approximate: phase 1 keeps ONE
  maximum per 256-token block (per workgroup), phase 2 takes the top k of those, so two of the true top k in
  one block cost a candidate; it is exact only when one workgroup covers the vocabulary (<= 256 tokens).
  It then samples the candidates in descending-logit order with `cdf >= u`; ours samples the exact top k in
  token order with `cdf > u * total` (doppler_py.testing.sampling_reference), so the two pick different
  tokens for the same u by design; each is checked against its own definition.
* RoPE: its kernel rotates one [rows, heads, head_dim] tensor in place; ours rotates q inside the fused QKV row
  and writes k to the cache. Both get the same f32 cos/sin table, so both compute the same rotation.
* SiLU: its `silu` is separate (and, gated, SwiGLU's silu(gate) * up); ours is the fused SwiGLU over the
  [gate | up] row. Its sigmoid clamps x to [-15, 15], so below -15 it returns x * sigmoid(-15) (relative
  error up to ~1 for large negative x); ours is accurate over the whole range tested.
* attention: under WebGPU default limits with subgroups it runs `prefill_small` (T > 1) and
  `decode_subgroup` (T = 1); `decode` is the decode kernel of its tiled_large tier (no subgroups and at least
  20 KiB of workgroup memory; at the default 16 KiB without subgroups it runs `prefill_small` for decode too).

Set DOPPLER_KERNEL_PARITY_JSON=path to write every recorded max error (ours, theirs) as JSON.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from parity import doppler_kernels as dop
from support.residual import Residual

from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight, dequantize_blocks, quantize_blocks
from doppler_py.ops.attention import Attention
from doppler_py.ops.elementwise import SwiGLU
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import Linear
from doppler_py.ops.norms import RMSNorm
from doppler_py.ops.rope import RoPE, rope_table
from doppler_py.ops.sampling import Sampler
from doppler_py.ops.softmax import Softmax
from doppler_py.sampling import SamplingParams
from doppler_py.testing import references
from doppler_py.testing.sampling_reference import sample_reference

pytestmark = pytest.mark.parity

SMOLLM2 = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64}
U = 2.0**-24  # unit roundoff of f32
SIGMOID_CLAMP = 15.0  # silu.wgsl clamps the sigmoid's argument to [-15, 15]

MAX_ERRORS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def error_table():
    yield
    path = os.environ.get("DOPPLER_KERNEL_PARITY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump(MAX_ERRORS, f, indent=1)


def report(kernel: str, case: str, **errors: float) -> None:
    MAX_ERRORS.append({"kernel": kernel, "case": case, **{k: float(v) for k, v in errors.items()}})


@pytest.fixture(scope="module")
def doppler(gpu, doppler_gpu_dir):
    # The kernels its wrappers pick here use subgroup builtins or f16 storage (as on lavapipe and GPUs).
    if not ("shader-f16" in gpu.features and gpu.has_subgroups):
        reason = f"{gpu.name} lacks shader-f16 or subgroups, which these kernels of the JS original need"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{reason} (CI=true: the parity lane must run)")
        pytest.skip(reason)
    return dop.DopplerKernels(gpu, doppler_gpu_dir)


def upload(gpu, array, dtype=None) -> Tensor:
    return Tensor.from_numpy(gpu, np.ascontiguousarray(array), dtype)


def run_ours(registry, op, *args, **kwargs) -> None:
    rec = registry.recorder()
    op.record(rec, *args, **kwargs)
    rec.submit()


def run_theirs(gpu, dispatches) -> None:
    dop.run(gpu, dispatches if isinstance(dispatches, list) else [dispatches])


# --- naga ---------------------------------------------------------------------------------------------------------
def test_naga_rejects_only_the_two_backward_kernels_that_pass_storage_pointers(doppler):
    """Every .wgsl of the package compiles under naga (after stripping `enable subgroups;`) except two training
    kernels whose helpers take `ptr<storage, atomic<u32>, read_write>` arguments, which naga refuses."""
    kernel_dir = doppler.package_dir / dop.KERNEL_DIR
    rejected = {}
    for path in sorted(kernel_dir.rglob("*.wgsl")):
        name = path.relative_to(kernel_dir).as_posix()
        try:
            doppler.module(name)
        except dop.DopplerShaderError as exc:
            rejected[name] = str(exc)
    assert sorted(rejected) == ["backward/embed_backward.wgsl", "backward/layernorm_backward.wgsl"]
    for message in rejected.values():
        assert re.search(r"pointer of space Storage .* can't be passed into functions", message)


# --- matmul -------------------------------------------------------------------------------------------------------
def dot_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Worst-case f32 rounding of each dot product of length K: K * 2u * sum |x_k w_k| (twice gamma_K)."""
    return x.shape[1] * 2 * U * (np.abs(x) @ np.abs(w).T)


@pytest.mark.parametrize("m", [1, 5])
def test_matmul_f32_both_match_float64(gpu, registry, doppler, rng, m):
    """Its matmul_f32 (16x16 tiles; at M = 1 it still launches ceil(N / 16) workgroups of 256) and our Linear."""
    n, k = 100, 96
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)

    ours = Tensor.empty(gpu, (m, n))
    run_ours(registry, Linear(registry, Weight.from_numpy(gpu, w, "f32"), upload(gpu, x), ours, max_rows=m), m)
    theirs = Tensor.empty(gpu, (m, n))
    run_theirs(gpu, dop.matmul(doppler, "f32", upload(gpu, x), upload(gpu, w), theirs, m, n, k))

    bound = dot_bound(x, w)
    ours_err, theirs_err = np.abs(ours.numpy() - expected), np.abs(theirs.numpy() - expected)
    report("matmul f32", f"M={m} {n}x{k}", ours=ours_err.max(), theirs=theirs_err.max())
    assert np.all(ours_err <= bound)
    assert np.all(theirs_err <= bound)


def test_f16_gemv_both_match_float64_of_the_f16_weights(gpu, registry, doppler, rng):
    """Its f16-weight GEMVs at M = 1 (gemv_subgroup_multicol, what it picks here, and the plain gemv) and our
    Linear with f16 weights; the reference multiplies the f16-rounded weights in float64."""
    n, k = 300, 576
    x = rng.standard_normal((1, k)).astype(np.float32)
    w16 = rng.standard_normal((n, k)).astype(np.float16)
    w = w16.astype(np.float32)
    expected = x.astype(np.float64) @ w.T.astype(np.float64)
    bound = dot_bound(x, w)

    ours = Tensor.empty(gpu, (1, n))
    run_ours(registry, Linear(registry, Weight.from_numpy(gpu, w, "f16"), upload(gpu, x), ours, max_rows=1), 1)
    errors = {"ours": np.abs(ours.numpy() - expected)}
    for variant in ("gemv_subgroup_multicol", "gemv"):
        theirs = Tensor.empty(gpu, (1, n))
        run_theirs(gpu, dop.matmul(doppler, variant, upload(gpu, x), upload(gpu, w16), theirs, 1, n, k))
        errors[variant] = np.abs(theirs.numpy() - expected)
    report("matmul f16 GEMV", f"M=1 {n}x{k}", **{name: e.max() for name, e in errors.items()})
    for e in errors.values():
        assert np.all(e <= bound)


def test_q4_matmuls_each_match_float64_of_their_own_dequantised_weights(gpu, registry, doppler, rng):
    """Its fused Q4_K GEMVs (q4_fused_multicol, what it picks at M = 1, and q4_fused_gemv) on the matrix packed
    in its Q4_K layout, K = 576 leaving a partial last super-block; our Linear with q4_0 and q4_1."""
    n, k = 200, 576
    x = rng.standard_normal((1, k)).astype(np.float32)
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    q4k = dop.quantize_q4k(w)
    dequantised = {"q4k": dop.dequantize_q4k(q4k, k)}
    errors, bounds = {}, {}
    for fmt in ("q4_0", "q4_1"):
        dequantised[fmt] = dequantize_blocks(quantize_blocks(w, fmt), fmt, (n, k)).astype(np.float64)
        ours = Tensor.empty(gpu, (1, n))
        run_ours(registry, Linear(registry, Weight.from_numpy(gpu, w, fmt), upload(gpu, x), ours, max_rows=1), 1)
        errors[f"ours {fmt}"] = np.abs(ours.numpy() - x.astype(np.float64) @ dequantised[fmt].T)
        bounds[f"ours {fmt}"] = dot_bound(x, dequantised[fmt])
    for variant in ("q4_fused_multicol", "q4_fused_gemv"):
        theirs = Tensor.empty(gpu, (1, n))
        weights = upload(gpu, q4k.reshape(-1).view(np.uint32))
        run_theirs(gpu, dop.matmul(doppler, variant, upload(gpu, x), weights, theirs, 1, n, k))
        errors[variant] = np.abs(theirs.numpy() - x.astype(np.float64) @ dequantised["q4k"].T)
        bounds[variant] = dot_bound(x, dequantised["q4k"])
    report("matmul Q4", f"M=1 {n}x{k}", **{name: e.max() for name, e in errors.items()})
    relative_rms = {
        fmt: np.sqrt(np.mean((wq - w) ** 2) / np.mean(w.astype(np.float64) ** 2)) for fmt, wq in dequantised.items()
    }
    report("Q4 formats: weight rms error / rms", f"{n}x{k} N(0, 0.05)", **relative_rms)
    for name, e in errors.items():
        assert np.all(e <= bounds[name]), name
    # 4 bits over each 32-weight range of a Gaussian row leave ~8% rms error; a packing slip costs far more.
    assert relative_rms["q4k"] < 0.1


# --- softmax and sampling -----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "cols"),
    [("small", 100), ("default", 1000), ("small_subgroup", 100), ("subgroup", 1000), ("subgroup", 49152)],
)
def test_softmax_both_match_float64(gpu, registry, doppler, rng, variant, cols):
    """Relative error <= 2e-5 per probability: WGSL's exp may be 3 + 2|x| ulp off (|x| <= ~30 here) and the sum
    adds a few ulp; a wrong max, sum or temperature would be off by far more."""
    rows, temperature = 3, 0.7
    x = (rng.standard_normal((rows, cols)) * 3).astype(np.float32)
    x[0, ::7] = -np.inf  # masked tokens: probability exactly 0
    expected = references.softmax(x, temperature)

    ours = Tensor.empty(gpu, (rows, cols))
    run_ours(registry, Softmax(registry, upload(gpu, x), ours, cols=cols, max_rows=rows), rows, temperature)
    theirs = Tensor.empty(gpu, (rows, cols))
    run_theirs(gpu, dop.softmax(doppler, variant, upload(gpu, x), theirs, rows, cols, temperature))

    ours_err, theirs_err = np.abs(ours.numpy() - expected), np.abs(theirs.numpy() - expected)
    report("softmax", f"{variant} {rows}x{cols}", ours=ours_err.max(), theirs=theirs_err.max())
    assert np.all(ours_err <= 2e-5 * expected)
    assert np.all(theirs_err <= 2e-5 * expected)


@pytest.mark.parametrize("vocab", [1000, 70000])
def test_argmax_both_pick_the_first_maximum(gpu, registry, doppler, rng, vocab):
    """Greedy picks are exact in both, ties going to the lowest id (its single-pass kernel up to 65536 tokens,
    argmax + argmax_reduce above)."""
    x = rng.standard_normal(vocab).astype(np.float32)
    first, second = sorted(rng.choice(vocab, 2, replace=False))
    x[first] = x[second] = x.max() + 1

    logits = upload(gpu, x)
    ours = Tensor.empty(gpu, 1, "u32")
    run_ours(
        registry, Sampler(registry, logits, upload(gpu, np.zeros(1, np.float32)), ours, vocab=vocab, max_rows=1), 1, 0.0
    )
    bufs = dop.SampleBuffers.create(gpu)
    run_theirs(gpu, dop.argmax(doppler, logits, vocab, bufs))
    report(
        "argmax",
        f"vocab {vocab}",
        ours_wrong=int(ours.numpy()[0] != first),
        theirs_wrong=int(bufs.out.numpy()[0] != first),
    )
    assert ours.numpy()[0] == first
    assert bufs.out.numpy()[0] == first


def doppler_candidates(x: np.ndarray, top_k: int, temperature: float) -> np.ndarray:
    """Its phase 1 + 2: the maximum of each workgroup's tokens (group of token i: (i mod 256 G) div 256 with G
    workgroups), or every token when G is 1; then the top_k of those by (scaled value desc, id asc)."""
    vocab = x.size
    s = x / np.float32(temperature)
    groups = min(dop.SAMPLE_WORKGROUP, -(-vocab // dop.SAMPLE_WORKGROUP))
    ids = np.arange(vocab)
    if groups > 1:
        owner = (ids % (dop.SAMPLE_WORKGROUP * groups)) // dop.SAMPLE_WORKGROUP
        order = np.lexsort((ids, -s.astype(np.float64), owner))  # by group, then value desc, then id
        ids = order[np.r_[True, owner[order][1:] != owner[order][:-1]]]
    best = ids[np.lexsort((ids, -s[ids].astype(np.float64)))]
    return best[:top_k]


def doppler_pick(x: np.ndarray, candidates: np.ndarray, temperature: float, u: float) -> int:
    """Its phase 3 in float64: softmax over the candidates in their sorted order, first with cdf >= u."""
    s = (x[candidates] / np.float32(temperature)).astype(np.float64)
    cdf = np.cumsum(np.exp(s - s.max()))
    cdf /= cdf[-1]
    index = int(np.searchsorted(cdf, u, side="left"))
    return int(candidates[min(index, len(candidates) - 1)])


def sample_both(gpu, registry, doppler, x, top_k, temperature, us):
    """(our picks, its picks, its phase-2 candidates) for each u."""
    vocab = x.size
    logits = upload(gpu, np.tile(x, (len(us), 1)))
    ours = Tensor.empty(gpu, len(us), "u32")
    sampler = Sampler(registry, logits, upload(gpu, us), ours, vocab=vocab, max_rows=len(us))
    run_ours(registry, sampler, len(us), temperature, top_k=top_k)
    row = upload(gpu, x)
    theirs, candidates = [], None
    for u in us:
        bufs = dop.SampleBuffers.create(gpu)
        run_theirs(gpu, dop.sample_top_k(doppler, row, vocab, top_k, temperature, float(u), bufs))
        theirs.append(int(bufs.out.numpy()[0]))
        candidates = bufs.topk_indices.numpy()[:top_k]
    return ours.numpy(), np.array(theirs), candidates


MARGIN = 1e-5  # a pick may move to a neighbour when u lies within float rounding of a cdf step


@pytest.mark.parametrize(("vocab", "exact"), [(200, True), (49152, False)])
def test_top_k_sampling_ours_is_exact_and_doppler_keeps_one_candidate_per_block(
    gpu, registry, doppler, rng, vocab, exact
):
    """Ours samples the exact top k. Its candidates are exactly `doppler_candidates`: the true top k when one
    workgroup covers the vocabulary, otherwise at most one token per 256-token block, so the true top k are
    missed wherever two share a block (here the top two are planted in one block). Its picks follow its own
    definition (`doppler_pick`); the total-variation distance of its distribution from the exact top-k one is
    recorded."""
    top_k, temperature = 40, 0.7
    x = rng.standard_normal(vocab).astype(np.float32)
    x[[3, 5]] = x.max() + np.float32([2.0, 1.0])  # the two largest logits, in one 256-token block
    us = ((np.arange(16) + 0.5) / 16).astype(np.float32)
    ours, theirs, candidates = sample_both(gpu, registry, doppler, x, top_k, temperature, us)

    expected_candidates = doppler_candidates(x, top_k, temperature)
    true_top_k = np.argsort(-x.astype(np.float64), kind="stable")[:top_k]
    assert np.array_equal(candidates, expected_candidates)
    recall = len(set(candidates) & set(true_top_k)) / top_k
    assert (recall == 1) == exact

    params = SamplingParams(temperature=temperature, top_k=top_k)
    for u, ours_pick, theirs_pick in zip(us, ours, theirs, strict=True):
        assert ours_pick in {sample_reference(x, min(1.0, max(0.0, u + d)), params) for d in (-MARGIN, 0, MARGIN)}
        assert theirs_pick in {doppler_pick(x, candidates, temperature, u + d) for d in (-MARGIN, 0, MARGIN)}

    def distribution(ids):
        p = np.zeros(vocab)
        s = (x[ids] / np.float32(temperature)).astype(np.float64)
        p[ids] = np.exp(s - s.max())
        return p / p.sum()

    tv = 0.5 * np.abs(distribution(candidates) - distribution(true_top_k)).sum()
    report(
        "sample top-k",
        f"vocab {vocab} k={top_k} T={temperature}",
        theirs_candidate_recall=recall,
        theirs_total_variation=tv,
    )


# --- normalisation, positions, activations, elementwise -----------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "dim"), [("small", 100), ("default", 576), ("small_subgroup", 100), ("subgroup", 576)]
)
def test_rmsnorm_both_match_float64(gpu, registry, doppler, rng, variant, dim):
    """Relative error <= 2e-5 per output: x * w * (1 / sqrt(mean(x^2) + eps)) has a few roundings plus the
    sum of squares' error (<= dim * u relative, ~1e-6 for random signs)."""
    rows, eps = 3, 1e-5
    x = rng.standard_normal((rows, dim)).astype(np.float32)
    w = rng.standard_normal(dim).astype(np.float32)
    expected = references.rmsnorm(x, w, eps)

    ours = Tensor.empty(gpu, (rows, dim))
    run_ours(registry, RMSNorm(registry, upload(gpu, x), upload(gpu, w), ours, dim=dim, eps=eps, max_rows=rows), rows)
    theirs = Tensor.empty(gpu, (rows, dim))
    run_theirs(gpu, dop.rmsnorm(doppler, variant, upload(gpu, x), upload(gpu, w), theirs, rows, dim, eps))

    ours_err, theirs_err = np.abs(ours.numpy() - expected), np.abs(theirs.numpy() - expected)
    report("rmsnorm", f"{variant} {rows}x{dim}", ours=ours_err.max(), theirs=theirs_err.max())
    assert np.all(ours_err <= 2e-5 * np.abs(expected))
    assert np.all(theirs_err <= 2e-5 * np.abs(expected))


def test_rope_both_match_float64(gpu, registry, doppler, rng):
    """SmolLM2 heads, 5 tokens at positions 7..11, the same f32 cos/sin table for both. Each output is
    x0 c -/+ x1 s: two products and a sum, so error <= 2u (|x0 c| + |x1 s|) (1 + 2u), bounded by 4u times it."""
    n_heads, n_kv, head_dim = SMOLLM2["n_heads"], SMOLLM2["n_kv_heads"], SMOLLM2["head_dim"]
    rows, start_pos, max_seq, half = 5, 7, 16, head_dim // 2
    table = rope_table(head_dim, max_seq, 1e5)
    qkv = rng.standard_normal((rows, (n_heads + 2 * n_kv) * head_dim)).astype(np.float32)
    q = qkv[:, : n_heads * head_dim].reshape(rows, n_heads, head_dim)
    k = qkv[:, n_heads * head_dim : (n_heads + n_kv) * head_dim].reshape(rows, n_kv, head_dim)

    angles = table[start_pos : start_pos + rows].astype(np.float64)  # [rows, half, (cos, sin)]

    def expected(x):
        c, s = np.abs(angles[:, None, :, 0]), np.abs(angles[:, None, :, 1])
        x0, x1 = np.abs(x[..., :half].astype(np.float64)), np.abs(x[..., half:].astype(np.float64))
        scale = np.concatenate([x0 * c + x1 * s, x0 * s + x1 * c], axis=-1)
        return references.rope(x, angles[..., 0], angles[..., 1]), 4 * U * scale

    qkv_t = upload(gpu, qkv)
    k_cache = Tensor.empty(gpu, (max_seq, n_kv, head_dim))
    v_cache = Tensor.empty(gpu, (max_seq, n_kv, head_dim))
    op = RoPE(
        registry, qkv_t, upload(gpu, table), k_cache, v_cache,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, max_seq=max_seq, max_rows=rows,
    )  # fmt: skip
    run_ours(registry, op, rows, start_pos)
    ours = {
        "q": qkv_t.numpy()[:, : n_heads * head_dim].reshape(q.shape),
        "k": k_cache.numpy()[start_pos : start_pos + rows],
    }
    cos, sin = upload(gpu, table[..., 0]), upload(gpu, table[..., 1])
    theirs = {}
    for name, x, heads in (("q", q, n_heads), ("k", k, n_kv)):
        t = upload(gpu, x)
        run_theirs(gpu, dop.rope(doppler, t, cos, sin, rows, heads, head_dim, start_pos))
        theirs[name] = t.numpy()

    for name, x in (("q", q), ("k", k)):
        value, bound = expected(x)
        ours_err, theirs_err = np.abs(ours[name] - value), np.abs(theirs[name] - value)
        report(
            "rope",
            f"{name} {rows}x{x.shape[1]}x{head_dim} from pos {start_pos}",
            ours=ours_err.max(),
            theirs=theirs_err.max(),
        )
        assert np.all(ours_err <= bound)
        assert np.all(theirs_err <= bound)


def test_swiglu_ours_matches_float64_and_doppler_silu_clamps_below_minus_15(gpu, registry, doppler, rng):
    """silu(gate) * up over gates in [-40, 40] (3 rows of 1000, not a multiple of 256). Relative error <= 2e-5
    (exp is 3 + 2|x| ulp in WGSL) for ours everywhere and for its gated silu inside its clamp; below -15 its
    result is gate * sigmoid(-15) * up, as its clamp defines. Its plain silu obeys the same."""
    rows, ffn = 3, 1000
    gate = rng.uniform(-40, 40, (rows, ffn)).astype(np.float32)
    up = rng.standard_normal((rows, ffn)).astype(np.float32)
    g = gate.astype(np.float64)
    silu_clamped = g / (1 + np.exp(-np.clip(g, -SIGMOID_CLAMP, SIGMOID_CLAMP)))
    size = rows * ffn

    ours = Tensor.empty(gpu, (rows, ffn))
    gate_up = upload(gpu, np.concatenate([gate, up], axis=1))
    run_ours(registry, SwiGLU(registry, gate_up, ours, ffn_dim=ffn, max_rows=rows), rows)
    theirs_gated, theirs_plain = Tensor.empty(gpu, size), Tensor.empty(gpu, size)
    run_theirs(gpu, dop.silu(doppler, upload(gpu, up), theirs_gated, size, gate=upload(gpu, gate)))
    run_theirs(gpu, dop.silu(doppler, upload(gpu, gate), theirs_plain, size))

    swiglu_exact = references.swiglu(gate, up)
    ours_err = np.abs(ours.numpy() - swiglu_exact)
    theirs_err = np.abs(theirs_gated.numpy().reshape(rows, ffn) - swiglu_exact)
    ours_rel, theirs_rel = ours_err / np.abs(swiglu_exact), theirs_err / np.abs(swiglu_exact)
    inside = g >= -SIGMOID_CLAMP
    report(
        "swiglu",
        f"{rows}x{ffn} gate in [-40, 40]",
        ours=ours_err.max(),
        theirs=theirs_err.max(),
        ours_relative=ours_rel.max(),
        theirs_relative=theirs_rel.max(),
        theirs_relative_gate_ge_minus_15=theirs_rel[inside].max(),
    )
    assert ours_rel.max() <= 2e-5
    assert theirs_rel[inside].max() <= 2e-5
    assert theirs_rel[~inside].max() > 0.5  # the clamp is far from silu for very negative gates
    clamped_rel = np.abs(theirs_gated.numpy().reshape(rows, ffn) - silu_clamped * up) / np.abs(silu_clamped * up)
    assert clamped_rel.max() <= 2e-5
    plain_rel = np.abs(theirs_plain.numpy().reshape(rows, ffn) - silu_clamped) / np.abs(silu_clamped)
    assert plain_rel.max() <= 2e-5


@pytest.mark.parametrize("variant", ["vec4", "default"])
def test_residual_add_is_exact_in_both(gpu, registry, doppler, rng, variant):
    """a + b rounds once in f32 in both: equal to numpy's f32 sum bit for bit (1001 elements: a ragged tail)."""
    rows, dim = 7, 143
    a = rng.standard_normal((rows, dim)).astype(np.float32)
    b = rng.standard_normal((rows, dim)).astype(np.float32)
    acc = upload(gpu, a)
    run_ours(registry, Residual(registry, upload(gpu, b), acc, dim=dim, max_rows=rows), rows)
    theirs = Tensor.empty(gpu, (rows, dim))
    run_theirs(gpu, dop.residual(doppler, variant, upload(gpu, a), upload(gpu, b), theirs, rows * dim))
    expected = a + b
    report(
        "residual",
        f"{variant} {rows * dim}",
        ours=np.abs(acc.numpy() - expected).max(),
        theirs=np.abs(theirs.numpy() - expected).max(),
    )
    assert np.array_equal(acc.numpy(), expected)
    assert np.array_equal(theirs.numpy(), expected)


def test_gather_copies_rows_exactly_and_zeroes_out_of_range_ids_in_both(gpu, registry, doppler, rng):
    vocab, dim = 300, 576
    table = rng.standard_normal((vocab, dim)).astype(np.float32)
    ids = np.array([5, vocab - 1, 0, vocab, 17], np.uint32)
    expected = np.where((ids < vocab)[:, None], table[np.minimum(ids, vocab - 1)], 0)
    rows = len(ids)
    ids_t = upload(gpu, ids)

    ours = Tensor.empty(gpu, (rows, dim))
    run_ours(registry, Embedding(registry, Weight.from_numpy(gpu, table, "f32"), ids_t, ours, max_rows=rows), rows)
    theirs = Tensor.empty(gpu, (rows, dim))
    run_theirs(gpu, dop.gather(doppler, ids_t, upload(gpu, table), theirs, rows, dim, vocab))
    report(
        "gather",
        f"{rows} of {vocab}x{dim}",
        ours=np.abs(ours.numpy() - expected).max(),
        theirs=np.abs(theirs.numpy() - expected).max(),
    )
    assert np.array_equal(ours.numpy(), expected)
    assert np.array_equal(theirs.numpy(), expected)


# --- attention ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("variant", "rows", "start_pos"),
    [("prefill_small", 37, 0), ("prefill_small", 5, 30), ("decode_subgroup", 1, 100), ("decode", 1, 100)],
)
def test_attention_both_match_float64(gpu, registry, doppler, rng, variant, rows, start_pos):
    """SmolLM2 heads (9 query, 3 KV, head_dim 64). Error <= 1e-5 max|v|: outputs are convex combinations of
    value rows, computed in f32 over a few hundred terms at most (as in tests/kernels/test_attention.py)."""
    n_heads, n_kv, head_dim = SMOLLM2["n_heads"], SMOLLM2["n_kv_heads"], SMOLLM2["head_dim"]
    context = start_pos + rows
    q = rng.standard_normal((rows, n_heads * head_dim)).astype(np.float32)
    k = rng.standard_normal((context, n_kv, head_dim)).astype(np.float32)
    v = rng.standard_normal((context, n_kv, head_dim)).astype(np.float32)
    expected = references.attention(q, k, v, start_pos)
    q_t, k_t, v_t = upload(gpu, q), upload(gpu, k), upload(gpu, v)

    ours = Tensor.empty(gpu, (rows, n_heads * head_dim))
    op = Attention(
        registry, q_t, k_t, v_t, ours,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, max_seq=context, max_rows=rows,
    )  # fmt: skip
    run_ours(registry, op, rows, start_pos)
    theirs = Tensor.empty(gpu, (rows, n_heads * head_dim))
    run_theirs(
        gpu,
        dop.attention(doppler, variant, q_t, k_t, v_t, theirs, rows=rows, start_pos=start_pos, **SMOLLM2),
    )
    ours_err, theirs_err = np.abs(ours.numpy() - expected), np.abs(theirs.numpy() - expected)
    report("attention", f"{variant} T={rows} from pos {start_pos}", ours=ours_err.max(), theirs=theirs_err.max())
    tolerance = 1e-5 * np.abs(v).max()
    assert ours_err.max() <= tolerance
    assert theirs_err.max() <= tolerance
