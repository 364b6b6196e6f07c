"""Train a spark block drafter for a target by self-distillation (torch on CPU), in resumable stages
(`doppler_py.training.data`); `out/` becomes the folder `doppler_py.speculative.drafters.heads.spark` loads.

For every position p of prompt + answer, block position i (0..K-1) reads h_p = final_norm(f_p) and the token
before its own (the target's choice at p + i, teacher-forced: at drafting time it is the draft before, and only
drafts after accepted ones matter) and learns the target's choice at p + i + 1 (cross-entropy over the draft
vocabulary, weighted 0.8^i). The confidence head learns, per position, whether the block's top draft there is
the target's choice (binary cross-entropy against the block's own current answer, detached): with teacher
forcing that is the chance a draft is accepted once the drafts before it were. Learnt on the sequences the
block fits, it is far too sure on new text, so it is then rescaled on the held-out split (`calibrate`).
ResBlocks and the bias projection start at zero (the block starts as the target's own LM head on h), the LM
head from the target's output rows of the draft vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from doppler_py.speculative.drafters.heads.files import made_for
from doppler_py.training.data import TrainOptions, card, prepare, train_loop
from doppler_py.training.resblock import export_folder, import_folder, resblock_module

CONFIDENCE_WEIGHT = 1.0  # of the confidence head's loss beside the drafts'


class SparkModule:
    """The block drafter in torch, mirroring `speculative.drafters.heads.spark`: `resblock_module`'s ResBlocks and
    LM head (`lm_head` [N, H]: its first rows), the previous-token bias and the confidence head."""

    def __new__(cls, block: int, lm_head, rank: int):
        import torch
        from torch import nn

        class Block(resblock_module()):
            def __init__(self):
                super().__init__(block, lm_head)
                draft_vocab, hidden = lm_head.shape
                self.prev_embed = nn.Parameter(torch.randn(draft_vocab + 1, rank) * 0.1)
                self.prev_proj = nn.Parameter(torch.zeros(draft_vocab, rank))
                self.confidence = nn.Linear(hidden, block)
                nn.init.zeros_(self.confidence.weight)
                nn.init.zeros_(self.confidence.bias)

            def forward(self, h, prev_slots):  # h [T, H], prev_slots [K, T] -> logits [K, T, N], conf [T, K]
                logits = super().forward(h)
                return logits + self.prev_embed[prev_slots] @ self.prev_proj.T, self.confidence(h)

            def tensors(self) -> dict:
                return super().tensors() | {
                    "prev.embed": self.prev_embed,
                    "prev.proj": self.prev_proj,
                    "confidence.weight": self.confidence.weight,
                    "confidence.bias": self.confidence.bias,
                }

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
    k = options.spark_block
    head = SparkModule(k, corpus.draft_rows(), options.spark_rank)

    def sequence_loss(i: int):
        argmax = corpus.data[i][1]
        logits, conf = head(corpus.normed(i), prev_slots(corpus, argmax, k))
        loss = torch.zeros(())
        for j in range(k):  # position j at p: the target's choice at p + j + 1
            if argmax.numel() > j + 1:
                labels = corpus.to_draft[argmax[j + 1 :]]
                rows = logits[j, : -(j + 1)]
                loss = loss + options.unroll_weight**j * F.cross_entropy(rows, labels, ignore_index=-100)
                right = (rows.argmax(-1) == labels).float().detach()
                loss = loss + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(conf[: -(j + 1), j], right)
        return loss

    steps, losses = train_loop(head, sequence_loss, corpus, Path(work) / "spark.pt", options, say)
    figures = {
        "held_in": block_figures(block_evidence(head, corpus, corpus.train, k)),
        "validation": block_figures(block_evidence(head, corpus, corpus.valid, k)),
    }
    extra = {f"{split}_{name}": value for split, named in figures.items() for name, value in named.items()}
    started = time.perf_counter()
    extra |= calibrate(head, corpus, k)
    corpus.times["calibrate_s"] = time.perf_counter() - started
    record = card("spark", model, options, corpus, steps, losses, **extra)
    meta = {
        "kind": "spark",
        "block": k,
        "rank": options.spark_rank,
        "target": made_for(corpus.hf.config, corpus.tokenizer),
        "draft_vocab": len(corpus.draft_ids),
    }
    export_folder(head, corpus.draft_ids, Path(out), meta, record, np.dtype(options.head_dtype))
    say(f"block written to {out} (validation top-1 by position {figures['validation']['top1_by_position']})")
    return record


def block_evidence(head, corpus, which: list[int], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per block position, at the answer positions of the sequences `which` (where drafting happens): the
    confidence head's logits and whether the block's top draft is the target's choice (the drafts before it
    teacher-forced)."""
    import torch

    logits_by, right_by = [[] for _ in range(k)], [[] for _ in range(k)]
    with torch.no_grad():
        for i in which:
            argmax = corpus.data[i][1]
            logits, conf = head(corpus.normed(i), prev_slots(corpus, argmax, k))
            kept = corpus.answer_positions(i, argmax.numel())
            for j in range(min(k, argmax.numel() - 1)):
                labels, at = corpus.to_draft[argmax[j + 1 :]], kept[: -(j + 1)]
                right_by[j].append((logits[j, : -(j + 1)].argmax(-1)[at] == labels[at]).numpy())
                logits_by[j].append(conf[: -(j + 1), j][at].numpy())
    return [(joined(logits_by[j]), joined(right_by[j])) for j in range(k)]


