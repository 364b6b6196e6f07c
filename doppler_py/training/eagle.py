"""Train an EAGLE head for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the head folder `doppler_py.speculative.eagle` loads.

Training pairs, for every position p of prompt + answer (teacher forcing through the target):
    input  (f_p standardised, t_{p+1})       f = the target's last-layer output before its final norm
    labels s_{p+1} (the next feature, standardised; smooth L1) and the target's own argmax at p+1 mapped to
           the draft vocabulary (cross-entropy; tokens outside it are ignored)
plus one unrolled step ("training-time test"): the head's own outputs replace the features, as in drafting,
with its losses weighted 0.8. The draft vocabulary is the `draft_vocab` most frequent argmax tokens.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.speculative.head_files import made_for
from doppler_py.training.data import TrainOptions, card, prepare, train_loop


class EagleHeadModule:
    """The head in torch, mirroring `doppler_py.speculative.eagle` (built lazily so torch stays optional)."""

    def __new__(cls, target_config, draft_vocab: int):
        import torch
        from torch import nn
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm, LlamaRotaryEmbedding

        cfg = LlamaConfig(**head_config(target_config, draft_vocab))
        cfg._attn_implementation = "sdpa"  # causal without an explicit mask

        class Head(nn.Module):
            def __init__(self):
                super().__init__()
                h = cfg.hidden_size
                self.config = cfg
                self.fc_embed = nn.Linear(h, h, bias=True)
                self.fc_feature = nn.Linear(h, h, bias=False)
                self.layer = LlamaDecoderLayer(cfg, 0)
                self.norm = LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
                self.rotary = LlamaRotaryEmbedding(cfg)
                self.lm_head = nn.Linear(h, draft_vocab, bias=False)

            def forward(self, emb, features):
                x = self.fc_embed(emb) + self.fc_feature(features)
                positions = torch.arange(x.shape[1])[None]
                out = self.layer(x, position_embeddings=self.rotary(x, positions), position_ids=positions)
                out = out[0] if isinstance(out, tuple) else out
                return out, self.lm_head(self.norm(out))

        return Head()


def head_config(target_config, draft_vocab: int) -> dict:
    """The head's one-layer LLaMA config (HF names), shaped like the target's layers."""
    t = target_config
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": draft_vocab,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": t.hidden_size // t.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.rms_norm_eps,
        "rope_theta": getattr(t, "rope_theta", None) or t.rope_parameters["rope_theta"],
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }


def train(
    model: str | Path,
    out: str | Path,
    work: str | Path,
    options: TrainOptions | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """All stages; returns the training card (also written to out/training_card.json)."""
    import torch

    options = options or TrainOptions()
    corpus = prepare(model, Path(work), options, say)
    hf, data, sequences, to_draft = corpus.hf, corpus.data, corpus.sequences, corpus.to_draft
    feats = torch.cat([data[i][0] for i in corpus.train])
    mean, std = feats.mean(0), feats.std(0).clamp_min(1e-3)
    embed = hf.get_input_embeddings().weight.detach()
    head = EagleHeadModule(hf.config, len(corpus.draft_ids))
    with torch.no_grad():  # start the draft LM head from the target's own output rows
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight.detach()[torch.tensor(corpus.draft_ids)])

    def sequence_loss(i: int):
        ids = torch.tensor(sequences[i])
        f, argmax = data[i]
        s = (f - mean) / std
        emb = embed[ids[1:]][None]  # t_{p+1} for p = 0..T-2
        labels = to_draft[argmax[1:]]  # the target's choice after t_{p+1}
        pred, logits = head(emb, s[:-1][None])
        loss = nn_loss(pred[0], s[1:], logits[0], labels)
        # Training-time test: the head's own predictions as the next pairs' features (one unrolled step).
        pred2, logits2 = head(emb[:, 1:], pred[:, :-1])
        return loss + options.unroll_weight * nn_loss(pred2[0], s[2:], logits2[0], labels[1:])

    steps, losses, seconds = train_loop(head, sequence_loss, corpus, Path(work) / "eagle.pt", options, say)
    corpus.times["train_s"] = seconds
    top1 = {name: top1_agreement(head, corpus, which, embed, mean, std) for name, which in
            (("held_in_top1", corpus.train), ("validation_top1", corpus.valid))}  # fmt: skip
    record = card("eagle", model, options, corpus, steps, losses, **top1)
    dtype = np.dtype(options.head_dtype)
    export(head, hf.config, corpus.draft_ids, mean, std, Path(out), record, corpus.tokenizer, dtype)
    say(f"head written to {out} (top-1 held-in {top1['held_in_top1']:.3f}, validation {top1['validation_top1']:.3f})")
    return record


def nn_loss(out, s_next, logits, labels):
    import torch.nn.functional as F

    return F.smooth_l1_loss(out, s_next) + F.cross_entropy(logits, labels, ignore_index=-100)


def top1_agreement(head, corpus, which: list[int], embed, mean, std) -> float:
    """How often the head's first draft equals the target's next choice at the answer positions of the
    sequences `which` (where drafting happens; the prompt's chat template would flatter the figure)."""
    import torch

    hits = total = 0
    with torch.no_grad():
        for i in which:
            (f, argmax), ids = corpus.data[i], torch.tensor(corpus.sequences[i])
            _, logits = head(embed[ids[1:]][None], ((f - mean) / std)[:-1][None])
            labels = corpus.to_draft[argmax[1:]]
            kept = corpus.answer_positions(i, labels.numel())
            hits += int((logits[0].argmax(-1)[kept] == labels[kept]).sum())
            total += int(kept.sum())
    return hits / max(1, total)


def torch_drafts(head, mean, std, draft_ids, embed, features, tokens: list[int], committed: int, n: int) -> list[int]:
    """The n tokens the torch head drafts after tokens[:committed] (greedy), as the GPU drafter does: the pairs
    (f_p, t_{p+1}) for p < committed - 1 from the target's `features` (raw, [T, H]), then its own predicted
    features for the tokens it drafted."""
    import torch

    feats, ids, out = ((features[: committed - 1] - mean) / std), list(tokens[1:committed]), []
    with torch.no_grad():
        for _ in range(n):
            pred, logits = head(embed[torch.tensor(ids)][None], feats[None])
            out.append(int(draft_ids[int(logits[0, -1].argmax())]))
            feats, ids = torch.cat([feats, pred[0, -1:]]), [*ids, out[-1]]
    return out


def export(
    head, target_config, draft_ids: list[int], mean, std, out: Path, card: dict, tokenizer=None, dtype=np.float32
) -> None:
    """Write the head folder `doppler_py.speculative.eagle.load_head` reads."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().float().numpy().astype(dtype) for k, v in head.state_dict().items() if "rotary" not in k}
    lm = sd["lm_head.weight"]
    model = {"model.embed_tokens.weight": lm, "model.norm.weight": sd["norm.weight"]}
    model |= {f"model.layers.0.{k[len('layer.') :]}": v for k, v in sd.items() if k.startswith("layer.")}
    save_file({k: np.ascontiguousarray(v) for k, v in model.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # fmt: skip
    eagle = {
        "fc_embed.weight": sd["fc_embed.weight"],
        "fc_embed.bias": sd["fc_embed.bias"],
        "fc_feature.weight": sd["fc_feature.weight"],
        "feature_mean": mean.numpy().astype(np.float32),  # f32 always: |μ| reaches thousands on SmolLM2
        "feature_std": std.numpy().astype(np.float32),
        "draft_to_target": np.asarray(draft_ids, dtype=np.int64),
    }
    save_file({k: np.ascontiguousarray(v) for k, v in eagle.items()}, str(out / "eagle.safetensors"))
    config = head_config(target_config, len(draft_ids)) | {"torch_dtype": np.dtype(dtype).name}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    meta = {
        "kind": "eagle",
        "target": made_for(target_config, tokenizer),
        "draft_vocab": len(draft_ids),
    }
    (out / "eagle.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_head(folder: str | Path, target_config):
    """The inverse of `export`: (torch head, feature mean, feature std, draft→target ids) from a head folder."""
    import torch
    from safetensors.numpy import load_file

    folder = Path(folder)
    eagle, model = load_file(str(folder / "eagle.safetensors")), load_file(str(folder / "model.safetensors"))
    head = EagleHeadModule(target_config, int(eagle["draft_to_target"].size))
    state = {name: eagle[name] for name in ("fc_embed.weight", "fc_embed.bias", "fc_feature.weight")}
    state |= {"norm.weight": model["model.norm.weight"], "lm_head.weight": model["model.embed_tokens.weight"]}
    prefix = "model.layers.0."
    state |= {"layer." + k[len(prefix) :]: v for k, v in model.items() if k.startswith(prefix)}
    missing, unexpected = head.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)
    if unexpected or any(not k.startswith("rotary") for k in missing):
        raise ValueError(f"{folder}: head tensors missing {missing} or unexpected {unexpected}")
    mean, std = torch.tensor(eagle["feature_mean"]), torch.tensor(eagle["feature_std"])
    return head.eval(), mean, std, eagle["draft_to_target"].astype(np.int64)
