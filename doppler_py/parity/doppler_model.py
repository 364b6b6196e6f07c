"""The JS original's whole pipeline on an HF folder: its converter writes RDRR, its loader runs it under Node.

doppler-gpu 0.5.1 converts only with an explicit conversion config (model inference fields, session, kernel
table with digests, step lists). `conversion_config` writes one for an HF folder: it starts from the package's
own config for the family (read from the fetched package, never copied here), sets every inference field from
the folder's config.json, and makes the run float32 end to end (weights, embeddings, LM head, KV cache and the
kernels that read them, digests from the package's `src/config/kernels/kernel-ref-digests.js`), so a
comparison with HF transformers in float32 measures the engines, not rounding to f16.

The package's loader finds WebGPU through the npm package `webgpu` (Dawn), fetched pinned like doppler-gpu.
Dawn needs a Vulkan driver it accepts (`dawn_driver`): Mesa 25's lavapipe where tools/mesa25.sh unpacked it
(shader-f16, which the package's f16-activation and Q4K paths need), else Chrome's SwiftShader (Debian's
`chromium` package ships its ICD; no shader-f16), or whatever DOPPLER_DAWN_VK_ICD names. Debian's Mesa 22.3
lavapipe is refused by Dawn ("shaderUniform*ArrayDynamicIndexing").
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import DopplerError
from doppler_py.gpu.webgpu import LAVAPIPE_WIDTH_ENV, mesa25_vector_width
from doppler_py.parity.npm import DOPPLER_GPU, NpmPackage, fetch_package

WEBGPU = NpmPackage(
    "webgpu",
    "0.6.2",
    "sha512-3L4GfmqJLvYUIEWJngEQY+2HQiUlAFkg8+P8NDDj3Xx5hHHIFO/r8JW+ynfqBj7kHN4mbnwO74uB+lrRtLhp4Q==",
)
SWIFTSHADER_ICD = Path(os.environ.get("DOPPLER_DAWN_VK_ICD", "/usr/lib/chromium/vk_swiftshader_icd.json"))
# Mesa 25's lavapipe, unpacked beside the system's Mesa by tools/mesa25.sh: lvp_icd.json, and lib/ with the newer
# libdrm it links (LD_LIBRARY_PATH for the Node process only). Dawn accepts it, with shader-f16.
MESA25_DIR = Path(os.environ.get("DOPPLER_MESA25_DIR", Path.home() / ".cache/doppler-py/mesa25"))
# "swiftshader": run on SwiftShader even where Mesa 25 is there (findings that depend on its 4-wide subgroups).
DRIVER_CHOICE = "DOPPLER_DAWN_DRIVER"
DRIVER = Path(__file__).with_name("doppler_model.mjs")
# llvmpipe's subgroups are its vector width / 32 bits wide. The JS original's subgroup RMSNorm keeps one partial sum
# per subgroup of its 256 invocations in 32 slots (finding 6), so it needs subgroups of 8 or more: at Dawn's 128
# bits (4 lanes, SwiftShader's width) the tiny LLaMAs of hidden 128 and 256 disagree with HF by 5.7 (measured).
MESA25_MIN_VECTOR_BITS = 256
CONVERT_TIMEOUT_S = 300
RUN_TIMEOUT_S = 600

# The package's conversion configs the generated ones start from: plain Qwen3 (0.6B), Gemma 3 (270m), Qwen 3.5
# (9B, its f32-activation config) and Gemma 4 (E2B, its f32-activation config without the int4 per-layer table).
# A LLaMA layer is a Qwen3 layer without the q/k norms.
TEMPLATES = {
    "llama": "qwen3/qwen-3-reranker-0-6b-f16-af32.json",
    "qwen3": "qwen3/qwen-3-reranker-0-6b-f16-af32.json",
    "gemma3_text": "gemma3/gemma-3-270m-it-f16-af32.json",
    "qwen3_5_text": "qwen3/qwen-3-5-9b-f16-af32.json",
    "gemma4_text": "gemma4/gemma-4-e2b-it-q4k-ehf16-af32.json",
}
# The package's production-format configs (Q4K weights; f16 embeddings and LM head; f16 KV cache; activations
# f32 "af32" or f16 "af16") the formats lane starts from. Gemma 3 270m has both; the plain Qwen3 (and so LLaMA)
# configs only af32. Under "q4k-af16" the package dequantizes the Q4K weights to f16 on load and runs its f16
# kernels; under "q4k" (af32) its fused Q4K matmuls read the blocks as they are.
FORMAT_TEMPLATES = {
    "llama": {"q4k": "qwen3/qwen-3-reranker-0-6b-q4k-ehf16-af32.json"},
    "qwen3": {"q4k": "qwen3/qwen-3-reranker-0-6b-q4k-ehf16-af32.json"},
    "gemma3_text": {
        "q4k": "gemma3/gemma-3-270m-it-q4k-ehf16-af32.json",
        "q4k-af16": "gemma3/gemma-3-270m-it-q4k-ehf16-af16.json",
    },
}
GEMMA_TYPES = ("gemma3_text",)
GEMMA_ROPE_KINDS = ("full_attention", "sliding_attention")  # the keys of transformers 5's per-layer-type RoPE
# Qwen 3.5 text: Gated DeltaNet layers between gated full-attention layers, (1 + w) norms, partial RoPE.
QWEN3_5_TYPES = ("qwen3_5_text",)
QWEN3_5_LAYER_TYPES = ("linear_attention", "full_attention")
# The converter reads a Gated DeltaNet layer's shape from config.json itself (src/converter/core.js); the lane
# requires them so that a folder missing one is refused here, not deep in the package's loader.
QWEN3_5_LINEAR_FIELDS = (
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_conv_kernel_dim",
)
# Gemma 4 text: the converter reads the per-layer shapes (head_dim / global_head_dim, num_kv_shared_layers,
# hidden_size_per_layer_input, ...) from config.json itself (src/converter/core.js); the lane sets the
# inference fields and refuses what neither it nor the E2B config it starts from covers.
GEMMA4_TYPES = ("gemma4_text",)
GEMMA4_LAYER_TYPES = ("sliding_attention", "full_attention")
# Every Gemma 4 checkpoint rotates its full layers proportionally (the E2B template's form) and its sliding
# layers plainly; the lane maps those two and refuses the rest.
GEMMA4_ROPE_TYPES = {"sliding_attention": "default", "full_attention": "proportional"}

# float32 kernels of the package that do what its f16 configs' kernels do: (file, entry).
F32_MATMUL = ("matmul_f32.wgsl", "main")
F32_GATHER = ("gather.wgsl", "main")
F32_DECODE_ATTENTION = ("attention_decode.wgsl", "attention_decode")
F32_PREFILL_ATTENTION = ("attention_streaming.wgsl", "main")
# The package's head-size-generic kernels for its head-size-specific f16-KV attention ones (file -> (file, entry)).
F16KV_GENERIC_ATTENTION = {
    "attention_head256_f16kv.wgsl": ("attention_streaming_f16kv.wgsl", "main"),
    "attention_decode_online_head256_f16kv.wgsl": ("attention_decode_online_f16kv.wgsl", "main"),
}


class DopplerParityError(DopplerError):
    """The JS original could not run a model: unsupported model, missing Node/driver, or its run failed."""


@dataclass(frozen=True)
class DopplerRun:
    """What the JS original generated greedily: `tokens[i]` was chosen from `logits[i]` ([steps, vocab])."""

    tokens: list[int]
    logits: np.ndarray
    adapter: dict | None
    phases: list[tuple[str, float]]  # (name, wall seconds) of the driver's phases: import, load, prefill, decode<i>
    driver: str  # the Vulkan driver Dawn ran on (DawnDriver.name)


def kernel_digests(package: Path) -> dict[str, str]:
    """ "file#entry" -> sha256 hex, as the package's kernel-ref-digests.js lists them."""
    text = (package / "src/config/kernels/kernel-ref-digests.js").read_text()
    return dict(re.findall(r'"([\w.]+#\w+)":\s*"([0-9a-f]{64})"', text))


