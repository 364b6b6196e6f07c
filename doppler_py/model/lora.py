"""LoRA adapters from PEFT folders (adapter_config.json + adapter_model.safetensors), read and mapped onto our weights.

PEFT's update of a target module W (out × in) is y = W x + scale · B (A x), with A = lora_A [r, in], B = lora_B
[out, r] and scale = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora). We fuse projections (q, k, v into one
`qkv` matmul, gate and up into `gate_up`; Qwen 3.5 splits q_proj's [q | gate] rows and reorders partial-RoPE dims),
so each module's update becomes a *segment* of one of our matmuls: the columns it writes and the rows of B that
feed them, in our order. The scale is folded into B here (one multiply per weight at load, none per token).

    read_adapter(folder)                 → LoraAdapter (modules per layer, A and B as float32, scale folded)
    adapter_segments(adapter, config)    → per layer, per matmul ("qkv", "o", "gate_up", "down", "attn_gate"):
                                           [Segment(col0, a [r, in], b [cols, r])], checked against the model
    merged_deltas(adapter, config)       → {HF tensor name: B·A}: the adapter merged into the weights at load

Everything wrong is an `AdapterError` naming the file, tensor, module, shape or option: a missing file, a PEFT option
we do not implement (DoRA, trained biases, modules_to_save, per-module rank or alpha patterns), a module we have no
matmul for (embeddings, LM head, Gemma 4's per-layer input projections), a layer past the model's, shapes that
differ from the base model's.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import AdapterError, ModelFormatError
from doppler_py.model.config import ModelConfig
from doppler_py.model.safetensors_file import load_array, read_header
from doppler_py.ops.lora import Segment
from doppler_py.ops.rope import partial_rotary_order

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
# PEFT saves tensors as "<prefix>.layers.<i>.<block>.<module>.lora_<A|B>.weight" (the prefix differs by model class).
_TENSOR_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.(self_attn|mlp|linear_attn)\.(\w+)\.lora_([AB])\.weight$")
# Options whose non-default values change the update in ways we do not run.
_REFUSED = {
    "use_dora": (False, None),
    "bias": ("none", None),
    "lora_bias": (False, None),
    "modules_to_save": (None, [], ()),
    "rank_pattern": ({}, None),
    "alpha_pattern": ({}, None),
    "fan_in_fan_out": (False, None),
    "layer_replication": (None, []),
}


@dataclass(frozen=True)
class ModuleUpdate:
    """One module's low-rank update, scale folded into b: y += b @ (a @ x)."""

    a: np.ndarray  # float32 [r, in]
    b: np.ndarray  # float32 [out, r], times the adapter's scale


@dataclass(frozen=True)
class LoraAdapter:
    """A PEFT LoRA adapter as read from its folder: modules keyed "block.module" (e.g. "self_attn.q_proj") per layer."""

    path: Path
    rank: int
    alpha: float
    scale: float
    layers: dict[int, dict[str, ModuleUpdate]]

    @property
    def modules(self) -> list[str]:
        return sorted({name for modules in self.layers.values() for name in modules})


