"""Tiny random LLaMA-family models written as HF folders (config.json + model.safetensors), numpy only.

HF transformers loads these folders as they are, so the same files drive our engine and the reference.
A character-level tokenizer (tokenizer.json + tokenizer_config.json with a ChatML template) is written too
when the vocabulary has room for it, so the CLI and the server can run on these models end to end.
Weights are drawn with a larger spread than HF's init (std 0.02 would make every logit nearly equal and
greedy decoding a coin toss between near-ties).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gemma4" or "qwen3_5"
    vocab_size: int = 128  # room for the character tokenizer (99 tokens)
    hidden_size: int = 64
    intermediate_size: int = 160
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    tie_word_embeddings: bool = True
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 256
    rms_norm_eps: float = 1e-5
    weight_std: float = 0.15
    seed: int = 0
    # The embedding's spread (None: weight_std). Gemma multiplies embeddings by sqrt(hidden): at weight_std its
    # tied head would score each token's own embedding far above the rest and repeat the last token forever.
    embed_std: float | None = None
    explicit_head_dim: int | None = None  # written as config.json's head_dim (Qwen3, Gemma 3 always write one)
    # Keys a sliding layer's query sees. Which layers slide: Mistral all; Qwen2 / Qwen3 (use_sliding_window)
    # all but the first (max_window_layers = 1); Gemma as `layer_pattern` cycles (window None: HF's 4096).
    sliding_window: int | None = None
    layer_pattern: tuple[str, ...] = ("sliding_attention", "full_attention")
    query_pre_attn_scalar: int = 24
    rope_local_base_freq: float = 10000.0
    # Gemma 2's score and final-logit soft-capping (written for gemma2 only)
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Gemma 4 (written for gemma4 only; partial_rotary_factor for qwen3_5 too): full layers' head_dim and partial
    # RoPE, the last layers reading earlier layers' K/V (with double-wide MLPs), per-layer inputs of this width
    # (0: none), values = keys on full layers (which then have num_global_key_value_heads KV heads when it is set)
    global_head_dim: int | None = None
    partial_rotary_factor: float = 0.25
    num_kv_shared_layers: int = 0
    use_double_wide_mlp: bool = False
    hidden_size_per_layer_input: int = 0
    attention_k_eq_v: bool = False
    num_global_key_value_heads: int | None = None
    # Qwen 3.5: which layers are Gated DeltaNet ("linear_attention") layers and their shape (partial RoPE: as above).
    hybrid_pattern: tuple[str, ...] = ("linear_attention", "full_attention", "linear_attention")
    linear_heads: tuple[int, int] = (2, 4)  # key heads, value heads
    linear_dims: tuple[int, int] = (16, 16)  # key head dim, value head dim
    conv_taps: int = 4

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.hidden_size // self.num_attention_heads


def draft_spec(vocab_size: int, seed: int, *, tie_word_embeddings: bool = True) -> TinySpec:
    """A weaker model to draft for a tiny target: one layer, hidden 32 (2 query heads over 1 KV head), FFN 64.

    `vocab_size` above or below the target's makes a padded- or narrow-vocabulary pair; `seed` gives each draft
    its own weights.
    """
    return TinySpec(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=tie_word_embeddings,
        weight_std=0.25,
        seed=seed,
    )


_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
    "qwen3_5": ("Qwen3_5ForCausalLM", "qwen3_5_text"),
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text"),
}
GEMMA = ("gemma2", "gemma3", "gemma4")


def config_dict(spec: TinySpec) -> dict:
    architecture, model_type = _ARCH[spec.arch]
    cfg = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "hidden_act": "silu",
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    if spec.arch == "llama":
        cfg["attention_bias"] = False
        cfg["mlp_bias"] = False
    if spec.arch == "mistral":
        cfg["sliding_window"] = spec.sliding_window
    if spec.arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = spec.sliding_window is not None
        if spec.sliding_window is not None:
            cfg["sliding_window"] = spec.sliding_window
            cfg["max_window_layers"] = 1
    if spec.arch in ("qwen3", *GEMMA):
        cfg["head_dim"] = spec.head_dim
        cfg["attention_bias"] = False
    if spec.arch in GEMMA:
        del cfg["hidden_act"]
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        cfg["query_pre_attn_scalar"] = spec.query_pre_attn_scalar
        if spec.sliding_window is not None:
            cfg["sliding_window"] = spec.sliding_window
        pattern = spec.layer_pattern
        cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(spec.num_hidden_layers)]
        cfg["final_logit_softcapping"] = spec.final_logit_softcapping
        cfg["attn_logit_softcapping"] = spec.attn_logit_softcapping
    if spec.arch == "gemma3":
        cfg["rope_local_base_freq"] = spec.rope_local_base_freq
    if spec.arch == "qwen3_5":
        del cfg["rope_theta"], cfg["rope_scaling"]
        cfg["rope_parameters"] = {
            "rope_type": "default",
            "rope_theta": spec.rope_theta,
            "partial_rotary_factor": spec.partial_rotary_factor,
        }
        cfg["head_dim"] = spec.head_dim
        cfg["layer_types"] = [spec.hybrid_pattern[i % len(spec.hybrid_pattern)] for i in range(spec.num_hidden_layers)]
        cfg["linear_num_key_heads"], cfg["linear_num_value_heads"] = spec.linear_heads
        cfg["linear_key_head_dim"], cfg["linear_value_head_dim"] = spec.linear_dims
        cfg["linear_conv_kernel_dim"] = spec.conv_taps
    if spec.arch == "gemma4":
        for name in ("rope_theta", "rope_scaling", "query_pre_attn_scalar", "attn_logit_softcapping"):
            del cfg[name]
        cfg["rope_parameters"] = {
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_local_base_freq},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": spec.partial_rotary_factor,
                "rope_theta": spec.rope_theta,
            },
        }
        cfg["global_head_dim"] = spec.global_head_dim or spec.head_dim
        cfg["num_kv_shared_layers"] = spec.num_kv_shared_layers
        cfg["use_double_wide_mlp"] = spec.use_double_wide_mlp
        cfg["hidden_size_per_layer_input"] = spec.hidden_size_per_layer_input
        cfg["vocab_size_per_layer_input"] = spec.vocab_size
        cfg["attention_k_eq_v"] = spec.attention_k_eq_v
        if spec.num_global_key_value_heads is not None:
            cfg["num_global_key_value_heads"] = spec.num_global_key_value_heads
        cfg["enable_moe_block"] = False
        cfg["layer_types"][-1] = "full_attention"  # transformers makes the last layer full (with a warning)
    return cfg


def random_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(spec.seed)

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * spec.weight_std).astype(np.float32)

    # Gemma 2/3 and Qwen 3.5 scale by (1 + w): their weights are drawn around 0 so every kind of norm scales by about 1.
    offset = 0.0 if spec.arch in ("gemma2", "gemma3", "qwen3_5") else 1.0

    def norm(size: int) -> np.ndarray:
        return (offset + 0.1 * rng.standard_normal(size)).astype(np.float32)

    h, hd, ffn = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q, kv = spec.num_attention_heads * hd, spec.num_key_value_heads * hd
    embed = mat(spec.vocab_size, h)
    if spec.embed_std is not None:
        embed *= np.float32(spec.embed_std / spec.weight_std)
    tensors = {"model.embed_tokens.weight": embed, "model.norm.weight": norm(h)}
    if spec.arch == "gemma4":
        tensors.update(_gemma4_weights(spec, mat, norm))
        if not spec.tie_word_embeddings:
            tensors["lm_head.weight"] = mat(spec.vocab_size, h)
        return tensors
    for i in range(spec.num_hidden_layers):
        p = f"model.layers.{i}."
        if spec.arch == "qwen3_5":
            tensors.update(_qwen3_5_layer(spec, i, mat, norm, rng))
            continue
        tensors.update(
            {
                p + "input_layernorm.weight": norm(h),
                p + "post_attention_layernorm.weight": norm(h),
                p + "self_attn.q_proj.weight": mat(q, h),
                p + "self_attn.k_proj.weight": mat(kv, h),
                p + "self_attn.v_proj.weight": mat(kv, h),
                p + "self_attn.o_proj.weight": mat(h, q),
                p + "mlp.gate_proj.weight": mat(ffn, h),
                p + "mlp.up_proj.weight": mat(ffn, h),
                p + "mlp.down_proj.weight": mat(h, ffn),
            }
        )
        if spec.arch == "qwen2":
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                tensors[p + f"self_attn.{name}_proj.bias"] = (rng.standard_normal(size) * 0.1).astype(np.float32)
        if spec.arch in ("qwen3", "gemma3"):
            tensors[p + "self_attn.q_norm.weight"] = norm(hd)
            tensors[p + "self_attn.k_norm.weight"] = norm(hd)
        if spec.arch in GEMMA:
            tensors[p + "pre_feedforward_layernorm.weight"] = norm(h)
            tensors[p + "post_feedforward_layernorm.weight"] = norm(h)
    if not spec.tie_word_embeddings:
        tensors["lm_head.weight"] = mat(spec.vocab_size, h)
    return tensors


def _qwen3_5_layer(spec: TinySpec, i: int, mat, norm, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A Qwen 3.5 layer: Gated DeltaNet or gated attention (q_proj holds [q | gate] per head), then the MLP."""
    p, h, hd, ffn = f"model.layers.{i}.", spec.hidden_size, spec.head_dim, spec.intermediate_size
    tensors = {
        p + "input_layernorm.weight": norm(h),
        p + "post_attention_layernorm.weight": norm(h),
        p + "mlp.gate_proj.weight": mat(ffn, h),
        p + "mlp.up_proj.weight": mat(ffn, h),
        p + "mlp.down_proj.weight": mat(h, ffn),
    }
    if spec.hybrid_pattern[i % len(spec.hybrid_pattern)] == "full_attention":
        q, kv, a = spec.num_attention_heads * hd, spec.num_key_value_heads * hd, p + "self_attn."
        tensors.update(
            {
                a + "q_proj.weight": mat(2 * q, h),
                a + "k_proj.weight": mat(kv, h),
                a + "v_proj.weight": mat(kv, h),
                a + "o_proj.weight": mat(h, q),
                a + "q_norm.weight": norm(hd),
                a + "k_norm.weight": norm(hd),
            }
        )
        return tensors
    (nk, nv), (dk, dv), a = spec.linear_heads, spec.linear_dims, p + "linear_attn."
    channels = 2 * nk * dk + nv * dv
    tensors.update(
        {
            a + "in_proj_qkv.weight": mat(channels, h),
            a + "in_proj_z.weight": mat(nv * dv, h),
            a + "in_proj_b.weight": mat(nv, h),
            a + "in_proj_a.weight": mat(nv, h),
            a + "conv1d.weight": (rng.standard_normal((channels, 1, spec.conv_taps)) * 0.5).astype(np.float32),
            # Slow decays (exp(g) near 1), so the state carries tokens far back and its rollback is tested.
            a + "A_log": np.log(rng.uniform(0.02, 0.5, nv)).astype(np.float32),
            a + "dt_bias": (rng.standard_normal(nv) * 0.3).astype(np.float32),
            a + "norm.weight": (1.0 + 0.1 * rng.standard_normal(dv)).astype(np.float32),
            a + "out_proj.weight": mat(h, nv * dv),
        }
    )
    return tensors


