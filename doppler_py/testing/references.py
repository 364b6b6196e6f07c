"""numpy references of the model's math: what the kernels, the forward pass and `doppler-py selfcheck` are
held to.

Each function restates HF transformers' LLaMA formula on its own, without importing the engine's ops, so a
kernel and its reference cannot share a mistake. They compute in float64 by default; `dtype=np.float32` runs
the same formula as numpy's timed peer in the benchmarks. Shapes: T rows (tokens), H hidden size, hd head
dim, S cached positions, V vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from doppler_py.model.config import LinearAttention, ModelConfig

DType = type[np.floating]


# -- layers --------------------------------------------------------------------------------------------------
def rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float, *, dtype: DType = np.float64) -> np.ndarray:
    """HF LlamaRMSNorm over the last axis: weight * x / sqrt(mean(x^2) + eps); x [..., H], weight [H]."""
    x = np.asarray(x, dtype)
    return np.asarray(weight, dtype) * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def linear(
    x: np.ndarray,
    w: np.ndarray,
    bias: np.ndarray | None = None,
    *,
    norm: tuple[np.ndarray, float] | None = None,
    dtype: DType = np.float64,
) -> np.ndarray:
    """x [T, K] @ w [N, K].T (+ bias [N]) → [T, N]; `norm` = (weight [K], eps) RMS-normalises x first, as
    `Linear(norm=InputNorm(...))` does."""
    x = rmsnorm(x, *norm, dtype=dtype) if norm is not None else np.asarray(x, dtype)
    y = x @ np.asarray(w, dtype).T
    return y if bias is None else y + np.asarray(bias, dtype)


def gelu_tanh(x: np.ndarray, *, dtype: DType = np.float64) -> np.ndarray:
    """torch's gelu(approximate="tanh"): 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))."""
    x = np.asarray(x, dtype)
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu(x: np.ndarray, *, dtype: DType = np.float64) -> np.ndarray:
    """x * sigmoid(x), element-wise; exp(-x) overflowing to inf gives the right limit (-0)."""
    x = np.asarray(x, dtype)
    with np.errstate(over="ignore"):
        return x / (1 + np.exp(-x))


def swiglu(gate: np.ndarray, up: np.ndarray, *, dtype: DType = np.float64) -> np.ndarray:
    """silu(gate) * up, element-wise; gate and up [T, F] (the halves of the model's fused [gate | up] rows)."""
    return silu(gate, dtype=dtype) * np.asarray(up, dtype)


def _width(x: np.ndarray) -> int:
    """Elements per row (a -1 in reshape cannot be inferred from zero rows)."""
    return math.prod(np.shape(x)[1:])


