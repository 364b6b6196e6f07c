"""HF-style model folder → weights on the GPU, in the precision the caller asks for.

Tensors are read one at a time from memory-mapped safetensors and uploaded straight away, so host memory
holds at most one tensor (plus one fused pair) beyond the page cache. Q/K/V projections and gate/up
projections are fused along the output dimension so a layer runs one matmul for each pair.

Gemma 4 layers load by `_gemma4_layer`: their shapes vary by layer, KV-shared layers have only a q projection,
and the per-layer inputs add a gate, a projection and a norm to every layer and three tensors to the model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import ModelFormatError, UnsupportedModelError
from doppler_py.gpu.device import Gpu
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import BLOCK, BLOCK_BYTES, Weight, dequantize_blocks
from doppler_py.model.config import ModelConfig
from doppler_py.model.safetensors_file import TensorInfo, index_folder, load_array
from doppler_py.ops.rope import partial_rotary_order

WEIGHT_FORMATS = ("f32", "f16", "q8_0", "q4_0", "q4_1", "keep")
BLOCK_FORMATS = ("q4_0", "q4_1", "q8_0")
# Stored dtypes a dense weight may have; anything else (integers, raw bytes without block metadata) is not a
# weight, and converting it to float would load garbage without a word.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")


@dataclass
class LinearMixerWeights:
    """A Gated DeltaNet layer's weights besides its input and output projections (LayerWeights.qkv and .o)."""

    conv: Tensor  # [channels, taps]: the depthwise causal convolution over the [q | k | v] channels
    gates: Tensor  # [-exp(A_log) (n_v) | dt_bias (n_v) | the gated RMSNorm's weight (value_dim)]


@dataclass
class LayerWeights:
    """One layer's weights. RMSNorm weights already include the config's norm_offset (Gemma's 1 + w).

    A linear-attention layer (Qwen 3.5) keeps its input projection in `qkv` ([q; k; v; z; b; a] rows, the
    LinearAttention.mix_width of them) and its output projection in `o`; `linear` holds the rest."""

    attn_norm: Tensor
    qkv: Weight  # [q; k; v] rows: (n_heads + 2 n_kv_heads) * head_dim
    qkv_bias: Tensor | None
    o: Weight
    o_bias: Tensor | None
    mlp_norm: Tensor  # before the MLP (LLaMA post_attention_layernorm, Gemma pre_feedforward_layernorm)
    gate_up: Weight  # [gate; up] rows: 2 * intermediate_size
    down: Weight
    qk_norm: Tensor | None = None  # [q_norm; k_norm]: 2 * head_dim (Qwen3, Gemma 3)
    post_attn_norm: Tensor | None = None  # on the attention output (Gemma post_attention_layernorm)
    post_mlp_norm: Tensor | None = None  # on the MLP output (Gemma post_feedforward_layernorm)
    attn_gate: Weight | None = None  # Qwen 3.5: the attention output is multiplied by sigmoid(x·Wgate)
    linear: LinearMixerWeights | None = None  # Qwen 3.5's Gated DeltaNet layers
    # Gemma 4's per-layer input: x += rmsnorm(per_layer_proj(act(per_layer_gate(x)) * the layer's input))
    per_layer_gate: Weight | None = None  # [P, H]
    per_layer_proj: Weight | None = None  # [H, P]
    per_layer_norm: Tensor | None = None  # post_per_layer_input_norm [H]
    layer_scalar: float = 1.0  # Gemma 4: the layer's output (the residual stream) is multiplied by it

    def matrices(self) -> list[Weight]:
        optional = (self.attn_gate, self.per_layer_gate, self.per_layer_proj)
        return [self.qkv, self.o, self.gate_up, self.down, *(w for w in optional if w is not None)]

    def vectors(self) -> list[Tensor]:
        linear = [self.linear.conv, self.linear.gates] if self.linear else []
        return [
            t
            for t in (
                self.attn_norm,
                self.mlp_norm,
                self.qkv_bias,
                self.o_bias,
                self.qk_norm,
                self.post_attn_norm,
                self.post_mlp_norm,
                self.per_layer_norm,
                *linear,
            )
            if t is not None
        ]


