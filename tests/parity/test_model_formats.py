"""The production formats in parity (issue 51 item 6): doppler-gpu's Q4K configs and our f16 / q4_1 weights on tiny
LLaMA and Gemma 3 models, each engine against HF float32 on the weights that engine holds (doppler_py.parity.formats
says why, and derives the tolerances).

doppler-gpu's Q4K paths need shader-f16, which only Mesa 25's lavapipe (tools/mesa25.sh) gives Dawn here; without
it these tests skip, and under CI=true they fail, as the rest of the lane does for a missing tool.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from doppler_py.parity import doppler_model
from doppler_py.parity.doppler_model import DopplerParityError
from doppler_py.parity.formats import (
    Q4K_AF32_ROUNDINGS_PER_LAYER,
    dequantize_q4k_rows,
    f16_tolerance,
    our_held_tensors,
    rdrr_tensors,
    write_held_folder,
)
from doppler_py.parity.model_parity import DEFAULT_ATOL, our_greedy
from doppler_py.testing.tiny import TINY_SPECS, config_dict
from tests.parity.conftest import skip_unless_ci

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 33, 8, 41, 9]
STEPS = 4
# Gemma 3 with a window wider than the context: the three windowed-attention findings cannot act here.
GEMMA = dataclasses.replace(TINY_SPECS["gemma3-sliding"], sliding_window=64, seed=8)
LLAMA = TINY_SPECS["llama-tied-gqa"]
MODELS = {"llama": LLAMA, "gemma3": GEMMA}
# A quantised model against HF on the original weights: the gap a held-weights reference takes out, which must
# dwarf the arithmetic tolerance for the comparison to mean anything.
QUANTISATION_GAP = 20


@pytest.fixture(scope="module")
def lavapipe25(node_executable, doppler_gpu_dir):
    """doppler-gpu on Dawn over Mesa 25's lavapipe (shader-f16), or a skip (a failure under CI)."""
    try:
        driver = doppler_model.dawn_driver()
        doppler_model.node_environment(driver)
    except DopplerParityError as exc:
        skip_unless_ci(str(exc))
    if driver.name != "lavapipe 25":
        skip_unless_ci(f"Dawn runs on {driver.name}, without shader-f16: tools/mesa25.sh unpacks Mesa 25's lavapipe")
    return doppler_gpu_dir


