"""Kernel registry: parsing, caching, uniforms, and one-submit recording."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import InternalError, ShaderError
from doppler_py.gpu.kernels import (
    KernelRegistry,
    entry_bindings,
    parse_bindings,
    parse_uniform,
    read_shader,
    source_for_naga,
    workgroups,
)
from doppler_py.gpu.tensor import Tensor


def test_subgroup_directive_is_stripped_for_naga_only_on_its_own_line():
    src = "enable f16;\nenable subgroups;\n// enable subgroups; in a comment stays\nfn f() {}\n"
    out = source_for_naga(src)
    assert "enable f16;" in out
    assert "\nenable subgroups;\n" not in out
    assert "// enable subgroups; in a comment stays" in out


def test_bindings_and_uniform_fields_are_read_from_the_source():
    src = """
    struct P { n: u32, scale: f32, offset: i32, }
    @group(0) @binding(0) var<uniform> params: P;
    @group(0) @binding(2) var<storage, read_write> out: array<f32>;
    @group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
    """
    bindings = parse_bindings(src)
    assert [(b.index, b.name, b.kind) for b in bindings] == [
        (0, "params", "uniform"),
        (1, "x", "read-only-storage"),
        (2, "out", "storage"),
    ]
    layout = parse_uniform(src, bindings)
    assert layout.fields == (("n", "u32"), ("scale", "f32"), ("offset", "i32"))


def test_uniform_struct_with_a_vector_field_is_rejected():
    src = "struct P { v: vec4<f32> }\n@group(0) @binding(0) var<uniform> p: P;"
    with pytest.raises(ShaderError, match="only u32/i32/f32"):
        parse_uniform(src, parse_bindings(src))


def test_unknown_shader_name_lists_the_known_ones(registry):
    with pytest.raises(ShaderError, match="residual"):
        registry.kernel("no_such_shader")


def test_pipelines_and_bind_groups_are_cached(gpu, registry):
    delta = Tensor.from_numpy(gpu, np.ones(10, np.float32))
    acc = Tensor.empty(gpu, 10)
    k1 = registry.kernel("residual")
    assert registry.kernel("residual") is k1
    first = registry.bind(k1, params={"n": 10}, delta=delta, acc=acc)
    again = registry.bind(k1, params=first.params, delta=delta, acc=acc)
    assert again.bind_group is first.bind_group


def test_each_compiled_pipeline_leaves_one_record_and_only_a_files_first_pays_for_its_module(gpu, tmp_path):
    """`PipelineCache.records` (what tools/bench_compile.py reports): one per pipeline compiled, in order, with its
    key; the shader module's seconds go to the first pipeline of the file, the next ones reuse the module."""
    (tmp_path / "embedding.wgsl").write_text(read_shader("embedding"))
    registry = KernelRegistry(gpu, tmp_path)  # a shader folder of its own: a cache no other test compiled into
    try:
        registry.kernel("embedding", FORMAT=0)
        registry.kernel("embedding", FORMAT=0)  # cached: no second record
        registry.kernel("embedding", FORMAT=1)
        records = registry.pipelines.records
        assert [r.key for r in records] == [
            registry.kernel_key("embedding", FORMAT=0),
            registry.kernel_key("embedding", FORMAT=1),
        ]
        assert records[0].module_s > 0 and records[1].module_s == 0
        assert all(r.pipeline_s > 0 for r in records)
        assert records[0].started < records[1].started
        assert registry.pipelines.compile_s["embedding"] == pytest.approx([r.module_s + r.pipeline_s for r in records])
    finally:
        registry.close()


@pytest.mark.slow
def test_every_registry_on_a_device_shares_its_compiled_pipelines(gpu, tiny_folder, monkeypatch):
    """A pipeline compiled for one engine is the same object in the next (and closing the first keeps it): a
    second `load()` of a model in one process compiles nothing."""
    import doppler_py
    from doppler_py.testing.tiny import TinySpec

    first, second = KernelRegistry(gpu), KernelRegistry(gpu)
    assert first.kernel("residual") is second.kernel("residual")
    first.close()
    assert KernelRegistry(gpu).kernel("residual") is second.kernel("residual")
    second.close()

    compiled = []
    compile_one = KernelRegistry._compile
    monkeypatch.setattr(
        KernelRegistry, "_compile", lambda registry, key: compiled.append(key) or compile_one(registry, key)
    )
    folder = tiny_folder(TinySpec(num_hidden_layers=1, seed=21))
    for _ in range(2):
        compiled.clear()
        with doppler_py.load(folder, "f32", gpu=gpu, max_seq=64, progress=False) as engine:
            engine.generate("hello", max_tokens=3, speculative="prompt-lookup")
    assert compiled == []


