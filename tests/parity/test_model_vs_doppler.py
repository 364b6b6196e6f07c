"""Whole-model parity with the JS original: doppler-gpu 0.5.1's converter and pipeline (Node, Dawn on SwiftShader)
against our engine and HF transformers on tiny random LLaMA, Qwen3, Gemma 3, Qwen 3.5 and Gemma 4 models, all in
float32.

Where the engines agree, logits agree to a few 1e-6 (atol 1e-4, the model-families issue's bound) and greedy
tokens are identical. On Gemma 3 with the window active they do not: the JS original's logits are instead held
to a numpy forward carrying the three diagnosed disagreements (tests/parity/doppler_findings.py,
docs/parity-findings.md), so a doppler-gpu version that changed its behaviour fails here and gets looked at.
On Qwen 3.5 they agree while a Gated DeltaNet value head fits one SwiftShader subgroup (4 columns); wider value
heads are held to a numpy model of the reduction race in its recurrent kernel, and the tiny spec's own shape
to the loader's refusal (docs/parity-findings.md). Past a hidden size of 124 its subgroup RMSNorm loses elements
under SwiftShader (finding 6): a tiny LLaMA of hidden 128, and SmolLM2-135M on request, are held to that. On
Gemma 4 they agree without per-layer inputs inside the window; with them the JS original is held to a numpy model
of its per-layer combine (finding 7), and past the window to that plus the three Gemma 3 findings (its sliding
layers' keys in a ring).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time

import numpy as np
import pytest

from doppler_py.cli import main
from doppler_py.model.config import ModelConfig
from doppler_py.parity import doppler_model
from doppler_py.parity.doppler_model import DopplerParityError, conversion_config, kernel_digests
from doppler_py.parity.model_parity import DEFAULT_ATOL, run_parity
from doppler_py.testing import references
from doppler_py.testing.reference import hf_logits
from doppler_py.testing.tiny import TINY_SPECS, config_dict
from tests.parity.conftest import skip_unless_ci
from tests.parity.doppler_findings import (
    DECODE_KEY_ROWS,
    FINDINGS,
    FULL_LAYERS_WINDOWED,
    PREFILL_CLAMPED,
    doppler_attention,
)

pytestmark = pytest.mark.parity

PROMPT = [5, 17, 33, 8, 41, 9]  # 6 ids: shorter than the Gemma models' 8-key window
LONG_PROMPT = [5, 17, 33, 8, 41, 9, 60, 3, 22, 71, 15, 90]  # 12 ids: longer than it
STEPS = 10
GEMMA = TINY_SPECS["gemma3-sliding"]  # layers sliding, full, sliding; window 8
GEMMA_ALL_SLIDING = dataclasses.replace(GEMMA, layer_pattern=("sliding_attention",), seed=7)
GEMMA_WIDE_WINDOW = dataclasses.replace(GEMMA, sliding_window=64, seed=8)
QWEN3_5 = TINY_SPECS["qwen3_5-hybrid"]  # linear, full, linear attention; Gated DeltaNet value heads of 16 columns
# Value heads of 4 columns: one SwiftShader subgroup holds all of a head's columns, so the reduction race in the
# JS original's recurrent kernel cannot act. 8 value heads keep the value width (32) a multiple of 32, which our
# matmuls need, with 2 value heads per key head as in the tiny spec.
QWEN3_5_NARROW_VALUES = dataclasses.replace(QWEN3_5, linear_heads=(4, 8), linear_dims=(16, 4))
# Value heads of 32 columns: columns 4..31 take the race. (16, the tiny spec's, is refused by the loader.)
QWEN3_5_WIDE_VALUES = dataclasses.replace(QWEN3_5, linear_dims=(16, 32))
SWIFTSHADER_SUBGROUP = 4  # SIMD::Width: invocations SwiftShader runs together, one subgroup after another
# doppler-gpu's subgroup RMSNorm (rmsnorm.wgsl main_subgroup / main_small_subgroup): 256 invocations, one slot per
# subgroup in a 32-slot workgroup array (MAX_SUBGROUPS). SwiftShader's subgroups of 4 make 64 (finding 6).
RMSNORM_WORKGROUP = 256
RMSNORM_SUBGROUP_SLOTS = 32
SMOLLM2_OPT_IN = "DOPPLER_PARITY_SMOLLM2"  # the real-model run takes minutes on SwiftShader: only on request


@pytest.fixture
def on_swiftshader(doppler_ready, monkeypatch):
    """doppler-gpu on SwiftShader even where Mesa 25's lavapipe is there: for the findings whose numpy models
    depend on SwiftShader's 4-wide subgroups (findings 5 and 6)."""
    if not doppler_model.SWIFTSHADER_ICD.is_file():
        skip_unless_ci(f"Chrome's SwiftShader ICD {doppler_model.SWIFTSHADER_ICD} is missing (Debian's chromium)")
    monkeypatch.setenv(doppler_model.DRIVER_CHOICE, "swiftshader")
    return doppler_ready