def _gemma4_weights(spec: TinySpec, mat, norm) -> dict[str, np.ndarray]:
    """A Gemma 4 text model's tensors besides the embedding and the final norm (transformers' names); the shared
    layers have no k/v projections or norms, a full layer of an attention_k_eq_v model no v_proj."""
    from doppler_py.model.config import ModelConfig  # here: it pulls in wgpu, which the other families never need

    cfg = ModelConfig.from_dict(config_dict(spec), source="tiny gemma4")
    h, per_layer, layers = spec.hidden_size, spec.hidden_size_per_layer_input, spec.num_hidden_layers
    tensors = {}
    if per_layer:
        tensors["model.embed_tokens_per_layer.weight"] = mat(spec.vocab_size, layers * per_layer)
        tensors["model.per_layer_model_projection.weight"] = mat(layers * per_layer, h)
        tensors["model.per_layer_projection_norm.weight"] = norm(per_layer)
    scalars = np.random.default_rng(spec.seed + 1).uniform(0.5, 1.5, layers).astype(np.float32)
    for i in range(layers):
        p, hd, ffn = f"model.layers.{i}.", cfg.layer_head_dim(i), cfg.layer_intermediate_size(i)
        q, kv = spec.num_attention_heads * hd, cfg.layer_num_kv_heads(i) * hd
        for name in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            tensors[p + f"{name}_layernorm.weight"] = norm(h)
        tensors[p + "self_attn.q_proj.weight"] = mat(q, h)
        tensors[p + "self_attn.q_norm.weight"] = norm(hd)
        if cfg.kv_source(i) == i:
            tensors[p + "self_attn.k_proj.weight"] = mat(kv, h)
            tensors[p + "self_attn.k_norm.weight"] = norm(hd)
            if not (cfg.attention_k_eq_v and cfg.layer_types[i] == "full_attention"):
                tensors[p + "self_attn.v_proj.weight"] = mat(kv, h)
        tensors[p + "self_attn.o_proj.weight"] = mat(h, q)
        tensors[p + "mlp.gate_proj.weight"] = mat(ffn, h)
        tensors[p + "mlp.up_proj.weight"] = mat(ffn, h)
        tensors[p + "mlp.down_proj.weight"] = mat(h, ffn)
        if per_layer:
            tensors[p + "per_layer_input_gate.weight"] = mat(per_layer, h)
            tensors[p + "per_layer_projection.weight"] = mat(h, per_layer)
            tensors[p + "post_per_layer_input_norm.weight"] = norm(h)
        tensors[p + "layer_scalar"] = scalars[i : i + 1]
    return tensors


