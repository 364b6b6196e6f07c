"""Train a spark block drafter for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the folder `doppler_py.speculative.spark` loads.

For every position p of prompt + answer, block position i (0..K-1) reads h_p = final_norm(f_p) and the token
before its own (the target's choice at p + i, teacher-forced: at drafting time it is the draft before, and only
drafts after accepted ones matter) and learns the target's choice at p + i + 1 (cross-entropy over the draft
vocabulary, weighted 0.8^i). The confidence head learns, per position, whether the block's top draft there is
the target's choice (binary cross-entropy against the block's own current answer, detached): with teacher
forcing that is the chance a draft is accepted once the drafts before it were. ResBlocks and the bias
projection start at zero (the block starts as the target's own LM head on h), the LM head from the target's
output rows of the draft vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.speculative.head_files import made_for
from doppler_py.training.data import TrainOptions, card, prepare, train_loop

CONFIDENCE_WEIGHT = 1.0  # of the confidence head's loss beside the drafts'


class SparkModule:
    """The block drafter in torch, mirroring `doppler_py.speculative.spark` (built lazily: torch stays optional)."""

    def __new__(cls, hidden: int, block: int, draft_vocab: int, rank: int):
        import torch
        import torch.nn.functional as F
        from torch import nn

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.resblock_weight = nn.Parameter(torch.zeros(block, hidden, hidden))
                self.resblock_bias = nn.Parameter(torch.zeros(block, hidden))
                self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)
                self.prev_embed = nn.Parameter(torch.randn(draft_vocab + 1, rank) * 0.1)
                self.prev_proj = nn.Parameter(torch.zeros(draft_vocab, rank))
                self.confidence = nn.Linear(hidden, block)
                nn.init.zeros_(self.confidence.weight)
                nn.init.zeros_(self.confidence.bias)

            def forward(self, h, prev_slots):  # h [T, H], prev_slots [K, T] -> logits [K, T, N], conf [T, K]
                gate = torch.einsum("koh,th->kto", self.resblock_weight, h) + self.resblock_bias[:, None, :]
                logits = self.lm_head(h[None] + F.silu(gate))
                return logits + self.prev_embed[prev_slots] @ self.prev_proj.T, self.confidence(h)

        return Block()


def prev_slots(corpus, argmax, block: int):
    """[K, T] draft slots of the token before each block position's (the target's choice at p + i; N outside
    the draft vocabulary or past the sequence)."""
    import torch

    n, length = len(corpus.draft_ids), argmax.numel()
    slots = torch.full((block, length), n, dtype=torch.long)
    for i in range(block):
        if length > i:
            draft = corpus.to_draft[argmax[i:]]
            slots[i, : length - i] = torch.where(draft < 0, torch.full_like(draft, n), draft)
    return slots


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
    hf, data, to_draft, k = corpus.hf, corpus.data, corpus.to_draft, options.spark_block
    final_norm = hf.model.norm
    head = SparkModule(hf.config.hidden_size, k, len(corpus.draft_ids), options.spark_rank)
    with torch.no_grad():
        head.lm_head.weight.copy_(hf.get_output_embeddings().weight.detach()[torch.tensor(corpus.draft_ids)])

    def normed(i: int):
        with torch.no_grad():
            return final_norm(data[i][0])

    def sequence_loss(i: int):
        argmax = data[i][1]
        logits, conf = head(normed(i), prev_slots(corpus, argmax, k))
        loss = torch.zeros(())
        for j in range(k):  # position j at p: the target's choice at p + j + 1
            if argmax.numel() > j + 1:
                labels = to_draft[argmax[j + 1 :]]
                rows = logits[j, : -(j + 1)]
                loss = loss + options.unroll_weight**j * F.cross_entropy(rows, labels, ignore_index=-100)
                right = (rows.argmax(-1) == labels).float().detach()
                loss = loss + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(conf[: -(j + 1), j], right)
        return loss

    steps, losses, seconds = train_loop(head, sequence_loss, corpus, Path(work) / "spark.pt", options, say)
    corpus.times["train_s"] = seconds
    figures = {
        "held_in": block_figures(head, corpus, corpus.train, normed, k),
        "validation": block_figures(head, corpus, corpus.valid, normed, k),
    }
    extra = {f"{split}_{name}": value for split, named in figures.items() for name, value in named.items()}
    record = card("spark", model, options, corpus, steps, losses, **extra)
    export(head, hf.config, k, options.spark_rank, corpus.draft_ids, Path(out), record, corpus.tokenizer,
           np.dtype(options.head_dtype))  # fmt: skip
    say(f"block written to {out} (validation top-1 by position {figures['validation']['top1_by_position']})")
    return record


def block_figures(head, corpus, which: list[int], normed, k: int) -> dict[str, list[float]]:
    """Per block position, at the answer positions of the sequences `which` (where drafting happens): how often
    its top draft is the target's choice (the drafts before it teacher-forced), and the mean confidence the
    head gives it (a calibrated head gives about the same)."""
    import torch

    hits, confidence, totals = [0] * k, [0.0] * k, [0] * k
    with torch.no_grad():
        for i in which:
            argmax = corpus.data[i][1]
            logits, conf = head(normed(i), prev_slots(corpus, argmax, k))
            kept = corpus.answer_positions(i, argmax.numel())
            for j in range(min(k, argmax.numel() - 1)):
                labels, at = corpus.to_draft[argmax[j + 1 :]], kept[: -(j + 1)]
                hits[j] += int((logits[j, : -(j + 1)].argmax(-1)[at] == labels[at]).sum())
                confidence[j] += float(torch.sigmoid(conf[: -(j + 1), j])[at].sum())
                totals[j] += int(at.sum())
    return {
        "top1_by_position": [round(h / max(1, t), 4) for h, t in zip(hits, totals, strict=True)],
        "confidence_by_position": [round(c / max(1, t), 4) for c, t in zip(confidence, totals, strict=True)],
    }


def export(head, target_config, k: int, rank: int, draft_ids, out: Path, card: dict, tokenizer, dtype) -> None:
    """Write the folder `doppler_py.speculative.spark.load_spark` reads."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        "resblock.weight": head.resblock_weight,
        "resblock.bias": head.resblock_bias,
        "lm_head.weight": head.lm_head.weight,
        "prev.embed": head.prev_embed,
        "prev.proj": head.prev_proj,
        "confidence.weight": head.confidence.weight,
        "confidence.bias": head.confidence.bias,
    }
    arrays = {name: np.ascontiguousarray(t.detach().numpy().astype(dtype)) for name, t in tensors.items()}
    arrays["draft_to_target"] = np.asarray(draft_ids, dtype=np.int64)
    save_file(arrays, str(out / "spark.safetensors"))
    meta = {
        "kind": "spark",
        "block": k,
        "rank": rank,
        "target": made_for(target_config, tokenizer),
        "draft_vocab": len(draft_ids),
    }
    (out / "spark.json").write_text(json.dumps(meta, indent=2))
    (out / "training_card.json").write_text(json.dumps(card, indent=2))


def import_block(folder: str | Path):
    """The inverse of `export`: (torch block drafter, draft→target ids)."""
    import torch
    from safetensors.numpy import load_file

    tensors = load_file(str(Path(folder) / "spark.safetensors"))
    k, hidden, _ = tensors["resblock.weight"].shape
    n, rank = tensors["prev.proj"].shape
    head = SparkModule(hidden, k, n, rank)
    with torch.no_grad():
        for name, param in (
            ("resblock.weight", head.resblock_weight),
            ("resblock.bias", head.resblock_bias),
            ("lm_head.weight", head.lm_head.weight),
            ("prev.embed", head.prev_embed),
            ("prev.proj", head.prev_proj),
            ("confidence.weight", head.confidence.weight),
            ("confidence.bias", head.confidence.bias),
        ):
            param.copy_(torch.tensor(tensors[name].astype(np.float32)))
    return head.eval(), tensors["draft_to_target"].astype(np.int64)