def test_conversion_config_runs_the_hf_config_in_float32(doppler_gpu_dir):
    config = conversion_config(config_dict(GEMMA), doppler_gpu_dir, "tiny-gemma3")
    inference = config["inference"]
    assert config["quantization"] == {"weights": "f32", "embeddings": "f32", "lmHead": "f32", "computePrecision": "f32"}
    assert config["session"]["kvcache"]["kvDtype"] == "f32"
    assert inference["attention"]["slidingWindow"] == 8
    assert inference["attention"]["queryPreAttnScalar"] == GEMMA.query_pre_attn_scalar
    assert inference["layerPattern"]["type"] == "custom"
    assert inference["layerPattern"]["layerTypes"] == ["sliding_attention", "full_attention", "sliding_attention"]
    assert inference["rope"]["ropeTheta"] == GEMMA.rope_theta
    assert inference["rope"]["ropeLocalTheta"] == GEMMA.rope_local_base_freq
    assert inference["normalization"]["rmsNormWeightOffset"] is True
    assert inference["output"]["scaleEmbeddings"] is True
    assert inference["chatTemplate"]["enabled"] is False
    assert_float32_kernels(config, doppler_gpu_dir)


def assert_float32_kernels(config: dict, package) -> None:
    """Every kernel a step list names is a float32 one, with the digest the package lists for it."""
    digests = kernel_digests(package)
    phases = [config["execution"][phase] for phase in ("decode", "prefill", "postLayer", "preLayer")]
    # a phase is a step list, or (Gemma 4's prefill) groups of {"layers", "steps"}
    steps = [
        step for phase in phases for item in phase for step in (item["steps"] if isinstance(item, dict) else [item])
    ]
    used = {step[1] for step in steps}
    for key in used:
        kernel = config["execution"]["kernels"][key]
        assert "f16" not in kernel["kernel"], kernel
        assert kernel["digest"] == "sha256:" + digests[f"{kernel['kernel']}#{kernel['entry']}"]


def test_conversion_config_runs_qwen3_5_in_float32(doppler_gpu_dir):
    config = conversion_config(config_dict(QWEN3_5), doppler_gpu_dir, "tiny-qwen3_5")
    inference = config["inference"]
    assert config["quantization"]["weights"] == config["quantization"]["lmHead"] == "f32"
    assert config["session"]["kvcache"]["kvDtype"] == "f32"
    assert inference["layerPattern"]["type"] == "custom"
    assert inference["layerPattern"]["layerTypes"] == ["linear_attention", "full_attention", "linear_attention"]
    assert inference["attention"]["attentionOutputGate"] is True
    assert inference["attention"]["queryKeyNorm"] is True
    assert inference["attention"]["queryPreAttnScalar"] == QWEN3_5.head_dim
    assert inference["normalization"]["rmsNormWeightOffset"] is True
    assert inference["normalization"]["rmsNormEps"] == QWEN3_5.rms_norm_eps
    assert inference["rope"]["ropeTheta"] == QWEN3_5.rope_theta
    assert inference["rope"]["partialRotaryFactor"] == QWEN3_5.partial_rotary_factor
    # the template's mrope sections (11, 11, 10) fit the 9B's 64 rotary dims, not these 8
    assert inference["rope"]["mropeSection"] is None and inference["rope"]["mropeInterleaved"] is False
    assert inference["output"]["tieWordEmbeddings"] is False
    assert inference["output"]["scaleEmbeddings"] is False
    assert_float32_kernels(config, doppler_gpu_dir)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"linear_conv_kernel_dim": None}, "linear_conv_kernel_dim"),
        ({"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]}, "sliding_attention"),
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
    ],
    ids=["no-conv-kernel", "sliding-layer", "yarn", "attention-bias"],
)
def test_qwen3_5_configs_outside_the_mapping_are_refused_by_name(tmp_path, change, named):
    hf = config_dict(QWEN3_5) | change
    hf = {key: value for key, value in hf.items() if value is not None}
    with pytest.raises(DopplerParityError, match=named):
        conversion_config(hf, tmp_path, "m")


@pytest.mark.parametrize("model_type", ["mistral", "qwen2", "gemma2"])
def test_families_outside_the_lane_are_refused_by_name(model_type, tmp_path):
    with pytest.raises(DopplerParityError, match=model_type):
        conversion_config({"model_type": model_type}, tmp_path, "m")


@pytest.mark.parametrize("name", ["llama-tied-gqa", "llama-untied-mha", "qwen3-qknorm-gqa"])
def test_llama_and_qwen3_agree_in_all_three_engines(doppler_ready, tiny_folder, name):
    report = run_parity(tiny_folder(TINY_SPECS[name]), PROMPT, STEPS)
    assert not report.missing
    assert report.agrees(DEFAULT_ATOL), [(p.pair, p.max_delta, p.first_divergence) for p in report.pairs]
    assert report.runs["ours"].tokens == report.runs["doppler"].tokens == report.runs["hf"].tokens
    assert all(len(pair.deltas) == STEPS for pair in report.pairs)


def test_gemma3_agrees_while_the_window_covers_the_whole_context(doppler_ready, tiny_folder):
    report = run_parity(tiny_folder(GEMMA_WIDE_WINDOW), LONG_PROMPT, STEPS)
    assert report.agrees(DEFAULT_ATOL), [(p.pair, p.max_delta, p.first_divergence) for p in report.pairs]