# Ids 0..2 as in SmolLM2, so config.json's bos (1) and eos (2) ids name <|im_start|> and <|im_end|>.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
PRINTABLE_CHARSET = "".join(chr(c) for c in range(0x20, 0x7F)) + "\n"
SMALL_CHARSET = "abcdefghijklmnopqrstuvwxyz .,!?\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tokenizer_charset(vocab_size: int) -> str | None:
    """The largest charset whose tokenizer fits `vocab_size` ids, or None when none fits."""
    for charset in (PRINTABLE_CHARSET, SMALL_CHARSET):
        if len(SPECIAL_TOKENS) + len(charset) <= vocab_size:
            return charset
    return None


def character_tokenizer(charset: str):
    """A `tokenizers.Tokenizer` with one token per character of `charset` after the special tokens.

    A BPE model without merges splits text into characters; characters outside the charset are dropped.
    The Fuse decoder joins tokens back without the spaces a plain decode would put between them.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *charset])}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tokenizer


def write_tokenizer(folder: Path, charset: str) -> None:
    character_tokenizer(charset).save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_tiny_model(folder: str | Path, spec: TinySpec = TinySpec()) -> Path:
    """Write a random model for `spec` into `folder` and return the folder.

    The tokenizer files are written when a charset fits the vocabulary (printable ASCII from 99 ids,
    lowercase letters and basic punctuation from 35).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config_dict(spec), indent=2))
    save_file(random_weights(spec), str(folder / "model.safetensors"), metadata={"format": "pt"})
    charset = tokenizer_charset(spec.vocab_size)
    if charset is not None:
        write_tokenizer(folder, charset)
    return folder