def test_forgetting_a_buffer_drops_exactly_the_groups_that_bind_it(gpu):
    registry = KernelRegistry(gpu)  # its own: the session registry's groups would hide the counts
    kernel = registry.kernel("residual")
    shared, kept, forgotten = (Tensor.empty(gpu, 8) for _ in range(3))
    slot = registry.bind(kernel, params={"n": 8}, delta=shared, acc=kept).params
    with_kept = registry.bind(kernel, params=slot, delta=shared, acc=kept)
    with_forgotten = registry.bind(kernel, params=slot, delta=shared, acc=forgotten)
    both = registry.bind(kernel, params=slot, delta=kept, acc=forgotten)
    assert registry.cache_sizes["bind_groups"] == 3

    registry.forget_buffer(forgotten.buffer)
    assert registry.cache_sizes["bind_groups"] == 1
    assert registry.bind(kernel, params=slot, delta=shared, acc=kept).bind_group is with_kept.bind_group
    assert registry.bind(kernel, params=slot, delta=shared, acc=forgotten).bind_group is not with_forgotten.bind_group
    assert registry.bind(kernel, params=slot, delta=kept, acc=forgotten).bind_group is not both.bind_group
    registry.forget_buffer(forgotten.buffer)
    registry.forget_buffer(kept.buffer)
    assert registry.cache_sizes["bind_groups"] == 0
    assert registry._groups_by_buffer == {}  # no key of a dropped group is left behind
    registry.close()


def test_wrong_binding_names_raise(registry, gpu):
    t = Tensor.empty(gpu, 4)
    with pytest.raises(ShaderError, match="missing bindings"):
        registry.bind(registry.kernel("residual"), params={"n": 4}, acc=t)