def doppler_path(model, prompt: list[int], steps: int):
    """Run the three engines; ours must agree with HF. Returns doppler-gpu's run and the sequence it decoded along
    (the prompt and its tokens but the last), over which a numpy model of its findings is held to its logits."""
    report = run_parity(model, prompt, steps)
    ours_hf = next(p for p in report.pairs if p.pair == ("ours", "hf"))
    assert ours_hf.first_divergence is None and ours_hf.max_delta <= DEFAULT_ATOL
    doppler = report.runs["doppler"]
    return doppler, prompt + doppler.tokens[:-1]


@pytest.mark.parametrize(
    ("spec", "prompt", "ring", "needed"),
    [
        (GEMMA, PROMPT, False, (FULL_LAYERS_WINDOWED, DECODE_KEY_ROWS)),
        (GEMMA, LONG_PROMPT, False, FINDINGS),
        (GEMMA_ALL_SLIDING, LONG_PROMPT, True, (PREFILL_CLAMPED, DECODE_KEY_ROWS)),
    ],
    ids=["decode-past-window", "prefill-past-window", "ring-cache"],
)
def test_gemma3_past_the_window_is_the_diagnosed_doppler_behaviour(
    doppler_ready, tiny_folder, monkeypatch, spec, prompt, ring, needed
):
    """Ours matches HF; the JS original matches the numpy model of its three findings, and each finding that
    can act here is needed for that match (so each one is pinned: a doppler-gpu that changes it fails)."""
    model = tiny_folder(spec)
    doppler, sequence = doppler_path(model, prompt, STEPS)
    config = ModelConfig.from_file(model / "config.json")

    def logits_with(findings: tuple[str, ...]) -> np.ndarray:
        with monkeypatch.context() as patch:
            patch.setattr(references, "attention", doppler_attention(len(prompt), spec.sliding_window, ring, findings))
            return references.forward_reference(model, config, sequence)[len(prompt) - 1 :]

    np.testing.assert_allclose(doppler.logits, logits_with(FINDINGS), atol=DEFAULT_ATOL, rtol=0)
    for finding in needed:
        without = logits_with(tuple(f for f in FINDINGS if f != finding))
        assert np.abs(doppler.logits - without).max() > 100 * DEFAULT_ATOL, f"{finding} is not needed here"
    # ...and with none of them it is HF's forward, which the JS original does not match.
    assert np.abs(doppler.logits - logits_with(())).max() > 100 * DEFAULT_ATOL


def test_cli_prints_every_pair_and_fails_on_a_divergence(doppler_ready, tiny_folder, tmp_path, capsys):
    report_path = tmp_path / "parity.json"
    ids = ",".join(map(str, PROMPT))
    status = main(
        ["parity", "doppler", str(tiny_folder(GEMMA)), "--ids", ids, "--steps", "5", "--json", str(report_path)]
    )
    captured = capsys.readouterr()
    out = captured.out
    # Exit 2 is a DopplerError (e.g. a failed or timed-out doppler-gpu run): its message is on stderr.
    assert status == 1, f"exit {status}; stderr:\n{captured.err}"
    assert "doppler vs hf" in out and "first divergence step 3" in out and "DIFFERS" in out
    record = json.loads(report_path.read_text())
    assert record["pairs"]["ours-hf"]["first_divergence"] is None
    assert record["pairs"]["doppler-hf"]["first_divergence"] == 3  # position 8: the first past the window
    assert len(record["tokens"]["doppler"]) == 5


def test_cli_runs_a_single_step_and_reports_each_phase_time(doppler_ready, tiny_folder, tmp_path, capsys):
    # One step is the prompt's prefill alone: the smallest run, which a real model needs on SwiftShader.
    report_path = tmp_path / "parity.json"
    folder = tiny_folder(TINY_SPECS["llama-tied-gqa"])
    ids = ",".join(map(str, PROMPT))
    options = ["--ids", ids, "--steps", "1", "--timeout", "300", "--json", str(report_path)]
    status = main(["parity", "doppler", str(folder), *options])
    captured = capsys.readouterr()
    assert status == 0, f"exit {status}; stderr:\n{captured.err}"
    record = json.loads(report_path.read_text())
    assert {name: len(tokens) for name, tokens in record["tokens"].items()} == {"ours": 1, "hf": 1, "doppler": 1}
    timings = record["timings"]
    assert {"ours", "hf", "doppler convert", "doppler load", "doppler prefill"} <= set(timings)
    assert not [name for name in timings if name.startswith("doppler decode")]  # no decode step after the last
    assert all(seconds >= 0 for seconds in timings.values())
    # The phases reach stderr as they end, and the report's last line sums them up.
    assert re.search(r"^doppler-gpu phase prefill [0-9.]+$", captured.err, re.MULTILINE), captured.err
    assert "wall s: ours" in captured.out


def test_cli_time_limit_is_a_typed_error_naming_the_limit(doppler_ready, tiny_folder, capsys):
    # 10 ms: Node alone does not start in that time, so the converter is stopped at its limit.
    ids = ",".join(map(str, PROMPT))
    folder = tiny_folder(TINY_SPECS["llama-tied-gqa"])
    status = main(["parity", "doppler", str(folder), "--ids", ids, "--steps", "2", "--timeout", "0.01"])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "DopplerTimeoutError: doppler-gpu's converter" in err and "took over 0.01 s" in err, err
    assert "--timeout" in err