TINY_SPECS: dict[str, TinySpec] = {
    "llama-tied-gqa": TinySpec(arch="llama", tie_word_embeddings=True, num_attention_heads=4, num_key_value_heads=2),
    "llama-untied-mha": TinySpec(
        arch="llama", tie_word_embeddings=False, num_attention_heads=4, num_key_value_heads=4, seed=1
    ),
    "qwen2-bias-gqa": TinySpec(
        arch="qwen2",
        tie_word_embeddings=False,
        num_attention_heads=8,
        num_key_value_heads=2,
        hidden_size=128,
        intermediate_size=224,
        seed=2,
    ),
    "mistral-gqa": TinySpec(arch="mistral", num_attention_heads=4, num_key_value_heads=1, seed=4),
    # head_dim 32 with 4 heads: q is 128 wide over a hidden size of 64.
    "qwen3-qknorm-gqa": TinySpec(
        arch="qwen3", num_attention_heads=4, num_key_value_heads=2, explicit_head_dim=32, rope_theta=1e6, seed=5
    ),
    # Layers sliding, full, sliding: an 8-key window, shorter than the tests' prompt and output.
    "gemma3-sliding": TinySpec(
        arch="gemma3",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        explicit_head_dim=32,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        seed=6,
        embed_std=0.02,
        sliding_window=8,
    ),
    # Gemma 2: no q/k norms, one RoPE base, scores and logits soft-capped at values these weights reach.
    "gemma2-softcap": TinySpec(
        arch="gemma2",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        explicit_head_dim=32,
        rms_norm_eps=1e-6,
        seed=10,
        embed_std=0.02,
        sliding_window=8,
        attn_logit_softcapping=1.5,
        final_logit_softcapping=0.5,
    ),
    # Layers linear, full, linear: Gated DeltaNet layers (2 key heads, 4 value heads of 16) beside gated
    # attention with partial RoPE (8 of 32 dims), as Qwen 3.5 interleaves them.
    "qwen3_5-hybrid": TinySpec(
        arch="qwen3_5",
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        explicit_head_dim=32,
        tie_word_embeddings=False,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        seed=11,
    ),
    # Gemma 4 (E2B's shape, shrunk): layers sliding, full, sliding, then two that read the K/V of layers 2
    # (sliding) and 1 (full) with double-wide MLPs; full layers have head_dim 64 (8 of 32 frequency pairs
    # rotating), sliding ones 32 over a 6-key window; per-layer inputs of 32; logits soft-capped.
    "gemma4": TinySpec(
        arch="gemma4",
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=1,
        intermediate_size=64,
        explicit_head_dim=32,
        global_head_dim=64,
        layer_pattern=("sliding_attention", "full_attention", "sliding_attention", "sliding_attention"),
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        seed=11,
        embed_std=0.02,
        sliding_window=6,
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=32,
        final_logit_softcapping=4.0,
        tie_word_embeddings=False,
    ),
    "mistral-sliding": TinySpec(arch="mistral", num_attention_heads=4, num_key_value_heads=2, sliding_window=6, seed=8),
    "qwen3-sliding": TinySpec(
        arch="qwen3", num_attention_heads=4, num_key_value_heads=1, explicit_head_dim=32, sliding_window=5, seed=9
    ),
    "llama-llama3-rope": TinySpec(
        arch="llama",
        num_attention_heads=2,
        num_key_value_heads=1,
        seed=3,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
}
