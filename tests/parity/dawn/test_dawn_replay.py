"""The Dawn lane itself: the worker runs WGSL under Dawn with browser rules, and the replay recorder catches
any difference between Dawn (SwiftShader) and wgpu-py.

Dawn facts checked here are the naga/Tint differences that shaders/README.md ("Portability rules") lists, so
a change of dawn.node that loses them (e.g. no longer enforcing default limits) shows up as a failure, not as
silent coverage loss.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from parity.dawn.client import b64, pipeline_spec
from parity.dawn.trace import DawnReplay, Tolerance, compare

from doppler_py.gpu.kernels import Binding, read_shader, workgroups
from doppler_py.gpu.tensor import Tensor

pytestmark = pytest.mark.parity

_STORAGE = Binding(0, "x", "storage", "array<f32>")


def _validate(worker, source: str, bindings=(_STORAGE,), adapter: str = "null"):
    return worker.run(
        {"adapter": adapter, "modules": {"m": source}, "pipelines": {"p": pipeline_spec("m", "main", {}, bindings)}}
    )


def test_worker_runs_the_residual_kernel_on_swiftshader_like_numpy(dawn_worker, rng):
    dawn_worker.require("vulkan")
    n = 1000  # not a multiple of the workgroup size (256)
    delta = rng.standard_normal(n).astype(np.float32)
    acc = rng.standard_normal(n).astype(np.float32)
    source = read_shader("residual")
    bindings = [Binding(0, "params", "uniform", "Params"), Binding(1, "delta", "read-only-storage", "array<f32>")]
    bindings.append(Binding(2, "acc", "storage", "array<f32>"))
    dispatch = {
        "dispatch": "p",
        "workgroups": [workgroups(n, 256), 1, 1],
        "bind": [
            {"binding": 1, "buffer": "delta", "offset": 0, "size": 4 * n},
            {"binding": 2, "buffer": "acc", "offset": 0, "size": 4 * n},
        ],
        "uniform": {"binding": 0, "data": b64(struct.pack("<I", n))},
    }
    result = dawn_worker.run(
        {
            "adapter": "vulkan",
            "modules": {"residual": source},
            "pipelines": {"p": pipeline_spec("residual", "main", {}, bindings)},
            "buffers": {
                "delta": {"size": 4 * n, "data": b64(delta.tobytes())},
                "acc": {"size": 4 * n, "data": b64(acc.tobytes())},
            },
            "steps": [dispatch, dispatch],
            "read": ["acc"],
        }
    )
    assert result.ok, result.describe()
    # Two exact f32 additions per element: the same rounding as numpy's, so equality is exact.
    np.testing.assert_array_equal(np.frombuffer(result.buffers["acc"], np.float32), acc + delta + delta)


def test_tint_reports_a_barrier_after_a_non_uniform_return_with_its_reasons(dawn_worker):
    source = """
    @group(0) @binding(0) var<storage, read_write> x: array<f32>;
    @compute @workgroup_size(64)
    fn main(@builtin(local_invocation_id) lid: vec3<u32>) {
      if (x[lid.x] > 0.0) { return; }
      workgroupBarrier();
      x[lid.x] = 1.0;
    }
    """
    result = _validate(dawn_worker, source)
    assert not result.ok
    assert "must only be called from uniform control flow" in result.describe()
    assert "non-uniform" in result.describe()  # Tint's notes say which value broke uniformity


@pytest.mark.parametrize(
    ("declaration", "message"),
    [
        ("@compute @workgroup_size(512) fn main() { _ = &x; }", "workgroup_size"),
        ("var<workgroup> big: array<f32, 4097>;\n@compute @workgroup_size(1) fn main() { big[0] = x[0]; }", "16384"),
    ],
    ids=["512-invocations", "16KiB+4-workgroup-memory"],
)
def test_devices_have_the_webgpu_default_limits_not_the_adapters(dawn_worker, declaration, message):
    source = "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n" + declaration
    result = _validate(dawn_worker, source)
    assert not result.ok
    assert message in result.describe()


def test_nine_storage_buffers_in_one_stage_are_rejected(dawn_worker):
    bindings = [Binding(i, f"b{i}", "storage", "array<f32>") for i in range(9)]
    declarations = "".join(f"@group(0) @binding({i}) var<storage, read_write> b{i}: array<f32>;\n" for i in range(9))
    body = "".join(f"b{i}[0] = 1.0; " for i in range(9))
    result = _validate(dawn_worker, declarations + f"@compute @workgroup_size(1) fn main() {{ {body}}}", bindings)
    assert not result.ok
    assert "storage buffers" in result.describe().lower()


def test_null_backend_validates_native_f16_shaders(dawn_worker):
    source = """enable f16;
    @group(0) @binding(0) var<storage, read_write> x: array<f32>;
    @compute @workgroup_size(64)
    fn main(@builtin(global_invocation_id) gid: vec3<u32>) { x[gid.x] = f32(f16(x[gid.x]) * 2.0h); }
    """
    assert "shader-f16" in dawn_worker.adapters["null"].features
    result = _validate(dawn_worker, source)
    assert result.ok, result.describe()


def test_binding_one_buffer_read_and_read_write_in_one_dispatch_is_rejected(dawn_worker):
    dawn_worker.require("vulkan")
    source = """
    @group(0) @binding(0) var<storage, read> src: array<f32>;
    @group(0) @binding(1) var<storage, read_write> dst: array<f32>;
    @compute @workgroup_size(1) fn main() { dst[0] = src[0]; }
    """
    bindings = [Binding(0, "src", "read-only-storage", "array<f32>"), Binding(1, "dst", "storage", "array<f32>")]
    whole = {"buffer": "b", "offset": 0, "size": 256}
    aliased = [{"binding": 0, **whole}, {"binding": 1, **whole}]
    result = dawn_worker.run(
        {
            "adapter": "vulkan",
            "modules": {"m": source},
            "pipelines": {"p": pipeline_spec("m", "main", {}, bindings)},
            "buffers": {"b": {"size": 256}},
            "steps": [{"dispatch": "p", "workgroups": [1, 1, 1], "bind": aliased}],
            "read": ["b"],
        }
    )
    assert not result.ok
    assert "writable" in result.describe().lower()


def test_float_differences_are_relative_to_the_largest_magnitude_and_integers_must_match():
    tolerance = Tolerance(rel=1e-4)
    big = np.array([1000.0, 1.0], np.float32)
    assert compare("f32", big, big + np.float32(0.05), tolerance).ok  # 0.05 ≤ 1e-4 · 1001
    assert not compare("f32", big, big + np.float32(0.2), tolerance).ok
    nan = np.array([np.nan, 1.0], np.float32)
    assert compare("f32", nan, nan.copy(), tolerance).ok
    assert compare("f32", nan, np.array([0.0, 1.0], np.float32), tolerance).max_abs == np.inf
    ints = np.array([3, 7], np.uint32)
    assert compare("u32", ints, ints.copy(), tolerance).ok
    difference = compare("u32", ints, np.array([3, 8], np.uint32), tolerance)
    assert not difference.ok and difference.worst == 1


def test_replay_matches_wgpu_for_many_dispatches_and_uniform_slots_in_one_submit(
    gpu, replay_registry, dawn_replay, rng
):
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    src = Tensor.from_numpy(gpu, x)
    kernel = replay_registry.kernel("residual")
    full = replay_registry.bind(kernel, params={"n": n}, delta=src, acc=acc)
    half = replay_registry.bind(kernel, params={"n": n // 2}, delta=src, acc=acc)
    before = dawn_replay.numbers.get("residual.main")
    compared_before = before.compared if before else 0
    rec = replay_registry.recorder()
    for _ in range(3):
        rec.dispatch(full, workgroups(n, 256))
    rec.dispatch(half, workgroups(n, 256))
    rec.submit()  # raises if Dawn disagrees
    assert dawn_replay.numbers["residual.main"].compared == compared_before + 1
    expected = 3 * x
    expected[: n // 2] += x[: n // 2]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-6, atol=1e-6)


def test_replay_follows_copies_and_views_at_offsets_in_a_shared_buffer(gpu, replay_registry, rng):
    # Two tensors in one buffer (the second at a 256-byte aligned offset), a whole copy and a partial one.
    n = 300
    pool = Tensor.empty(gpu, 64 + 256 + n, "f32")
    delta = pool.view((n,), offset_bytes=256 * 4)
    head = pool.view((64,))
    head.write(rng.standard_normal(64).astype(np.float32))
    delta.write(rng.standard_normal(n).astype(np.float32))
    acc = Tensor.from_numpy(gpu, rng.standard_normal(n).astype(np.float32))
    staged = Tensor.empty(gpu, n, "f32")
    part = Tensor.from_numpy(gpu, np.zeros(20, np.float32))
    rec = replay_registry.recorder()
    rec.copy(acc, staged)
    rec.dispatch(replay_registry.bind(replay_registry.kernel("residual"), params={"n": n}, delta=delta, acc=staged), 2)
    rec.copy(staged, part, 4 * 10, src_offset=4 * 2, dst_offset=4 * 4)
    rec.submit()  # raises if Dawn disagrees
    total = acc.numpy() + delta.numpy()
    np.testing.assert_allclose(staged.numpy(), total, rtol=1e-6)
    np.testing.assert_allclose(part.numpy()[4:14], total[2:12], rtol=1e-6)


def test_replay_failure_names_the_kernel_the_buffer_and_the_difference(gpu, replay_registry, dawn_replay, rng):
    n = 100
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    delta = Tensor.from_numpy(gpu, rng.uniform(1.0, 2.0, n).astype(np.float32))
    private = DawnReplay(dawn_replay.worker)  # keeps this deliberate mismatch out of the session's numbers

    class ZeroLengthUnderDawn(private.recorder_class):
        """Sends Dawn n = 0, so Dawn leaves `acc` untouched while wgpu adds delta."""

        def plan(self):
            plan = super().plan()
            plan.job["steps"][0]["uniform"]["data"] = b64(struct.pack("<I", 0))
            return plan

    rec = ZeroLengthUnderDawn(replay_registry)
    rec.dispatch(replay_registry.bind(replay_registry.kernel("residual"), params={"n": n}, delta=delta, acc=acc), 1)
    with pytest.raises(AssertionError, match=r"residual\.main: buffer 'acc' \(f32\[100\]\) max \|dawn - wgpu\| = 1\.9"):
        rec.submit()
