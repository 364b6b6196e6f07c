"""`doppler-py selfcheck`: a one-layer tiny model's GPU forward against the float64 numpy forward of
`doppler_py.testing.references`, which is itself checked against HF transformers here."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.model.config import ModelConfig
from doppler_py.selfcheck import run_selfcheck
from doppler_py.testing.references import forward_reference
from doppler_py.testing.tiny import TINY_SPECS, write_tiny_model

STAGES = ("q", "k", "v", "attention", "gate_up", "hidden", "logits")


def stage_verdicts(lines: list[str]) -> dict[str, str]:
    return {line.split()[0]: line.split()[-1] for line in lines if line.startswith("  ")}


def test_selfcheck_passes_and_reports_every_stage():
    lines: list[str] = []
    assert run_selfcheck(lines.append)
    assert stage_verdicts(lines) == dict.fromkeys(STAGES, "ok")
    assert lines[-1] == "forward vs numpy: ok"


def test_a_wrong_weight_on_the_gpu_fails_from_its_stage_on():
    def nudge_down_proj(weights: dict[str, np.ndarray]) -> None:
        weights["model.layers.0.mlp.down_proj.weight"][3, 5] += 0.05

    lines: list[str] = []
    assert not run_selfcheck(lines.append, tamper=nudge_down_proj)
    verdicts = stage_verdicts(lines)
    # The down projection feeds the residual stream: everything before it still agrees.
    assert verdicts == {**dict.fromkeys(STAGES[:5], "ok"), "hidden": "FAIL", "logits": "FAIL"}
    assert lines[-1] == "forward vs numpy: FAIL"


@pytest.mark.parametrize("name", TINY_SPECS)
def test_the_numpy_forward_matches_hf_transformers(tmp_path, name):
    # In CI the model tests (tests/model) fail when torch is missing; here a skip loses nothing.
    reference = pytest.importorskip("doppler_py.testing.reference")
    pytest.importorskip("transformers")
    folder = write_tiny_model(tmp_path, TINY_SPECS[name])
    ids = [1, 40, 73, 5, 88, 17, 60, 2, 99, 31, 31, 12]
    ours = forward_reference(folder, ModelConfig.from_file(folder / "config.json"), ids)
    hf = reference.hf_logits(folder, ids)
    # HF runs in float32: ~1e-6 relative over a 2-layer model; a wrong formula is off by 1e-2 or more.
    np.testing.assert_allclose(ours, hf, rtol=0, atol=1e-5 * np.abs(hf).max())
