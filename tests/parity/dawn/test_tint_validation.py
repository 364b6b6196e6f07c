"""Every compute entry point in shaders/*.wgsl compiles under Chrome's Tint within the WebGPU default limits.

Each entry is validated with its override defaults and with every override combination the ops use, listed
in VARIANTS below (reviewed by hand: an op that starts using a new combination adds it here). A shader file
without a VARIANTS entry is still validated with its defaults, and
`test_variant_table_covers_every_shader_and_names_only_existing_entry_points` fails until someone records
its variants (an empty list when it has none). Variants used by the kernel tests are also compiled by Tint when
CI runs those tests in process on Dawn (tools/test.sh), so a combination missing here is still caught when a test
uses it.

Dawn's null backend is enough: it runs Tint's full validation (uniformity, limits, f16, subgroups) and
creates each pipeline with the same explicit bind group layout the kernel registry builds. All variants of
one entry point go to Dawn in one job (one pipeline each), so the test is one case per entry point.
"""

from __future__ import annotations

import itertools
import re

import pytest
from parity.dawn.client import pipeline_spec

from doppler_py.gpu.kernels import SHADER_DIR, entry_bindings, parse_bindings

pytestmark = pytest.mark.parity

Constants = dict[str, float]

# Attention (doppler_py/ops/attention.py) accepts any head_dim that is a multiple of 16 up to 512: all 32.
_HEAD_DIMS = list(range(16, 513, 16))


def _product(**axes: list) -> list[Constants]:
    return [dict(zip(axes, values, strict=True)) for values in itertools.product(*axes.values())]


# Weight formats (doppler_py/gpu/weights.py FORMAT_IDS: f32, f16, q4_0, q4_1, q8_0) with the flags Linear
# passes (doppler_py/ops/linear.py); its register kernels take ROWS = 1..8 x rows per invocation, COLS 8,
# 64 invocations; its tiled GEMM only the flags.
_FORMATS = [0, 1, 2, 3, 4]
_MATMUL_FLAGS = _product(FORMAT=_FORMATS)
# Linear uses workgroups of 16 and SIMD_LANES 8 or 16 on CPU adapters, 64 and 1 on GPUs (doppler_py/ops/linear.py);
# its subgroup kernel gets SUBGROUP_MIN 4 on GPUs and the measured size (4 or 8) on CPU adapters.
# The projections after a norm (qkv, gate_up, the LM head) fuse it: RMS_NORM; the down projection fuses the
# gated MLP's activation: GLU 1 (silu) or 2 (gelu_tanh).
_MATMUL_INPUTS = [{"RMS_NORM": 0}, {"RMS_NORM": 1}, {"GLU": 1}, {"GLU": 2}]
_MATMUL_REGISTER = [
    {**f, "ROWS": r, "COLS": 8, "WORKGROUP_SIZE": g, "SIMD_LANES": 8 if g == 16 else 1, **inputs}
    for f in _MATMUL_FLAGS
    for r in range(1, 9)
    for g in (16, 64)
    for inputs in _MATMUL_INPUTS
]
_MATMUL_SUBGROUPS = [
    {**v, "SUBGROUP_MIN": m} for v in _MATMUL_REGISTER for m in ((4, 8) if v["WORKGROUP_SIZE"] == 16 else (4,))
]

# shader → entry point → override combinations used by the ops (beyond the defaults, always validated).
VARIANTS: dict[str, dict[str, list[Constants]]] = {
    # BatchedAttention compiles PAGED without FUSED_ROPE (its rope modes are 2 and 3).
    # main_subgroups (CPU adapters) takes the same overrides.
    "attention": {
        entry: _product(HEAD_DIM=_HEAD_DIMS, FUSED_ROPE=[False, True]) + _product(HEAD_DIM=_HEAD_DIMS, PAGED=[True])
        for entry in ("main", "main_subgroups")
    },
    "attention_reduce": {"main": _product(HEAD_DIM=_HEAD_DIMS)},
    "embedding": {"main": _product(FORMAT=_FORMATS)},
    "linear_attention": {"conv": [], "delta": [], "commit_state": [], "commit_conv": []},
    "logit_softcap": {"main": []},
    "lora": {"main": _product(FORMAT=[0, 1], RMS_NORM=[False, True])},  # ops/lora.py: workgroups of 64
    "logprobs": {"main": []},
    "matmul": {
        "main": _MATMUL_REGISTER,
        "main_subgroups": _MATMUL_SUBGROUPS,
        "gemm_tiled": _MATMUL_FLAGS,
    },
    "residual": {"main": []},
    "rmsnorm": {"main": [{"ACCUMULATE": True}], "heads": []},
    "rope": {"main": []},
    "sample": {
        "main": [],
        "spec_draft_filter": [],
        "spec_rows": [],
        "spec_finalize": [],
        "tree_rows": [],
        "tree_finalize": [],
        "top_tokens": [],
    },
    "softmax": {"main": [{"LOG_SOFTMAX": False}, {"LOG_SOFTMAX": True}]},
    "token_mask": {"main": []},
    "penalties": {"main": []},
    "min_p": {"main": []},
    "subgroup_size": {"main": []},
    "swiglu": {"main": [{"ACTIVATION": 1}], "sigmoid_gate": [], "per_layer_gate": [{"ACTIVATION": 1}]},
    "kv_compact": {"main": []},
    "vocab_scatter": {"main": []},
    "standardize": {"main": []},
    # doppler_py/bandwidth.py measures with these workgroup sizes, both patterns and both unrolls.
    "stream_read": {
        entry: _product(WORKGROUP_SIZE=[16, 64, 256], PATTERN=[0, 1], UNROLL=[1, 4])
        for entry in ("read_f32", "read_vec4_f32", "read_u32", "read_vec4_u32")
    },
}