def _kernel(digests: dict[str, str], file: str, entry: str, **extra) -> dict:
    key = f"{file}#{entry}"
    if key not in digests:
        raise DopplerParityError(f"{DOPPLER_GPU.spec} lists no digest for kernel {key}")
    return {"kernel": file, "entry": entry, "digest": f"sha256:{digests[key]}", **extra}


def conversion_config(hf: dict, package: Path, model_id: str, fmt: str = "f32") -> dict:
    """The doppler-gpu conversion config that runs the HF config `hf` in format `fmt`, as its own configs are laid
    out: "f32" (float32 end to end), or one of FORMAT_TEMPLATES' production formats (the package's own config
    for the family and format, quantization, session and kernels kept, the inference fields set from `hf`)."""
    model_type = hf.get("model_type")
    if fmt != "f32":
        formats = FORMAT_TEMPLATES.get(model_type, {})
        if fmt not in formats:
            raise DopplerParityError(
                f"format {fmt!r} for {model_type!r}: the lane runs {', '.join(sorted(formats)) or 'f32 only'}"
            )
    if model_type not in TEMPLATES:
        raise DopplerParityError(
            f"model_type {model_type!r}: the doppler-gpu parity lane runs {', '.join(sorted(TEMPLATES))}"
        )
    if hf.get("use_sliding_window") and model_type != "gemma3_text":
        raise DopplerParityError(f"{model_type} with use_sliding_window: not mapped to doppler-gpu's layer pattern")
    if hf.get("rope_scaling"):
        raise DopplerParityError(f"rope_scaling {hf['rope_scaling']!r}: not mapped to doppler-gpu's RoPE fields")
    if model_type in GEMMA4_TYPES:
        return _gemma4_config(hf, package, model_id)
    qwen3_5 = model_type in QWEN3_5_TYPES
    rope = _rope_parameters(hf, model_type)
    if qwen3_5:
        _check_qwen3_5(hf)
    template = TEMPLATES[model_type] if fmt == "f32" else FORMAT_TEMPLATES[model_type][fmt]
    config = json.loads((package / "src/config/conversion" / template).read_text())
    gemma = model_type in GEMMA_TYPES
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    eos = hf.get("eos_token_id")
    config["modelType"] = "transformer"
    config["output"] = {"baseDir": ".", "modelBaseId": model_id, "textOnly": True, "fast": False}
    if fmt == "f32":
        config["quantization"] = {"weights": "f32", "embeddings": "f32", "lmHead": "f32", "computePrecision": "f32"}
    config["manifest"] = {"eosTokenId": eos[0] if isinstance(eos, list) else eos}
    inference = config["inference"]
    for key in ("supportsRerank", "rerank"):
        inference.pop(key, None)
    inference["attention"].update(
        queryPreAttnScalar=hf.get("query_pre_attn_scalar", head_dim),
        attnLogitSoftcapping=hf.get("attn_logit_softcapping"),
        slidingWindow=hf.get("sliding_window") if gemma else None,
        queryKeyNorm=model_type != "llama",
        attentionBias=bool(hf.get("attention_bias", False)),
        # EmbeddingGemma's Gemma 3 attends both ways (transformers: use_bidirectional_attention)
        causal=not hf.get("use_bidirectional_attention", False),
    )
    if qwen3_5:  # HF's Qwen 3.5 attention always gates its output by sigmoid(gate), q_proj holding [q | gate]
        inference["attention"]["attentionOutputGate"] = True
    inference["normalization"].update(
        rmsNormEps=hf["rms_norm_eps"],
        rmsNormWeightOffset=gemma or qwen3_5,
        postAttentionNorm=True,
        preFeedforwardNorm=gemma,
        postFeedforwardNorm=gemma,
    )
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    inference["ffn"]["activation"] = "gelu" if activation.startswith("gelu") else activation
    inference["rope"].update(
        ropeTheta=rope.get("rope_theta", 10000.0),
        ropeLocalTheta=hf.get("rope_local_base_freq", rope.get("rope_local_base_freq")) if gemma else None,
    )
    if qwen3_5:
        # Plain (not multimodal) RoPE unless the folder names sections: the template's mrope sections fit the
        # 9B's 64 rotary dims, and the converter falls back to them when config.json names none.
        inference["rope"].update(
            # transformers' Qwen3_5TextConfig defaults the factor to 0.25 where config.json names none
            partialRotaryFactor=rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25)),
            mropeInterleaved=bool(rope.get("mrope_interleaved", False)),
            mropeSection=rope.get("mrope_section"),
        )
    inference["output"].update(
        finalLogitSoftcapping=hf.get("final_logit_softcapping"),
        tieWordEmbeddings=bool(hf.get("tie_word_embeddings", gemma)),
        scaleEmbeddings=gemma,
    )
    layer_types = hf.get("layer_types") if gemma or qwen3_5 else None
    inference["layerPattern"].update(
        type="custom" if layer_types else "uniform",
        globalPattern=None,
        period=None,
        offset=None,
        layerTypes=layer_types,
    )
    inference["chatTemplate"] = {"type": None, "enabled": False}  # the prompt goes in as token ids
    session = config["session"]
    session["kvcache"]["maxSeqLen"] = hf.get("max_position_embeddings", 2048)
    session["decodeLoop"]["batchSize"] = 1
    if fmt == "f32":
        session["kvcache"]["kvDtype"] = "f32"
        _float32_kernels(config["execution"], kernel_digests(package))
    else:
        _fit_attention_to_head_dim(config["execution"], kernel_digests(package), head_dim)
    return config