def joined(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.float64) if parts else np.zeros(0)


def block_figures(evidence: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, list[float]]:
    """Per block position: how often its top draft is right, and the mean confidence the head gives it (a
    calibrated head gives about the same)."""
    top1, confidence = [], []
    for z, right in evidence:
        top1.append(round(float(right.mean()), 4) if right.size else 0.0)
        confidence.append(round(float(sigmoid(z).mean()), 4) if z.size else 0.0)
    return {"top1_by_position": top1, "confidence_by_position": confidence}


def sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def platt(z: np.ndarray, right: np.ndarray, iterations: int = 100) -> tuple[float, float]:
    """(a, b) minimising the log loss of sigmoid(a·z + b) against `right`, with a small ridge towards (1, 0) so
    a split with one class or none stays near the head's own answer: Newton's method, each step halved until
    the loss goes down (a full Newton step overshoots from (1, 0) when the logits are large and far off)."""
    prior = np.array([1.0, 0.0])
    x = np.stack([z, np.ones_like(z)], axis=1)
    ridge = 1e-3 * max(1, z.size)

    def loss(w: np.ndarray) -> float:
        t = x @ w
        return float((np.logaddexp(0.0, t) - right * t).sum() + 0.5 * ridge * ((w - prior) ** 2).sum())

    w = prior.copy()
    current = loss(w)
    for _ in range(iterations):
        p = sigmoid(x @ w)
        grad = x.T @ (p - right) + ridge * (w - prior)
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(2)
        step = np.linalg.solve(hess, grad)
        while (value := loss(w - step)) > current and np.abs(step).max() >= 1e-12:
            step = step / 2
        if value > current:
            break
        w, gain, current = w - step, current - value, value
        if gain < 1e-12 * max(1.0, abs(current)):
            break
    return float(w[0]), float(w[1])


def calibrate(head, corpus, k: int) -> dict[str, list[float]]:
    """Fit the confidence head to sequences the block never trained on (the held-out split): per position an
    affine map of its logit (Platt scaling), folded into the head's weights. The head learnt its confidence on
    the sequences the block fits, where it is right far more often than on new text. The reported calibrated
    confidence is cross-fitted (each half of the split scaled by the map fitted on the other half), so it is
    not measured on the data it was fitted to."""
    import torch

    if len(corpus.valid) < 2:
        return {}
    halves = [corpus.valid[0::2], corpus.valid[1::2]]
    evidence = [block_evidence(head, corpus, half, k) for half in halves]
    crossed: list[tuple[np.ndarray, np.ndarray]] = []
    for j in range(k):
        parts = []
        for fit, apply in ((0, 1), (1, 0)):
            a, b = platt(*evidence[fit][j])
            z, right = evidence[apply][j]
            parts.append((a * z + b, right))
        crossed.append((joined([z for z, _ in parts]), joined([r for _, r in parts])))
    # the map folded in is fitted on the whole split: both halves' evidence together
    scale = [platt(joined([h[j][0] for h in evidence]), joined([h[j][1] for h in evidence])) for j in range(k)]
    with torch.no_grad():
        a = torch.tensor([s[0] for s in scale], dtype=head.confidence.weight.dtype)
        b = torch.tensor([s[1] for s in scale], dtype=head.confidence.bias.dtype)
        head.confidence.weight.mul_(a[:, None])
        head.confidence.bias.mul_(a).add_(b)
    return {
        "confidence_scale": [round(x, 4) for x, _ in scale],
        "confidence_shift": [round(y, 4) for _, y in scale],
        "validation_calibrated_confidence_by_position": block_figures(crossed)["confidence_by_position"],
    }


def import_block(folder: str | Path):
    """The inverse of `train`'s export: (torch block drafter, draft→target ids)."""
    import torch

    def make_head(arrays: dict[str, np.ndarray]):
        k, hidden, _ = arrays["resblock.weight"].shape
        n, rank = arrays["prev.proj"].shape
        return SparkModule(k, torch.zeros(n, hidden), rank)

    return import_folder(folder, "spark", make_head)
