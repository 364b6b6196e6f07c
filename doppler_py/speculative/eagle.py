"""EAGLE drafting: a one-layer head that reads the target's own features and drafts on the GPU.

The head, at position p, takes the pair (f_p, t_{p+1}) — the target's final residual stream at p (before the
final norm) and the embedding of the token after it — and predicts f_{p+1} (in standardised units) and the
token after that over a reduced draft vocabulary (the N most frequent target tokens):

    x   = W_e·E[t_{p+1}] + b + W_f·(f_p − μ)/σ          (W_f/σ and −W_f·μ/σ folded at load for target rows)
    out = decoder_layer(x)                              own KV cache, RoPE at position p
    q   = lm_head(rmsnorm(out)) → spread over the target vocabulary (-inf elsewhere) → sampled

The first draft comes from the pairs of the rows the target just verified; each further draft feeds back the
head's own `out` as the next feature with the token it just sampled. Nothing returns to the host while drafting.
With `branches` > 1 it proposes a token tree (`gpu_drafting.TreeBranches`): its greedy chain plus each draft
row's second-best token as a side leaf, read back once; after a tree step the target's features of the
accepted path are moved into consecutive rows (the engine), so the head consumes them as after a chain.

A head folder (written by `doppler_py.training.eagle`):
    config.json, model.safetensors   the decoder layer, its norm and the LM head as a one-layer LLaMA whose
                                     tied embedding is the draft LM head (loads with our loader and with HF)
    eagle.safetensors                fc_embed.weight [H, H], fc_embed.bias [H], fc_feature.weight [H, H],
                                     feature_mean [H], feature_std [H], draft_to_target [N] (target ids)
    eagle.json                       kind, the target it was made for (hidden size, vocabulary, layers, model
                                     type), the draft vocabulary size
    training_card.json               how it was trained (data, steps, losses, acceptance)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.errors import InternalError, ModelFormatError
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import Linear
from doppler_py.ops.vocab_scatter import VocabScatter
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal, StepContext
from doppler_py.speculative.gpu_drafting import GREEDY, Branching, DraftSampler, TreeBranches
from doppler_py.speculative.head_files import dense_format, read_meta, read_tensors
from doppler_py.tokenizer import Tokenizer


@dataclass
class EagleHead:
    """A head folder loaded on the GPU for one target."""

    folder: Path
    model: Transformer  # the decoder layer + norm + draft LM head (vocabulary = the draft vocabulary)
    fc_embed: Weight
    fc_bias: Tensor
    fc_feature_raw: Weight  # W_f / σ: for the target's own features
    fc_feature_raw_bias: Tensor  # −W_f·μ/σ
    fc_feature: Weight  # W_f: for the head's own (standardised) predictions
    draft_to_target: np.ndarray

    def close(self) -> None:
        self.model.close()
        self.model.weights.destroy()
        for w in (self.fc_embed, self.fc_feature_raw, self.fc_feature):
            w.destroy()
        for t in (self.fc_bias, self.fc_feature_raw_bias):
            t.destroy()


def load_head(
    folder: str | Path, target: Transformer, precision: str = "f32", tokenizer: Tokenizer | None = None
) -> EagleHead:
    """Load an EAGLE head for `target` (and its `tokenizer`, when given), refusing one made for another model;
    typed errors name the file. precision: the target's weight format ("keep": as the head stores them)."""
    folder = Path(folder)
    read_meta(folder, "eagle", target, tokenizer)
    cfg = target.config
    h = cfg.hidden_size
    shapes = {"fc_embed.weight": (h, h), "fc_embed.bias": (h,), "fc_feature.weight": (h, h)}
    shapes |= {"feature_mean": (h,), "feature_std": (h,)}
    tensors = read_tensors(folder / "eagle.safetensors", shapes, cfg.vocab_size)
    if not (tensors["feature_std"] > 0).all():
        raise ModelFormatError(f"{folder / 'eagle.safetensors'}: feature_std must be positive")
    gpu = target.gpu
    fmt = dense_format(precision, tensors["fc_embed.weight"].dtype)
    weights = load_weights(folder, gpu, fmt if precision == "keep" else precision)
    try:
        model = Transformer(weights, target.registry, max_rows=target.max_rows, max_logit_rows=1)
    except BaseException:
        weights.destroy()
        raise
    if model.config.hidden_size != cfg.hidden_size:
        model.close()
        weights.destroy()
        raise ModelFormatError(
            f"{folder / 'config.json'}: the head's layer has hidden size {model.config.hidden_size}, the target's is "
            f"{cfg.hidden_size}"
        )
    w_f = tensors["fc_feature.weight"].astype(np.float64)
    mean, std = tensors["feature_mean"].astype(np.float64), tensors["feature_std"].astype(np.float64)

    def upload(name: str, w: np.ndarray) -> Weight:
        return Weight.from_numpy(gpu, np.ascontiguousarray(w, np.float32), fmt, name=name)

    return EagleHead(
        folder=folder,
        model=model,
        fc_embed=upload("fc_embed", tensors["fc_embed.weight"]),
        fc_bias=Tensor.from_numpy(gpu, tensors["fc_embed.bias"].astype(np.float32), "f32", "fc_bias"),
        # f32 whatever the precision: x·(W_f/σ) − W_f·μ/σ cancels two large terms on SmolLM2's massive-activation
        # dimensions (|x|, |μ| in the thousands), where f16's 3 digits would leave an error of order one.
        fc_feature_raw=Weight.from_numpy(gpu, (w_f / std[None, :]).astype(np.float32), "f32", name="fc_feature_raw"),
        fc_feature_raw_bias=Tensor.from_numpy(gpu, (-(w_f @ (mean / std))).astype(np.float32), "f32", "fc_raw_bias"),
        fc_feature=upload("fc_feature", w_f),
        draft_to_target=tensors["draft_to_target"].astype(np.int64),
    )


