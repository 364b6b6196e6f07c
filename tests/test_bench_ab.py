"""The side-by-side benchmark's paired summary and its refusal of a --before that is not a checkout.

No model runs here; `tools/bench_ab.py` itself is run by hand (issue 18's closing note has its figures)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "tools" / "bench_ab.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_ab", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rounds_are_compared_pairwise_and_worse_depends_on_the_measure(bench):
    before, after = [10.0, 5.0, 8.0], [11.0, 4.0, 8.0]  # a slow round hits both sides alike
    faster_is_better = bench.paired_summary(before, after, higher_is_better=True)
    assert faster_is_better["ratio_median"] == pytest.approx(1.0)
    assert faster_is_better["ratio_geomean"] == pytest.approx(math.prod([1.1, 0.8, 1.0]) ** (1 / 3))
    assert (faster_is_better["ratio_min"], faster_is_better["ratio_max"]) == pytest.approx((0.8, 1.1))
    assert (faster_is_better["rounds_worse"], faster_is_better["rounds"]) == (1, 3)
    assert faster_is_better["before_median"] == 8.0 and faster_is_better["after_median"] == 8.0
    assert bench.paired_summary(before, after, higher_is_better=False)["rounds_worse"] == 1  # the 11 > 10 round


def test_unequal_rounds_are_refused(bench):
    with pytest.raises(ValueError):
        bench.paired_summary([1.0, 2.0], [1.0], higher_is_better=True)


def test_before_must_be_a_checkout(bench, tmp_path, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--before", str(tmp_path)])
    assert "another checkout" in capsys.readouterr().err
