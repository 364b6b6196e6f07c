"""Train Medusa heads for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the folder `doppler_py.speculative.drafters.heads.medusa` loads.

For every position p of prompt + answer, head i (1..K) reads h_p = final_norm(f_p) and learns the target's own
choice i places after its next token: argmax at p + i (cross-entropy over the draft vocabulary, tokens outside
it ignored), weighted 0.8^(i-1). The ResBlocks start at zero (each head starts as h_p itself) and the shared LM
head from the target's own output rows of the draft vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.speculative.drafters.heads.files import made_for
from doppler_py.training.data import TrainOptions, card, prepare, train_loop


class MedusaModule:
    """The heads in torch, mirroring `speculative.drafters.heads.medusa` (built lazily: torch stays optional)."""

    def __new__(cls, hidden: int, heads: int, draft_vocab: int):
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Heads(nn.Module):
            def __init__(self):
                super().__init__()
                self.resblock_weight = nn.Parameter(torch.zeros(heads, hidden, hidden))
                self.resblock_bias = nn.Parameter(torch.zeros(heads, hidden))
                self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

            def forward(self, h):  # h [T, H] -> logits [K, T, N]
                gate = torch.einsum("koh,th->kto", self.resblock_weight, h) + self.resblock_bias[:, None, :]
                return self.lm_head(h[None] + F.silu(gate))

        return Heads()


def train(
    model: str | Path,
    out: str | Path,
    work: str | Path,
    options: TrainOptions | None = None,
    say: Callable[[str], None] = print,
) -> dict:
    """All stages; returns the training card (also written to out/training_card.json)."""
    import torch
    import torch.nn.functional as F

    options = options or TrainOptions()
    corpus = prepare(model, Path(work), options, say)
    hf, data, to_draft, k = corpus.hf, corpus.data, corpus.to_draft, options.medusa_heads
    final_norm = hf.model.norm
    head = MedusaModule(hf.config.hidden_size, k, len(corpus.draft_ids))
    with torch.no_grad():
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight.detach()[torch.tensor(corpus.draft_ids)])

    def normed(i: int):
        with torch.no_grad():
            return final_norm(data[i][0])

    def sequence_loss(i: int):
        logits, argmax = head(normed(i)), data[i][1]
        loss = torch.zeros(())
        for j in range(1, k + 1):  # head j at p: the target's choice at p + j
            if argmax.numel() > j:
                labels = to_draft[argmax[j:]]
                loss = loss + 0.8 ** (j - 1) * F.cross_entropy(logits[j - 1, :-j], labels, ignore_index=-100)
        return loss

    steps, losses, seconds = train_loop(head, sequence_loss, corpus, Path(work) / "medusa.pt", options, say)
    corpus.times["train_s"] = seconds
    top1 = {
        "held_in_top1_by_head": top1_by_head(head, corpus, corpus.train, normed, k),
        "validation_top1_by_head": top1_by_head(head, corpus, corpus.valid, normed, k),
    }
    record = card("medusa", model, options, corpus, steps, losses, **top1)
    export(head, hf.config, k, corpus.draft_ids, Path(out), record, corpus.tokenizer, np.dtype(options.head_dtype))
    say(f"heads written to {out} (validation top-1 by head {top1['validation_top1_by_head']})")
    return record


def top1_by_head(head, corpus, which: list[int], normed, k: int) -> list[float]:
    """Per head, how often its top draft equals the target's choice, at the answer positions of the sequences
    `which` (where drafting happens)."""
    import torch

    hits, totals = [0] * k, [0] * k
    with torch.no_grad():
        for i in which:
            logits, argmax = head(normed(i)), corpus.data[i][1]
            kept = corpus.answer_positions(i, argmax.numel())
            for j in range(1, min(k, argmax.numel() - 1) + 1):
                labels, at = corpus.to_draft[argmax[j:]], kept[:-j]
                hits[j - 1] += int((logits[j - 1, :-j].argmax(-1)[at] == labels[at]).sum())
                totals[j - 1] += int(at.sum())
    return [round(h / max(1, t), 4) for h, t in zip(hits, totals, strict=True)]


def export(head, target_config, k: int, draft_ids: list[int], out: Path, card: dict, tokenizer, dtype) -> None:
    """Write the folder `doppler_py.speculative.drafters.heads.medusa.load_medusa` reads."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        "resblock.weight": head.resblock_weight.detach().numpy().astype(dtype),
        "resblock.bias": head.resblock_bias.detach().numpy().astype(dtype),
        "lm_head.weight": head.lm_head.weight.detach().numpy().astype(dtype),
        "draft_to_target": np.asarray(draft_ids, dtype=np.int64),
    }
    save_file({name: np.ascontiguousarray(t) for name, t in tensors.items()}, str(out / "medusa.safetensors"))
    meta = {"kind": "medusa", "heads": k, "target": made_for(target_config, tokenizer), "draft_vocab": len(draft_ids)}
    (out / "medusa.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_heads(folder: str | Path):
    """The inverse of `export`: (torch heads, draft→target ids)."""
    import torch
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(folder) / "medusa.safetensors"))
    k, hidden, _ = tensors["resblock.weight"].shape
    head = MedusaModule(hidden, k, tensors["draft_to_target"].size)
    with torch.no_grad():
        head.resblock_weight.copy_(torch.tensor(tensors["resblock.weight"].astype(np.float32)))
        head.resblock_bias.copy_(torch.tensor(tensors["resblock.bias"].astype(np.float32)))
        head.lm_head.weight.copy_(torch.tensor(tensors["lm_head.weight"].astype(np.float32)))
    return head.eval(), tensors["draft_to_target"].astype(np.int64)