class EagleDrafter(Branching):
    """Drafts with an `EagleHead` on the GPU (see the module docstring)."""

    name = "eagle"

    def __init__(self, target: Transformer, head: EagleHead):
        self.target, self.head = target, head
        model, registry, gpu = head.model, target.registry, target.gpu
        hidden, rows = target.config.hidden_size, model.max_rows
        if head.draft_to_target.size != model.config.vocab_size:
            raise ModelFormatError(
                f"{head.folder}: draft_to_target maps {head.draft_to_target.size} ids, the head's LM head has "
                f"{model.config.vocab_size} rows"
            )
        self.emb = Tensor.empty(gpu, (rows, hidden), "f32", "eagle emb")
        self.features = Tensor.empty(gpu, (rows, hidden), "f32", "eagle features")
        self.embed = Embedding(registry, target.weights.embed, model.ids, self.emb, max_rows=rows)
        self.fc_embed = Linear(registry, head.fc_embed, self.emb, model.x, max_rows=rows, bias=head.fc_bias)
        self.fc_raw = Linear(
            registry, head.fc_feature_raw, self.features, model.x, max_rows=rows, bias=head.fc_feature_raw_bias,
            accumulate=True,
        )  # fmt: skip
        self.fc_own = Linear(registry, head.fc_feature, self.features, model.x, max_rows=1, accumulate=True)
        self.sampling = DraftSampler(model, target.config.vocab_size)
        self.branching = TreeBranches(self.sampling)
        self.scatter = VocabScatter(registry, model.logits, head.draft_to_target, self.sampling.row)
        self.cache: KVCache | None = None
        self.consumed = 0  # pairs (f_p, t_{p+1}) in the head cache: positions 0..consumed-1
        self.out_row = 0  # the row of model.x holding the head's latest prediction

    def start(self, ctx: StepContext) -> None:
        self.finish()
        self.branching.reset()
        self.cache = self.head.model.new_cache(ctx.capacity)

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        self._consume(ctx, begin + ctx.hidden_rows)

    def commit(self, ctx: StepContext, accepted: int) -> None:
        self.branching.observe(ctx.tokens[-(accepted + 1) :])
        self.cache.truncate(self.consumed)  # drop the pairs built on the head's own predictions
        self._consume(ctx, len(ctx.tokens) - 1)

    def _consume(self, ctx: StepContext, m: int) -> None:
        """Feed the head every pair whose feature the target just produced (it has consumed tokens[:m]):
        positions consumed..m-1."""
        rows = m - self.consumed
        if rows <= 0:
            return
        if rows > ctx.hidden_rows:
            raise InternalError(f"EAGLE head lags {rows} positions, but the target holds only {ctx.hidden_rows} rows")
        model, hidden = self.head.model, self.target.config.hidden_size
        model.ids.view((rows,)).write(self.target.check_ids(ctx.tokens[self.consumed + 1 : m + 1]))
        rec = model.registry.recorder()
        row_bytes = hidden * 4
        rec.copy(ctx.hidden, self.features, rows * row_bytes, src_offset=(ctx.hidden_rows - rows) * row_bytes)
        self.embed.record(rec, rows=rows)  # gather: emb = E[t_{p+1}]
        self.fc_embed.record(rec, rows=rows)  # matmul: x = emb·W_eᵀ + b
        self.fc_raw.record(rec, rows=rows)  # matmul: x += f·(W_f/σ)ᵀ − W_f·μ/σ
        model.record_forward(rec, rows, self.cache, self.consumed, logits="last", embedded=True)
        rec.submit()
        self.consumed, self.out_row = m, rows - 1

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        m = len(ctx.tokens) - 1
        k = min(k, self.sampling.max_drafts)
        if self.consumed == 0 or self.consumed != m or self.cache.free < k:
            return NO_PROPOSAL
        if self.branches > 1 and k >= 2:  # a tree: the greedy chain plus second-best leaves
            depth = self.branching.chain_length(k)
            self._draft(ctx, depth, GREEDY, tree=True)
            return self.branching.read(depth, k)[0]
        self._draft(ctx, k, ctx.params, tree=False)
        return Proposal(k, self.sampling.tokens, self.sampling.logits)

    def _draft(self, ctx: StepContext, k: int, params: SamplingParams, *, tree: bool) -> None:
        """Draft k tokens into `sampling`, one submit each; with `tree`, the last also finds each row's best
        tokens."""
        m = len(ctx.tokens) - 1
        model, hidden = self.head.model, self.target.config.hidden_size
        for i in range(k):
            rec = model.registry.recorder()
            if i > 0:  # the pair (the head's predicted f, d_{i-1}) at position m + i - 1
                rec.copy(model.x, self.features, hidden * 4, src_offset=self.out_row * hidden * 4)
                self.embed.record(rec, rows=1)
                self.fc_embed.record(rec, rows=1)
                self.fc_own.record(rec, rows=1)
                model.record_forward(rec, 1, self.cache, m + i - 1, logits="last", embedded=True)
                self.out_row = 0
            self.scatter.record(rec)  # the draft-vocabulary logits over the target's vocabulary
            self.sampling.record_pick(rec, model.ids, i, params)
            if tree and i == k - 1:
                self.branching.record(rec, k)
            self.sampling.submit(rec, ctx.rng.random())

    def finish(self) -> None:
        if self.cache is not None:
            self.head.model.release_cache(self.cache)
            self.cache = None
        self.consumed = self.out_row = 0

    def close(self) -> None:
        self.finish()
        self.scatter.release(self.target.registry)
        self.branching.close()
        self.sampling.close()
        self.target.registry.release_tensors(self.emb, self.features)