def _fit_attention_to_head_dim(execution: dict, digests: dict[str, str], head_dim: int) -> None:
    """Point a production config's attention kernels written for one head size (Gemma 3 270m's head256 ones, which
    read 256 columns per head) at the package's head-size-generic f16-KV kernels when this model's heads differ."""
    kernels = execution["kernels"]
    for key, kernel in kernels.items():
        sized = re.search(r"_head(\d+)_", kernel["kernel"])
        if sized and int(sized[1]) != head_dim:
            generic = F16KV_GENERIC_ATTENTION.get(kernel["kernel"])
            if generic is None:
                raise DopplerParityError(f"{kernel['kernel']} reads heads of {sized[1]}; this model's are {head_dim}")
            extra = {name: value for name, value in kernel.items() if name not in ("kernel", "entry", "digest")}
            kernels[key] = _kernel(digests, *generic, **extra)


def _gemma4_config(hf: dict, package: Path, model_id: str) -> dict:
    """The float32 conversion config of a `gemma4_text` folder, from the package's E2B f32-activation config."""
    _check_gemma4(hf)
    config = json.loads((package / "src/config/conversion" / TEMPLATES["gemma4_text"]).read_text())
    template_types = _template_layer_types(config)
    rope = hf["rope_parameters"]
    layer_types = list(hf["layer_types"])
    eos = hf.get("eos_token_id")
    config["modelType"] = "gemma4"
    config["output"] = {"baseDir": ".", "modelBaseId": model_id, "textOnly": True, "fast": False}
    # The template quantizes to Q4K with f16 embeddings; the lane runs every tensor in f32 (the per-layer input
    # table included: the converter int4-quantizes it only when the quantization config asks for it).
    config["quantization"] = {"weights": "f32", "embeddings": "f32", "lmHead": "f32", "computePrecision": "f32"}
    config["manifest"] = {"eosTokenId": eos[0] if isinstance(eos, list) else eos}  # no vision/audio configs
    config.pop("largeWeights", None)  # names the multimodal checkpoint's embedding, which a text folder lacks
    inference = config["inference"]
    inference["attention"].update(
        queryPreAttnScalar=1,  # transformers' Gemma4TextAttention scores q.k unscaled (scaling = 1.0)
        attnLogitSoftcapping=None,
        slidingWindow=hf.get("sliding_window"),
        queryKeyNorm=True,
        valueNorm=True,
        attentionBias=False,
    )
    inference["normalization"].update(
        rmsNormEps=hf["rms_norm_eps"],
        rmsNormWeightOffset=False,  # Gemma 4's norms scale by w, not 1 + w
        postAttentionNorm=True,
        preFeedforwardNorm=True,
        postFeedforwardNorm=True,
    )
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh")
    inference["ffn"].update(
        activation="gelu" if activation.startswith("gelu") else activation,
        useDoubleWideMlp=bool(hf.get("use_double_wide_mlp", False)),
    )
    full, sliding = rope["full_attention"], rope["sliding_attention"]
    inference["rope"].update(
        ropeTheta=full["rope_theta"],
        ropeLocalTheta=sliding["rope_theta"],
        # transformers' proportional RoPE defaults the factor to 1 and spreads its frequencies over the whole
        # full-attention head (the converter derives the same base dim from config.json and refuses a
        # conflicting one, src/converter/rope-config.js, resolveFrequencyBaseDim)
        partialRotaryFactor=full.get("partial_rotary_factor", 1.0),
        ropeFrequencyBaseDim=hf.get("global_head_dim") or hf["head_dim"],
        ropeLocalPartialRotaryFactor=None,
        ropeLocalFrequencyBaseDim=None,
    )
    inference["output"].update(
        finalLogitSoftcapping=hf.get("final_logit_softcapping"),
        tieWordEmbeddings=bool(hf.get("tie_word_embeddings", True)),
        scaleEmbeddings=True,
        embeddingVocabSize=hf["vocab_size"],
    )
    inference["layerPattern"].update(
        type="custom", globalPattern=None, period=None, offset=None, layerTypes=layer_types
    )
    inference["chatTemplate"] = {"type": None, "enabled": False}  # the prompt goes in as token ids
    session = config["session"]
    session["kvcache"]["kvDtype"] = "f32"
    session["kvcache"]["maxSeqLen"] = hf.get("max_position_embeddings", 2048)
    session["decodeLoop"].update(batchSize=1, readbackInterval=1)
    # The template's "gpu_split_tables" reads the per-layer input table through ranged shard reads, which a
    # model loaded from a file URL under Node lacks (src/loader/per-layer-input-loader.js:86 and :354: "requires
    # range-backed per-layer inputs ... shard range loading is unavailable"); a tiny table fits the GPU whole.
    session["perLayerInputs"]["materialization"] = "gpu_resident"
    execution = config["execution"]
    # The template's prefill runs its sliding and its full layers as two groups (head-256 and head-512 kernels);
    # each group gets this model's layers of its type.
    for group, kind in zip(execution["prefill"], template_types, strict=True):
        group["layers"] = [i for i, layer_type in enumerate(layer_types) if layer_type == kind]
    execution["prefill"] = [group for group in execution["prefill"] if group["layers"]]
    _float32_kernels(execution, kernel_digests(package))
    return config