@pytest.mark.parametrize("native", [True, False], ids=["native-calls", "wgpu-py-api"])
def test_many_dispatches_in_one_submit_see_each_others_writes_and_their_own_uniforms(
    gpu, registry, rng, monkeypatch, native
):
    """Both recording paths: wgpu-native's pass functions called directly, and wgpu-py's public API."""
    monkeypatch.setattr(registry, "native_dispatch", native and registry.native_dispatch)
    n = 1000
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    src = Tensor.from_numpy(gpu, x)
    kernel = registry.kernel("residual")
    rec = registry.recorder()
    # Ten accumulations in one encoder; a second op adds only the first half (its own uniform slot).
    full = registry.bind(kernel, params={"n": n}, delta=src, acc=acc)
    half = registry.bind(kernel, params={"n": n // 2}, delta=src, acc=acc)
    for _ in range(10):
        rec.dispatch(full, workgroups(n, 256))
    rec.dispatch(half, workgroups(n, 256))
    rec.submit()
    expected = 10 * x
    expected[: n // 2] += x[: n // 2]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-5, atol=1e-5)
    assert rec.dispatches == 11


def test_a_slot_dispatched_twice_in_one_submit_with_different_values_raises(gpu, registry):
    # The arena is uploaded at submit, so both dispatches would silently run with n=3.
    acc = Tensor.from_numpy(gpu, np.zeros(8, np.float32))
    op = registry.bind(registry.kernel("residual"), params={"n": 8}, delta=Tensor.empty(gpu, 8), acc=acc)
    rec = registry.recorder()
    rec.dispatch(op, 1)
    op.params.set(n=3)
    with pytest.raises(InternalError, match=r"Kernel\(residual\.main\).*n 8 -> 3"):
        rec.dispatch(op, 1)


def test_a_slot_dispatched_twice_with_the_same_values_or_in_the_next_submit_is_fine(gpu, registry, rng):
    n = 64
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    op = registry.bind(registry.kernel("residual"), params={"n": n}, delta=Tensor.from_numpy(gpu, x), acc=acc)
    rec = registry.recorder()
    rec.dispatch(op, 1)
    op.params.set(n=n)  # set again to the same bytes, as an op recorded once per layer does
    rec.dispatch(op, 1)
    rec.submit()
    # The next recorder is the next submit: the slot may hold new values there.
    op.params.set(n=n // 2)
    rec = registry.recorder()
    rec.dispatch(op, 1)
    rec.submit()
    expected = 2 * x
    expected[: n // 2] += x[: n // 2]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-6)


def test_a_fork_shares_pipelines_but_not_uniforms_and_frees_only_its_own(gpu, registry, rng):
    n = 64
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    delta = Tensor.from_numpy(gpu, x)
    fork = registry.fork()
    assert fork.kernel("residual") is registry.kernel("residual")
    mine = registry.bind(registry.kernel("residual"), params={"n": n}, delta=delta, acc=acc)
    theirs = fork.bind(fork.kernel("residual"), params={"n": n // 2}, delta=delta, acc=acc)
    assert theirs.params.arena is not mine.params.arena
    for reg, op in ((registry, mine), (fork, theirs)):
        rec = reg.recorder()
        rec.dispatch(op, 1)
        rec.submit()
    fork.close()
    expected = x.copy()
    expected[: n // 2] += x[: n // 2]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-6)  # the buffers bound through the fork live on


def test_phases_give_one_submit_several_sets_of_uniform_values(gpu, registry, rng):
    """Recorder.phase: each phase dispatches a copy of the op's slot holding the values set just before, so an
    op can run with different values in one submit; mixing phase 0 (the op's own slot) in is refused."""
    n = 64
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    op = registry.bind(registry.kernel("residual"), params={"n": n}, delta=Tensor.from_numpy(gpu, x), acc=acc)
    rec = registry.recorder()
    for phase, count in enumerate((n, n // 2, n // 4), start=1):
        rec.phase = phase
        op.params.set(n=count)
        rec.dispatch(op, 1)
    rec.submit()
    expected = x.copy()
    expected[: n // 2] += x[: n // 2]
    expected[: n // 4] += x[: n // 4]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-6)
    rec = registry.recorder()
    rec.phase = 1
    rec.dispatch(op, 1)
    rec.phase = 0
    with pytest.raises(InternalError, match="with and without a phase"):
        rec.dispatch(op, 1)


def test_odd_sized_tensors_round_trip(gpu):
    for dtype, data in [("f16", np.arange(7, dtype=np.float16)), ("u32", np.arange(3, dtype=np.uint32))]:
        t = Tensor.from_numpy(gpu, data)
        np.testing.assert_array_equal(t.numpy(), data)
        assert t.dtype == dtype


def test_each_entry_point_binds_only_what_its_call_graph_uses():
    src = """
    struct P { n: u32 }
    @group(0) @binding(0) var<uniform> params: P;
    @group(0) @binding(1) var<storage, read> a: array<f32>;
    @group(0) @binding(2) var<storage, read_write> b: array<f32>;
    @group(0) @binding(3) var<storage, read_write> c: array<f32>;
    fn helper(i: u32) -> f32 { return a[i]; }  // b is only named in a comment here
    @compute @workgroup_size(1) fn first() { b[0] = helper(params.n); }
    @compute @workgroup_size(1) fn second() { c[0] = 1.0; }
    """
    bindings = parse_bindings(src)
    assert [b.name for b in entry_bindings(src, "first", bindings)] == ["params", "a", "b"]
    assert [b.name for b in entry_bindings(src, "second", bindings)] == ["c"]
    with pytest.raises(ShaderError, match="not found"):
        entry_bindings(src, "third", bindings)


def test_kernels_with_a_subgroup_entry_point_run_on_a_device_without_subgroups(rng):
    """Each entry point is compiled from its own pruned module there, so the subgroup twin does not break it."""
    from doppler_py.gpu.device import create_gpu
    from doppler_py.gpu.kernels import KernelRegistry
    from doppler_py.gpu.weights import Weight
    from doppler_py.ops.linear import Linear

    gpu = create_gpu(browser_limits=True, disable_features=("subgroup",))
    assert not gpu.has_subgroups
    registry = KernelRegistry(gpu)
    w = rng.standard_normal((40, 64)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    out = Tensor.empty(gpu, (3, 40))
    linear = Linear(registry, Weight.from_numpy(gpu, w, "f16"), Tensor.from_numpy(gpu, x), out, max_rows=3)
    rec = registry.recorder()
    linear.record(rec, 1)
    rec.submit()
    expected = x[0] @ w.astype(np.float16).astype(np.float32).T
    np.testing.assert_allclose(out.numpy()[0], expected, rtol=1e-4, atol=1e-4)


def _accumulators(gpu, registry, rng, n=64):
    x = rng.standard_normal(n).astype(np.float32)
    acc = Tensor.from_numpy(gpu, np.zeros(n, np.float32))
    op = registry.bind(registry.kernel("residual"), params={"n": n}, delta=Tensor.from_numpy(gpu, x), acc=acc)
    return x, acc, op


def test_a_tape_plays_its_dispatches_and_copies_with_the_captured_uniforms(gpu, registry, rng, tape_loop):
    n = 64
    x, acc, op = _accumulators(gpu, registry, rng, n)
    y, other, other_op = _accumulators(gpu, registry, rng, n)
    copy = Tensor.empty(gpu, n)
    rec = registry.recorder()
    rec.capture()
    op.params.set(n=n // 2)
    rec.dispatch(op, 1)
    rec.copy(acc, copy, 4 * n)
    rec.dispatch(other_op, 1)  # a run after a copy, starting with another bind group
    rec.dispatch(op, 1)
    tape = rec.end_capture()
    rec.submit()
    op.params.set(n=n)  # another call's values: the tape restores its own
    rec = registry.recorder()
    tape.restore()
    rec.play_tape(tape)
    rec.dispatch(other_op, 1)
    rec.submit()
    expected = np.zeros(n, np.float32)
    expected[: n // 2] = 4 * x[: n // 2]
    np.testing.assert_allclose(acc.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(copy.numpy(), expected * 3 / 4, rtol=1e-6)
    np.testing.assert_allclose(other.numpy(), 3 * y, rtol=1e-6)
    assert rec.dispatches == tape.dispatches + 1 == 4


def test_an_invalid_dispatch_raises_at_submit_and_the_next_submit_works(gpu, registry, rng):
    # The pass and the submit go through wgpu-native's functions directly on the fast path: wgpu-core's
    # validation error must still reach the caller as an exception, not a log line (on Dawn: Dawn's error).
    from doppler_py.gpu.kernels import Bound

    x, acc, op = _accumulators(gpu, registry, rng)
    src, weight, out = (Tensor.empty(gpu, 64) for _ in range(3))
    other = registry.bind(registry.kernel("rmsnorm"), params={"dim": 64}, src=src, weight=weight, out=out)
    rec = registry.recorder()
    rec.dispatch(Bound(op.kernel, other.bind_group, op.params, op.resources), 1)  # another layout's group
    with pytest.raises(gpu.api.GPUError):
        rec.submit()
    rec = registry.recorder()
    rec.dispatch(op, 1)
    rec.submit()
    np.testing.assert_allclose(acc.numpy(), x, rtol=1e-6)


def test_restoring_a_tape_leaves_the_slots_between_its_own_alone(gpu, rng):
    # A registry of its own: the session's may have its current arena nearly full, and the three slots must share one.
    registry = KernelRegistry(gpu)
    first, between, last = (_accumulators(gpu, registry, rng)[2] for _ in range(3))
    assert first.params.arena is last.params.arena is between.params.arena
    assert first.params.offset < between.params.offset < last.params.offset
    rec = registry.recorder()
    rec.capture()
    rec.dispatch(first, 1)
    rec.dispatch(last, 1)
    tape = rec.end_capture()
    rec.submit()
    for op in (first, between, last):
        op.params.set(n=5)
    tape.restore()
    assert [op.params.values()["n"] for op in (first, between, last)] == [64, 5, 64]
    registry.close()


def test_a_dispatch_after_a_played_tape_sets_its_own_bind_group_again(gpu, registry, rng, tape_loop):
    x, acc, op = _accumulators(gpu, registry, rng)
    y, other, other_op = _accumulators(gpu, registry, rng)
    rec = registry.recorder()
    rec.capture()
    rec.dispatch(op, 1)
    tape = rec.end_capture()
    rec.submit()
    rec = registry.recorder()
    rec.dispatch(other_op, 1)
    tape.restore()
    rec.play_tape(tape)  # in the same pass: the loop sets op's group over other_op's
    rec.dispatch(other_op, 1)
    rec.submit()
    np.testing.assert_allclose(acc.numpy(), 2 * x, rtol=1e-6)
    np.testing.assert_allclose(other.numpy(), 2 * y, rtol=1e-6)


def test_a_played_slot_follows_the_one_values_per_submit_rule(gpu, registry, rng):
    if not registry.native_dispatch:
        pytest.skip("tapes play through wgpu-native's pass functions")
    _, _, op = _accumulators(gpu, registry, rng)
    rec = registry.recorder()
    rec.capture()
    rec.dispatch(op, 1)
    tape = rec.end_capture()
    # played, then dispatched op by op with other values; and the other way round; and played twice
    for first, second in [("play", "dispatch"), ("dispatch", "play"), ("play", "play")]:
        rec = registry.recorder()
        tape.restore()
        rec.play_tape(tape) if first == "play" else rec.dispatch(op, 1)
        op.params.set(n=3)
        with pytest.raises(InternalError, match="n 64 -> 3"):
            rec.play_tape(tape) if second == "play" else rec.dispatch(op, 1)
        op.params.set(n=64)
    rec = registry.recorder()
    tape.restore()
    rec.play_tape(tape)
    rec.phase = 1
    with pytest.raises(InternalError, match="with and without a phase"):
        rec.dispatch(op, 1)
    with pytest.raises(InternalError, match="captured in phase 0 played in phase 1"):
        rec.play_tape(tape)
    rec = registry.recorder()
    rec.phase = 1
    rec.capture()
    rec.dispatch(op, 1)
    phased = rec.end_capture()
    rec = registry.recorder()
    rec.dispatch(op, 1)
    rec.phase = 1
    with pytest.raises(InternalError, match="with and without a phase"):
        rec.play_tape(phased)
