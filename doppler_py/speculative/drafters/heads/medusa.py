"""Medusa drafting: K heads on the target's last verified hidden state propose K tokens at once, on the GPU.

Head i (i = 1..K) reads h = final_norm(f), f the target's final residual stream at the last row it verified
(the row whose logits gave the last committed token t), and proposes the token i places after t:

    y_i = h + silu(W_i·h + b_i)      a ResBlock (zero-initialised in training, so it starts as the identity)
    q_i = lm_head(y_i)               one LM head shared by the heads, over a reduced draft vocabulary (the N most
                                     frequent target tokens), spread over the target vocabulary (-inf elsewhere)

and d_i is sampled from q_i on the GPU. The heads do not see each other's drafts: every q_i is fixed before
drafting, which the verification allows (d_i is drawn from q_i, whatever q_i depends on). No KV cache, no host
round trip; the target's features need no copy either, since the heads read the verified row where it is.

The ResBlocks and the LM head are `resblock`'s, shared with spark (how they run on the GPU is told there).

A head folder (written by `doppler_py.training.medusa`):
    medusa.json          kind, heads, the target it was made for (see `head_files`), the draft vocabulary size
    medusa.safetensors   resblock.weight [K, H, H], resblock.bias [K, H], lm_head.weight [N, H],
                         draft_to_target [N] (target ids)
    training_card.json   how it was trained (data, steps, losses, per-head top-1 on held-out text); its
                         validation_top1_by_head, when there, is the prior of the heads' token trees

With `branches` > 1 the heads propose a token tree instead (`ranked_trees.medusa_tree`): each head's best
tokens, combined into the tree with the most expected accepted tokens by measured acceptance per head and rank.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import ModelFormatError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal, StepContext
from doppler_py.speculative.drafters.gpu_drafting import GREEDY, Branching, TreeBranches
from doppler_py.speculative.drafters.heads.files import dense_format, read_meta
from doppler_py.speculative.drafters.heads.resblock import ResBlockDrafter, ResBlocks, read_resblocks, upload_resblocks
from doppler_py.speculative.trees.ranked import MEDUSA_TREE_TOPS, medusa_tree
from doppler_py.tokenizer import Tokenizer


@dataclass
class MedusaHeads:
    """A Medusa head folder loaded on the GPU for one target."""

    folder: Path
    blocks: ResBlocks  # one per head
    top1_by_head: Sequence[float] | None = None  # validation top-1 per head, from the training card

    def close(self) -> None:
        self.blocks.close()


def load_medusa(
    folder: str | Path, target: Transformer, precision: str = "f32", tokenizer: Tokenizer | None = None
) -> MedusaHeads:
    """Load Medusa heads for `target` (and its `tokenizer`, when given), refusing heads made for another model;
    typed errors name the file. precision: the target's weight format ("keep": as the heads store them)."""
    folder = Path(folder)
    meta = read_meta(folder, "medusa", target, tokenizer)
    heads = meta.get("heads")
    if not isinstance(heads, int) or heads < 1:
        raise ModelFormatError(f"{folder / 'medusa.json'}: 'heads' must be a positive integer, got {heads!r}")
    tensors = read_resblocks(folder / "medusa.safetensors", heads, target)
    fmt = dense_format(target, precision, tensors["lm_head.weight"].dtype)
    return MedusaHeads(
        folder=folder,
        blocks=upload_resblocks(target, tensors, fmt, "medusa"),
        top1_by_head=card_top1(folder / "training_card.json", heads),
    )


def card_top1(card: Path, heads: int) -> list[float] | None:
    """The card's validation top-1 per head (None without a card or that entry); a malformed one is refused."""
    if not card.is_file():
        return None
    try:
        top1 = json.loads(card.read_text()).get("validation_top1_by_head")
    except (json.JSONDecodeError, AttributeError) as exc:
        raise ModelFormatError(f"{card}: not a JSON object ({exc})") from exc
    if top1 is None:
        return None
    if (
        not isinstance(top1, list)
        or len(top1) != heads
        or not all(isinstance(v, int | float) and not isinstance(v, bool) and 0 <= v <= 1 for v in top1)
    ):
        raise ModelFormatError(
            f"{card}: validation_top1_by_head must list {heads} rates in [0, 1] (one per head), got {top1!r}"
        )
    return [float(v) for v in top1]


class HeadBranches(TreeBranches):
    """Medusa's trees: each head's best tokens, in any combination (`ranked_trees.medusa_tree`). A head's
    candidates do not depend on the tree's other nodes, so every depth the walk reached tells how they fared."""

    tops = MEDUSA_TREE_TOPS

    def build(self, best: np.ndarray, budget: int) -> Proposal:
        return medusa_tree(best, self.acceptance.rates, budget, self.sampling.vocab)

    def observed(self, best: np.ndarray, committed: list[int]) -> list[int]:
        return committed


class MedusaDrafter(Branching, ResBlockDrafter):
    """Drafts up to K tokens with `MedusaHeads` in one pass (see the module docstring)."""

    name = "medusa"
    tree_branches = MEDUSA_TREE_TOPS

    def __init__(self, target: Transformer, heads: MedusaHeads):
        super().__init__(target, heads.blocks)
        self.heads = heads
        self.next_id = Tensor.empty(target.gpu, 1, "u32", "medusa unused next id")
        rows = min(heads.blocks.count, self.sampling.max_drafts)
        self.branching = HeadBranches(self.sampling, rows=rows, prior=heads.top1_by_head)

    def start(self, ctx: StepContext) -> None:
        self.branching.reset()

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        if ctx.hidden_rows == 0:
            return NO_PROPOSAL
        depth = min(k, self.blocks.count, self.sampling.max_drafts)
        if self.branches > 1 and k >= 2:
            self._run_heads(ctx, depth, GREEDY, tree=True)
            return self.branching.read(depth, k)[0]
        if depth == 0:
            return NO_PROPOSAL
        self._run_heads(ctx, depth, ctx.params, tree=False)
        return Proposal(depth, self.sampling.tokens, self.sampling.logits)

    def commit(self, ctx: StepContext, accepted: int) -> None:
        self.branching.observe(ctx.tokens[-(accepted + 1) :])

    def _run_heads(self, ctx: StepContext, k: int, params: SamplingParams, *, tree: bool) -> None:
        """Draft k tokens into `sampling` (head i's logits row into logits[i]), one submit per head; with `tree`,
        the last also finds each row's best tokens."""
        rec = self.target.registry.recorder()
        self.record_resblocks(rec, ctx, k)  # logits_i = LM·(h + silu(W_i·h + b_i)) for every head
        for i in range(k):
            if i > 0:
                rec = self.target.registry.recorder()
            self.record_row(rec, i)
            self.scatter.record(rec)  # head i's draft-vocabulary logits over the target's vocabulary
            self.sampling.record_pick(rec, self.next_id, i, params, ctx.penalties)
            if tree and i == k - 1:
                self.branching.record(rec, k)
            self.sampling.submit(rec, ctx.rng.random())

    def close(self) -> None:
        self.branching.close()
        super().close()
        self.target.registry.release_tensors(self.next_id)