def _template_layer_types(template: dict) -> list[str]:
    """The layer type of each of the Gemma 4 template's prefill groups, from its layer pattern (every_n: every
    `period`-th layer from `offset` is full attention); each group must hold layers of one type."""
    pattern, groups = template["inference"]["layerPattern"], template["execution"]["prefill"]
    if pattern.get("type") != "every_n":
        raise DopplerParityError(f"{TEMPLATES['gemma4_text']}: layer pattern {pattern.get('type')!r}, not every_n")
    kinds = []
    for group in groups:
        types = {GEMMA4_LAYER_TYPES[i % pattern["period"] == pattern["offset"]] for i in group["layers"]}
        if len(types) != 1:
            raise DopplerParityError(f"{TEMPLATES['gemma4_text']}: a prefill group mixes layer types {types}")
        kinds.append(types.pop())
    if sorted(kinds) != sorted(GEMMA4_LAYER_TYPES):
        raise DopplerParityError(f"{TEMPLATES['gemma4_text']}: prefill groups of types {kinds}")
    return kinds


def _check_gemma4(hf: dict) -> None:
    """Refuse, by name, a Gemma 4 config the lane's mapping (or doppler-gpu's converter) does not cover."""
    layer_types = hf.get("layer_types")
    if not layer_types or any(kind not in GEMMA4_LAYER_TYPES for kind in layer_types):
        raise DopplerParityError(
            f"gemma4_text layer_types {layer_types!r}: the lane maps {' and '.join(GEMMA4_LAYER_TYPES)} layers"
        )
    rope = hf.get("rope_parameters") or {}
    for kind, allowed in GEMMA4_ROPE_TYPES.items():
        params = rope.get(kind)
        if not isinstance(params, dict) or "rope_theta" not in params:
            raise DopplerParityError(f"gemma4_text without rope_parameters.{kind}.rope_theta")
        rope_type = params.get("rope_type", "default")
        if rope_type != allowed:
            raise DopplerParityError(f"gemma4_text {kind} rope_type {rope_type!r}: the lane maps {allowed!r} only")
    if hf.get("enable_moe_block"):  # the converter refuses it too (src/converter/core.js, Gemma 4 MoE)
        raise DopplerParityError("gemma4_text with enable_moe_block: doppler-gpu runs no Gemma 4 MoE blocks")
    if hf.get("attention_k_eq_v"):
        # Nothing in the package reads attention_k_eq_v: a full layer without v_proj is the 12B/31B form
        raise DopplerParityError("gemma4_text with attention_k_eq_v: doppler-gpu's converter does not read it")
    if hf.get("attention_bias"):
        raise DopplerParityError("gemma4_text with attention_bias: doppler-gpu's Gemma 4 configs have none")
    if hf.get("use_bidirectional_attention") == "all":
        raise DopplerParityError("gemma4_text with use_bidirectional_attention 'all': the lane runs causal models")
    if hf.get("num_kv_shared_layers", 0) >= hf["num_hidden_layers"]:
        raise DopplerParityError("gemma4_text with every layer KV-shared (the assistant form): not a target model")