@dataclass
class ModelWeights:
    config: ModelConfig
    embed: Weight
    layers: list[LayerWeights]
    norm: Tensor
    lm_head: Weight  # the embedding's Weight when tied
    precision: str
    # Gemma 4's per-layer inputs: (rmsnorm(x0·Wp^T / sqrt(H)) + E_ple[ids]·sqrt(P)) / sqrt(2), P per layer
    per_layer_embed: Weight | None = None  # embed_tokens_per_layer [vocab_size_per_layer_input, L * P]
    per_layer_projection: Weight | None = None  # per_layer_model_projection [L * P, H]
    per_layer_projection_norm: Tensor | None = None  # [P], times 1 / sqrt(2) (the sum's scale, folded in)

    def _model_matrices(self) -> list[Weight]:
        return [w for w in (self.embed, self.lm_head, self.per_layer_embed, self.per_layer_projection) if w is not None]

    @property
    def nbytes(self) -> int:
        seen: dict[int, int] = {}
        for w in [*self._model_matrices(), *(x for layer in self.layers for x in layer.matrices())]:
            seen[id(w)] = w.nbytes
        small = [self.norm] + [t for layer in self.layers for t in layer.vectors()]
        if self.per_layer_projection_norm is not None:
            small.append(self.per_layer_projection_norm)
        return sum(seen.values()) + sum(t.nbytes for t in small)

    def destroy(self) -> None:
        for w in {id(w): w for w in self._model_matrices()}.values():
            w.destroy()
        for layer in self.layers:
            for w in layer.matrices():
                w.destroy()
            for t in layer.vectors():
                t.destroy()
        self.norm.destroy()
        if self.per_layer_projection_norm is not None:
            self.per_layer_projection_norm.destroy()


