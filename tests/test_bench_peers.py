"""tools/bench_peers.py's table, JSON and chart on a tiny model, with the peers that run cheaply here.

The bench itself is not part of CI (it loads real models in every peer); this runs its whole path once with
our plain decoding and HF transformers (skipped without them), and asks for the llama.cpp peers, which have no
GGUF of a tiny random model, so that a skipped peer's reason is checked too. No speed is asserted.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import bench_peers  # noqa: E402

NEW_TOKENS = 3


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("transformers / torch not installed (pip install -e .[reference])")
    out = tmp_path_factory.mktemp("bench-peers")
    argv = [
        "--models", "tiny-llama",
        "--peers", "ours-none,transformers,llama.cpp-cpu",
        "--rounds", "2",
        "--new-tokens", str(NEW_TOKENS),
        "--warmup-tokens", "2",
        "--prompt-tokens", "6",
        "--max-seq", "64",
        "--json", str(out / "peers.json"),
        "--chart", str(out / "peers.png"),
    ]  # fmt: skip
    assert bench_peers.main(argv) == 0
    return json.loads((out / "peers.json").read_text()), out


def test_every_asked_peer_is_measured_or_skipped_with_a_reason(record):
    data, _ = record
    (result,) = data["results"]
    assert result["model"] == "tiny-llama" and result["prompt_tokens"] == 6 and result["new_tokens"] == NEW_TOKENS
    assert [row["peer"] for row in result["rows"]] == ["ours-none", "transformers"]
    assert list(result["skipped"]) == ["llama.cpp-cpu"]
    assert "no GGUF of tiny-llama" in result["skipped"]["llama.cpp-cpu"]


def test_rows_hold_every_measure(record):
    data, _ = record
    rows = {row["peer"]: row for row in data["results"][0]["rows"]}
    for row in rows.values():
        assert row["rounds"] == 2 and len(row["decode_tok_s_runs"]) == 2
        assert len(row["load_average_runs"]) == 2 and all(load >= 0 for load in row["load_average_runs"])
        for key in ("load_s", "warmup_s", "first_token_s", "prefill_tok_s", "decode_tok_s", "peak_rss_mib"):
            assert row[key] > 0, (row["peer"], key, row[key])
        assert row["warmup_tokens"] == 2
        assert row["prefill_tok_s"] == pytest.approx(6 / row["first_token_s"])
        assert 0 <= row["agree_with_plain"] <= NEW_TOKENS
        assert row["format"] and row["adapter"]
    assert rows["ours-none"]["format"] == "q4_1" and rows["transformers"]["format"] == "f32"
    assert rows["ours-none"]["agree_with_plain"] == NEW_TOKENS  # the baseline agrees with itself, round 0 with 0
    assert rows["ours-none"]["plain_decode_over_this"] == pytest.approx(1.0)
    assert data["machine"]["commit"] and data["machine"]["cores"] >= 1


def test_chart_is_a_png(record):
    _, out = record
    assert (out / "peers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_rows_and_skips(record, capsys):
    data, _ = record
    bench_peers.print_table(data["results"])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["model", "peer"]
    assert sum("doppler-py (plain)" in line for line in lines) == 1
    assert any("llama.cpp CPU" in line and "skipped: no GGUF" in line for line in lines)


def test_round_order_rotates_and_reverses():
    peers = ["a", "b", "c"]
    assert bench_peers.round_order(peers, 0) == ["a", "b", "c"]
    assert bench_peers.round_order(peers, 1) == ["a", "c", "b"]
    assert bench_peers.round_order(peers, 2) == ["c", "a", "b"]
    firsts = {bench_peers.round_order(peers, r)[0] for r in range(6)}
    assert firsts == set(peers)  # every peer goes first in some round


def test_a_peer_past_its_warm_up_bound_is_stopped_and_skipped_with_what_it_was_doing(tmp_path):
    argv = [
        "--models", "tiny-llama",
        "--peers", "ours-none",
        "--new-tokens", "2",
        "--prompt-tokens", "4",
        "--warmup-minutes", "0.001",  # 0.06 s: no process starts Python, imports and loads a model in that
        "--json", str(tmp_path / "peers.json"),
    ]  # fmt: skip
    assert bench_peers.main(argv) == 0
    (result,) = json.loads((tmp_path / "peers.json").read_text())["results"]
    assert result["rows"] == []
    assert result["skipped"]["ours-none"].startswith("stopped loading after 0 s")


def test_rounds_stop_once_the_longest_round_would_not_fit(monkeypatch):
    class Peer:  # answers at once; the deadline's clock decides
        def __init__(self):
            self.jobs = 0

        def run(self, ids, new_tokens, timeout):
            self.jobs += 1
            clock[0] += 40.0  # each generation "takes" 40 s
            return {"first_token_s": 1.0, "decode_s": 1.0, "first_count": 1, "tokens": [1] * new_tokens,
                    "max_rss_bytes": 1}  # fmt: skip

        def close(self):
            pass

    clock = [0.0]
    peer = Peer()
    ready = {"load_s": 1.0, "warmup_s": 1.0, "warmup_tokens": 2}
    monkeypatch.setattr(bench_peers, "warm_up", lambda *args: (peer, dict(ready)))
    prepared = bench_peers.Prepared("m", Path("."), ("m", "keep"), "q4_1", [1, 2, 3])
    monkeypatch.setattr(bench_peers, "prepare", lambda *args: prepared)
    args = bench_peers.build_parser().parse_args(["--rounds", "5", "--new-tokens", "2", "--gguf-type", "q4_0"])
    # Rounds of 40 s: two fit in 100 s, a third would pass it.
    deadline = bench_peers.Deadline(100.0, clock=lambda: clock[0])
    result = bench_peers.bench_model("m", ["ours-none"], args, ("adapter", {}), deadline)
    assert peer.jobs == 2 and result["rows"][0]["rounds"] == 2
    assert result["notes"] == ["2 of 5 rounds: round 2 would not end within --max-minutes"]