def _rope_parameters(hf: dict, model_type: str) -> dict:
    """rope_theta and friends, from config.json's top level or from transformers 5's `rope_parameters`. A Gemma 3
    folder that transformers 5 saved keeps them per layer type: the full layers' base is `rope_theta`, the sliding
    layers' `rope_local_base_freq` (the names of the older top-level form)."""
    rope = dict(hf.get("rope_parameters") or {})
    if model_type in GEMMA_TYPES and "full_attention" in rope:
        full, sliding = (_rope_parameters({"rope_parameters": rope.get(kind)}, model_type) for kind in GEMMA_ROPE_KINDS)
        return full | {"rope_local_base_freq": sliding.get("rope_theta")}
    if "rope_theta" in hf:
        rope.setdefault("rope_theta", hf["rope_theta"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise DopplerParityError(f"{model_type} rope_type {rope_type!r}: not mapped to doppler-gpu's RoPE fields")
    return rope


def _check_qwen3_5(hf: dict) -> None:
    """Refuse, by name, a Qwen 3.5 config the lane's mapping does not cover."""
    missing = [name for name in QWEN3_5_LINEAR_FIELDS if name not in hf]
    if missing:
        raise DopplerParityError(f"qwen3_5_text without {', '.join(missing)}: the Gated DeltaNet shape is unknown")
    layer_types = hf.get("layer_types")
    if not layer_types or any(kind not in QWEN3_5_LAYER_TYPES for kind in layer_types):
        raise DopplerParityError(
            f"qwen3_5_text layer_types {layer_types!r}: the lane maps {' and '.join(QWEN3_5_LAYER_TYPES)} layers"
        )
    if hf.get("attention_bias"):
        raise DopplerParityError("qwen3_5_text with attention_bias: doppler-gpu's Qwen 3.5 configs have none")


def _float32_kernels(execution: dict, digests: dict[str, str]) -> None:
    """Point every kernel the step lists use at its float32 counterpart (f32 weights and KV cache), each with
    the digest the package's kernel-ref-digests.js lists for it."""
    kernels = execution["kernels"]
    roles = {"decode": F32_DECODE_ATTENTION, "prefill": F32_PREFILL_ATTENTION}
    for phase, attention in roles.items():
        for step in _steps(execution[phase]):
            if step[0] == "attention":
                kernels[step[1]] = _kernel(digests, *attention, precision={"kvDtype": "f32"})
    for key, kernel in kernels.items():
        if kernel["kernel"].startswith("matmul"):
            kernels[key] = _kernel(digests, *F32_MATMUL)
        elif kernel["kernel"].startswith("gather"):
            kernels[key] = _kernel(digests, *F32_GATHER)
        else:
            # The digest the package lists, not the template's: its Qwen3 / Qwen 3.5 configs name silu.wgsl#main
            # with a digest kernel-ref-digests.js does not list (the loader checks only a digest's form).
            extra = {name: value for name, value in kernel.items() if name not in ("kernel", "entry", "digest")}
            kernels[key] = _kernel(digests, kernel["kernel"], kernel["entry"], **extra)


def _steps(phase: list) -> list[list]:
    """A phase's steps: a step list, or (Gemma 4's prefill) groups of {"layers", "steps"}."""
    return [step for item in phase for step in (item["steps"] if isinstance(item, dict) else [item])]


def _node() -> str:
    node = shutil.which("node")
    if node is None:
        raise DopplerParityError("node is not installed (Node 20+ runs the JS original)")
    return node


class DopplerTimeoutError(DopplerParityError):
    """A doppler-gpu phase (its converter, or its load and generation) ran past its time limit."""

    def __init__(self, what: str, limit_s: float, phases: list[tuple[str, float]]):
        done = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases) or "none"
        super().__init__(
            f"{what} took over {limit_s:g} s (its time limit; `doppler-py parity doppler --timeout SECONDS` "
            f"sets it); phases finished before the limit: {done}"
        )
        self.what = what
        self.limit_s = limit_s
        self.phases = phases


PHASE_LINE = re.compile(r"^doppler-gpu phase (\S+) ([0-9.]+)$")


def _phases(lines: list[str]) -> list[tuple[str, float]]:
    """The `doppler-gpu phase NAME SECONDS` lines the Node driver printed, in order."""
    found = (PHASE_LINE.match(line) for line in lines)
    return [(match[1], float(match[2])) for match in found if match]


def _run(
    command: list[str],
    *,
    timeout: float,
    what: str,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    log: Callable[[str], None] | None = None,
) -> list[str]:
    """Run `command` to its end within `timeout` seconds; returns its output lines (stdout and stderr merged).

    The output is read as it comes so that `log` sees each phase line when the phase ends (a real model's run
    takes minutes), and so that a run stopped at its limit still says which phases it finished."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, errors="replace"
    )
    lines: list[str] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            if log is not None and PHASE_LINE.match(lines[-1]):
                log(lines[-1])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        reader.join(timeout=10)  # a grandchild holding the pipe open must not hang the report
        raise DopplerTimeoutError(what, timeout, _phases(lines)) from None
    reader.join()
    if returncode != 0:
        tail = [line for line in lines if line.strip()][-6:]
        raise DopplerParityError(f"{what} failed (exit {returncode}): " + " / ".join(tail))
    return lines


def convert(
    model_dir: Path,
    out_dir: Path,
    package: Path | None = None,
    *,
    timeout: float = CONVERT_TIMEOUT_S,
    fmt: str = "f32",
    config: dict | None = None,
) -> Path:
    """Convert the HF folder into RDRR in format `fmt` (see `conversion_config`; `config`: a conversion config to
    use as it is instead) with doppler-gpu's converter within `timeout` seconds; returns `out_dir` (manifest.json
    inside)."""
    package = package or fetch_package(DOPPLER_GPU)
    if config is None:
        hf = json.loads((model_dir / "config.json").read_text())
        config = conversion_config(hf, package, model_id=model_dir.name.lower(), fmt=fmt)
    out_dir.mkdir(parents=True, exist_ok=True)
    config_path = out_dir / "conversion.json"
    config_path.write_text(json.dumps(config, indent=1))
    converter = package / "tools/convert-safetensors-node.js"
    with tempfile.TemporaryDirectory(prefix="doppler-convert-") as scratch:  # it writes reports/ under its cwd
        command = [_node(), str(converter), str(model_dir), "--config", str(config_path), "--output-dir", str(out_dir)]
        _run(command, timeout=timeout, what=f"doppler-gpu's converter on {model_dir}", cwd=scratch)
    if not (out_dir / "manifest.json").exists():
        raise DopplerParityError(f"doppler-gpu's converter wrote no manifest.json into {out_dir}")
    return out_dir


@dataclass(frozen=True)
class DawnDriver:
    """The Vulkan driver Dawn runs the JS original on: its ICD json, a library folder it needs first on
    LD_LIBRARY_PATH (None: the system's), and the LP_NATIVE_VECTOR_WIDTH a lavapipe gets (None: the environment's)."""

    name: str  # "lavapipe 25" or "swiftshader" (or "DOPPLER_DAWN_VK_ICD" when named there)
    icd: Path
    library_dir: Path | None
    # Mesa 25's lavapipe gets `node_vector_width()`, not the 512 bits device.py sets in this process for the system's
    # Mesa 22.3 on AVX-512 hosts: Mesa 25 compiles many times slower at 512.
    vector_width: str | None = None


def dawn_driver() -> DawnDriver:
    """DOPPLER_DAWN_VK_ICD when set; else Mesa 25's lavapipe when tools/mesa25.sh unpacked it (shader-f16, ~10x
    faster than SwiftShader) unless DOPPLER_DAWN_DRIVER=swiftshader; else Chrome's SwiftShader ICD."""
    if "DOPPLER_DAWN_VK_ICD" in os.environ:
        return DawnDriver("DOPPLER_DAWN_VK_ICD", SWIFTSHADER_ICD, None)
    mesa25 = MESA25_DIR / "lvp_icd.json"
    if mesa25.is_file() and os.environ.get(DRIVER_CHOICE) != "swiftshader":
        return DawnDriver("lavapipe 25", mesa25, MESA25_DIR / "lib", node_vector_width())
    if not SWIFTSHADER_ICD.is_file():
        raise DopplerParityError(
            f"no Vulkan driver Dawn accepts: neither Mesa 25's lavapipe ({mesa25}; tools/mesa25.sh unpacks it) nor "
            f"Chrome's SwiftShader ICD {SWIFTSHADER_ICD} is there (install Debian's chromium, or name another ICD "
            "in DOPPLER_DAWN_VK_ICD)"
        )
    return DawnDriver("swiftshader", SWIFTSHADER_ICD, None)