def test_a_run_past_its_limit_reports_the_phases_it_finished(node_executable):
    # A stand-in for the Node driver: it finishes its "load" phase, then hangs in the next one.
    script = "console.error('doppler-gpu phase load 0.250'); setTimeout(() => {}, 60000);"
    seen: list[str] = []
    start = time.monotonic()
    with pytest.raises(doppler_model.DopplerTimeoutError) as caught:
        doppler_model._run([node_executable, "-e", script], timeout=5, what="the stand-in", log=seen.append)
    assert time.monotonic() - start < 30  # stopped at the limit, not at the script's end
    assert caught.value.limit_s == 5 and caught.value.phases == [("load", 0.25)]
    assert "the stand-in took over 5 s" in str(caught.value) and "load 0.2 s" in str(caught.value)
    assert seen == ["doppler-gpu phase load 0.250"]


@pytest.mark.parametrize("limit", ["0", "-5", "soon"])
def test_cli_refuses_a_time_limit_that_is_not_positive_seconds(limit, tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["parity", "doppler", str(tmp_path), "--timeout", limit])
    assert caught.value.code == 2
    assert "--timeout" in capsys.readouterr().err


def test_qwen3_5_agrees_in_all_three_engines_while_a_value_head_fits_one_subgroup(doppler_ready, tiny_folder):
    """Gated DeltaNet (causal conv, gated delta rule, gated RMSNorm) and gated attention with partial RoPE agree
    in all three engines wherever the JS original's reduction race cannot act."""
    report = run_parity(tiny_folder(QWEN3_5_NARROW_VALUES), LONG_PROMPT, STEPS)
    assert report.agrees(DEFAULT_ATOL), [(p.pair, p.max_delta, p.first_divergence) for p in report.pairs]
    assert report.runs["ours"].tokens == report.runs["doppler"].tokens == report.runs["hf"].tokens
    assert all(len(pair.deltas) == STEPS for pair in report.pairs)


