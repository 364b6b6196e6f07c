"""Spark: a block drafter. ONE head pass over the target's last verified hidden state proposes a block of K
tokens, a cheap previous-token bias adjusts each position, and a confidence head says how many of the block
are worth verifying.

With h = final_norm(f), f the target's final residual stream at the last row it verified (whose logits gave the
last committed token t), position i (0..K-1) proposes the token i + 1 places after t:

    y_i = h + silu(W_i·h + b_i)                  a ResBlock per position (Medusa's; zero-initialised in training)
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
from doppler_py.ops.elementwise import SwiGLU
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import InputNorm, Linear, compile_rows
from doppler_py.ops.vocab_scatter import VocabScatter
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.drafters.gpu_drafting import DraftSampler
from doppler_py.speculative.drafters.heads.files import dense_format, read_meta, read_tensors
from doppler_py.tokenizer import Tokenizer


@dataclass
class SparkHead:
    """A spark head folder loaded on the GPU for one target."""

    folder: Path
    block: int
    gate_up: Weight  # [2KH, H]: the K ResBlock matrices, then K·H zero rows (SwiGLU's "up" half, bias one)
    gate_up_bias: Tensor  # [2KH]
    lm_head: Weight  # [N, H]
    prev_embed: Weight  # [V_target, r]: prev.embed's row for each target id (its draft slot, or row N)
    prev_proj: Weight  # [N, r]
    confidence: Weight  # [K, H]
    confidence_bias: Tensor  # [K]
    draft_to_target: np.ndarray

    def close(self) -> None:
        for weight in (self.gate_up, self.lm_head, self.prev_embed, self.prev_proj, self.confidence):
            weight.destroy()
        self.gate_up_bias.destroy()
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
    shapes = {
        "resblock.weight": (block, h, h),
        "resblock.bias": (block, h),
        "confidence.weight": (block, h),
        "confidence.bias": (block,),
    }
    tensors = read_tensors(path, shapes, vocab)
    draft_to_target = tensors["draft_to_target"].astype(np.int64)
    n = draft_to_target.size
    for name, shape in (("lm_head.weight", (n, h)), ("prev.embed", (n + 1, rank)), ("prev.proj", (n, rank))):
        if name not in tensors or tensors[name].shape != shape:
            raise ModelFormatError(
                f"{path}: tensor {name} must have shape {shape}, got {getattr(tensors.get(name), 'shape', None)}"
            )
    fmt = dense_format(precision, tensors["lm_head.weight"].dtype)
    slots = np.full(vocab, n, np.int64)
    slots[draft_to_target] = np.arange(n)
    gate_up = np.concatenate([tensors["resblock.weight"].reshape(block * h, h), np.zeros((block * h, h))])
    bias = np.concatenate([tensors["resblock.bias"].reshape(-1), np.ones(block * h)]).astype(np.float32)
    gpu = target.gpu

    def dense(name: str, array: np.ndarray) -> Weight:
        return Weight.from_numpy(gpu, np.ascontiguousarray(array, np.float32), fmt, name=f"spark {name}")

    return SparkHead(
        folder=folder,
        block=block,
        gate_up=dense("resblocks", gate_up),
        gate_up_bias=Tensor.from_numpy(gpu, bias, "f32", "spark resblock bias"),
        lm_head=dense("lm_head", tensors["lm_head.weight"]),
        prev_embed=dense("prev.embed", tensors["prev.embed"].astype(np.float32)[slots]),
        prev_proj=dense("prev.proj", tensors["prev.proj"]),
        confidence=dense("confidence", tensors["confidence.weight"]),
        confidence_bias=Tensor.from_numpy(gpu, tensors["confidence.bias"].astype(np.float32), "f32", "spark cb"),
        draft_to_target=draft_to_target,
    )


class SparkDrafter(NoOpHooks):
    """Drafts a block of up to K tokens with a `SparkHead` (see the module docstring)."""

    name = "spark"

    def __init__(self, target: Transformer, head: SparkHead):
        self.target, self.head = target, head
        registry, gpu, cfg = target.registry, target.gpu, target.config
        k, h, n = head.block, cfg.hidden_size, head.draft_to_target.size
        rank = head.prev_proj.shape[1]
        self.features = Tensor.empty(gpu, (k, h), "f32", "spark features")  # f of the verified row, K times
        self.gate_up_out = Tensor.empty(gpu, (1, 2 * k * h), "f32", "spark gate_up")
        self.act = Tensor.empty(gpu, (k, h), "f32", "spark silu")
        self.logits = Tensor.empty(gpu, (k, n), "f32", "spark logits")
        self.conf = Tensor.empty(gpu, (1, k), "f32", "spark confidence logits")
        self.row = Tensor.empty(gpu, (1, n), "f32", "spark row")
        self.prev = Tensor.empty(gpu, 1, "u32", "spark previous token")
        self.prev_vec = Tensor.empty(gpu, (1, rank), "f32", "spark previous-token vector")
        self.scratch = Tensor.empty(gpu, (k, h), "f32", "spark norm scratch")
        norm = InputNorm(target.weights.norm, cfg.rms_norm_eps, self.scratch)
        self.resblocks = Linear(
            registry, head.gate_up, self.features, self.gate_up_out, max_rows=1, bias=head.gate_up_bias, norm=norm
        )
        self.silu = SwiGLU(registry, self.gate_up_out, self.act, ffn_dim=k * h, max_rows=1)
        self.lm_act = Linear(registry, head.lm_head, self.act, self.logits, max_rows=k)
        self.lm_h = Linear(registry, head.lm_head, self.features, self.logits, max_rows=k, accumulate=True, norm=norm)
        self.confidence = Linear(
            registry, head.confidence, self.features, self.conf, max_rows=1, bias=head.confidence_bias, norm=norm
        )
        self.gather = Embedding(registry, head.prev_embed, self.prev, self.prev_vec, max_rows=1)
        self.bias = Linear(registry, head.prev_proj, self.prev_vec, self.row, max_rows=1, accumulate=True)
        self.sampling = DraftSampler(target, cfg.vocab_size)
        self.scatter = VocabScatter(registry, self.row, head.draft_to_target, self.sampling.row)

    def compile(self) -> None:
        """Compile the heads' matmul pipelines ahead of use (`compile_rows`): the engine runs it beside its own
        warm-up; on first use with `--weights keep` they compiled mid-generation (4-5 pipelines on lavapipe)."""
        compile_rows((self.resblocks, self.lm_act, self.lm_h, self.confidence, self.bias))

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        depth = min(k, self.head.block, self.sampling.max_drafts)
        if ctx.hidden_rows == 0 or depth == 0:
            return NO_PROPOSAL
        h, n = self.target.config.hidden_size, self.head.draft_to_target.size
        rec = self.target.registry.recorder()
        last = (ctx.hidden_rows - 1) * h * 4
        for i in range(depth):  # the verified row, once per position (the LM head's h term reads one per row)
            rec.copy(ctx.hidden, self.features, h * 4, src_offset=last, dst_offset=i * h * 4)
        self.prev.write(np.array([ctx.tokens[-1]], np.uint32))
        self.resblocks.record(rec, rows=1)  # matmul: [W_i·h + b_i | 1] for every position
        self.silu.record(rec, rows=1)
        self.lm_act.record(rec, rows=depth)  # LM·silu_i
        self.lm_h.record(rec, rows=depth)  # += LM·h
        self.confidence.record(rec, rows=1)  # C·h + cb
        for i in range(depth):
            if i > 0:
                rec = self.target.registry.recorder()
            rec.copy(self.logits, self.row, n * 4, src_offset=i * n * 4)
            self.gather.record(rec, rows=1)  # E[prev_i]
            self.bias.record(rec, rows=1)  # z_i += P·E[prev_i]
            self.scatter.record(rec)
            self.sampling.record_pick(rec, self.prev, i, ctx.params)  # d_i, also prev_{i+1}
            self.sampling.submit(rec, ctx.rng.random())
        raw = self.target.gpu.queue.read_buffer(self.conf.buffer, 0, 4 * depth)
        accepted_chance = 1.0 / (1.0 + np.exp(-np.frombuffer(raw, np.float32).astype(np.float64)))
        values = np.cumprod(accepted_chance).tolist()
        return Proposal(depth, self.sampling.tokens, self.sampling.logits, values=values)

    def close(self) -> None:
        registry = self.target.registry
        self.scatter.release(registry)
        self.sampling.close()
        registry.release_tensors(
            self.features,
            self.gate_up_out,
            self.act,
            self.logits,
            self.conf,
            self.row,
            self.prev,
            self.prev_vec,
            self.scratch,
        )
