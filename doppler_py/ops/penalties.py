"""One generation's penalties, logit bias and min-p on the GPU (`shaders/penalties.wgsl`, `shaders/min_p.wgsl`).

The exact definitions and their order are the contract of `doppler_py.testing.penalty_reference`. Both kernels
change the verified rows of target.logits in place, before the constraint's mask (penalties) and after it (min-p),
so every kernel after them (the verifier, the log-probs) reads the changed rows:

    penalties (rows 0..n)    per row, with the committed tokens' counts and the drafts on the row's own path
    token mask               the constraint's, when there is one (`ops.token_mask`)
    log-softmax              the log-probs' distribution, when asked for (`ops.logprobs`)
    min-p (rows 0..n)        tokens below min_p times the likeliest after temperature, -inf
    verification             temperature, top-k, top-p, acceptance (`ops.speculative`, `ops.tree_verify`)

The per-generation state is sparse: the host keeps every token's generated count and last position in the context
and, before each step, uploads the tokens that matter (`entries`: a generated count, a place in the repetition
window, or a bias; ~the distinct tokens of the answer and the window). The drafts of a step are read on the GPU from
the step's token buffer, so a GPU drafter's proposal is never read back for it. Nothing is dispatched for an option
that is off.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from doppler_py.gpu.kernels import KernelRegistry
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
        if params.penalized:
            self._grow(_FIRST_ENTRIES)
        self.min_p = None
        if params.filters_min_p:
            kernel = registry.kernel("min_p")
            offset = float(np.float32(params.temperature * math.log(params.min_p)))  # <= 0: below the max
            self.min_p = registry.bind(kernel, params={"vocab": vocab, "offset": offset}, logits=logits)

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

    def record_min_p(self, rec: Recorder, rows: int) -> None:
        """Min-p of rows 0..rows-1; nothing when it is off (or the picks are greedy)."""
        if self.min_p is not None:
            require_rows(rows, self.max_rows, "Penalties min_p")
            rec.dispatch(self.min_p, rows)

    def _grow(self, entries: int) -> None:
        """A larger entries buffer (a longer answer has more distinct tokens), bound in place of the old one."""
        old, old_slot = self.entries, None if self.bound is None else self.bound.params
        self.entries = Tensor.empty(self.registry.gpu, (min(entries, self.vocab) or 1, 4), "u32", "penalty entries")
        p = self.params
        uniforms = old_slot or {
            "vocab": self.vocab,
            "window": self.window,
            "presence": p.presence_penalty,
            "frequency": p.frequency_penalty,
            "repetition": p.repetition_penalty,
            "inv_repetition": float(np.float32(1.0 / p.repetition_penalty)),
        }
        self.bound = self.registry.bind(
            self.registry.kernel("penalties"),
            uniforms,
            tokens=self.tokens,
            tree=self.layout,
            entries=self.entries,
            logits=self.logits,
        )
        if old is not None:
            self.registry.release_tensors(old)

    def release(self) -> None:
        """Free the generation's buffers and uniform slots."""
        if self.bound is not None:
            self.registry.release_slot(self.bound.params)
            self.registry.release_tensors(self.entries)
            self.bound = self.entries = None
        if self.min_p is not None:
            self.registry.release_slot(self.min_p.params)
            self.min_p = None