def doppler_gated_delta_net(module, hidden: np.ndarray, dispatches: list[int], race: bool) -> tuple[np.ndarray, float]:
    """What doppler-gpu 0.5.1's recurrent kernel (linear-attention-core.js) computes for one HF
    Qwen3_5GatedDeltaNet over `hidden` [T, hidden], the rows run as dispatches of `dispatches` rows, in float64;
    and the largest |recurrent state| it reached. With `race`, its shared_sq race under SwiftShader: a head's
    columns from SWIFTSHADER_SUBGROUP on read the reduction result after lane 0 has overwritten it with its next
    partial sum (docs/parity-findings.md): q's scale takes k[0]^2, k's scale takes lane 0's output squared, and
    the gated RMSNorm (every row but a dispatch's last) q[0]^2 of the next row. Without `race` it is HF's layer.
    """

    def w(tensor) -> np.ndarray:
        return tensor.detach().double().numpy()

    rows = hidden.shape[0]
    nk, nv, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    taps = module.conv_kernel_size
    mixed = hidden @ w(module.in_proj_qkv.weight).T
    z = (hidden @ w(module.in_proj_z.weight).T).reshape(rows, nv, dv)
    beta = 1 / (1 + np.exp(-(hidden @ w(module.in_proj_b.weight).T)))
    decay = np.exp(
        -np.exp(w(module.A_log)) * np.log1p(np.exp(hidden @ w(module.in_proj_a.weight).T + w(module.dt_bias)))
    )
    padded = np.concatenate([np.zeros((taps - 1, mixed.shape[1])), mixed])
    conv = np.stack([(padded[t : t + taps] * w(module.conv1d.weight)[:, 0, :].T).sum(0) for t in range(rows)])
    conv = conv / (1 + np.exp(-conv))
    q = conv[:, : nk * dk].reshape(rows, nk, dk)
    k = conv[:, nk * dk : 2 * nk * dk].reshape(rows, nk, dk)
    v = conv[:, 2 * nk * dk :].reshape(rows, nv, dv)
    qk_eps, eps = 1e-6, module.norm.variance_epsilon  # the kernel's qk_l2norm_eps; config.rms_norm_eps
    late = np.arange(dv) >= SWIFTSHADER_SUBGROUP if race else np.zeros(dv, bool)
    last_rows = set(np.cumsum(dispatches) - 1)
    state = np.zeros((nv, dk, dv))  # [head, key dim, value column]: one kernel lane per value column
    out = np.zeros((rows, nv, dv))
    for t in range(rows):
        for h in range(nv):
            qh, kh = q[t, h // (nv // nk)], k[t, h // (nv // nk)]
            q_scale = np.where(late, dk**-0.5 / np.sqrt(kh[0] ** 2 + qk_eps), dk**-0.5 / np.sqrt(qh @ qh + qk_eps))
            k_scale = np.full(dv, 1 / np.sqrt(kh @ kh + qk_eps))
            s = state[h] * decay[t, h]
            o = np.zeros(dv)
            for lanes in (~late, late):  # the first subgroup's columns run first: the late ones read its o[0]
                if lanes is late:
                    k_scale[late] = 1 / np.sqrt(o[0] ** 2 + qk_eps)
                k_normed = kh[:, None] * k_scale[None, :]
                delta = (v[t, h] - (s * k_normed).sum(0)) * beta[t, h]
                s = np.where(lanes[None, :], s + k_normed * delta[None, :], s)
                o = np.where(lanes, (s * (qh[:, None] * q_scale[None, :])).sum(0), o)
            state[h] = s
            inv_rms = np.full(dv, 1 / np.sqrt(o @ o / dv + eps))
            if race and t not in last_rows:
                inv_rms[late] = 1 / np.sqrt(q[t + 1, h // (nv // nk), 0] ** 2 / dv + eps)
            out[t, h] = o * inv_rms * w(module.norm.weight) * z[t, h] / (1 + np.exp(-z[t, h]))
    return out.reshape(rows, nv * dv) @ w(module.out_proj.weight).T, float(np.abs(state).max())


def doppler_qwen3_5_logits(monkeypatch, folder, ids: list[int], prompt_len: int, race: bool):
    """HF's Qwen 3.5 forward over `ids` with every Gated DeltaNet layer replaced by `doppler_gated_delta_net`
    (the prompt as one dispatch, then one dispatch per token, as the JS original runs them); the logits and the
    largest |recurrent state| of any layer."""
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5

    largest = [0.0]

    def forward(module, hidden_states, *args, **kwargs):
        dispatches = [prompt_len] + [1] * (hidden_states.shape[1] - prompt_len)
        out, peak = doppler_gated_delta_net(module, hidden_states[0].double().numpy(), dispatches, race)
        largest[0] = max(largest[0], peak)
        return torch.from_numpy(out).float()[None]

    with monkeypatch.context() as patch:
        patch.setattr(modeling_qwen3_5.Qwen3_5GatedDeltaNet, "forward", forward)
        return hf_logits(folder, ids), largest[0]


@pytest.mark.parametrize("prompt_len", [1, 3])
def test_qwen3_5_wider_value_heads_are_the_diagnosed_doppler_behaviour(
    on_swiftshader, tiny_folder, monkeypatch, prompt_len
):
    """Ours matches HF; the JS original matches the numpy model of its recurrent kernel's reduction race (and
    without the race that model is HF's forward), over positions 0..3. From the fifth position its exploding
    recurrent state (~1e17) leaves float32 nothing to agree on, and a 12-id prompt overflows it: NaN logits."""
    model = tiny_folder(QWEN3_5_WIDE_VALUES)
    prompt = LONG_PROMPT[:prompt_len]
    steps = 5 - prompt_len  # positions prompt_len - 1 .. 3
    doppler, sequence = doppler_path(model, prompt, steps)
    raced, _ = doppler_qwen3_5_logits(monkeypatch, model, sequence, prompt_len, race=True)
    np.testing.assert_allclose(doppler.logits, raced[prompt_len - 1 :], atol=DEFAULT_ATOL, rtol=0)
    plain, _ = doppler_qwen3_5_logits(monkeypatch, model, sequence, prompt_len, race=False)
    np.testing.assert_allclose(plain, hf_logits(model, sequence), atol=DEFAULT_ATOL, rtol=0)
    assert np.abs(doppler.logits - plain[prompt_len - 1 :]).max() > 100 * DEFAULT_ATOL


def test_qwen3_5_race_overflows_doppler_state_on_a_long_prompt(on_swiftshader, tiny_folder, monkeypatch, tmp_path):
    model = tiny_folder(QWEN3_5_WIDE_VALUES)
    _, raced_peak = doppler_qwen3_5_logits(monkeypatch, model, LONG_PROMPT, len(LONG_PROMPT), race=True)
    _, plain_peak = doppler_qwen3_5_logits(monkeypatch, model, LONG_PROMPT, len(LONG_PROMPT), race=False)
    assert raced_peak > float(np.finfo(np.float32).max) and plain_peak < 100  # what the race does, what HF's state is
    rdrr = doppler_model.convert(model, tmp_path / "rdrr")
    with pytest.raises(DopplerParityError, match="no finite candidate logits"):
        doppler_model.run_greedy(rdrr, LONG_PROMPT, 1)


def test_qwen3_5_tiny_shape_is_refused_by_doppler_loader(doppler_ready, tiny_folder, tmp_path):
    """The tiny spec's value heads (4 x 16 columns) cannot load: the loader infers the Gated DeltaNet norm's
    layout from its GPU buffer's size, which the buffer pool rounds up to its smallest bucket. 16 floats = 64
    bytes -> 256 bytes = 64 floats = num_value_heads * value_head_dim, the per-head layout's size."""
    schema = (doppler_ready / "src/config/schema/buffer-pool.schema.js").read_text()
    min_bucket = int(re.search(r"minBucketSizeBytes:\s*(\d+)", schema).group(1))
    heads, dim = QWEN3_5.linear_heads[1], QWEN3_5.linear_dims[1]
    assert 4 * dim < min_bucket == 4 * heads * dim  # the norm's bucket is exactly the per-head size
    rdrr = doppler_model.convert(tiny_folder(QWEN3_5), tmp_path / "rdrr")
    with pytest.raises(
        DopplerParityError, match=re.escape('linearNormMode="shared" but norm.weight shape implies "per_head"')
    ):
        doppler_model.run_greedy(rdrr, PROMPT, 1)


def doppler_rmsnorm_sum_sq(squares):
    """The sum doppler-gpu's subgroup RMSNorm makes of a row's squares (a torch tensor [..., width]) under
    SwiftShader (finding 6).

    Invocation i holds elements [i * per, (i + 1) * per), so a subgroup holds 4 * per. Subgroups 31..63 all
    write their partial sums to slot 31 (Tint clamps the index into the 32-slot array), one after another, so
    the last one's (subgroup 63) stays; the final loop over 64 subgroups reads slots 0..30 once and slot 31
    33 times."""
    per = -(-squares.shape[-1] // RMSNORM_WORKGROUP)
    lanes = SWIFTSHADER_SUBGROUP * per
    subgroups = RMSNORM_WORKGROUP // SWIFTSHADER_SUBGROUP
    last = RMSNORM_SUBGROUP_SLOTS - 1
    kept = squares[..., : last * lanes].sum(-1, keepdim=True)
    final = squares[..., (subgroups - 1) * lanes : subgroups * lanes].sum(-1, keepdim=True)
    return kept + (subgroups - last) * final


def doppler_rmsnorm_logits(monkeypatch, folder, ids: list[int]) -> np.ndarray:
    """HF's LLaMA forward over `ids` with every RMSNorm taking doppler-gpu's sum of squares (and dividing it by
    the whole width, as the kernel does)."""
    import torch
    from transformers.models.llama import modeling_llama

    def forward(module, x):
        mean_sq = doppler_rmsnorm_sum_sq(x.double() ** 2) / x.shape[-1]
        return (module.weight.double() * x.double() / torch.sqrt(mean_sq + module.variance_epsilon)).to(x.dtype)

    with monkeypatch.context() as patch:
        patch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
        return hf_logits(folder, ids)


@pytest.mark.parametrize(
    ("width", "expected"),
    [
        (64, "all"),  # the tiny models: every square kept
        (128, "first 124"),  # subgroups 31 (elements 124..127) overwritten by 32..63, which hold nothing
        (256, "first 124 + 33 x last 4"),  # subgroup 63 holds elements 252..255 and is read 33 times
        (576, "first 372"),  # SmolLM2: 3 elements an invocation, subgroups 0..30 hold 0..371
    ],
)
def test_doppler_rmsnorm_sum_of_squares(width, expected):
    import torch

    squares = torch.rand(width, dtype=torch.float64) + 1
    want = {
        "all": squares.sum(),
        "first 124": squares[:124].sum(),
        "first 124 + 33 x last 4": squares[:124].sum() + 33 * squares[252:].sum(),
        "first 372": squares[:372].sum(),
    }[expected]
    assert float(doppler_rmsnorm_sum_sq(squares)) == pytest.approx(float(want), rel=1e-12)


@pytest.mark.parametrize("hidden", [128, 256])
def test_llama_wider_than_124_is_the_diagnosed_rmsnorm_behaviour(on_swiftshader, tiny_folder, monkeypatch, hidden):
    """Hidden 128 and 256 (heads of 32 and 64): ours matches HF; the JS original matches HF with its RMSNorm's
    sum of squares (finding 6), and not HF itself. 128 loses its last 4 squares; 256 also counts its last
    subgroup's 33 times."""
    folder = tiny_folder(dataclasses.replace(TINY_SPECS["llama-tied-gqa"], hidden_size=hidden, seed=11))
    doppler, path = doppler_path(folder, PROMPT, 3)
    steps = slice(len(PROMPT) - 1, None)
    assert np.abs(doppler.logits - doppler_rmsnorm_logits(monkeypatch, folder, path)[steps]).max() < DEFAULT_ATOL
    assert np.abs(doppler.logits - hf_logits(folder, path)[steps]).max() > 100 * DEFAULT_ATOL


@pytest.mark.parametrize("hidden", [128, 256])
def test_llama_wider_than_124_agrees_on_lavapipe_25(doppler_ready, tiny_folder, hidden):
    """Finding 6 is SwiftShader's: lavapipe's subgroups are wide enough for the 256 invocations to fit the 32
    slots, and the JS original agrees with HF."""
    if doppler_model.dawn_driver().name != "lavapipe 25":
        skip_unless_ci("Mesa 25's lavapipe is not unpacked (tools/mesa25.sh)")
    folder = tiny_folder(dataclasses.replace(TINY_SPECS["llama-tied-gqa"], hidden_size=hidden, seed=11))
    report = run_parity(folder, PROMPT, 3)
    assert report.dawn_driver == "lavapipe 25"
    assert report.agrees(DEFAULT_ATOL), [(p.pair, p.max_delta, p.first_divergence) for p in report.pairs]


@pytest.mark.slow
@pytest.mark.realmodel
def test_smollm2_in_all_three_engines(on_swiftshader, smollm2_gguf, monkeypatch, capsys):
    """SmolLM2-135M (f32) through the CLI, one step (the prompt's prefill; ~40-90 s of doppler-gpu on two
    SwiftShader cores): ours agrees with HF, the JS original matches finding 6's RMSNorm (30 layers of float32
    put it within 1e-3 of that model, measured 1e-4) and differs from HF by tens. Opt-in: set
    DOPPLER_PARITY_SMOLLM2=1."""
    if os.environ.get(SMOLLM2_OPT_IN) != "1":
        pytest.skip(f"takes minutes on SwiftShader; set {SMOLLM2_OPT_IN}=1 to run it")
    from doppler_py.model.catalog import DEFAULT_MODEL, resolve_model
    from doppler_py.tokenizer import Tokenizer

    folder = resolve_model(DEFAULT_MODEL, "f32", progress=False)
    ids = Tokenizer.from_dir(folder).encode("The quick brown fox", add_special_tokens=False)
    report = run_parity(folder, ids, 1, timeout=900)
    pairs = {p.pair: p for p in report.pairs}
    assert pairs["ours", "hf"].first_divergence is None and pairs["ours", "hf"].max_delta <= DEFAULT_ATOL
    doppler = report.runs["doppler"].logits
    assert np.abs(doppler - doppler_rmsnorm_logits(monkeypatch, folder, ids)[-1:]).max() < 1e-3
    assert pairs["doppler", "hf"].max_delta > 1.0


GEMMA4 = TINY_SPECS["gemma4"]  # sliding, full, sliding, then a sliding and a full layer reading layers 2's and 1's K/V
# Positions 2..5: inside the 6-key window, where none of the Gemma 3 window findings can act.
GEMMA4_PROMPT, GEMMA4_STEPS = [5, 17, 33], 4
# No per-layer inputs, and so no KV sharing either: transformers 5.24 cannot run a multi-token forward of a
# KV-shared model without per-layer inputs (Gemma4TextModel._maybe_slice_kv_shared_inputs indexes them, None).
GEMMA4_NO_PER_LAYER = dataclasses.replace(
    GEMMA4, hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, seed=12
)


def test_conversion_config_runs_gemma4_in_float32(doppler_gpu_dir):
    config = conversion_config(config_dict(GEMMA4), doppler_gpu_dir, "tiny-gemma4")
    inference = config["inference"]
    assert config["quantization"]["weights"] == config["quantization"]["embeddings"] == "f32"
    assert config["session"]["kvcache"]["kvDtype"] == "f32"
    assert config["session"]["perLayerInputs"]["materialization"] == "gpu_resident"
    assert inference["attention"]["queryPreAttnScalar"] == 1  # Gemma 4 scores q.k unscaled
    assert inference["attention"]["valueNorm"] is True and inference["attention"]["queryKeyNorm"] is True
    assert inference["attention"]["slidingWindow"] == GEMMA4.sliding_window
    assert inference["normalization"]["rmsNormWeightOffset"] is False
    assert inference["ffn"]["useDoubleWideMlp"] is True
    assert inference["rope"]["ropeTheta"] == GEMMA4.rope_theta
    assert inference["rope"]["ropeLocalTheta"] == GEMMA4.rope_local_base_freq
    assert inference["rope"]["partialRotaryFactor"] == GEMMA4.partial_rotary_factor
    assert inference["rope"]["ropeFrequencyBaseDim"] == GEMMA4.global_head_dim  # proportional: the whole head
    assert inference["output"]["finalLogitSoftcapping"] == GEMMA4.final_logit_softcapping
    assert inference["output"]["tieWordEmbeddings"] is False
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    assert inference["layerPattern"]["type"] == "custom" and inference["layerPattern"]["layerTypes"] == layer_types
    # the template's two prefill groups (its sliding and its full layers) hold this model's layers of each type
    assert [group["layers"] for group in config["execution"]["prefill"]] == [[0, 2, 3], [1, 4]]
    assert_float32_kernels(config, doppler_gpu_dir)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"enable_moe_block": True}, "enable_moe_block"),
        ({"attention_k_eq_v": True}, "attention_k_eq_v"),
        ({"layer_types": ["sliding_attention", "linear_attention"] * 2 + ["full_attention"]}, "linear_attention"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_theta": 1e4},
                    "full_attention": {"rope_type": "yarn", "rope_theta": 1e6},
                }
            },
            "yarn",
        ),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_theta": 1e4},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            "full_attention rope_type 'default'",
        ),
        ({"num_kv_shared_layers": 5}, "every layer KV-shared"),
        ({"attention_bias": True}, "attention_bias"),
    ],
    ids=["moe", "k-eq-v", "linear-layer", "yarn", "plain-full-rope", "all-shared", "attention-bias"],
)
def test_gemma4_configs_outside_the_mapping_are_refused_by_name(tmp_path, change, named):
    with pytest.raises(DopplerParityError, match=named):
        conversion_config(config_dict(GEMMA4) | change, tmp_path, "m")