def read_adapter(folder: str | Path) -> LoraAdapter:
    """Read a PEFT LoRA folder; the update's options are checked here, its shapes against a model by
    `adapter_segments`."""
    folder = Path(folder)
    config_path, weights_path = folder / CONFIG_FILE, folder / WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise AdapterError(f"{path}: no such file (a PEFT LoRA folder holds {CONFIG_FILE} and {WEIGHTS_FILE})")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{config_path}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_path}: expected a JSON object, got {type(config).__name__}")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"{config_path}: peft_type {peft_type!r} is not a LoRA adapter")
    for option, accepted in _REFUSED.items():
        if config.get(option) not in accepted:
            raise AdapterError(
                f"{config_path}: {option}={config[option]!r} is not supported (only plain LoRA: "
                f"{', '.join(f'{k}={v[0]!r}' for k, v in _REFUSED.items())})"
            )
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise AdapterError(f"{config_path}: r must be a whole number >= 1, got {rank!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise AdapterError(f"{config_path}: lora_alpha must be a finite number, got {alpha!r}")
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        infos, _ = read_header(weights_path)
    except ModelFormatError as exc:
        raise AdapterError(str(exc), advice="") from exc
    pairs: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, info in infos.items():
        match = _TENSOR_RE.search(name)
        if match is None:
            raise AdapterError(
                f"{weights_path}: tensor {name!r} is not a LoRA A/B weight of a layer's attention or MLP module "
                "(embedding and LM-head adapters are not supported)"
            )
        layer, block, module, which = int(match[1]), match[2], match[3], match[4]
        array = np.asarray(load_array(info), dtype=np.float32)
        if array.ndim != 2 or array.shape[0 if which == "A" else 1] != rank:
            raise AdapterError(f"{weights_path}: {name} has shape {tuple(array.shape)}, expected rank r={rank}")
        pairs.setdefault((layer, f"{block}.{module}"), {})[which] = array
    layers: dict[int, dict[str, ModuleUpdate]] = {}
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "lora_B" if "A" in pair else "lora_A"
            raise AdapterError(f"{weights_path}: layer {layer} {module} has no {missing} weight")
        b = (pair["B"] * np.float32(scale)).astype(np.float32)
        layers.setdefault(layer, {})[module] = ModuleUpdate(np.ascontiguousarray(pair["A"]), b)
    if not layers:
        raise AdapterError(f"{weights_path}: no LoRA weights in the file")
    return LoraAdapter(folder, rank, float(alpha), float(scale), layers)


def _targets(config: ModelConfig, layer: int) -> dict[str, tuple[int, list[tuple[str, int, np.ndarray]]]]:
    """Each module this layer has, as (its input width, [(our matmul, first column, rows of its B in column order)])."""
    h, hd = config.hidden_size, config.layer_head_dim(layer)
    ffn = config.layer_intermediate_size(layer)
    heads, kv_heads = config.num_attention_heads, config.layer_num_kv_heads(layer)
    q, kv = heads * hd, kv_heads * hd
    mlp = {
        "mlp.gate_proj": (h, [("gate_up", 0, np.arange(ffn))]),
        "mlp.up_proj": (h, [("gate_up", ffn, np.arange(ffn))]),
        "mlp.down_proj": (ffn, [("down", 0, np.arange(h))]),
    }
    shape = config.linear_attention
    if config.is_linear(layer) and shape is not None:  # Qwen 3.5's Gated DeltaNet: in_proj = [qkv; z; b; a] rows
        widths = [("qkv", shape.channels), ("z", shape.value_width), ("b", shape.value_heads), ("a", shape.value_heads)]
        starts = np.cumsum([0] + [w for _, w in widths])
        linear = {
            f"linear_attn.in_proj_{x}": (h, [("qkv", int(start), np.arange(w))])
            for (x, w), start in zip(widths, starts, strict=False)
        }
        return linear | {"linear_attn.out_proj": (shape.value_width, [("o", 0, np.arange(h))])} | mlp
    order = np.arange(hd) if config.rotary_dim is None else partial_rotary_order(hd, config.rotary_dim)
    if config.attention_gate:  # Qwen 3.5 attention: q_proj holds [q | gate] per head, as the loader splits it
        q_rows = (np.arange(heads)[:, None] * 2 * hd + order[None, :]).reshape(-1)
        gate_rows = (np.arange(heads)[:, None] * 2 * hd + hd + np.arange(hd)[None, :]).reshape(-1)
        q_parts = [("qkv", 0, q_rows), ("attn_gate", 0, gate_rows)]
        k_rows = (np.arange(kv_heads)[:, None] * hd + order[None, :]).reshape(-1)
    else:
        q_parts, k_rows = [("qkv", 0, np.arange(q))], np.arange(kv)
    attention = {"self_attn.q_proj": (h, q_parts), "self_attn.o_proj": (q, [("o", 0, np.arange(h))])}
    if config.kv_source(layer) == layer:  # Gemma 4's KV-shared layers compute no K/V: their k/v updates do nothing
        attention["self_attn.k_proj"] = (h, [("qkv", q, k_rows)])
        attention["self_attn.v_proj"] = (h, [("qkv", q + kv, np.arange(kv))])
    return attention | mlp


def adapter_segments(adapter: LoraAdapter, config: ModelConfig) -> dict[int, dict[str, list[Segment]]]:
    """The adapter's updates as segments of our matmuls, per layer and matmul name, checked against `config`."""
    layers = config.num_hidden_layers
    out: dict[int, dict[str, list[Segment]]] = {}
    for layer, modules in adapter.layers.items():
        if layer >= layers:
            raise AdapterError(
                f"{adapter.path}: the adapter has weights for layer {layer}, the model has {layers} layers "
                "(an adapter for another base model?)"
            )
        targets = _targets(config, layer)
        for module, update in modules.items():
            if module not in targets:
                if config.kv_source(layer) != layer and module in ("self_attn.k_proj", "self_attn.v_proj"):
                    continue  # a KV-shared layer's k/v projections do not run (in transformers either)
                raise AdapterError(
                    f"{adapter.path}: layer {layer} has no module {module} this engine can adapt "
                    f"(it adapts {', '.join(sorted(targets))})"
                )
            width, parts = targets[module]
            rows = sum(len(r) for _, _, r in parts)
            if update.a.shape[1] != width or update.b.shape[0] != rows:
                raise AdapterError(
                    f"{adapter.path}: layer {layer} {module}: lora_A {tuple(update.a.shape)} and lora_B "
                    f"{tuple(update.b.shape)} do not fit the base model's {rows} x {width} weight "
                    "(an adapter for another base model?)"
                )
            for matmul, col0, picked in parts:
                segment = Segment(col0, update.a, np.ascontiguousarray(update.b[picked]))
                out.setdefault(layer, {}).setdefault(matmul, []).append(segment)
    for matmuls in out.values():
        for segments in matmuls.values():
            segments.sort(key=lambda s: s.col0)
    return out


def merged_deltas(adapter: LoraAdapter, config: ModelConfig) -> dict[str, np.ndarray]:
    """The adapter as additions to the base tensors, B·A (scale folded in) by HF tensor name, for `load_weights`'s
    `deltas` (merged: every token pays nothing more, and every generation gets the adapter); checked against
    `config` first."""
    adapter_segments(adapter, config)
    return {
        f"model.layers.{layer}.{module}.weight": update.b @ update.a
        for layer, modules in adapter.layers.items()
        for module, update in modules.items()
    }
