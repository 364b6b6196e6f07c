"""Train Medusa heads for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the folder `doppler_py.speculative.drafters.heads.medusa` loads.

For every position p of prompt + answer, head i (1..K) reads h_p = final_norm(f_p) and learns the target's own
choice i places after its next token: argmax at p + i (cross-entropy over the draft vocabulary, tokens outside
it ignored), weighted 0.8^(i-1). The ResBlocks start at zero (each head starts as h_p itself) and the shared LM
head from the target's own output rows of the draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.speculative.drafters.heads.files import made_for
from doppler_py.training.data import TrainOptions, card, prepare, train_loop
from doppler_py.training.resblock import export_folder, import_folder, resblock_module


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
    k = options.medusa_heads
    head = resblock_module()(k, corpus.draft_rows())

    def sequence_loss(i: int):
        logits, argmax = head(corpus.normed(i)), corpus.data[i][1]
        loss = torch.zeros(())
        for j in range(1, k + 1):  # head j at p: the target's choice at p + j
            if argmax.numel() > j:
                labels = corpus.to_draft[argmax[j:]]
                loss = loss + 0.8 ** (j - 1) * F.cross_entropy(logits[j - 1, :-j], labels, ignore_index=-100)
        return loss

    steps, losses = train_loop(head, sequence_loss, corpus, Path(work) / "medusa.pt", options, say)
    top1 = {
        "held_in_top1_by_head": top1_by_head(head, corpus, corpus.train, k),
        "validation_top1_by_head": top1_by_head(head, corpus, corpus.valid, k),
    }
    record = card("medusa", model, options, corpus, steps, losses, **top1)
    target = made_for(corpus.hf.config, corpus.tokenizer)
    meta = {"kind": "medusa", "heads": k, "target": target, "draft_vocab": len(corpus.draft_ids)}
    export_folder(head, corpus.draft_ids, Path(out), meta, record, np.dtype(options.head_dtype))
    say(f"heads written to {out} (validation top-1 by head {top1['validation_top1_by_head']})")
    return record


def top1_by_head(head, corpus, which: list[int], k: int) -> list[float]:
    """Per head, how often its top draft equals the target's choice, at the answer positions of the sequences
    `which` (where drafting happens)."""
    import torch

    hits, totals = [0] * k, [0] * k
    with torch.no_grad():
        for i in which:
            logits, argmax = head(corpus.normed(i)), corpus.data[i][1]
            kept = corpus.answer_positions(i, argmax.numel())
            for j in range(1, min(k, argmax.numel() - 1) + 1):
                labels, at = corpus.to_draft[argmax[j:]], kept[:-j]
                hits[j - 1] += int((logits[j - 1, :-j].argmax(-1)[at] == labels[at]).sum())
                totals[j - 1] += int(at.sum())
    return [round(h / max(1, t), 4) for h, t in zip(hits, totals, strict=True)]


def import_heads(folder: str | Path):
    """The inverse of `train`'s export: (torch heads, draft→target ids)."""
    import torch

    def make_head(arrays: dict[str, np.ndarray]):
        k, hidden, _ = arrays["resblock.weight"].shape
        return resblock_module()(k, torch.zeros(arrays["draft_to_target"].size, hidden))

    return import_folder(folder, "medusa", make_head)