_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_FUNCTION_RE = re.compile(r"((?:@\w+\s*(?:\([^)]*\))?\s*)+)fn\s+(\w+)")
_OVERRIDE_RE = re.compile(r"(?:@id\(\s*\d+\s*\)\s*)?override\s+(\w+)\s*(?::\s*\w+)?\s*(=)?")


def compute_entry_points(source: str) -> list[str]:
    """Names of the `@compute` functions, whatever the order of their attributes."""
    text = _COMMENT_RE.sub("", source)
    return [name for attrs, name in _FUNCTION_RE.findall(text) if re.search(r"@compute\b", attrs)]


def overrides_without_default(source: str) -> list[str]:
    return [name for name, has_default in _OVERRIDE_RE.findall(_COMMENT_RE.sub("", source)) if not has_default]


def _shaders() -> dict[str, str]:
    return {path.stem: path.read_text() for path in sorted(SHADER_DIR.glob("*.wgsl"))}


def _variant_name(constants: Constants) -> str:
    return ",".join(f"{k}={v:g}" for k, v in constants.items()) or "defaults"


def _cases() -> list:
    return [
        pytest.param(shader, entry, id=f"{shader}.{entry}")
        for shader, source in _shaders().items()
        for entry in compute_entry_points(source)
    ]


@pytest.mark.parametrize(("shader", "entry"), _cases())
def test_tint_accepts_entry_point_and_its_variants_under_webgpu_default_limits(dawn_worker, shader, entry):
    source = (SHADER_DIR / f"{shader}.wgsl").read_text()
    variants = VARIANTS.get(shader, {}).get(entry, [])
    # An override without a default must be given, so such an entry is validated with its variants only.
    combos = variants if overrides_without_default(source) and variants else [{}, *variants]
    bindings = entry_bindings(source, entry, parse_bindings(source))
    pipelines = {_variant_name(c): pipeline_spec(shader, entry, c, bindings) for c in combos}
    result = dawn_worker.run({"adapter": "null", "modules": {shader: source}, "pipelines": pipelines})
    assert result.ok, f"Tint rejects {shader}.wgsl entry {entry} (pipelines named by overrides):\n" + (
        result.describe()
    )


def test_every_shader_has_a_compute_entry_point():
    empty = [shader for shader, source in _shaders().items() if not compute_entry_points(source)]
    assert not empty, f"no @compute function found in {empty} (or the entry-point parser missed it)"


def test_variant_table_covers_every_shader_and_names_only_existing_entry_points():
    found = {f"{shader}.{entry}" for shader, source in _shaders().items() for entry in compute_entry_points(source)}
    listed = {f"{shader}.{entry}" for shader, entries in VARIANTS.items() for entry in entries}
    missing, stale = sorted(found - listed), sorted(listed - found)
    assert not missing, (
        f"entry points validated with their defaults only — add them to VARIANTS with the override "
        f"combinations their ops use (an empty list if none): {missing}"
    )
    assert not stale, f"VARIANTS names entry points that no shader has: {stale}"


def test_entry_point_parser_reads_attributes_in_any_order_and_ignores_comments():
    source = """
    // @compute fn commented_out() {}
    /* @compute @workgroup_size(1) fn also_commented() {} */
    @compute @workgroup_size(64, 1, 1)
    fn first(@builtin(global_invocation_id) gid: vec3<u32>) {}
    @workgroup_size(WG) @compute fn second() {}
    fn helper(x: f32) -> f32 { return x; }
    @must_use fn also_helper() -> u32 { return 1u; }
    """
    assert compute_entry_points(source) == ["first", "second"]


def test_override_parser_tells_required_overrides_from_defaulted_ones():
    source = "override TILE: u32 = 16u;\n@id(3) override F16: bool;\noverride WG = 64;\n"
    assert overrides_without_default(source) == ["F16"]
