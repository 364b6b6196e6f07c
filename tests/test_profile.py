"""`doppler-py profile` on tiny random models: per-kernel GPU time that accounts for every dispatch, the host/GPU
split per step, its JSON, and the plain host-only report on a device without timestamp queries."""

from __future__ import annotations

import json

import numpy as np
import pytest

from doppler_py import cli
from doppler_py.errors import CapacityError, GenerationOptionError
from doppler_py.gpu.device import create_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.profile import (
    NO_TIMESTAMPS,
    QueryStamps,
    format_report,
    profile_model,
    profiling_recorder,
    recording_with,
    stamp_problem,
)
from doppler_py.testing.tiny import TinySpec

PROMPT = list(range(1, 12))
STEPS = 3
PHASE_FIELDS = {"phase", "rows", "steps", "dispatches", "host_ms", "host_us_per_dispatch", "wall_ms", "gpu_ms"}
GPU_FIELDS = {"profiled_dispatches", "profiled_gpu_ms", "kernel_ms_per_step", "kernels"}
KERNEL_FIELDS = {"kernel", "count", "per_step", "total_ms", "share_pct", "mean_us"}


SPEC = TinySpec(vocab_size=112)  # not the 128 outputs of the q/k/v matmul, so the LM head's label is its own


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(SPEC)


@pytest.fixture(scope="module")
def report(model):
    if "timestamp-query" not in model.gpu.features:
        pytest.skip("this adapter has no timestamp-query feature")
    return profile_model(model, PROMPT, steps=STEPS, rows=5)


def test_every_dispatch_is_counted_once_under_its_kernel(report):
    for phase in report["phases"]:
        assert phase["profiled_dispatches"] == phase["dispatches"] > 0
        assert sum(row["count"] for row in phase["kernels"]) == phase["dispatches"] * phase["steps"]


def test_kernel_times_are_positive_and_fit_inside_the_stamped_step(report):
    for phase in report["phases"]:
        assert phase["gpu_ms"] > 0 and phase["profiled_gpu_ms"] > 0
        assert all(row["total_ms"] > 0 for row in phase["kernels"])
        # The kernels ran one after another inside the profiled step: their sum cannot exceed its span.
        assert phase["kernel_ms_per_step"] <= phase["profiled_gpu_ms"] * 1.02 + 0.01
        assert sum(row["share_pct"] for row in phase["kernels"]) == pytest.approx(100, abs=0.1)
        totals = [row["total_ms"] for row in phase["kernels"]]
        assert totals == sorted(totals, reverse=True)


def test_phases_are_prefill_decode_and_verify_with_their_rows(report, model):
    assert [(p["phase"], p["rows"], p["steps"]) for p in report["phases"]] == [
        ("prefill", len(PROMPT), 3),
        ("decode", 1, STEPS),
        ("verify T=5", 5, 1),
    ]
    decode = report["phases"][1]
    lm_head = f"{model.config.vocab_size}x{model.config.hidden_size}"
    assert sum(row["count"] for row in decode["kernels"] if row["kernel"].endswith(lm_head)) == STEPS


def test_profiling_leaves_the_registry_and_the_results_as_they_were(model):
    previous = model.registry.recorder_class
    cache = model.new_cache(64)
    try:
        plain = model.forward(PROMPT, cache, 0, logits="all")
        if "timestamp-query" in model.gpu.features:
            stamps = QueryStamps(model.gpu)
            with recording_with(model.registry, profiling_recorder(stamps)):
                profiled = model.forward(PROMPT, cache, 0, logits="all")
            stamps.close()
            np.testing.assert_array_equal(profiled, plain)
        profile_model(model, PROMPT, steps=1, rows=2)
    finally:
        model.release_cache(cache)
    assert model.registry.recorder_class is previous


def test_stamps_that_go_backwards_or_outlast_the_step_are_refused():
    assert stamp_problem(np.array([0, 1_000_000, 1_000_000, 2_000_000]), wall_s=0.01) is None
    assert "backwards" in stamp_problem(np.array([0, 1_000, 500, 400]), wall_s=0.01)
    assert "backwards" in stamp_problem(np.array([5_000, 6_000, 1_000, 2_000]), wall_s=0.01)
    assert "wall time" in stamp_problem(np.array([0, 2_000_000_000]), wall_s=0.01)
    assert "do not advance" in stamp_problem(np.array([7, 7]), wall_s=0.01)


def test_without_timestamp_queries_only_host_and_wall_time_are_reported(tiny_folder):
    gpu = create_gpu(browser_limits=True, disable_features=("timestamp-query",))
    registry = KernelRegistry(gpu)
    model = Transformer(load_weights(tiny_folder(SPEC), gpu, "f32"), registry)
    try:
        report = profile_model(model, PROMPT, steps=2, rows=3)
    finally:
        model.close()
        model.weights.destroy()
        registry.close()
    assert report["timestamps"] is False and report["note"] == NO_TIMESTAMPS
    for phase in report["phases"]:
        assert set(phase) == PHASE_FIELDS and phase["gpu_ms"] is None
        assert phase["host_ms"] > 0 and phase["wall_ms"] >= phase["host_ms"]
    text = format_report(report)
    assert NO_TIMESTAMPS in text
    assert text.splitlines()[-1].startswith("decode step: host ") and "GPU time not measured" in text


def test_bad_steps_or_rows_are_refused_before_anything_runs(model):
    with pytest.raises(GenerationOptionError, match="--steps"):
        profile_model(model, PROMPT, steps=0)
    with pytest.raises(CapacityError, match="--rows"):
        profile_model(model, PROMPT, rows=model.max_logit_rows + 1)
    assert cli.main(["profile", "--steps", "0"]) == cli.EXIT_USAGE


def test_cli_prints_the_tables_and_a_summary_and_writes_the_json(tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "profile.json"
    folder = str(tiny_folder(SPEC))
    assert cli.main(["profile", "--model", folder, "--steps", "2", "--json", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out.splitlines()
    report = json.loads(out.read_text())
    assert {"model", "weights", "adapter", "backend", "timestamps", "prompt_tokens", "phases"} <= set(report)
    assert report["decode_steps"] == 2 and report["verify_rows"] == 5
    assert printed[-1].startswith("decode step: host ")
    for phase in report["phases"]:
        assert set(phase) >= PHASE_FIELDS
        if report["timestamps"]:
            assert set(phase) >= GPU_FIELDS
            assert all(set(row) == KERNEL_FIELDS for row in phase["kernels"])
            assert f"{phase['phase']}: GPU time per kernel" in "\n".join(printed)