# -- rotary embeddings ---------------------------------------------------------------------------------------
def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping | None = None) -> np.ndarray:
    """HF's inverse frequencies [hd // 2] in float64, element by element as its docstrings describe them:
    1 / theta^(2i / hd), then `scaling` (a config.json rope_scaling: "linear", "llama3" or "proportional")
    applied."""
    inv_freq = [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]
    rope_type = "default" if scaling is None else scaling.get("rope_type", scaling.get("type"))
    if rope_type == "default":
        return np.array(inv_freq)
    factor = scaling["factor"]
    if rope_type == "linear":
        return np.array(inv_freq) / factor
    if rope_type == "proportional":  # Gemma 4: pairs past partial_rotary_factor of them do not rotate
        rotated = int(scaling["partial_rotary_factor"] * head_dim // 2)
        return np.array([f if i < rotated else 0.0 for i, f in enumerate(inv_freq)]) / factor
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    scaled = []
    for f in inv_freq:
        wavelen = 2 * math.pi / f
        if wavelen < old_context / high:  # high frequency: kept
            scaled.append(f)
        elif wavelen > old_context / low:  # low frequency: interpolated by the full factor
            scaled.append(f / factor)
        else:  # in between: a smooth blend of the two
            smooth = (old_context / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return np.array(scaled)


def rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray, *, dtype: DType = np.float64) -> np.ndarray:
    """HF apply_rotary_pos_emb ("rotate half"): x * cat(cos, cos) + rotate_half(x) * cat(sin, sin).

    x [T, heads, hd] or [T, heads * hd]; cos, sin [T, hd // 2], the angles of each row's position. Returns the
    rotated heads shaped like x.
    """
    half = cos.shape[-1]
    heads = np.asarray(x, dtype).reshape(len(x), _width(x) // (2 * half), 2 * half)
    c, s = np.asarray(cos, dtype)[:, None, :], np.asarray(sin, dtype)[:, None, :]
    x1, x2 = heads[..., :half], heads[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).reshape(np.shape(x))


# -- attention and softmax -----------------------------------------------------------------------------------
def _shifted_logits(logits: np.ndarray, temperature: float, dtype: DType) -> tuple[np.ndarray, np.ndarray]:
    """(scaled logits minus their row max, which rows have no finite logit). The division rounds in the
    logits' own precision: float32 logits are scaled in float32, as the kernels (and the JS original) do."""
    scaled = (np.asarray(logits) / np.float32(temperature)).astype(dtype)
    top = scaled.max(axis=-1, keepdims=True)
    empty = np.isneginf(top)
    return scaled - np.where(empty, 0, top), empty


def softmax(logits: np.ndarray, temperature: float = 1.0, *, dtype: DType = np.float64) -> np.ndarray:
    """softmax(logits / temperature) over the last axis, any leading shape. A -inf logit gets probability 0;
    a row of only -inf has no distribution and comes out all zeros (a sampler sees zero mass)."""
    shifted, empty = _shifted_logits(logits, temperature, dtype)
    e = np.exp(shifted)
    with np.errstate(invalid="ignore"):
        return np.where(empty, 0, e / e.sum(axis=-1, keepdims=True))


def log_softmax(logits: np.ndarray, temperature: float = 1.0, *, dtype: DType = np.float64) -> np.ndarray:
    """log of `softmax`: -inf where the probability is 0, and over the whole of a row of only -inf."""
    shifted, empty = _shifted_logits(logits, temperature, dtype)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(empty, -np.inf, shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start_pos: int,
    *,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
    bidirectional: bool = False,
    key_end: int | None = None,
    dtype: DType = np.float64,
) -> np.ndarray:
    """Causal (or bidirectional) GQA softmax attention over a KV cache.

    q [T, n_heads, hd] or [T, n_heads * hd] holds the queries of positions start_pos .. start_pos + T - 1;
    k, v [S, n_kv_heads, hd] with S >= start_pos + T (later positions are never read). Query head h reads KV
    head h // (n_heads / n_kv_heads); scores are q.k * scale (default 1 / sqrt(hd)); row t at position
    p = start_pos + t sees positions <= p, and with `window` > 0 only those > p - window (HF's sliding window);
    `softcap` > 0 caps the scaled scores at softcap * tanh(score / softcap) (Gemma 2). `bidirectional`: every
    row sees all positions < start_pos + T, with `window` those less than `window` away either way (transformers'
    Gemma 3 with use_bidirectional_attention); `key_end` (bidirectional): all positions < key_end instead (an
    input longer than the call: its later rows' keys too). Returns [T, n_heads * hd].
    """
    rows, context = len(q), start_pos + len(q)
    if key_end is not None:
        if not bidirectional or key_end < context:
            raise ValueError(f"key_end={key_end}: a bidirectional call's keys end at or past {context}")
        context = key_end
    _, n_kv, head_dim = k.shape
    # Query heads sharing a KV head side by side: [n_kv, group, T, hd].
    qg = np.asarray(q, dtype).reshape(rows, n_kv, _width(q) // (n_kv * head_dim), head_dim).transpose(1, 2, 0, 3)
    keys = np.asarray(k[:context], dtype).transpose(1, 2, 0)[:, None]  # [n_kv, 1, hd, context]
    values = np.asarray(v[:context], dtype).transpose(1, 0, 2)[:, None]  # [n_kv, 1, context, hd]
    scores = qg @ keys / np.sqrt(dtype(head_dim)) if scale is None else qg @ keys * dtype(scale)
    if softcap:  # Gemma 2: HF caps the scaled scores before the mask
        scores = softcap * np.tanh(scores / softcap)
    key_pos, query_pos = np.arange(context)[None, :], start_pos + np.arange(rows)[:, None]
    if bidirectional:
        hidden = np.abs(key_pos - query_pos) >= window if window else np.zeros((rows, context), bool)
    else:
        hidden = key_pos > query_pos
        if window:
            hidden |= key_pos <= query_pos - window
    scores[..., hidden] = -np.inf
    out = softmax(scores, dtype=dtype) @ values  # [n_kv, group, T, hd]
    return out.transpose(2, 0, 1, 3).reshape(rows, _width(q))


def tree_attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start_pos: int,
    parents: Sequence[int],
    *,
    window: int = 0,
    scale: float | None = None,
    softcap: float = 0.0,
) -> np.ndarray:
    """Attention of a token tree's rows (row 0 the root, row i + 1 node i with parent row parents[i] + 1).

    Row r sits at position p = start_pos + depth(r) and sees the keys at positions j < start_pos (within the
    window: j > p - window) and those of its own ancestor rows and itself, whose keys are in k, v at slot
    start_pos + row (the same window test on their positions start_pos + depth). Returns [rows, n_heads * hd].
    """
    depths = [0]
    ancestors: list[set[int]] = [{0}]
    for i, parent in enumerate(parents):
        depths.append(depths[parent + 1] + 1)
        ancestors.append(ancestors[parent + 1] | {i + 1})
    out = []
    for row in range(len(parents) + 1):
        p = start_pos + depths[row]
        lowest = p - window + 1 if window else 0
        seen = [j for j in range(max(0, lowest), start_pos)]
        seen += [start_pos + a for a in sorted(ancestors[row]) if start_pos + depths[a] >= lowest]
        out.append(attention(q[row : row + 1], k[seen], v[seen], len(seen) - 1, scale=scale, softcap=softcap))
    return np.concatenate(out)


# -- the whole model -----------------------------------------------------------------------------------------
# -- Gated DeltaNet (Qwen 3.5's linear attention) --------------------------------------------------------------
def gated_delta_net(
    shape: LinearAttention,
    mix: np.ndarray,
    conv_w: np.ndarray,
    gates: np.ndarray,
    *,
    conv_state: np.ndarray | None = None,
    state: np.ndarray | None = None,
    parents: Sequence[int] | None = None,
    eps: float = 1e-6,
) -> tuple[np.ndarray, np.ndarray]:
    """transformers' causal_conv1d_update and torch_recurrent_gated_delta_rule with its gated RMSNorm, in float64,
    over a forward's rows: (out [T, n_v * dv], the state after each row [T, n_v, dk, dv]).

    mix [T, mix_width]: the input projection's rows [q | k | v | z | b | a]; conv_w [channels, taps]; gates
    [-exp(A_log) (n_v) | dt_bias (n_v) | norm weight (dv)]; conv_state [taps - 1, channels] (oldest first) and
    state [n_v, dk, dv] before the first row (zeros: a sequence's start). `parents`: the rows are a token tree
    whose node i (row i + 1) hangs under row parents[i] + 1, each row seeing its ancestors instead of the rows
    before it."""
    rows, nk, nv, dk, dv = len(mix), shape.key_heads, shape.value_heads, shape.key_dim, shape.value_dim
    channels, width, group = shape.channels, shape.value_width, shape.value_heads // shape.key_heads
    mix = np.asarray(mix, np.float64)
    if conv_state is None:
        conv_state = np.zeros((shape.conv_taps - 1, channels))
    if state is None:
        state = np.zeros((nv, dk, dv))
    ancestors = [list(range(r)) for r in range(rows)]
    if parents is not None:
        ancestors = [[]]
        for parent in parents:
            ancestors.append([*ancestors[parent + 1], parent + 1])
    convolved = np.zeros((rows, channels))
    for r in range(rows):
        window = np.concatenate([conv_state, mix[ancestors[r] + [r], :channels]])[-shape.conv_taps :]
        convolved[r] = silu((np.asarray(conv_w, np.float64) * window.T).sum(1))
    q = convolved[:, : nk * dk].reshape(rows, nk, dk)
    k = convolved[:, nk * dk : 2 * nk * dk].reshape(rows, nk, dk)
    v = convolved[:, 2 * nk * dk :].reshape(rows, nv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    z = mix[:, channels : channels + width].reshape(rows, nv, dv)
    b, a = mix[:, channels + width : channels + width + nv], mix[:, channels + width + nv :]
    neg_a, dt_bias, norm_w = (np.asarray(g, np.float64) for g in (gates[:nv], gates[nv : 2 * nv], gates[2 * nv :]))
    decay = np.exp(neg_a * np.log1p(np.exp(a + dt_bias)))
    beta = 1.0 / (1.0 + np.exp(-b))
    out, states = np.zeros((rows, width)), np.zeros((rows, nv, dk, dv))
    for r in range(rows):
        s = np.array(state, np.float64)
        for j in [*ancestors[r], r]:
            for h in range(nv):
                kj = k[j, h // group]
                s[h] *= decay[j, h]
                s[h] += np.outer(kj, (v[j, h] - kj @ s[h]) * beta[j, h])
        states[r] = s
        for h in range(nv):
            o = q[r, h // group] @ s[h]
            out[r, h * dv : (h + 1) * dv] = rmsnorm(o, norm_w, eps) * silu(z[r, h])
    return out, states


def load_tensors(folder: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a HF folder's *.safetensors files (one file, or the shards of an index)."""
    from safetensors.numpy import load_file

    tensors: dict[str, np.ndarray] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(str(path)))
    return tensors


def forward_stages(
    model: str | Path | Mapping[str, np.ndarray], config: ModelConfig, ids: Sequence[int]
) -> dict[str, np.ndarray]:
    """The forward pass over `ids` at positions 0..T-1 in float64, as llama2.c writes it, returning the last
    layer's intermediates beside the logits:

        q_proj [T, n_heads * hd]: q before RoPE (after q_norm where the model has one)
        q [T, n_heads * hd] and k [T, n_kv_heads, hd] after RoPE, v [T, n_kv_heads, hd]
        attention [T, n_heads * hd]   gate_up [T, 2F] ([gate | up])   mlp [T, F] = act(gate) * up
        hidden [T, H] (the residual stream before the final norm)   logits [T, V]

    `model` is a HF folder or its tensors by HF name (float32 or float64; GGUF block formats are not read).
    Qwen3 and Gemma 3 follow their HF modeling files: q/k heads RMS-normalised before RoPE; Gemma's (1 + w)
    norms, embeddings times sqrt(H), attention and MLP outputs normalised before the residual add, GELU
    (tanh) gating, per-layer sliding windows and RoPE bases; Gemma 2's soft-capped scores and logits. Gemma 4
    (Gemma4TextModel): head dims per layer, v heads normalised too (no weight), values = raw keys on full layers
    of attention_k_eq_v models, KV-shared layers attending over their source layer's keys and values, per-layer
    inputs added after the MLP, each layer's output times its layer_scalar. Qwen 3.5 (Qwen3_5TextModel): its
    linear_attention layers are Gated DeltaNets (`gated_delta_net` from a zero state); its attention layers take
    [q | gate] per head from q_proj, rotate the first rotary_dim dims of q and k (rotate half within them) and
    multiply their output by sigmoid(gate).
    """
    w = load_tensors(model) if isinstance(model, str | Path) else model
    eps, n_heads = config.rms_norm_eps, config.num_attention_heads
    rows = len(ids)
    gemma = config.sandwich_norms

    def norm(name: str) -> tuple[np.ndarray, float]:
        return (np.asarray(w[name], np.float64) + config.norm_offset, eps)

    def rope_angles(layer: int) -> tuple[np.ndarray, np.ndarray]:
        theta, scaling = config.layer_rope(layer)
        inv_freq = rope_inv_freq(config.rotary_dim or config.layer_head_dim(layer), theta, scaling)
        angles = np.arange(rows)[:, None] * inv_freq[None, :]
        return np.cos(angles), np.sin(angles)

    act = gelu_tanh if config.hidden_act == "gelu_pytorch_tanh" else silu
    x = np.asarray(w["model.embed_tokens.weight"], np.float64)[list(ids)] * config.embed_scale  # [T, H]
    per_layer = config.hidden_size_per_layer_input
    if per_layer:  # Gemma 4's per-layer inputs [T, L, P]
        projected = linear(x, w["model.per_layer_model_projection.weight"]) / math.sqrt(config.hidden_size)
        projected = rmsnorm(projected.reshape(rows, -1, per_layer), *norm("model.per_layer_projection_norm.weight"))
        token = np.asarray(w["model.embed_tokens_per_layer.weight"], np.float64)[list(ids)] * math.sqrt(per_layer)
        per_layer_inputs = (projected + token.reshape(projected.shape)) / math.sqrt(2)
    stages: dict[str, np.ndarray] = {}
    attended: dict[str, np.ndarray] = {}  # the last attention layer's stages
    kv: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # each layer's rotated keys and values
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        hd, n_kv = config.layer_head_dim(i), config.layer_num_kv_heads(i)
        cos, sin = rope_angles(i)
        attn_norm = norm(p + "input_layernorm.weight")
        if config.is_linear(i):
            x = x + _gated_delta_net_layer(w, config, p, x, attn_norm)
        else:
            q = linear(x, w[p + "self_attn.q_proj.weight"], w.get(p + "self_attn.q_proj.bias"), norm=attn_norm)
            q = q.reshape(rows, n_heads, -1)
            q, out_gate = q[..., :hd], q[..., hd:]  # q_proj holds an output gate only in Qwen 3.5
            if config.qk_norm:
                q = rmsnorm(q, *norm(p + "self_attn.q_norm.weight"))
            q_proj = q.reshape(rows, n_heads * hd)
            q = _rope_part(q, cos, sin).reshape(rows, n_heads * hd)
            if config.kv_source(i) == i:
                k_eq_v = config.attention_k_eq_v and config.layer_types[i] == "full_attention"
                k, v = (
                    linear(
                        x, w[p + f"self_attn.{n}_proj.weight"], w.get(p + f"self_attn.{n}_proj.bias"), norm=attn_norm
                    )
                    for n in ("k", "k" if k_eq_v else "v")
                )
                k, v = k.reshape(rows, n_kv, hd), v.reshape(rows, n_kv, hd)
                if config.qk_norm:
                    k = rmsnorm(k, *norm(p + "self_attn.k_norm.weight"))
                if config.v_norm:
                    v = rmsnorm(v, np.ones(hd), eps)
                kv[i] = _rope_part(k, cos, sin), v
            k, v = kv[config.kv_source(i)]
            a = attention(
                q.reshape(rows, n_heads, hd),
                k,
                v,
                0,
                window=config.layer_window(i),
                scale=config.attention_scale,
                softcap=config.attn_logit_softcapping or 0.0,
            )
            if out_gate.size:
                a = a / (1 + np.exp(-out_gate.reshape(rows, n_heads * hd)))
            o = linear(a, w[p + "self_attn.o_proj.weight"], w.get(p + "self_attn.o_proj.bias"))
            x = x + (rmsnorm(o, *norm(p + "post_attention_layernorm.weight")) if gemma else o)
            attended = {"q_proj": q_proj, "q": q, "k": k, "v": v, "attention": a}
        mlp_norm = norm(p + ("pre_feedforward_layernorm.weight" if gemma else "post_attention_layernorm.weight"))
        gate = linear(x, w[p + "mlp.gate_proj.weight"], norm=mlp_norm)
        up = linear(x, w[p + "mlp.up_proj.weight"], norm=mlp_norm)
        h = act(gate) * up
        d = linear(h, w[p + "mlp.down_proj.weight"])
        x = x + (rmsnorm(d, *norm(p + "post_feedforward_layernorm.weight")) if gemma else d)
        if per_layer:
            gated = act(linear(x, w[p + "per_layer_input_gate.weight"])) * per_layer_inputs[:, i]
            y = linear(gated, w[p + "per_layer_projection.weight"])
            x = x + rmsnorm(y, *norm(p + "post_per_layer_input_norm.weight"))
        if p + "layer_scalar" in w:
            x = x * float(np.asarray(w[p + "layer_scalar"]).reshape(-1)[0])
        gate_up = np.concatenate([gate, up], axis=1)
        stages = {**attended, "gate_up": gate_up, "mlp": h}
    head = w["model.embed_tokens.weight"] if config.tie_word_embeddings else w["lm_head.weight"]
    logits = linear(x, head, norm=norm("model.norm.weight"))
    if config.final_logit_softcapping:
        logits = config.final_logit_softcapping * np.tanh(logits / config.final_logit_softcapping)
    return {**stages, "hidden": x, "logits": logits}


def _rope_part(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """`rope` over the first 2 * cos.shape[-1] dims of each head [T, heads, hd] (Qwen 3.5's partial RoPE: rotate
    half within them), the other dims as they are."""
    rotated = 2 * cos.shape[-1]
    return np.concatenate([rope(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)


def _gated_delta_net_layer(
    w: Mapping[str, np.ndarray], config: ModelConfig, prefix: str, x: np.ndarray, attn_norm: tuple[np.ndarray, float]
) -> np.ndarray:
    """A Qwen 3.5 linear_attention layer's output [T, H] (before the residual add), from a sequence's start."""
    shape = config.linear_attention
    assert shape is not None
    a = prefix + "linear_attn."
    mix = linear(x, np.concatenate([w[a + f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a")]), norm=attn_norm)
    conv = np.asarray(w[a + "conv1d.weight"], np.float64).reshape(shape.channels, -1)
    gates = np.concatenate([-np.exp(np.asarray(w[a + "A_log"], np.float64)), w[a + "dt_bias"], w[a + "norm.weight"]])
    out, _ = gated_delta_net(shape, mix, conv, gates, eps=config.rms_norm_eps)
    return linear(out, w[a + "out_proj.weight"])


def forward_reference(
    model: str | Path | Mapping[str, np.ndarray], config: ModelConfig, ids: Sequence[int]
) -> np.ndarray:
    """Logits [T, V] in float64 of the model (a HF folder or its tensors) over `ids` at positions 0..T-1."""
    return forward_stages(model, config, ids)["logits"]