def test_gemma4_without_per_layer_inputs_agrees_in_all_three_engines(doppler_ready, tiny_folder):
    """Mixed head dims (32 sliding, 64 full), proportional partial RoPE on the full layers, q/k/v norms, unscaled
    scores, layer scalars and the final soft-cap agree in all three engines inside the window."""
    report = run_parity(tiny_folder(GEMMA4_NO_PER_LAYER), GEMMA4_PROMPT, GEMMA4_STEPS)
    assert report.agrees(DEFAULT_ATOL), [(p.pair, p.max_delta, p.first_divergence) for p in report.pairs]
    assert report.runs["ours"].tokens == report.runs["doppler"].tokens == report.runs["hf"].tokens


def doppler_per_layer_tensors(folder) -> dict[str, np.ndarray]:
    """The model's tensors with the per-layer embedding table times sqrt(2): HF's per-layer input over them,
    (rmsnorm(proj) * w + sqrt(2) * E[ids] * sqrt(P)) / sqrt(2) = rmsnorm(proj) * w / sqrt(2) + E[ids] * sqrt(P),
    is what doppler-gpu computes over the original ones (docs/parity-findings.md, finding 7)."""
    tensors = {name: np.asarray(t, np.float64) for name, t in references.load_tensors(folder).items()}
    tensors["model.embed_tokens_per_layer.weight"] = tensors["model.embed_tokens_per_layer.weight"] * np.sqrt(2)
    return tensors


