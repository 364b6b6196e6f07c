"""A smoke run of tools/bench_bandwidth.py at tiny sizes (1 MiB streamed, one load type, a tiny model, 4 tokens):
its table names the host, each load's best shape and each format's decode figures, and its JSON's fraction is
decode's weight bytes per second over the streaming rate timed beside it. The figures themselves are run by hand
(docs/benchmarks.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from doppler_py.testing.tiny import TinySpec

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench_bandwidth.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_bandwidth", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_table_and_json_of_a_tiny_run(bench, tiny_folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "record.json"
    argv = ["--model", str(tiny_folder(TinySpec())), "--weights", "q4_1", "--stream-mib", "1", "--loads", "vec4<u32>"]
    argv += ["--new-tokens", "4", "--repeats", "2", "--rounds", "1", "--quiet", "--json", str(out)]
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["host"]["cpu"] in table and record["adapter"]["adapter"] in table
    assert list(record["stream"]["per_load"]) == ["vec4<u32>"] and "vec4<u32>" in table
    assert record["stream"]["buffer_bytes"] == 1 << 20
    (row,) = record["decode"]
    assert row["weights"] == "q4_1" and row["formats"] == "q4_1 layers, q4_1 LM head"
    assert len(row["tok_s_runs"]) == 2 and row["tok_s"] > 0
    assert row["weight_bytes_per_s"] == pytest.approx(row["tok_s"] * row["weight_bytes_per_token"]["total"])
    bytes_per_token = row["weight_bytes_per_token"]["total"]
    ratios = [t * bytes_per_token / w for t, w in zip(row["tok_s_runs"], row["stream_bytes_per_s_runs"], strict=True)]
    assert row["fraction_runs"] == pytest.approx(ratios)
    assert row["fraction_of_stream"] == pytest.approx(sum(ratios) / 2)  # the median of two
    q4_1_row = table.splitlines()[-2]  # before the JSON line
    assert f"{row['fraction_of_stream']:.0%}" in q4_1_row and f"{min(ratios):.0%}-{max(ratios):.0%}" in q4_1_row
    # A 1 MiB buffer is not the adapter's figure: nothing was cached for `doppler-py info`.
    assert not list((tmp_path / "cache").glob("stream-rate/*.json"))