def node_vector_width() -> str:
    """The LP_NATIVE_VECTOR_WIDTH Mesa 25's lavapipe gets under the JS original: our Dawn devices' width
    (`mesa25_vector_width`, fast compiles), but never below MESA25_MIN_VECTOR_BITS (its subgroups' slots)."""
    return str(max(int(mesa25_vector_width()), MESA25_MIN_VECTOR_BITS))


def node_environment(driver: DawnDriver | None = None) -> dict[str, str]:
    """The environment under which the package's loader finds Dawn on `driver` (default: `dawn_driver()`)."""
    driver = driver or dawn_driver()
    if not driver.icd.is_file():
        raise DopplerParityError(f"no Vulkan driver Dawn accepts: the ICD {driver.icd} ({driver.name}) is missing")
    env = dict(os.environ)
    env["VK_ICD_FILENAMES"] = env["VK_DRIVER_FILES"] = str(driver.icd)
    if driver.library_dir is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(driver.library_dir), env.get("LD_LIBRARY_PATH")]))
    if driver.vector_width is not None:
        env[LAVAPIPE_WIDTH_ENV] = driver.vector_width
    env["DOPPLER_NODE_WEBGPU_MODULE"] = str(fetch_package(WEBGPU))
    env.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())  # Dawn's Vulkan loader complains without one
    return env