def test_gemma4_per_layer_inputs_are_the_diagnosed_doppler_behaviour(doppler_ready, tiny_folder):
    """Ours matches HF; the JS original matches the numpy forward whose per-layer inputs leave the token part
    unscaled by 1/sqrt(2) (KV sharing, double-wide MLPs and everything else as HF), and not HF's."""
    model = tiny_folder(GEMMA4)
    doppler, sequence = doppler_path(model, GEMMA4_PROMPT, GEMMA4_STEPS)
    config = ModelConfig.from_file(model / "config.json")
    rows = slice(len(GEMMA4_PROMPT) - 1, None)
    diagnosed = references.forward_reference(doppler_per_layer_tensors(model), config, sequence)[rows]
    np.testing.assert_allclose(doppler.logits, diagnosed, atol=DEFAULT_ATOL, rtol=0)
    plain = references.forward_reference(model, config, sequence)[rows]
    np.testing.assert_allclose(plain, hf_logits(model, sequence)[rows], atol=DEFAULT_ATOL, rtol=0)
    assert np.abs(doppler.logits - plain).max() > 100 * DEFAULT_ATOL


PER_LAYER_COMBINE = "per-layer-combine"  # finding 7: the token part of the per-layer inputs is not scaled by 1/sqrt(2)


def gemma4_doppler_logits(
    model, config, sequence: list[int], prompt_len: int, findings: tuple[str, ...], *, ring_sliding: bool = True
):
    """The numpy forward over `sequence` carrying the given findings as doppler-gpu shows them on Gemma 4: the
    three Gemma 3 window findings (doppler_findings.py), with the sliding layers' keys in a ring of `window`
    rows and the full layers' in a contiguous cache (a Gemma 4 cache with mixed head dims or KV-shared layers
    is "mixed-geometry", whose sliding layers are rings: src/inference/pipelines/text/init.js,
    resolveMixedGeometrySlidingLayerLayout), and the per-layer combine (`doppler_per_layer_tensors`)."""
    window = config.sliding_window
    ring = doppler_attention(prompt_len, window, ring_sliding, findings)
    contiguous = doppler_attention(prompt_len, window, False, findings)

    def attend(q, k, v, start_pos, *, window=0, **options):
        return (ring if window else contiguous)(q, k, v, start_pos, window=window, **options)

    tensors = doppler_per_layer_tensors(model) if PER_LAYER_COMBINE in findings else model
    saved = references.attention
    references.attention = attend
    try:
        return references.forward_reference(tensors, config, sequence)[prompt_len - 1 :]
    finally:
        references.attention = saved


