"""The ResBlock heads Medusa and spark share: K ResBlocks on the target's last verified hidden state and one LM
head over a reduced draft vocabulary, on the GPU.

With h = final_norm(f), f the target's final residual stream at the last row it verified, position i (0..K-1)
proposes the token i + 1 places after the last committed one from

    y_i = h + silu(W_i·h + b_i)      a ResBlock (zero-initialised in training, so it starts as the identity)
    z_i = lm_head(y_i)               over the N draft tokens (the most frequent target choices)

All K ResBlocks are one matmul into [gate | up] rows with up ≡ 1 (zero weights, bias one), so the model's own
SwiGLU kernel yields silu(gate) for every position at once; the LM head runs over the K rows of y as
LM·silu + LM·h (the second with the target's final norm fused into its input, h repeated in every row). Each
drafter then turns row i of the logits into a draft over the target vocabulary (`ResBlockDrafter.scatter`).

In KIND.safetensors: resblock.weight [K, H, H], resblock.bias [K, H], lm_head.weight [N, H], draft_to_target [N].
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.model.transformer import Transformer
from doppler_py.ops.elementwise import SwiGLU
from doppler_py.ops.linear import InputNorm, Linear, compile_rows
from doppler_py.ops.vocab_scatter import VocabScatter
from doppler_py.speculative.contract import NoOpHooks, StepContext
from doppler_py.speculative.drafters.gpu_drafting import DraftSampler
from doppler_py.speculative.drafters.heads.files import read_tensors, require_shapes


@dataclass
class ResBlocks:
    """K ResBlocks and their LM head loaded on the GPU."""

    count: int  # K
    gate_up: Weight  # [2KH, H]: the K ResBlock matrices stacked, then K·H zero rows (SwiGLU's "up" half)
    gate_up_bias: Tensor  # [2KH]: the K biases, then K·H ones
    lm_head: Weight  # [N, H]
    draft_to_target: np.ndarray  # [N] target ids

    def close(self) -> None:
        self.gate_up.destroy()
        self.lm_head.destroy()
        self.gate_up_bias.destroy()


def read_resblocks(
    path: Path, count: int, target: Transformer, shapes: dict[str, tuple[int, ...]] | None = None
) -> dict[str, np.ndarray]:
    """The tensors of KIND.safetensors holding `count` ResBlocks and an LM head over its draft vocabulary for
    `target`, with the head's own `shapes` too; typed errors name the file."""
    h = target.config.hidden_size
    resblocks = {"resblock.weight": (count, h, h), "resblock.bias": (count, h)}
    tensors = read_tensors(path, resblocks | (shapes or {}), target.config.vocab_size)
    require_shapes(path, tensors, {"lm_head.weight": (tensors["draft_to_target"].size, h)})
    return tensors


def upload_resblocks(target: Transformer, tensors: dict[str, np.ndarray], fmt: str, name: str) -> ResBlocks:
    """`read_resblocks`' tensors on `target`'s GPU, the matrices in `fmt`, their buffers labelled `name`."""
    gpu = target.gpu
    count, h, _ = tensors["resblock.weight"].shape
    gate_up = np.concatenate([tensors["resblock.weight"].reshape(count * h, h), np.zeros((count * h, h))])
    bias = np.concatenate([tensors["resblock.bias"].reshape(-1), np.ones(count * h)]).astype(np.float32)
    lm = tensors["lm_head.weight"]
    return ResBlocks(
        count=count,
        gate_up=Weight.from_numpy(gpu, gate_up.astype(np.float32), fmt, name=f"{name} resblocks"),
        gate_up_bias=Tensor.from_numpy(gpu, bias, "f32", f"{name} resblock bias"),
        lm_head=Weight.from_numpy(gpu, lm.astype(np.float32), fmt, name=f"{name} lm_head"),
        draft_to_target=tensors["draft_to_target"].astype(np.int64),
    )


