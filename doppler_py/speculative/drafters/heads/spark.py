"""Spark: a block drafter. ONE head pass over the target's last verified hidden state proposes a block of K
tokens, a cheap previous-token bias adjusts each position, and a confidence head says how many of the block
are worth verifying.

With h = final_norm(f), f the target's final residual stream at the last row it verified (whose logits gave the
last committed token t), position i (0..K-1) proposes the token i + 1 places after t:

    y_i = h + silu(W_i·h + b_i)                  a ResBlock per position (Medusa's: `resblock`; zero-initialised)
    z_i = lm_head(y_i) + P·E[prev_i]             over a reduced draft vocabulary of N tokens; prev_0 = t and
                                                 prev_i = d_{i-1}: a rank-r bias from the token before it
    c_i = sigmoid(C_i·h + cb_i)                  the chance that d_i is accepted once d_0..d_{i-1} were

d_i is sampled from z_i (spread over the target vocabulary, -inf elsewhere) on the GPU, and its id is fed to the
next position's bias there. The confidences come back with the drafts (one small readback) as the proposal's
`values`, the expected accepted tokens of each leading run: c_0, c_0·c_1, ... The engine then verifies the
leading run whose expected tokens most exceed what its verification time makes at this device's measured
throughput (`policy.tree_budget`), so the confidence head chooses how much of the block is verified. The bias
makes q_i depend on the drafts before it, which the verification allows (each d_i is drawn from its own q_i).

A head folder (written by `doppler_py.training.spark`):
    spark.json           kind, block (K), rank (r), the target it was made for (`head_files`), draft vocabulary size
    spark.safetensors    resblock.weight [K, H, H], resblock.bias [K, H], lm_head.weight [N, H],
                         prev.embed [N + 1, r] (row N: any token outside the draft vocabulary), prev.proj [N, r],
                         confidence.weight [K, H], confidence.bias [K], draft_to_target [N]
    training_card.json   how it was trained
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import ModelFormatError
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.model.transformer import Transformer
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import Linear
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal, StepContext
from doppler_py.speculative.drafters.heads.files import dense_format, read_meta, require_shapes
from doppler_py.speculative.drafters.heads.resblock import ResBlockDrafter, ResBlocks, read_resblocks, upload_resblocks
from doppler_py.tokenizer import Tokenizer


@dataclass
class SparkHead:
    """A spark head folder loaded on the GPU for one target."""

    folder: Path
    blocks: ResBlocks  # one per block position
    prev_embed: Weight  # [V_target, r]: prev.embed's row for each target id (its draft slot, or row N)
    prev_proj: Weight  # [N, r]
    confidence: Weight  # [K, H]
    confidence_bias: Tensor  # [K]

    def close(self) -> None:
        self.blocks.close()
        for weight in (self.prev_embed, self.prev_proj, self.confidence):
            weight.destroy()
        self.confidence_bias.destroy()


def load_spark(
    folder: str | Path, target: Transformer, precision: str = "f32", tokenizer: Tokenizer | None = None
) -> SparkHead:
    """Load a spark head for `target` (and its `tokenizer`, when given), refusing one made for another model;
    typed errors name the file. precision: the target's weight format ("keep": as the head stores them)."""
    folder = Path(folder)
    meta = read_meta(folder, "spark", target, tokenizer)
    h, vocab, path = target.config.hidden_size, target.config.vocab_size, folder / "spark.safetensors"
    block, rank = meta.get("block"), meta.get("rank")
    for name, value in (("block", block), ("rank", rank)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ModelFormatError(f"{folder / 'spark.json'}: {name!r} must be a positive integer, got {value!r}")
    if rank % 32:  # the matmul kernels' blocks along K
        raise ModelFormatError(f"{folder / 'spark.json'}: 'rank' must be a multiple of 32, got {rank}")
    tensors = read_resblocks(path, block, target, {"confidence.weight": (block, h), "confidence.bias": (block,)})
    n = tensors["draft_to_target"].size
    require_shapes(path, tensors, {"prev.embed": (n + 1, rank), "prev.proj": (n, rank)})
    fmt = dense_format(target, precision, tensors["lm_head.weight"].dtype)
    slots = np.full(vocab, n, np.int64)
    slots[tensors["draft_to_target"]] = np.arange(n)
    gpu = target.gpu

    def dense(name: str, array: np.ndarray) -> Weight:
        return Weight.from_numpy(gpu, np.ascontiguousarray(array, np.float32), fmt, name=f"spark {name}")

    return SparkHead(
        folder=folder,
        blocks=upload_resblocks(target, tensors, fmt, "spark"),
        prev_embed=dense("prev.embed", tensors["prev.embed"].astype(np.float32)[slots]),
        prev_proj=dense("prev.proj", tensors["prev.proj"]),
        confidence=dense("confidence", tensors["confidence.weight"]),
        confidence_bias=Tensor.from_numpy(gpu, tensors["confidence.bias"].astype(np.float32), "f32", "spark cb"),
    )


class SparkDrafter(ResBlockDrafter):
    """Drafts a block of up to K tokens with a `SparkHead` (see the module docstring)."""

    name = "spark"

    def __init__(self, target: Transformer, head: SparkHead):
        super().__init__(target, head.blocks)
        self.head = head
        registry, gpu = target.registry, target.gpu
        k, rank = head.blocks.count, head.prev_proj.shape[1]
        self.conf = Tensor.empty(gpu, (1, k), "f32", "spark confidence logits")
        self.prev = Tensor.empty(gpu, 1, "u32", "spark previous token")
        self.prev_vec = Tensor.empty(gpu, (1, rank), "f32", "spark previous-token vector")
        self.confidence = Linear(
            registry, head.confidence, self.features, self.conf, max_rows=1, bias=head.confidence_bias, norm=self.norm
        )
        self.gather = Embedding(registry, head.prev_embed, self.prev, self.prev_vec, max_rows=1)
        self.bias = Linear(registry, head.prev_proj, self.prev_vec, self.row, max_rows=1, accumulate=True)

    def matmuls(self) -> tuple[Linear, ...]:
        return (*super().matmuls(), self.confidence, self.bias)

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        depth = min(k, self.blocks.count, self.sampling.max_drafts)
        if ctx.hidden_rows == 0 or depth == 0:
            return NO_PROPOSAL
        rec = self.target.registry.recorder()
        self.prev.write(np.array([ctx.tokens[-1]], np.uint32))
        self.record_resblocks(rec, ctx, depth)  # LM·(h + silu(W_i·h + b_i)) for every position
        self.confidence.record(rec, rows=1)  # C·h + cb
        for i in range(depth):
            if i > 0:
                rec = self.target.registry.recorder()
            self.record_row(rec, i)
            self.gather.record(rec, rows=1)  # E[prev_i]
            self.bias.record(rec, rows=1)  # z_i += P·E[prev_i]
            self.scatter.record(rec)
            self.sampling.record_pick(rec, self.prev, i, ctx.params, ctx.penalties)  # d_i, also prev_{i+1}
            self.sampling.submit(rec, ctx.rng.random())
        raw = self.target.gpu.queue.read_buffer(self.conf.buffer, 0, 4 * depth)
        accepted_chance = 1.0 / (1.0 + np.exp(-np.frombuffer(raw, np.float32).astype(np.float64)))
        values = np.cumprod(accepted_chance).tolist()
        return Proposal(depth, self.sampling.tokens, self.sampling.logits, values=values)

    def close(self) -> None:
        super().close()
        self.target.registry.release_tensors(self.conf, self.prev, self.prev_vec)