def f16_source(folder: Path, out: Path) -> Path:
    """The folder with its tensors stored as f16, as a production checkpoint's: the package's Qwen3 Q4K config
    leaves the MLP matrices unconverted (modulesToNotConvert) and reads them with f16-weight kernels."""
    out.mkdir(parents=True, exist_ok=True)
    for item in folder.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, out / item.name)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({k: v.astype(np.float16) for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def hf_steps(folder: Path, path: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """HF float32's logits for each step of `path` (teacher-forced after PROMPT) and each step's logit scale
    max_j |w_j| * |h| (h the final normed hidden state, w_j the head's rows)."""
    import torch

    from doppler_py.testing.reference import hf_model

    model = hf_model(folder)
    with torch.no_grad():
        out = model(torch.tensor([PROMPT + path[:-1]]), output_hidden_states=True)
    start = len(PROMPT) - 1
    hidden = out.hidden_states[-1][0, start:].double().numpy()
    head = model.get_output_embeddings().weight.detach().double().numpy()
    logits = out.logits[0, start:].double().numpy()
    np.testing.assert_allclose(hidden @ head.T, logits, atol=1e-4)  # no soft-cap: the scale bounds these logits
    scale = np.linalg.norm(head, axis=1).max() * np.linalg.norm(hidden, axis=1)
    return logits, scale


def assert_within(logits: np.ndarray, reference: np.ndarray, bounds: np.ndarray, what: str) -> None:
    deltas = np.abs(logits - reference).max(axis=1)
    assert (deltas <= bounds).all(), f"{what}: max |dlogit| per step {deltas} over the bounds {bounds}"


def test_q4k_dequantiser_reads_the_packages_own_blocks(lavapipe25, node_executable, tmp_path):
    """Our numpy Q4_K reader against the package's own quantizer and dequantizer (src/converter/quantizer.js) on
    rows that end inside a super-block, as a tiny model's (64 or 160 columns of 256) do."""
    rng = np.random.default_rng(3)
    values = (rng.standard_normal((3, 288)) * 0.2).astype(np.float32)
    values.tofile(tmp_path / "values.bin")
    script = f"""
import {{ readFileSync, writeFileSync }} from 'node:fs';
const q = await import('{lavapipe25}/src/converter/quantizer.js');
const bytes = readFileSync('{tmp_path}/values.bin');
const values = new Float32Array(bytes.buffer, bytes.byteOffset, bytes.byteLength / 4);
const {{ quantized }} = q.quantizeToQ4KMRowWise(values, [3, 288]);
writeFileSync('{tmp_path}/q4k.bin', quantized);
writeFileSync('{tmp_path}/back.bin', q.dequantizeQ4KMRowWise(quantized, [3, 288]));
"""
    (tmp_path / "roundtrip.mjs").write_text(script)
    command = [node_executable, str(tmp_path / "roundtrip.mjs")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    theirs = np.fromfile(tmp_path / "back.bin", dtype=np.float32).reshape(3, 288)
    ours = dequantize_q4k_rows(np.fromfile(tmp_path / "q4k.bin", dtype=np.uint8), (3, 288), "probe")
    np.testing.assert_array_equal(ours, theirs)
    assert 0 < np.abs(ours - values).max() < 0.1  # quantised, not copied


@pytest.mark.parametrize("name", sorted(MODELS))
def test_doppler_q4k_matches_hf_on_the_weights_it_holds(lavapipe25, tiny_folder, tmp_path, name):
    """doppler-gpu's Q4K config with f32 activations (Q4K matrices, f16 embeddings / head / KV cache) against HF
    float32 on its RDRR read back: the same greedy tokens, logits within the f16 KV cache's bound."""
    spec = MODELS[name]
    source = f16_source(tiny_folder(spec), tmp_path / "source")
    rdrr = doppler_model.convert(source, tmp_path / "rdrr", fmt="q4k")
    manifest = json.loads((rdrr / "manifest.json").read_text())
    dtypes = {info["dtype"] for info in manifest["tensors"].values()}
    assert "Q4_K_M" in dtypes, dtypes
    run = doppler_model.run_greedy(rdrr, PROMPT, STEPS)
    assert run.driver == "lavapipe 25"
    held = write_held_folder(source, rdrr_tensors(rdrr), tmp_path / "held")
    path = run.tokens
    reference, scale = hf_steps(held, path)
    assert run.tokens == [int(t) for t in reference.argmax(axis=1)]
    bounds = f16_tolerance(Q4K_AF32_ROUNDINGS_PER_LAYER * spec.num_hidden_layers, scale)
    assert_within(run.logits, reference, bounds, f"doppler-gpu q4k on tiny {name}")
    original, _ = hf_steps(source, path)
    assert np.abs(run.logits - original).max() > QUANTISATION_GAP * bounds.max()


@pytest.mark.parametrize("precision", ["f16", "q4_1"])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_ours_matches_hf_on_the_weights_it_holds(tiny_folder, tmp_path, name, precision):
    """Our engine with its weights in f16 or q4_1 (f32 arithmetic) against HF float32 on those weights: the float32
    lane's bound; against the original weights it differs by far more (so the weights were quantised)."""
    spec = MODELS[name]
    source = tiny_folder(spec)
    ours = our_greedy(source, PROMPT, STEPS, precision)
    held = write_held_folder(source, our_held_tensors(source, precision), tmp_path / "held")
    reference, _ = hf_steps(held, ours.tokens)
    assert ours.tokens == [int(t) for t in reference.argmax(axis=1)]
    assert_within(ours.logits, reference, np.full(STEPS, DEFAULT_ATOL), f"ours {precision} on tiny {name}")
    if precision == "q4_1":
        original, _ = hf_steps(source, ours.tokens)
        assert np.abs(ours.logits - original).max() > QUANTISATION_GAP * DEFAULT_ATOL


def test_format_configs_keep_the_packages_formats_and_fit_the_heads(doppler_gpu_dir):
    config = doppler_model.conversion_config(config_dict(GEMMA), doppler_gpu_dir, "tiny-gemma3", fmt="q4k-af16")
    assert config["quantization"]["weights"] == "q4k" and config["quantization"]["computePrecision"] == "f16"
    assert config["session"]["compute"]["defaults"]["activationDtype"] == "f16"
    assert config["session"]["kvcache"]["kvDtype"] == "f16"
    kernels = {kernel["kernel"] for kernel in config["execution"]["kernels"].values()}
    assert not {name for name in kernels if "head256" in name}, kernels  # the tiny heads are 32 wide
    assert "attention_streaming_f16kv.wgsl" in kernels
    with pytest.raises(DopplerParityError, match="q4k-af16"):
        doppler_model.conversion_config(config_dict(LLAMA), doppler_gpu_dir, "tiny-llama", fmt="q4k-af16")


def test_doppler_f16_activations_give_nan_logits(lavapipe25, tiny_folder, tmp_path):
    """Finding 9 (docs/parity-findings.md): the package's Gemma 3 f16-activation config writes all-NaN logits at
    the prefill on lavapipe 25, from the missing barrier in rmsnorm_f16.wgsl's rmsnorm_small_f16. Pinned here so
    that a doppler-gpu that fixes it fails this test and the format gets compared instead."""
    rdrr = doppler_model.convert(tiny_folder(GEMMA), tmp_path / "rdrr", fmt="q4k-af16")
    with pytest.raises(DopplerParityError, match=r"no finite candidate logits.*nan=128"):
        doppler_model.run_greedy(rdrr, PROMPT, 1)
