"""The adapter's streaming rate (doppler_py/bandwidth.py): the sweep keeps the best shapes per load, a kernel that
does not read every element once fails the measurement, the figure is cached per adapter and host, and the weight
bytes a decode step reads are counted from the model's shapes and formats."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py import bandwidth
from doppler_py.bandwidth import (
    SHAPES,
    StreamProbe,
    StreamShape,
    cached_stream_rate,
    decode_weight_bytes,
    measure_stream_rates,
    save_stream_rate,
    stream_bytes,
    stream_report,
)
from doppler_py.errors import InternalError
from doppler_py.ops.stream_read import LOADS
from doppler_py.testing.tiny import TinySpec

SMALL = 1 << 20  # fits in a cache: fine for checking the plumbing, not for a rate worth reporting


def test_sweep_keeps_the_fastest_shapes_per_load_and_reports_the_best(gpu):
    shapes = tuple(s for s in SHAPES if s.load in ("u32", "vec4<f32>") and s.workgroup_size == 64)
    rates = measure_stream_rates(gpu, nbytes=SMALL, shapes=shapes, rounds=2, finalists=2)
    assert sorted(r.shape.load for r in rates) == ["u32", "u32", "vec4<f32>", "vec4<f32>"]
    assert [r.bytes_per_s for r in rates] == sorted((r.bytes_per_s for r in rates), reverse=True)
    assert all(len(r.seconds) == 2 and r.nbytes % SMALL == 0 and r.bytes_per_s > 0 for r in rates)
    report = stream_report(gpu, rates, SMALL)
    assert report["bytes_per_s"] == rates[0].bytes_per_s == report["best"]["bytes_per_s"]
    assert set(report["per_load"]) == {"u32", "vec4<f32>"}


def test_a_read_whose_sums_are_wrong_fails_the_measurement(gpu, monkeypatch):
    probe = StreamProbe(gpu, [StreamShape("vec4<u32>", "contiguous", 16, 4, 1024)], SMALL)
    try:
        probe.readers[0].warm_up()  # the buffer holds ONE_BITS in every word: the sums agree
        monkeypatch.setattr(bandwidth, "ONE_BITS", bandwidth.ONE_BITS + 1)  # as if a word were skipped or read twice
        with pytest.raises(InternalError, match="exactly once"):
            probe.readers[0].warm_up()
    finally:
        probe.close()


def test_the_streamed_buffer_is_at_most_256_mib_and_the_binding_limit(gpu):
    nbytes = stream_bytes(gpu)
    assert nbytes <= min(256 << 20, gpu.max_binding_bytes) and nbytes % (64 << 10) == 0
    assert nbytes >= 32 << 20  # larger than the last-level caches this project runs on (32 MiB L3)


def test_the_figure_is_cached_per_adapter_and_host(gpu, monkeypatch, tmp_path):
    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path))
    assert cached_stream_rate(gpu) is None
    fake = {"bytes_per_s": 5e9, "buffer_bytes": stream_bytes(gpu), "best": {}, "per_load": {}}
    save_stream_rate(gpu, fake)
    assert cached_stream_rate(gpu) == fake
    monkeypatch.setattr(bandwidth.os, "cpu_count", lambda: 1024)  # another host
    assert cached_stream_rate(gpu) is None


# Bytes per weight as stored (ggml's bits; the tiny shapes are multiples of 8 rows, so no padding).
_BYTES_PER_WEIGHT = {"f32": 4, "f16": 2, "q4_1": 20 / 32, "q8_0": 34 / 32}


@pytest.mark.parametrize("precision", ["f32", "q4_1", "q8_0"])
@pytest.mark.parametrize("tied", [True, False])
def test_decode_reads_every_layer_matrix_the_whole_head_and_one_embedding_row(tiny_model, precision, tied):
    spec = TinySpec(tie_word_embeddings=tied)
    weights = tiny_model(spec, precision).weights
    h, ffn, vocab = spec.hidden_size, spec.intermediate_size, spec.vocab_size
    head_dim = h // spec.num_attention_heads
    q, kv = spec.num_attention_heads * head_dim, spec.num_key_value_heads * head_dim
    per_layer = (q + 2 * kv) * h + h * q + 2 * ffn * h + h * ffn
    per_weight = _BYTES_PER_WEIGHT[precision]
    read = decode_weight_bytes(weights)
    assert read["layers"] == spec.num_hidden_layers * per_layer * per_weight
    assert read["lm_head"] == vocab * h * per_weight
    assert read["embedding_rows"] == h * per_weight
    assert read["total"] == read["layers"] + read["lm_head"] + read["embedding_rows"]


def test_every_load_type_of_the_kernel_is_swept_in_every_pattern():
    assert {s.load for s in SHAPES} == set(LOADS)
    assert {(s.pattern, s.unroll) for s in SHAPES} == {(p, u) for p in ("contiguous", "interleaved") for u in (1, 4)}
    assert len(set(SHAPES)) == len(SHAPES) and np.all([s.bytes_per_invocation >= 16 for s in SHAPES])


def test_info_shows_the_cached_figure_with_its_shape_and_date(monkeypatch, tmp_path, capsys):
    from doppler_py import cli
    from doppler_py.gpu.device import default_gpu

    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path))
    gpu = default_gpu(browser_limits=False)  # the device `doppler-py info` reports
    shape = StreamShape("vec4<u32>", "interleaved", 16, 1, 16 << 10)
    best = {"load": shape.load, "label": shape.label(), "bytes_per_s": 3.5e9}
    report = {"bytes_per_s": 3.5e9, "buffer_bytes": stream_bytes(gpu), "best": best, "per_load": {shape.load: best}}
    save_stream_rate(gpu, report | {"measured_at": "2026-12-07T12:00:00+00:00"})
    assert cli.main(["info"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("streaming read:"))
    assert line.startswith("streaming read: 3.50 GB/s (vec4<u32> loads, interleaved, workgroup 16, 1 per iteration")
    assert "2026-12-07T12:00:00+00:00" in line and f"{stream_bytes(gpu) >> 20} MiB" in line