class ResBlockDrafter(NoOpHooks):
    """A drafter over `ResBlocks`: the pass that fills logits[i] = LM·y_i (`record_resblocks`), and per position
    the copy of that row into `row`, which `scatter` spreads over the target vocabulary for `sampling`."""

    name: str  # the drafter's, also in its buffers' labels

    def __init__(self, target: Transformer, blocks: ResBlocks):
        self.target, self.blocks = target, blocks
        registry, gpu, cfg = target.registry, target.gpu, target.config
        k, h, n = blocks.count, cfg.hidden_size, blocks.draft_to_target.size
        self.features = Tensor.empty(gpu, (k, h), "f32", f"{self.name} features")  # f of the verified row, K times
        self.gate_up_out = Tensor.empty(gpu, (1, 2 * k * h), "f32", f"{self.name} gate_up")
        self.act = Tensor.empty(gpu, (k, h), "f32", f"{self.name} silu")
        self.logits = Tensor.empty(gpu, (k, n), "f32", f"{self.name} logits")
        self.row = Tensor.empty(gpu, (1, n), "f32", f"{self.name} row")
        self.scratch = Tensor.empty(gpu, (k, h), "f32", f"{self.name} norm scratch")
        norm = self.norm = InputNorm(target.weights.norm, cfg.rms_norm_eps, self.scratch)  # h = final_norm(f)
        self.resblocks = Linear(
            registry, blocks.gate_up, self.features, self.gate_up_out, max_rows=1, bias=blocks.gate_up_bias, norm=norm
        )
        self.silu = SwiGLU(registry, self.gate_up_out, self.act, ffn_dim=k * h, max_rows=1)
        self.lm_act = Linear(registry, blocks.lm_head, self.act, self.logits, max_rows=k)
        self.lm_h = Linear(registry, blocks.lm_head, self.features, self.logits, max_rows=k, accumulate=True, norm=norm)
        self.sampling = DraftSampler(target, cfg.vocab_size)
        self.scatter = VocabScatter(registry, self.row, blocks.draft_to_target, self.sampling.row)

    def matmuls(self) -> tuple[Linear, ...]:
        return (self.resblocks, self.lm_act, self.lm_h)

    def compile(self, max_rows: int | None = None) -> None:
        """Compile the heads' matmul pipelines ahead of use (`compile_rows`): the engine runs it beside its own
        warm-up; on first use with `--weights keep` they compiled mid-generation (4-5 pipelines on lavapipe)."""
        compile_rows(self.matmuls(), max_rows=max_rows)

    def record_resblocks(self, rec: Recorder, ctx: StepContext, k: int) -> None:
        """Record logits[i] = LM·y_i for the first k positions, from the verified row of `ctx.hidden`."""
        h = self.target.config.hidden_size
        last = (ctx.hidden_rows - 1) * h * 4
        for i in range(k):  # the verified row, once per position (the LM head's h term reads one row per position)
            rec.copy(ctx.hidden, self.features, h * 4, src_offset=last, dst_offset=i * h * 4)
        self.resblocks.record(rec, rows=1)  # matmul: [W_i·h + b_i | 1] for every position
        self.silu.record(rec, rows=1)  # silu(W_i·h + b_i)·1
        self.lm_act.record(rec, rows=k)  # matmul: logits_i = LM·silu_i
        self.lm_h.record(rec, rows=k)  # matmul: logits_i += LM·h

    def record_row(self, rec: Recorder, i: int) -> None:
        """Record the copy of position i's logits into `row`."""
        n = self.blocks.draft_to_target.size
        rec.copy(self.logits, self.row, n * 4, src_offset=i * n * 4)

    def close(self) -> None:
        registry = self.target.registry
        self.scatter.release(registry)
        self.sampling.close()
        registry.release_tensors(self.features, self.gate_up_out, self.act, self.logits, self.row, self.scratch)
