"""One generation's penalties, logit bias and min-p on the GPU (`shaders/penalties.wgsl`, `shaders/min_p.wgsl`).

The exact definitions and their order are the contract of `doppler_py.testing.penalty_reference`. Both kernels
change the verified rows of target.logits in place, before the constraint's mask (penalties) and after it (min-p),
so every kernel after them (the verifier, the log-probs) reads the changed rows:

    penalties (rows 0..n)    per row, with the committed tokens' counts and the drafts on the row's own path
    token mask               the constraint's, when there is one (`ops.token_mask`)
    log-softmax              the log-probs' distribution, when asked for (`ops.logprobs`)
    min-p (rows 0..n)        tokens below min_p times the likeliest after temperature, -inf
    verification             temperature, top-k, top-p, acceptance (`ops.speculative`, `ops.tree_verify`)

A GPU drafter's row for its draft i is penalised and min-p filtered the same way (`record_draft`: row i's path is the
drafts before it), so a drafter proposes from what the target will sample from rather than from logits the
penalties have since moved; a draft sampled from the changed row reports that row, so the verification stays exact.
Plain steps several per submit penalise step j's row with the tokens steps 0..j-1 chose as its path (`record_row`),
so penalised plain decoding needs no readback per token.

The per-generation state is sparse: the host keeps every token's generated count and last position in the context
and, before each step, uploads the tokens that matter (`entries`: a generated count, a place in the repetition
window, or a bias; ~the distinct tokens of the answer and the window). The drafts of a step (and a submit's plain
steps' tokens) are read on the GPU, so neither is read back for the penalties. Nothing is dispatched for an option
that is off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from doppler_py.gpu.kernels import Bound, KernelRegistry
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.elementwise import require_f32, require_rows
from doppler_py.ops.tree import MAX_TREE_ROWS
from doppler_py.sampling import SamplingParams, check_bias_vocab

_ALL = 0xFFFFFFFF  # the shader's "no occurrence" age and "every token" window
_FIRST_ENTRIES = 256


class Penalties:
    """`params`' penalties and min-p for the generation whose prompt is `prompt`, over `logits` (f32 rows of `vocab`)
    verified with the step's `tokens` (u32: row j's input token) and tree `layout` (u32 [rows, 2]); see the module
    docstring. `update` before each step's `record_penalties` / `record_min_p`; `release` at the generation's end."""

    def __init__(
        self,
        registry: KernelRegistry,
        params: SamplingParams,
        prompt: Sequence[int],
        *,
        vocab: int,
        logits: Tensor,
        tokens: Tensor,
        layout: Tensor,
    ):
        check_bias_vocab(params, vocab)
        require_f32(logits, vocab, "Penalties logits")
        self.registry, self.params, self.vocab = registry, params, vocab
        self.max_rows = min(MAX_TREE_ROWS, logits.numel // vocab)
        self.logits, self.tokens, self.layout = logits, tokens, layout
        self.n_prompt = len(prompt)
        repeats = params.repetition_penalty != 1.0 and params.repeat_last_n != 0
        self.window = (_ALL if params.repeat_last_n < 0 else params.repeat_last_n) if repeats else 0
        self.counts = np.zeros(vocab, np.int64)  # occurrences among the generated tokens
        self.last = np.full(vocab, -1, np.int64)  # index of the last occurrence in the context; -1: none
        self.biased = np.zeros(vocab, bool)
        self.bias = np.zeros(vocab, np.float32)
        for token, bias in params.logit_bias:
            self.biased[token], self.bias[token] = True, bias
        self.folded = 0  # context tokens counted so far
        self.n_entries = 0
        self.entries: Tensor | None = None
        self.bound = None
        # `record_row`'s bindings, per (row, path, i): (row, path, the bound penalties); `record_draft`'s min-p per row.
        self._row_bounds: dict[tuple[int, int, int], tuple[Tensor, Tensor, Bound]] = {}
        self._row_min_p: dict[int, tuple[Tensor, Bound]] = {}
        if params.penalized:
            self._grow(_FIRST_ENTRIES)
        self.min_p = None
        if params.filters_min_p:
            kernel = registry.kernel("min_p")
            offset = float(np.float32(params.temperature * math.log(params.min_p)))  # <= 0: below the max
            self.min_p_values = {"vocab": vocab, "offset": offset}
            self.min_p = registry.bind(kernel, params=self.min_p_values, logits=logits)

    def update(self, context: Sequence[int]) -> None:
        """Fold in the context's new tokens (the committed ones) and upload the entries the next step reads."""
        if self.bound is None:
            return
        for i in range(self.folded, len(context)):
            token = int(context[i])
            if token < self.vocab:
                self.last[token] = i
                if i >= self.n_prompt:
                    self.counts[token] += 1
        self.folded = len(context)
        wanted = (self.counts > 0) | self.biased
        if self.window:
            wanted |= self.last >= len(context) - min(self.window, len(context))
        ids = np.flatnonzero(wanted)
        age = np.where(self.last[ids] >= 0, len(context) - 1 - self.last[ids], _ALL)
        rows = np.stack([ids, self.counts[ids], age, self.bias[ids].view(np.uint32)], axis=1).astype(np.uint32)
        if rows.shape[0] > self.entries.shape[0]:
            self._grow(2 * rows.shape[0])
        self.n_entries = rows.shape[0]
        if self.n_entries:
            self.entries.view(rows.shape).write(np.ascontiguousarray(rows))

    def record_penalties(self, rec: Recorder, rows: int, *, tree: bool) -> None:
        """Penalties and bias of rows 0..rows-1 (a chain's rows, or a tree's by `layout`); nothing when all are off."""
        if self.bound is None:
            return
        require_rows(rows, self.max_rows, "Penalties")
        self.bound.params.set(entries=self.n_entries, is_tree=int(tree))
        rec.dispatch(self.bound, rows)

    def record_row(self, rec: Recorder, row: Tensor, path: Tensor, i: int) -> None:
        """Penalties and bias of `row` (f32, its first vocab entries) as row i whose path is path[0..i-1] (u32): a
        drafter's row for its draft i, or a plain step's row after the steps before it in the same submit. The
        committed tokens are those of the last `update`. Nothing when all are off."""
        if self.bound is None:
            return
        require_rows(i + 1, self.max_rows, "Penalties path")
        key = (id(row), id(path), i)
        entry = self._row_bounds.get(key)
        if entry is None:
            bound = self.registry.bind(
                self.registry.kernel("penalties"),
                self._uniforms(row0=i, drafts_at=0),
                tokens=path,
                tree=self.layout,
                entries=self.entries,
                logits=row,
            )
            entry = self._row_bounds[key] = (row, path, bound)
        entry[2].params.set(entries=self.n_entries)
        rec.dispatch(entry[2], 1)

    def record_draft(self, rec: Recorder, row: Tensor, drafts: Tensor, i: int) -> None:
        """A drafter's `row` (f32 [1, vocab]) for its draft i, penalised (`record_row`) and min-p filtered as the
        target's row i will be, after the committed tokens and drafts 0..i-1 (u32 `drafts`)."""
        self.record_row(rec, row, drafts, i)
        if self.min_p is not None:
            entry = self._row_min_p.get(id(row))
            if entry is None:
                entry = self._row_min_p[id(row)] = (
                    row,
                    self.registry.bind(self.min_p.kernel, self.min_p_values, logits=row),
                )
            rec.dispatch(entry[1], 1)

    def record_min_p(self, rec: Recorder, rows: int) -> None:
        """Min-p of rows 0..rows-1; nothing when it is off (or the picks are greedy)."""
        if self.min_p is not None:
            require_rows(rows, self.max_rows, "Penalties min_p")
            rec.dispatch(self.min_p, rows)

    def _grow(self, entries: int) -> None:
        """A larger entries buffer (a longer answer has more distinct tokens), bound in place of the old one."""
        old, old_slot = self.entries, None if self.bound is None else self.bound.params
        self.entries = Tensor.empty(self.registry.gpu, (min(entries, self.vocab) or 1, 4), "u32", "penalty entries")
        self.bound = self.registry.bind(
            self.registry.kernel("penalties"),
            old_slot or self._uniforms(row0=0, drafts_at=1),
            tokens=self.tokens,
            tree=self.layout,
            entries=self.entries,
            logits=self.logits,
        )
        self._release_row_bounds()  # bound to the old entries: bound again at their next use
        if old is not None:
            self.registry.release_tensors(old)

    def _uniforms(self, *, row0: int, drafts_at: int) -> dict[str, float | int]:
        p = self.params
        return {
            "vocab": self.vocab,
            "window": self.window,
            "presence": p.presence_penalty,
            "frequency": p.frequency_penalty,
            "repetition": p.repetition_penalty,
            "inv_repetition": float(np.float32(1.0 / p.repetition_penalty)),
            "row0": row0,
            "drafts_at": drafts_at,
        }

    def _release_row_bounds(self) -> None:
        for _, _, bound in self._row_bounds.values():
            self.registry.release_slot(bound.params)
        for _, bound in self._row_min_p.values():
            self.registry.release_slot(bound.params)
        self._row_bounds.clear()
        self._row_min_p.clear()

    def release(self) -> None:
        """Free the generation's buffers and uniform slots."""
        self._release_row_bounds()
        if self.bound is not None:
            self.registry.release_slot(self.bound.params)
            self.registry.release_tensors(self.entries)
            self.bound = self.entries = None
        if self.min_p is not None:
            self.registry.release_slot(self.min_p.params)
            self.min_p = None