def test_gemma4_past_the_window_is_the_diagnosed_doppler_behaviour(doppler_ready, tiny_folder):
    """A 12-id prompt over the 6-key window: the JS original matches the numpy model of the per-layer combine
    and the three Gemma 3 window findings (sliding layers in a ring), and each of the four is needed."""
    model = tiny_folder(GEMMA4)
    doppler, sequence = doppler_path(model, LONG_PROMPT, GEMMA4_STEPS)
    config = ModelConfig.from_file(model / "config.json")
    every = (*FINDINGS, PER_LAYER_COMBINE)
    diagnosed = gemma4_doppler_logits(model, config, sequence, len(LONG_PROMPT), every)
    np.testing.assert_allclose(doppler.logits, diagnosed, atol=DEFAULT_ATOL, rtol=0)
    for finding in every:
        without = gemma4_doppler_logits(
            model, config, sequence, len(LONG_PROMPT), tuple(f for f in every if f != finding)
        )
        assert np.abs(doppler.logits - without).max() > 100 * DEFAULT_ATOL, f"{finding} is not needed here"
    # ...and the sliding layers' ring is needed too: their keys read from a contiguous cache do not match.
    flat = gemma4_doppler_logits(model, config, sequence, len(LONG_PROMPT), every, ring_sliding=False)
    assert np.abs(doppler.logits - flat).max() > 100 * DEFAULT_ATOL
