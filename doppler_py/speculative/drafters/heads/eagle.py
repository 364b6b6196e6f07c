"""EAGLE drafting: a one-layer head that reads the target's own features and drafts on the GPU.

The head, at position p, takes the pair (f_p, t_{p+1}) — the target's final residual stream at p (before the
final norm) and the embedding of the token after it — and predicts f_{p+1} (in standardised units) and the
token after that over a reduced draft vocabulary (the N most frequent target tokens):

    x   = W_e·E[t_{p+1}] + b + W_f·(f_p − μ)/σ          (a target row standardised first, `Standardize`)
    out = decoder_layer(x)                              own KV cache, RoPE at position p
    q   = lm_head(rmsnorm(out)) → spread over the target vocabulary (-inf elsewhere) → sampled

The first draft comes from the pairs of the rows the target just verified; each further draft feeds back the
head's own `out` as the next feature with the token it just sampled. An EAGLE-3-style head (`feature_taps`) also
fuses, for the target's rows, the outputs of a few lower layers g_t,p (kept by the target forward, `tap_layers`):
x += Σ_t W_t·(g_t,p − μ_t)/σ_t; a drafted row has no such layers, and its own `out` stands for all of them.
Nothing returns to the host while drafting, unless the engine prices steps (`StepContext.worth_drafting`):
then after each draft the head's row and the drafted id come back (one small readback), the head's confidence
in that draft gives its chance of acceptance (`confidence`), and the chain ends at the first draft that did not
pay for itself; the engine verifies the chain's best leading run, or nothing.
With `branches` > 1 it proposes EAGLE-2's dynamic token tree (`dynamic_tree`): depth by depth the head runs
over the `branches` likeliest candidates of the newest depth (by cumulative draft log-probability, one small
readback of their rows per depth), and the proposal keeps the likeliest nodes of all; after a tree step the
target's features of the accepted path are moved into consecutive rows (the engine), so the head consumes
them as after a chain.

A head folder (written by `doppler_py.training.eagle`):
    config.json, model.safetensors   the decoder layer, its norm and the LM head as a one-layer LLaMA whose
                                     tied embedding is the draft LM head (loads with our loader and with HF)
    eagle.safetensors                fc_embed.weight [H, H], fc_embed.bias [H], fc_feature.weight [H, H],
                                     feature_mean [H], feature_std [H], draft_to_target [N] (target ids);
                                     with taps also fc_taps.weight [H, taps·H], tap_mean, tap_std [taps, H]
    eagle.json                       kind, the target it was made for (hidden size, vocabulary, layers, model
                                     type), the draft vocabulary size, feature_taps (the fused layers, 0-based)
    training_card.json               how it was trained (data, steps, losses, acceptance)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from doppler_py.errors import InternalError, ModelFormatError
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.loader import load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.ops.elementwise import Standardize
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.linear import Linear, compile_rows
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.ops.vocab_scatter import VocabScatter
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.drafters.gpu_drafting import DraftSampler, checked_branches
from doppler_py.speculative.drafters.heads.files import dense_format, read_meta, read_tensors
from doppler_py.speculative.policy.confidence import ConfidenceCalibration, draft_confidence
from doppler_py.speculative.trees.dynamic import DYNAMIC_TREE_WIDTH, DraftTree
from doppler_py.tokenizer import Tokenizer


@dataclass
class EagleHead:
    """A head folder loaded on the GPU for one target."""

    folder: Path
    model: Transformer  # the decoder layer + norm + draft LM head (vocabulary = the draft vocabulary)
    fc_embed: Weight
    fc_bias: Tensor
    feature_mean: Tensor  # μ, σ: a target feature is standardised, (f − μ)/σ, before fc_feature
    feature_std: Tensor
    fc_feature: Weight  # W_f, over standardised features: the target's, and the head's own predictions
    draft_to_target: np.ndarray
    # EAGLE-3 fusion: the target layers whose outputs the first draft also reads, and per layer μ_t, σ_t and W_t
    tap_layers: tuple[int, ...] = ()
    tap_mean: tuple[Tensor, ...] = ()
    tap_std: tuple[Tensor, ...] = ()
    fc_taps: tuple[Weight, ...] = ()
    # The drafter whose latest prediction the head model's buffers hold: several generations' drafters share the
    # head (`EagleDrafter.claim`).
    holder: object | None = field(default=None, repr=False, compare=False)

    def close(self) -> None:
        self.model.close()
        self.model.weights.destroy()
        for w in (self.fc_embed, self.fc_feature, *self.fc_taps):
            w.destroy()
        for t in (self.fc_bias, self.feature_mean, self.feature_std, *self.tap_mean, *self.tap_std):
            t.destroy()


def load_head(
    folder: str | Path, target: Transformer, precision: str = "f32", tokenizer: Tokenizer | None = None
) -> EagleHead:
    """Load an EAGLE head for `target` (and its `tokenizer`, when given), refusing one made for another model;
    typed errors name the file. precision: the target's weight format ("keep": as the head stores them)."""
    folder = Path(folder)
    meta = read_meta(folder, "eagle", target, tokenizer)
    cfg = target.config
    h = cfg.hidden_size
    taps = tap_layers(meta, folder, len(target.layers))
    shapes = {"fc_embed.weight": (h, h), "fc_embed.bias": (h,), "fc_feature.weight": (h, h)}
    shapes |= {"feature_mean": (h,), "feature_std": (h,)}
    if taps:
        shapes |= {"fc_taps.weight": (h, len(taps) * h), "tap_mean": (len(taps), h), "tap_std": (len(taps), h)}
    tensors = read_tensors(folder / "eagle.safetensors", shapes, cfg.vocab_size)
    for name in ("feature_std", "tap_std") if taps else ("feature_std",):
        if not (tensors[name] > 0).all():
            raise ModelFormatError(f"{folder / 'eagle.safetensors'}: {name} must be positive")
    gpu = target.gpu
    fmt = dense_format(target, precision, tensors["fc_embed.weight"].dtype, in_target_blocks=True)
    weights = load_weights(folder, gpu, fmt)
    try:
        model = Transformer(weights, target.registry, max_rows=target.max_rows, max_logit_rows=MAX_TREE_ROWS)
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

    def upload(name: str, w: np.ndarray) -> Weight:
        return Weight.from_numpy(gpu, np.ascontiguousarray(w, np.float32), fmt, name=name)

    def vector(name: str, v: np.ndarray) -> Tensor:
        return Tensor.from_numpy(gpu, np.ascontiguousarray(v, np.float32), "f32", name)

    return EagleHead(
        folder=folder,
        model=model,
        fc_embed=upload("fc_embed", tensors["fc_embed.weight"]),
        fc_bias=vector("fc_bias", tensors["fc_embed.bias"]),
        feature_mean=vector("feature_mean", tensors["feature_mean"]),
        feature_std=vector("feature_std", tensors["feature_std"]),
        fc_feature=upload("fc_feature", tensors["fc_feature.weight"]),
        draft_to_target=tensors["draft_to_target"].astype(np.int64),
        tap_layers=taps,
        tap_mean=tuple(vector(f"tap_mean {layer}", tensors["tap_mean"][t]) for t, layer in enumerate(taps)),
        tap_std=tuple(vector(f"tap_std {layer}", tensors["tap_std"][t]) for t, layer in enumerate(taps)),
        fc_taps=tuple(
            upload(f"fc_tap {layer}", tensors["fc_taps.weight"][:, t * h : (t + 1) * h]) for t, layer in enumerate(taps)
        ),
    )