class _Reader:
    """Looks up tensors by HF name and checks their shapes against the config."""

    def __init__(self, folder: Path, prefix: str = "model.", deltas: Mapping[str, np.ndarray] | None = None):
        self.folder = folder
        self.tensors = index_folder(folder)
        self.deltas = deltas or {}  # by HF name: added to the tensor as it is read (a merged LoRA update)
        # Where the text model's "model." tensors live (ModelConfig.weights_prefix); a folder saved from the bare
        # model (sentence-transformers' Qwen3-Embedding: "embed_tokens.weight", "layers.0...") has no prefix.
        if (
            prefix == "model."
            and "model.embed_tokens.weight" not in self.tensors
            and "embed_tokens.weight" in self.tensors
        ):
            prefix = ""
        self.prefix = prefix

    def stored_name(self, name: str) -> str:
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name

    def info(self, name: str, shape: tuple[int, ...]) -> TensorInfo:
        name = self.stored_name(name)
        info = self.tensors.get(name)
        if info is None:
            raise ModelFormatError(f"{self.folder}: missing tensor {name} (expected shape {list(shape)})")
        if info.logical_shape != shape:
            raise ModelFormatError(
                f"{info.file}: tensor {name} has shape {list(info.logical_shape)}, expected {list(shape)}"
            )
        if info.quant is None and info.dtype not in FLOAT_DTYPES:
            raise ModelFormatError(
                f"{info.file}: tensor {name} has dtype {info.dtype}; weights must be {', '.join(FLOAT_DTYPES)} "
                "(or GGUF blocks listed in the 'doppler.quant' metadata)"
            )
        if info.quant is not None:
            self._check_blocks(info)
        return info

    @staticmethod
    def _check_blocks(info: TensorInfo) -> None:
        """Kept GGUF blocks: a known format, stored as the exact number of bytes its shape needs."""
        fmt, shape = info.quant["format"], info.logical_shape
        if fmt not in BLOCK_FORMATS:
            raise UnsupportedModelError(
                f"{info.file}: tensor {info.name} is stored in block format {fmt!r} "
                f"(supported: {', '.join(BLOCK_FORMATS)})"
            )
        if len(shape) != 2 or shape[1] % BLOCK:
            raise ModelFormatError(
                f"{info.file}: tensor {info.name} is stored as {fmt} blocks but its shape {list(shape)} is not a "
                f"matrix with rows of a multiple of {BLOCK} values"
            )
        expected = shape[0] * (shape[1] // BLOCK) * BLOCK_BYTES[fmt]
        if info.dtype != "U8" or math.prod(info.shape) != expected:
            raise ModelFormatError(
                f"{info.file}: tensor {info.name} ({fmt} blocks of shape {list(info.logical_shape)}) needs "
                f"{expected} U8 bytes, stored as {info.dtype}{list(info.shape)}"
            )

    def dense(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A tensor as float32 (dequantised when stored as GGUF blocks)."""
        info = self.info(name, shape)
        if info.quant:
            dense = dequantize_blocks(load_array(info), info.quant["format"], shape, name=name)
        else:
            dense = np.asarray(load_array(info), dtype=np.float32)
        delta = self.deltas.get(name)
        return dense if delta is None else dense + delta


def _matrix(gpu: Gpu, reader: _Reader, names: list[str], shapes: list[tuple[int, int]], precision: str) -> Weight:
    """Upload one weight matrix made of `names` stacked along the output dimension."""
    infos = [reader.info(n, s) for n, s in zip(names, shapes, strict=True)]
    label = names[0] if len(names) == 1 else "+".join(names)
    n_rows = sum(s[0] for s in shapes)
    k = shapes[0][1]
    formats = {i.quant["format"] if i.quant else None for i in infos}
    stored = formats.pop() if len(formats) == 1 else None
    # Tensors already in a block format keep it under "keep" and under any block precision: re-quantising
    # one block format into another would add a second rounding error (the default model's Q8_0 embedding
    # stays Q8_0 when the Q4_1 file is loaded as "q4_1").
    keeps_blocks = precision == "keep" or precision in BLOCK_FORMATS
    target = stored if keeps_blocks and stored in BLOCK_FORMATS else _dense_target(infos, precision)
    if stored is not None and stored == target and not any(n in reader.deltas for n in names):
        raw = np.concatenate([load_array(i) for i in infos]) if len(infos) > 1 else load_array(infos[0])
        return Weight.from_gguf_blocks(gpu, raw, target, (n_rows, k), name=label)
    dense = [reader.dense(n, s) for n, s in zip(names, shapes, strict=True)]
    matrix = np.concatenate(dense) if len(dense) > 1 else dense[0]
    return Weight.from_numpy(gpu, matrix, target, name=label)


def _dense_target(infos: list[TensorInfo], precision: str) -> str:
    """The format a dense matrix is uploaded in: `precision`, or under "keep" its stored float width."""
    if precision == "keep":
        return "f16" if all(i.dtype in ("F16", "BF16") for i in infos) else "f32"
    return precision


def _rearranged(
    gpu: Gpu, reader: _Reader, names: list[str], shapes: list[tuple[int, int]], rows: np.ndarray, precision: str
) -> Weight:
    """Like `_matrix` for a matrix whose rows are picked or reordered (`rows` indexes the stacked tensors' rows):
    always through float32, so GGUF blocks are dequantised and quantised again."""
    infos = [reader.info(n, s) for n, s in zip(names, shapes, strict=True)]
    dense = np.concatenate([reader.dense(n, s) for n, s in zip(names, shapes, strict=True)])
    return Weight.from_numpy(gpu, dense[rows], _dense_target(infos, precision), name="+".join(names))


def _qwen3_5_attention(
    gpu: Gpu, reader: _Reader, config: ModelConfig, prefix: str, precision: str
) -> tuple[Weight, Weight, Tensor]:
    """A Qwen 3.5 full-attention layer's [q; k; v] rows, its output gate's rows and [q_norm; k_norm].

    q_proj holds [q | gate] per head (2 * head_dim rows each): the q rows go into the fused projection, the gate
    rows into their own. Under partial RoPE the q and k dims (and their norm weights) are reordered as
    `partial_rotary_order` says."""
    h, hd = config.hidden_size, config.head_dim
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    order = np.arange(hd) if config.rotary_dim is None else partial_rotary_order(hd, config.rotary_dim)
    a = prefix + "self_attn."
    names = [a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]
    shapes = [(2 * heads * hd, h), (kv_heads * hd, h), (kv_heads * hd, h)]
    q_rows = (np.arange(heads)[:, None] * 2 * hd + order[None, :]).reshape(-1)
    k_rows = 2 * heads * hd + (np.arange(kv_heads)[:, None] * hd + order[None, :]).reshape(-1)
    v_rows = 2 * heads * hd + kv_heads * hd + np.arange(kv_heads * hd)
    qkv = _rearranged(gpu, reader, names, shapes, np.concatenate([q_rows, k_rows, v_rows]), precision)
    gate_rows = (np.arange(heads)[:, None] * 2 * hd + hd + np.arange(hd)[None, :]).reshape(-1)
    gate = _rearranged(gpu, reader, names[:1], shapes[:1], gate_rows, precision)
    norms = [reader.dense(a + f"{x}_norm.weight", (hd,))[order] + np.float32(config.norm_offset) for x in "qk"]
    qk_norm = Tensor.from_numpy(gpu, np.concatenate(norms).astype(np.float32), "f32", label=a + "q_norm+k_norm")
    return qkv, gate, qk_norm


def _linear_attention(
    gpu: Gpu, reader: _Reader, config: ModelConfig, prefix: str, precision: str
) -> tuple[Weight, Weight, LinearMixerWeights]:
    """A Gated DeltaNet layer's input projection ([q; k; v; z; b; a] rows), output projection and the rest."""
    shape, h = config.linear_attention, config.hidden_size
    assert shape is not None
    a = prefix + "linear_attn."
    names = [a + f"in_proj_{x}.weight" for x in ("qkv", "z", "b", "a")]
    shapes = [(shape.channels, h), (shape.value_width, h), (shape.value_heads, h), (shape.value_heads, h)]
    in_proj = _matrix(gpu, reader, names, shapes, precision)
    out = _matrix(gpu, reader, [a + "out_proj.weight"], [(h, shape.value_width)], precision)
    conv = reader.dense(a + "conv1d.weight", (shape.channels, 1, shape.conv_taps)).reshape(shape.channels, -1)
    # transformers: g = -A_log.float().exp() * softplus(...); the first factor is a constant of the layer.
    neg_a = -np.exp(reader.dense(a + "A_log", (shape.value_heads,)))
    gates = np.concatenate(
        [neg_a, reader.dense(a + "dt_bias", (shape.value_heads,)), reader.dense(a + "norm.weight", (shape.value_dim,))]
    )
    linear = LinearMixerWeights(
        conv=Tensor.from_numpy(gpu, np.ascontiguousarray(conv, dtype=np.float32), "f32", label=a + "conv1d"),
        gates=Tensor.from_numpy(gpu, gates.astype(np.float32), "f32", label=a + "gates"),
    )
    return in_proj, out, linear


def _vector(gpu: Gpu, reader: _Reader, name: str, size: int) -> Tensor:
    return Tensor.from_numpy(gpu, reader.dense(name, (size,)), "f32", label=name)


def _norm(gpu: Gpu, reader: _Reader, config: ModelConfig, names: list[str], size: int) -> Tensor:
    """RMSNorm weights `names` (each [size]) concatenated, with the config's norm_offset added in float32 as
    transformers does (Gemma: `1.0 + weight.float()`)."""
    parts = [reader.dense(n, (size,)) + np.float32(config.norm_offset) for n in names]
    return Tensor.from_numpy(gpu, np.concatenate(parts).astype(np.float32), "f32", label="+".join(names))


def load_weights(
    folder: str | Path,
    gpu: Gpu,
    precision: str = "f32",
    config: ModelConfig | None = None,
    num_layers: int | None = None,
    deltas: Mapping[str, np.ndarray] | None = None,
) -> ModelWeights:
    """Read `folder` (config.json + safetensors) and upload its weights in `precision`.

    precision: "f32", "f16", "q8_0", "q4_0", "q4_1" (dense tensors are quantised on load; tensors already in
    a GGUF block format keep their blocks), or "keep" (GGUF blocks stay as they are; dense tensors keep their
    float width). `num_layers` loads only the first layers (drafting
    by layer skip uses the full model instead; this is for tests and truncated drafts). `deltas`: float32 arrays
    added to the named tensors (HF names) before they are converted, e.g. a LoRA adapter merged in (`model.lora`);
    a tensor kept in GGUF blocks is then dequantised, changed and quantised again.
    """
    if precision not in WEIGHT_FORMATS:
        raise ModelFormatError(f"unknown weight precision {precision!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
    folder = Path(folder)
    config = config or ModelConfig.from_file(folder / "config.json")
    reader = _Reader(folder, config.weights_prefix, deltas)
    h, hd = config.hidden_size, config.head_dim
    q_rows, kv_rows, ffn = config.num_attention_heads * hd, config.num_key_value_heads * hd, config.intermediate_size
    embed = _matrix(gpu, reader, ["model.embed_tokens.weight"], [(config.vocab_size, h)], precision)
    layers = []
    for i in range(num_layers if num_layers is not None else config.num_hidden_layers):
        if config.model_type == "gemma4_text":
            layers.append(_gemma4_layer(gpu, reader, config, i, precision))
            continue
        p = f"model.layers.{i}."
        bias = None
        if config.attention_bias:
            bias_parts = [
                reader.dense(p + f"self_attn.{x}_proj.bias", (n,))
                for x, n in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))
            ]
            bias = Tensor.from_numpy(gpu, np.concatenate(bias_parts), "f32", label=p + "qkv_bias")
        a = p + "self_attn."
        attn_gate = linear = None
        if config.is_linear(i):
            qkv, o, linear = _linear_attention(gpu, reader, config, p, precision)
            qk_norm = None
        elif config.attention_gate:
            qkv, attn_gate, qk_norm = _qwen3_5_attention(gpu, reader, config, p, precision)
            o = _matrix(gpu, reader, [a + "o_proj.weight"], [(h, q_rows)], precision)
        else:
            qkv = _matrix(
                gpu,
                reader,
                [a + f"{x}_proj.weight" for x in "qkv"],
                [(q_rows, h), (kv_rows, h), (kv_rows, h)],
                precision,
            )
            o = _matrix(gpu, reader, [a + "o_proj.weight"], [(h, q_rows)], precision)
            qk_norm = (
                _norm(gpu, reader, config, [a + "q_norm.weight", a + "k_norm.weight"], hd) if config.qk_norm else None
            )
        if config.sandwich_norms:  # Gemma: post_attention_layernorm normalises the attention output
            mlp_norm = _norm(gpu, reader, config, [p + "pre_feedforward_layernorm.weight"], h)
            post_attn_norm = _norm(gpu, reader, config, [p + "post_attention_layernorm.weight"], h)
            post_mlp_norm = _norm(gpu, reader, config, [p + "post_feedforward_layernorm.weight"], h)
        else:
            mlp_norm = _norm(gpu, reader, config, [p + "post_attention_layernorm.weight"], h)
            post_attn_norm = post_mlp_norm = None
        layers.append(
            LayerWeights(
                attn_norm=_norm(gpu, reader, config, [p + "input_layernorm.weight"], h),
                qkv=qkv,
                qkv_bias=bias,
                o=o,
                o_bias=_vector(gpu, reader, p + "self_attn.o_proj.bias", h) if config.attention_out_bias else None,
                mlp_norm=mlp_norm,
                gate_up=_matrix(
                    gpu, reader, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(ffn, h), (ffn, h)], precision
                ),
                down=_matrix(gpu, reader, [p + "mlp.down_proj.weight"], [(h, ffn)], precision),
                qk_norm=qk_norm,
                post_attn_norm=post_attn_norm,
                post_mlp_norm=post_mlp_norm,
                attn_gate=attn_gate,
                linear=linear,
            )
        )
    norm = _norm(gpu, reader, config, ["model.norm.weight"], h)
    if config.tie_word_embeddings:
        lm_head = embed
    else:
        lm_head = _matrix(gpu, reader, ["lm_head.weight"], [(config.vocab_size, h)], precision)
    weights = ModelWeights(config, embed, layers, norm, lm_head, precision)
    if config.hidden_size_per_layer_input:
        per_layer, width = (
            config.hidden_size_per_layer_input,
            config.num_hidden_layers * config.hidden_size_per_layer_input,
        )
        weights.per_layer_embed = _matrix(
            gpu,
            reader,
            ["model.embed_tokens_per_layer.weight"],
            [(config.vocab_size_per_layer_input, width)],
            precision,
        )
        weights.per_layer_projection = _matrix(
            gpu, reader, ["model.per_layer_model_projection.weight"], [(width, h)], precision
        )
        norm_weight = reader.dense("model.per_layer_projection_norm.weight", (per_layer,)) * np.float32(2**-0.5)
        weights.per_layer_projection_norm = Tensor.from_numpy(gpu, norm_weight, "f32", "per_layer_projection_norm")
    return weights


def _gemma4_layer(gpu: Gpu, reader: _Reader, config: ModelConfig, i: int, precision: str) -> LayerWeights:
    """Layer i of a Gemma 4 text model. A KV-shared layer's qkv holds q only (its keys and values are its source
    layer's); a full layer of an attention_k_eq_v model has no v_proj and takes [q; k; k] (values are the raw
    keys). qk_norm is [q_norm; k_norm; ones] (the weightless v_norm), or q_norm alone on a KV-shared layer."""
    p, h = f"model.layers.{i}.", config.hidden_size
    hd, ffn, per_layer = config.layer_head_dim(i), config.layer_intermediate_size(i), config.hidden_size_per_layer_input
    q_rows, kv_rows = config.num_attention_heads * hd, config.layer_num_kv_heads(i) * hd
    a = p + "self_attn."
    if config.kv_source(i) != i:
        projections, shapes = [a + "q_proj.weight"], [(q_rows, h)]
        head_norms = [reader.dense(a + "q_norm.weight", (hd,))]
    else:
        values = "k" if config.attention_k_eq_v and config.layer_types[i] == "full_attention" else "v"
        projections = [a + f"{x}_proj.weight" for x in ("q", "k", values)]
        shapes = [(q_rows, h), (kv_rows, h), (kv_rows, h)]
        head_norms = [reader.dense(a + "q_norm.weight", (hd,)), reader.dense(a + "k_norm.weight", (hd,))]
        head_norms.append(np.ones(hd, np.float32))
    scalar_name = reader.stored_name(p + "layer_scalar")
    # transformers keeps a missing layer_scalar at its initial 1 (a buffer, not a weight it warns about)
    scalar = float(reader.dense(p + "layer_scalar", (1,))[0]) if scalar_name in reader.tensors else 1.0
    return LayerWeights(
        attn_norm=_norm(gpu, reader, config, [p + "input_layernorm.weight"], h),
        qkv=_matrix(gpu, reader, projections, shapes, precision),
        qkv_bias=None,
        o=_matrix(gpu, reader, [a + "o_proj.weight"], [(h, q_rows)], precision),
        o_bias=None,
        mlp_norm=_norm(gpu, reader, config, [p + "pre_feedforward_layernorm.weight"], h),
        gate_up=_matrix(
            gpu, reader, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"], [(ffn, h), (ffn, h)], precision
        ),
        down=_matrix(gpu, reader, [p + "mlp.down_proj.weight"], [(h, ffn)], precision),
        qk_norm=Tensor.from_numpy(gpu, np.concatenate(head_norms).astype(np.float32), "f32", a + "qkv_norm"),
        post_attn_norm=_norm(gpu, reader, config, [p + "post_attention_layernorm.weight"], h),
        post_mlp_norm=_norm(gpu, reader, config, [p + "post_feedforward_layernorm.weight"], h),
        per_layer_gate=_matrix(gpu, reader, [p + "per_layer_input_gate.weight"], [(per_layer, h)], precision)
        if per_layer
        else None,
        per_layer_proj=_matrix(gpu, reader, [p + "per_layer_projection.weight"], [(h, per_layer)], precision)
        if per_layer
        else None,
        per_layer_norm=_norm(gpu, reader, config, [p + "post_per_layer_input_norm.weight"], h) if per_layer else None,
        layer_scalar=scalar,
    )
