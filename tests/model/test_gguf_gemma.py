"""Gemma 2 and 3 GGUF import: a SentencePiece vocabulary (tokenizer model "llama": pieces, scores, types, no merges)
converted to tokenizer.json, the norm weights llama.cpp stores as 1 + w, the norms around attention and the
MLP, q/k norms (Gemma 3), soft-capping (Gemma 2) and sliding-window layers. Tiny files are written with
`gguf.GGUFWriter` the way llama.cpp's converter writes them, and transformers reading the SAME file is the
reference for tokens and logits."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer as Backend

from doppler_py.model.config import ModelConfig
from doppler_py.model.gguf import convert_gguf, read_gguf, tokenizer_files
from doppler_py.model.loader import load_weights
from doppler_py.model.spm_vocab import BYTE, CONTROL, NORMAL, SPACE, UNKNOWN, USER_DEFINED, spm_merges
from doppler_py.model.transformer import Transformer

SPECIAL = [("<pad>", CONTROL), ("<eos>", CONTROL), ("<bos>", CONTROL), ("<unk>", UNKNOWN)]
TURNS = [("<start_of_turn>", USER_DEFINED), ("<end_of_turn>", USER_DEFINED)]
BYTES = [(f"<0x{b:02X}>", BYTE) for b in range(256)]
# Merged pieces in merge order (earlier = higher score), then the characters they are built from.
MERGED = [SPACE + "t", "he", SPACE + "the", "in", SPACE + "a", "ing", SPACE + "in", "th", SPACE + "th", "er", "on"]
CHARS = [SPACE, *"abcdefghijklmnopqrstuvwxyz", *"TH.,!?"]
TEXTS = [
    "the thing in a tin",
    "The other one, then!",
    "  double  spaces and trailing ",
    "Ünïcödé ☃ and\nnew lines\t",
    "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n",
    "",
]
# Six layers: transformers' default patterns (Gemma 2 alternates, Gemma 3 has every 6th global), which its GGUF
# reader does not set. head_dim 256 = transformers' default query_pre_attn_scalar, which it does not set either
# (llama.cpp scales by head_dim^-1/2 too).
LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, WINDOW = 6, 64, 2, 1, 256, 96, 4


def vocabulary() -> tuple[list[str], list[float], list[int]]:
    typed = SPECIAL + TURNS + BYTES + [(p, NORMAL) for p in MERGED] + [(c, NORMAL) for c in CHARS]
    pieces = [p for p, _ in typed]
    types = [t for _, t in typed]
    scores = [0.0] * len(SPECIAL + TURNS + BYTES)
    scores += [-float(i) for i in range(len(MERGED))] + [-1000.0 - i for i in range(len(CHARS))]
    return pieces, scores, types


def hf_weights(rng, arch: str = "gemma3") -> dict[str, np.ndarray]:
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    vocab = len(vocabulary()[0])
    shapes = {"model.embed_tokens.weight": (vocab, HIDDEN), "model.norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, HIDDEN),
            p + "self_attn.k_proj.weight": (kv, HIDDEN),
            p + "self_attn.v_proj.weight": (kv, HIDDEN),
            p + "self_attn.o_proj.weight": (HIDDEN, q),
            p + "mlp.gate_proj.weight": (FFN, HIDDEN),
            p + "mlp.up_proj.weight": (FFN, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, FFN),
            p + "input_layernorm.weight": (HIDDEN,),
            p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "pre_feedforward_layernorm.weight": (HIDDEN,),
            p + "post_feedforward_layernorm.weight": (HIDDEN,),
        }
        if arch == "gemma3":
            shapes |= {p + "self_attn.q_norm.weight": (HEAD_DIM,), p + "self_attn.k_norm.weight": (HEAD_DIM,)}
    # Small weights keep activations moderate through six layers, as in a trained model.
    return {name: (0.2 * rng.standard_normal(shape)).astype(np.float32) for name, shape in shapes.items()}


GGUF_PARTS = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    _, _, layer, rest = hf.split(".", 3)
    return f"blk.{layer}.{GGUF_PARTS[rest.removesuffix('.weight')]}.weight"


def write_gemma_gguf(path, weights: dict[str, np.ndarray], *, arch: str = "gemma3", add_space_prefix: bool = False):
    pieces, scores, types = vocabulary()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(1_000_000.0 if arch == "gemma3" else 10_000.0)
    writer.add_sliding_window(WINDOW)
    if arch == "gemma2":  # llama.cpp writes Gemma 2's caps (transformers reads the same defaults)
        writer.add_attn_logit_softcapping(50.0)
        writer.add_final_logit_softcapping(30.0)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(pieces)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    for hf, array in weights.items():
        # llama.cpp's Gemma 3 converter stores every norm weight as 1 + w (Gemma's RMSNorm multiplies by 1 + w).
        writer.add_tensor(gguf_name(hf), array + np.float32(1) if hf.endswith("norm.weight") else array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_merges_follow_the_merged_pieces_scores():
    pieces, scores, types = vocabulary()
    merges = spm_merges(pieces, scores, types)
    assert merges[:3] == [(SPACE, "t"), ("h", "e"), (SPACE + "t", "he")]
    assert (SPACE + "th", "e") in merges  # a piece reachable by two splits gets both, at its own score
    assert not any("<" in left + right for left, right in merges), "byte and control pieces never merge"


def test_sentencepiece_vocabulary_tokenizes_like_transformers(tmp_path, rng):
    transformers = pytest.importorskip("transformers")
    path = write_gemma_gguf(tmp_path / "v.gguf", hf_weights(rng))
    ours = Backend.from_str(tokenizer_files(read_gguf(path))[0])
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == theirs(text)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids), text
    # "he" is merged before "th" (a higher score), so a bare "the" stays t + he.
    assert ours.encode("the thing").tokens == ["<bos>", "t", "he", SPACE + "th", "ing"]
    assert ours.encode("Ü").tokens == ["<bos>", "<0xC3>", "<0x9C>"], "unknown characters fall back to bytes"


def test_a_space_prefix_vocabulary_puts_one_space_before_the_text(tmp_path, rng):
    """Llama 2 style (tokenizer.ggml.add_space_prefix = true; transformers picks its tokenizer by architecture,
    so it is no reference for a gemma3 file with the flag): "▁" before the text, removed again by decoding."""
    path = write_gemma_gguf(tmp_path / "v.gguf", hf_weights(rng), add_space_prefix=True)
    ours = Backend.from_str(tokenizer_files(read_gguf(path))[0])
    assert ours.encode("the thing").tokens == ["<bos>", SPACE + "the", SPACE + "th", "ing"]
    for text in TEXTS[:4]:
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=True) == text, text


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_a_gemma_gguf_runs_like_transformers_reading_the_same_file(tmp_path, rng, reference, registry, arch):
    """Logits through a prompt longer than the sliding window and decode steps past it."""
    import torch

    weights = hf_weights(rng, arch)
    path = write_gemma_gguf(tmp_path / "g.gguf", weights, arch=arch)
    folder = convert_gguf(path, tmp_path / "out", "f32", progress=False)
    config = ModelConfig.from_file(folder / "config.json")
    sliding, full = "sliding_attention", "full_attention"
    if arch == "gemma3":
        assert config.layer_types == (sliding,) * 5 + (full,) and config.qk_norm
        assert config.attn_logit_softcapping is None and config.layer_rope(0) == (10_000.0, None)
    else:
        assert config.layer_types == (sliding, full) * 3 and not config.qk_norm
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert config.sliding_window == WINDOW
    assert config.eos_token_ids == (1, 5), "<eos>, and <end_of_turn> found by its text"
    ids = [2, 40, 7, 99, 12, 3, 250, 61, 300, 5, 77]
    with torch.no_grad():
        theirs = reference.hf_model(tmp_path, gguf_file=path.name)(torch.tensor([ids])).logits[0].numpy()
    model = Transformer(load_weights(folder, registry.gpu, "f32"), registry, max_rows=16)
    try:
        cache = model.new_cache(32)
        prefill = model.forward(ids[:7], cache, logits="all")
        ours = np.concatenate([prefill] + [model.forward([i], cache)[None] for i in ids[7:]])
    finally:
        model.close()
        model.weights.destroy()
    # f32 on both sides; the 1 + w round trip through the file is exact for these weights (Sterbenz: |w| < 1).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * np.abs(theirs).max())
