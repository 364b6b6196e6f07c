"""Medusa drafting: K heads on the target's last verified hidden state propose K tokens at once, on the GPU.

Head i (i = 1..K) reads h = final_norm(f), f the target's final residual stream at the last row it verified
(the row whose logits gave the last committed token t), and proposes the token i places after t:

    y_i = h + silu(W_i·h + b_i)      a ResBlock (zero-initialised in training, so it starts as the identity)
    q_i = lm_head(y_i)               one LM head shared by the heads, over a reduced draft vocabulary (the N most
                                     frequent target tokens), spread over the target vocabulary (-inf elsewhere)

and d_i is sampled from q_i on the GPU. The heads do not see each other's drafts: every q_i is fixed before
drafting, which the verification allows (d_i is drawn from q_i, whatever q_i depends on). No KV cache, no host
round trip; the target's features need no copy either, since the heads read the verified row where it is.

On the GPU all K ResBlocks are one matmul into [gate | up] rows with up ≡ 1 (zero weights, bias one), so the
model's own SwiGLU kernel yields silu(gate) for every head at once; the LM head runs over the K rows of y as
LM·silu + LM·h (the second with the target's final norm fused into its input, h repeated in every row).

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
from doppler_py.gpu.weights import Weight
from doppler_py.model.transformer import Transformer
from doppler_py.ops.elementwise import SwiGLU
from doppler_py.ops.linear import InputNorm, Linear, compile_rows
from doppler_py.ops.vocab_scatter import VocabScatter
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.drafters.gpu_drafting import GREEDY, Branching, DraftSampler, TreeBranches
from doppler_py.speculative.drafters.heads.files import dense_format, read_meta, read_tensors
from doppler_py.speculative.trees.ranked import MEDUSA_TREE_TOPS, medusa_tree
from doppler_py.tokenizer import Tokenizer


@dataclass
class MedusaHeads:
    """A Medusa head folder loaded on the GPU for one target."""

    folder: Path
    heads: int
    gate_up: Weight  # [2KH, H]: the K ResBlock matrices stacked, then K·H zero rows (the "up" half)
    gate_up_bias: Tensor  # [2KH]: the K biases, then K·H ones
    lm_head: Weight  # [N, H]
    draft_to_target: np.ndarray
    top1_by_head: Sequence[float] | None = None  # validation top-1 per head, from the training card

    def close(self) -> None:
        self.gate_up.destroy()
        self.lm_head.destroy()
        self.gate_up_bias.destroy()


def load_medusa(
    folder: str | Path, target: Transformer, precision: str = "f32", tokenizer: Tokenizer | None = None
) -> MedusaHeads:
    """Load Medusa heads for `target` (and its `tokenizer`, when given), refusing heads made for another model;
    typed errors name the file. precision: the target's weight format ("keep": as the heads store them)."""
    folder = Path(folder)
    meta = read_meta(folder, "medusa", target, tokenizer)
    h, path = target.config.hidden_size, folder / "medusa.safetensors"
    heads = meta.get("heads")
    if not isinstance(heads, int) or heads < 1:
        raise ModelFormatError(f"{folder / 'medusa.json'}: 'heads' must be a positive integer, got {heads!r}")
    tensors = read_tensors(
        path, {"resblock.weight": (heads, h, h), "resblock.bias": (heads, h)}, target.config.vocab_size
    )
    n = tensors["draft_to_target"].size
    lm = tensors.get("lm_head.weight")
    if lm is None or lm.shape != (n, h):
        raise ModelFormatError(
            f"{path}: tensor lm_head.weight must have shape {(n, h)}, got {getattr(lm, 'shape', None)}"
        )
    fmt = dense_format(precision, lm.dtype)
    gate_up = np.concatenate([tensors["resblock.weight"].reshape(heads * h, h), np.zeros((heads * h, h))])
    bias = np.concatenate([tensors["resblock.bias"].reshape(-1), np.ones(heads * h)]).astype(np.float32)
    gpu = target.gpu
    return MedusaHeads(
        folder=folder,
        heads=heads,
        gate_up=Weight.from_numpy(gpu, gate_up.astype(np.float32), fmt, name="medusa resblocks"),
        gate_up_bias=Tensor.from_numpy(gpu, bias, "f32", "medusa resblock bias"),
        lm_head=Weight.from_numpy(gpu, lm.astype(np.float32), fmt, name="medusa lm_head"),
        draft_to_target=tensors["draft_to_target"].astype(np.int64),
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


class MedusaDrafter(Branching, NoOpHooks):
    """Drafts up to K tokens with `MedusaHeads` in one pass (see the module docstring)."""

    name = "medusa"
    tree_branches = MEDUSA_TREE_TOPS

    def __init__(self, target: Transformer, heads: MedusaHeads):
        self.target, self.heads = target, heads
        registry, gpu, cfg = target.registry, target.gpu, target.config
        k, h, n = heads.heads, cfg.hidden_size, heads.draft_to_target.size
        self.features = Tensor.empty(gpu, (k, h), "f32", "medusa features")  # f of the verified row, K times
        self.gate_up_out = Tensor.empty(gpu, (1, 2 * k * h), "f32", "medusa gate_up")
        self.act = Tensor.empty(gpu, (k, h), "f32", "medusa silu")
        self.logits = Tensor.empty(gpu, (k, n), "f32", "medusa logits")
        self.row = Tensor.empty(gpu, n, "f32", "medusa row")
        self.scratch = Tensor.empty(gpu, (k, h), "f32", "medusa norm scratch")
        self.next_id = Tensor.empty(gpu, 1, "u32", "medusa unused next id")
        norm = InputNorm(target.weights.norm, cfg.rms_norm_eps, self.scratch)
        self.resblocks = Linear(
            registry, heads.gate_up, self.features, self.gate_up_out, max_rows=1, bias=heads.gate_up_bias, norm=norm
        )
        self.silu = SwiGLU(registry, self.gate_up_out, self.act, ffn_dim=k * h, max_rows=1)
        self.lm_act = Linear(registry, heads.lm_head, self.act, self.logits, max_rows=k)
        self.lm_h = Linear(registry, heads.lm_head, self.features, self.logits, max_rows=k, accumulate=True, norm=norm)
        self.sampling = DraftSampler(target, cfg.vocab_size)
        self.scatter = VocabScatter(registry, self.row, heads.draft_to_target, self.sampling.row)
        self.branching = HeadBranches(self.sampling, rows=min(k, self.sampling.max_drafts), prior=heads.top1_by_head)

    def start(self, ctx: StepContext) -> None:
        self.branching.reset()

    def compile(self) -> None:
        """Compile the heads' matmul pipelines ahead of use (`compile_rows`): the engine runs it beside its own
        warm-up; on first use with `--weights keep` they compiled mid-generation (4-5 pipelines on lavapipe)."""
        compile_rows((self.resblocks, self.lm_act, self.lm_h))

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        if ctx.hidden_rows == 0:
            return NO_PROPOSAL
        depth = min(k, self.heads.heads, self.sampling.max_drafts)
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
        h, n = self.target.config.hidden_size, self.heads.draft_to_target.size
        rec = self.target.registry.recorder()
        last = (ctx.hidden_rows - 1) * h * 4
        for i in range(k):  # the verified row, once per head (the LM head's h term reads one row per head)
            rec.copy(ctx.hidden, self.features, h * 4, src_offset=last, dst_offset=i * h * 4)
        self.resblocks.record(rec, rows=1)  # matmul: [W_i·h + b_i | 1] for all heads
        self.silu.record(rec, rows=1)  # silu(W_i·h + b_i)·1
        self.lm_act.record(rec, rows=k)  # LM·silu_i
        self.lm_h.record(rec, rows=k)  # += LM·h
        for i in range(k):
            if i > 0:
                rec = self.target.registry.recorder()
            rec.copy(self.logits, self.row, n * 4, src_offset=i * n * 4)
            self.scatter.record(rec)  # head i's draft-vocabulary logits over the target's vocabulary
            self.sampling.record_pick(rec, self.next_id, i, params)
            if tree and i == k - 1:
                self.branching.record(rec, k)
            self.sampling.submit(rec, ctx.rng.random())

    def close(self) -> None:
        self.scatter.release(self.target.registry)
        self.branching.close()
        self.sampling.close()
        self.target.registry.release_tensors(
            self.features, self.gate_up_out, self.act, self.logits, self.row, self.scratch, self.next_id
        )