def run_greedy(
    rdrr_dir: Path,
    prompt_ids: list[int],
    steps: int,
    package: Path | None = None,
    *,
    timeout: float = RUN_TIMEOUT_S,
    log: Callable[[str], None] | None = None,
) -> DopplerRun:
    """Greedy generation of `steps` tokens after `prompt_ids` in the JS original, with each step's logits, all
    within `timeout` seconds (Node's start, the model's load and every step); `log` gets each phase line."""
    job = {"ids": list(prompt_ids), "steps": steps}
    done = run_driver(DRIVER, rdrr_dir, job, package, timeout=timeout, what="doppler-gpu's generation", log=log)
    return DopplerRun(
        tokens=[int(t) for t in done.result["tokens"]],
        logits=float32_rows(done.result["logits"]),
        adapter=done.result["adapter"],
        phases=done.phases,
        driver=done.driver,
    )


@dataclass(frozen=True)
class DriverRun:
    """What a Node driver of the lane wrote (its OUT json), the phases it reported and the Vulkan driver it ran on."""

    result: dict
    phases: list[tuple[str, float]]
    driver: str


def run_driver(
    script: Path,
    rdrr_dir: Path,
    job: dict,
    package: Path | None = None,
    *,
    timeout: float,
    what: str,
    log: Callable[[str], None] | None = None,
) -> DriverRun:
    """`node SCRIPT PACKAGE_DIR RDRR_DIR JOB.json OUT.json` on Dawn (`dawn_driver()`) within `timeout` seconds."""
    package = package or fetch_package(DOPPLER_GPU)
    driver = dawn_driver()
    env = node_environment(driver)
    with tempfile.TemporaryDirectory(prefix="doppler-run-") as scratch:
        job_path, out = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job_path.write_text(json.dumps(job))
        command = [_node(), str(script), str(package), str(rdrr_dir), str(job_path), str(out)]
        lines = _run(command, timeout=timeout, what=what, env=env, log=log)
        return DriverRun(json.loads(out.read_text()), _phases(lines), driver.name)


def float32_rows(rows: list[str]) -> np.ndarray:
    """[n, width] float32 from the base64 rows a Node driver wrote."""
    return np.stack([np.frombuffer(base64.b64decode(row), dtype=np.float32) for row in rows])