def tap_layers(meta: dict, folder: Path, layers: int) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head fuses (eagle.json's feature_taps; none for an EAGLE-1 head), checked
    against the target's layer count."""
    taps = meta.get("feature_taps") or []
    if not isinstance(taps, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in taps):
        raise ModelFormatError(f"{folder / 'eagle.json'}: feature_taps must be a list of layer indices, got {taps!r}")
    if any(not 0 <= t < layers for t in taps) or len(set(taps)) != len(taps):
        raise ModelFormatError(
            f"{folder / 'eagle.json'}: feature_taps {taps} are not distinct layers of the target's {layers}"
        )
    return tuple(taps)


class EagleDrafter(NoOpHooks):
    """Drafts with an `EagleHead` on the GPU (see the module docstring)."""

    name = "eagle"
    tree_branches = DYNAMIC_TREE_WIDTH
    gates_chains = True  # its chains end where its confidence says a draft stops paying
    reads_prompt_features = True  # its head consumes the target's features of every position

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
        self.standardize = Standardize(registry, head.feature_mean, head.feature_std, self.features, max_rows=rows)
        self.fc_feature = Linear(registry, head.fc_feature, self.features, model.x, max_rows=rows, accumulate=True)
        self.feature_taps = head.tap_layers  # the engine taps them (contract.Drafter)
        self.tapped = [Tensor.empty(gpu, (rows, hidden), "f32", f"eagle tap {layer}") for layer in head.tap_layers]
        self.standardize_taps = [
            Standardize(registry, mean, std, tapped, max_rows=rows)
            for mean, std, tapped in zip(head.tap_mean, head.tap_std, self.tapped, strict=True)
        ]
        self.fc_taps = [
            Linear(registry, w, tapped, model.x, max_rows=rows, accumulate=True)
            for w, tapped in zip(head.fc_taps, self.tapped, strict=True)
        ]
        self.sampling = DraftSampler(model, target.config.vocab_size)
        self.branches = 1
        self.scatter = VocabScatter(registry, model.logits, head.draft_to_target, self.sampling.row)
        self.calibration = ConfidenceCalibration()
        self.to_draft = np.full(target.config.vocab_size, -1, np.int64)  # target id -> draft id
        self.to_draft[head.draft_to_target] = np.arange(head.draft_to_target.size)
        self.chain: list[tuple[int, float]] = []  # the last gated chain's (target id, confidence) per draft
        # A gated draft's pick and the head's row it came from, side by side for one readback
        self.draft_readback = Tensor.empty(gpu, 1 + model.config.vocab_size, "f32", "eagle draft readback")
        self.cache: KVCache | None = None
        self.consumed = 0  # pairs (f_p, t_{p+1}) in the head cache: positions offset..consumed-1
        # The first position the head cache holds: after a prompt prefix that came from the prefix cache (whose
        # features the target never computed), the head starts there; RoPE is relative, so the head's positions
        # are shifted by it.
        self.offset = 0
        self.out_row = 0  # the row of model.x holding the head's latest prediction
        # That prediction (its feature row and its logits), kept for when another generation's drafter has used
        # the head model since (`claim`).
        self.kept_x = Tensor.empty(gpu, (1, hidden), "f32", "eagle kept prediction")
        self.kept_logits = Tensor.empty(gpu, (1, model.config.vocab_size), "f32", "eagle kept logits")

    def matmuls(self) -> tuple[Linear, ...]:
        return (self.fc_embed, self.fc_feature, *self.fc_taps, *self.head.model.linears())

    def compile(self, max_rows: int | None = None) -> None:
        """Compile the pipelines of the head's matmuls (its input projections, its layer and LM head) for every
        row count they may run with (the rows a verification kept, 1..capacity + 1, or a prefill chunk;
        `compile_rows`), or up to `max_rows`: else a head in a format of its own (not the target's, `dense_format`)
        compiles them mid-generation, timed as the step's cost. The engine runs it beside its own warm-up."""
        compile_rows(self.matmuls(), max_rows=max_rows)

    @property
    def branches(self) -> int:
        return self._branches

    @branches.setter
    def branches(self, value: int) -> None:
        self._branches = checked_branches(value, self.tree_branches, "EAGLE's")

    def start(self, ctx: StepContext) -> None:
        self.finish()
        self.cache = self.head.model.new_cache(ctx.capacity)

    def prefilled(self, ctx: StepContext, begin: int) -> None:
        self._consume(ctx, begin + ctx.hidden_rows)

    def join(self, ctx: StepContext) -> bool:
        """The head starts at the first committed pair whose feature the target still holds (the last step's rows),
        as after a prefix-cache hit (`offset`)."""
        if ctx.hidden_rows == 0:
            return False
        self.start(ctx)
        self.consumed = self.offset = len(ctx.tokens) - 1 - min(ctx.hidden_rows, self.head.model.max_rows)
        self._consume(ctx, len(ctx.tokens) - 1)
        return True

    def commit(self, ctx: StepContext, accepted: int) -> None:
        if self.chain:
            # Whether each draft was the target's token, verified or cut: greedy, a draft the engine cut would
            # have been accepted exactly when the target's token equals it.
            committed = ctx.tokens[len(ctx.tokens) - accepted - 1 :]
            drafts, confidences = zip(*self.chain[: accepted + 1], strict=True)
            self.calibration.observe(confidences, [d == t for d, t in zip(drafts, committed, strict=False)])
            self.chain = []
        self.cache.truncate(self.consumed - self.offset)  # drop the pairs built on the head's own predictions
        self._consume(ctx, len(ctx.tokens) - 1)

    def _consume(self, ctx: StepContext, m: int) -> None:
        """Feed the head every pair whose feature the target just produced (it has consumed tokens[:m]):
        positions consumed..m-1."""
        rows = m - self.consumed
        if rows <= 0:
            return
        if rows > ctx.hidden_rows and self.consumed == self.offset and ctx.cached:
            self.consumed = self.offset = m - ctx.hidden_rows
            rows = ctx.hidden_rows
            if rows == 0:
                return
        if rows > ctx.hidden_rows:
            raise InternalError(f"EAGLE head lags {rows} positions, but the target holds only {ctx.hidden_rows} rows")
        model, hidden = self.head.model, self.target.config.hidden_size
        model.ids.view((rows,)).write(self.target.check_ids(ctx.tokens[self.consumed + 1 : m + 1]))
        rec = model.registry.recorder()
        row_bytes = hidden * 4
        first = (ctx.hidden_rows - rows) * row_bytes
        rec.copy(ctx.hidden, self.features, rows * row_bytes, src_offset=first)
        for layer, tapped in zip(self.head.tap_layers, self.tapped, strict=True):
            rec.copy(self.target.taps[layer], tapped, rows * row_bytes, src_offset=first)
        self.embed.record(rec, rows=rows)  # gather: emb = E[t_{p+1}]
        self.fc_embed.record(rec, rows=rows)  # matmul: x = emb·W_eᵀ + b
        self.standardize.record(rec, rows=rows)  # f ← (f − μ)/σ
        self.fc_feature.record(rec, rows=rows)  # matmul: x += f·W_fᵀ
        for standardize, fc_tap in zip(self.standardize_taps, self.fc_taps, strict=True):
            standardize.record(rec, rows=rows)
            fc_tap.record(rec, rows=rows)  # matmul: x += ((f_t − μ_t)/σ_t)·W_tᵀ
        model.record_forward(rec, rows, self.cache, self.consumed - self.offset, logits="last", embedded=True)
        row_bytes = hidden * 4
        rec.copy(model.x, self.kept_x, row_bytes, src_offset=(rows - 1) * row_bytes)
        rec.copy(model.logits, self.kept_logits, self.kept_logits.nbytes)
        rec.submit()
        self.consumed, self.out_row = m, rows - 1
        self.head.holder = self

    def claim(self) -> None:
        """The head model's buffers hold this drafter's latest prediction: put it back if another generation's
        drafter (beside this one in a batch) has used the head since."""
        if self.head.holder is self:
            return
        model = self.head.model
        rec = model.registry.recorder()
        rec.copy(self.kept_x, model.x, self.kept_x.nbytes)
        rec.copy(self.kept_logits, model.logits, self.kept_logits.nbytes)
        rec.submit()
        self.out_row = 0
        self.head.holder = self

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        m = len(ctx.tokens) - 1
        k = min(k, self.sampling.max_drafts)
        if self.consumed == self.offset or self.consumed != m or self.cache.free < k:
            return NO_PROPOSAL
        self.claim()
        if self.branches > 1 and k >= 2:
            return self._dynamic_tree(ctx, k)
        if ctx.worth_drafting is None:
            self._draft(ctx, k, ctx.params)
            return Proposal(k, self.sampling.tokens, self.sampling.logits)
        made = self._draft(ctx, k, ctx.params, ctx.worth_drafting)
        values = self.calibration.values([c for _, c in self.chain])
        return Proposal(made, self.sampling.tokens, self.sampling.logits, values=values)

    def _dynamic_tree(self, ctx: StepContext, budget: int) -> Proposal:
        """EAGLE-2's tree of at most `budget` nodes (`dynamic_tree`): one head forward and one readback of the
        new rows' logits per expanded depth, all rows of the head's tree in each forward."""
        m = len(ctx.tokens) - 1
        model, hidden, gpu = self.head.model, self.target.config.hidden_size, self.target.gpu
        n = model.config.vocab_size
        root = gpu.queue.read_buffer(model.logits.buffer, 0, n * 4)  # the prediction from the committed pairs
        tree = DraftTree(self.tree_branches)

        def run_rows(first: int) -> np.ndarray:
            rows = len(tree.rows)
            rec = model.registry.recorder()
            for r in range(first, rows):  # a new row's feature: its parent's output (the root's: out_row)
                above = tree.parent_row(r)
                source = self.out_row if above < 0 else above
                rec.copy(model.x, self.features, hidden * 4, src_offset=source * hidden * 4, dst_offset=r * hidden * 4)
            model.ids.view((rows,)).write(self.target.check_ids(tree.row_tokens()))
            model.tree.view((rows, 2)).write(tree.layout())
            self.embed.record(rec, rows=rows)
            self.fc_embed.record(rec, rows=rows)
            self.fc_feature.record(rec, rows=rows)
            model.record_forward(rec, rows, self.cache, m - self.offset, logits="all", embedded=True, tree=True)
            rec.submit()
            raw = gpu.queue.read_buffer(model.logits.buffer, first * n * 4, (rows - first) * n * 4)
            return np.frombuffer(raw, np.float32).reshape(rows - first, n)

        return tree.grow(
            budget,
            np.frombuffer(root, np.float32),
            run_rows,
            to_target=self.head.draft_to_target,
            max_rows=min(MAX_TREE_ROWS, model.max_rows, self.cache.free),
        )

    def _draft(
        self, ctx: StepContext, k: int, params: SamplingParams, worth: Callable[[Sequence[float]], bool] | None = None
    ) -> int:
        """Draft up to k tokens into `sampling`, one submit each; with `worth`, each draft's confidence is read
        back into `chain` and drafting stops after the first that `worth` says did not pay. Returns the drafts."""
        m = len(ctx.tokens) - 1
        self.chain = []
        model, hidden = self.head.model, self.target.config.hidden_size
        for i in range(k):
            rec = model.registry.recorder()
            if i > 0:  # the pair (the head's predicted f, d_{i-1}) at position m + i - 1
                rec.copy(model.x, self.features, hidden * 4, src_offset=self.out_row * hidden * 4)
                self.embed.record(rec, rows=1)
                self.fc_embed.record(rec, rows=1)
                self.fc_feature.record(rec, rows=1)
                model.record_forward(rec, 1, self.cache, m + i - 1 - self.offset, logits="last", embedded=True)
                self.out_row = 0
            self.scatter.record(rec)  # the draft-vocabulary logits over the target's vocabulary
            self.sampling.record_pick(rec, model.ids, i, params, ctx.penalties)
            if worth is not None:  # the pick (u32 bits) and the head's row, for `_read_draft`
                rec.copy(self.sampling.pick, self.draft_readback, 4)
                rec.copy(model.logits, self.draft_readback, model.config.vocab_size * 4, dst_offset=4)
            self.sampling.submit(rec, ctx.rng.random())
            if worth is not None:
                self.chain.append(self._read_draft(params))
                if not worth(self.calibration.values([c for _, c in self.chain])):
                    return i + 1
        return k

    def _read_draft(self, params: SamplingParams) -> tuple[int, float]:
        """The draft just sampled (target id) and the head's confidence in it, read back."""
        readback = self.draft_readback
        raw = self.target.gpu.queue.read_buffer(readback.buffer, readback.offset, readback.nbytes)
        picked = int(np.frombuffer(raw, np.uint32, count=1)[0])
        return picked, draft_confidence(np.frombuffer(raw, np.float32, offset=4), int(self.to_draft[picked]), params)

    def finish(self) -> None:
        if self.cache is not None:
            self.head.model.release_cache(self.cache)
            self.cache = None
        self.consumed = self.offset = self.out_row = 0
        self.chain = []
        if self.head.holder is self:
            self.head.holder = None

    def close(self) -> None:
        self.finish()
        self.scatter.release(self.target.registry)
        self.sampling.close()
        self.target.registry.release_tensors(
            self.emb, self.features, self.draft_readback, self.kept_x, self.kept_logits, *self.tapped
        )
