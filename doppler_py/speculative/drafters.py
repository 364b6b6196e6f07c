"""Drafters: where the proposed tokens of a speculative step come from.

Every drafter answers `draft(session, k)`, filling the engine's step buffers:
  session.spec_tokens[1..n]   the n ≤ k proposed tokens (GPU buffer; host drafters upload them)
  session.draft_logits[0..n)  the logits each GPU-drafted token was sampled from (not for one-hot drafts)
and returns a `Draft` saying how many it proposed and whether the proposal is deterministic (one-hot q).

* `PromptLookupDrafter` — no model: continue the most recent earlier occurrence of the last n-gram of the
  prompt + generated text. Deterministic, so q is one-hot and the check stays exact.
* `DraftModelDrafter` — a smaller model with the same vocabulary, its own KV cache, drafting on the GPU:
  each draft token is sampled on the GPU and copied straight into the next draft forward's input.
* `LayerSkipDrafter` — the target's first L layers + its final norm and head (self-speculation). It shares
  the target's KV cache: layers < L at a position depend only on layers < L, so the draft's cache writes
  are exactly what the target would write, and verification overwrites them anyway.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from doppler_py.errors import GenerationOptionError, VocabularyMismatchError
from doppler_py.model.transformer import Transformer

if TYPE_CHECKING:
    from doppler_py.speculative.engine import StepSession

# Draft and target vocabularies may differ by this many padding rows (e.g. 49152 vs 49280).
MAX_VOCAB_PADDING = 1024


@dataclass(frozen=True)
class Draft:
    count: int  # tokens proposed (0 = nothing to propose: the engine takes a plain step)
    onehot: bool  # deterministic proposal (q is one-hot at the token)


class Drafter(Protocol):
    name: str

    def start(self, session: StepSession) -> None:
        """A new generation: the target has consumed session.tokens[:-1]."""

    def draft(self, session: StepSession, k: int) -> Draft: ...

    def commit(self, session: StepSession, accepted: int, drafted: int) -> None:
        """The step ended: `accepted` of `drafted` proposals were kept (session.tokens already updated)."""

    def close(self) -> None: ...


class PromptLookupDrafter:
    """Proposes the continuation of the most recent earlier match of the last n tokens (n = max..min).

    Single-token matches are not used by default: on SmolLM2 (benchmarks of 128-token answers) their
    continuations were mostly rejected, and requiring n >= 2 (up to 4) raised acceptance on the repeat,
    summarise and code prompts (e.g. repeat 0.92 → 0.98, summarise 0.29 → 0.75).
    """

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        if not 1 <= min_ngram <= max_ngram:
            raise GenerationOptionError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def start(self, session: StepSession) -> None:
        pass

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """The proposal as a host list (also used by tests)."""
        seq = np.asarray(tokens, dtype=np.int64)
        n_tokens = seq.size
        for n in range(min(self.max_ngram, n_tokens - 1), self.min_ngram - 1, -1):
            tail = seq[n_tokens - n :]
            # Windows starting at 0..n_tokens-n-1 (the tail itself is excluded); the latest match wins.
            windows = np.lib.stride_tricks.sliding_window_view(seq[: n_tokens - 1], n)
            hits = np.flatnonzero((windows == tail).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return seq[start : start + k].tolist()
        return []

    def draft(self, session: StepSession, k: int) -> Draft:
        proposal = self.propose(session.tokens, k)
        if proposal:
            session.upload_draft(proposal)
        return Draft(len(proposal), onehot=True)

    def commit(self, session: StepSession, accepted: int, drafted: int) -> None:
        pass

    def close(self) -> None:
        pass


class _GpuDrafter:
    """Shared GPU drafting loop: `model` forwards one step at a time, each sampled token fed to the next."""

    name = ""

    def __init__(self, model: Transformer, num_layers: int | None):
        self.model = model
        self.num_layers = num_layers

    def _cache(self, session: StepSession):
        raise NotImplementedError

    def _pending(self, session: StepSession) -> list[int]:
        """Committed tokens this drafter's cache has not consumed yet (at least the last token)."""
        raise NotImplementedError

    def draft(self, session: StepSession, k: int) -> Draft:
        model, cache = self.model, self._cache(session)
        pending = self._pending(session)
        if len(pending) + k - 1 > model.max_rows or cache.free < len(pending) + k:
            return Draft(0, onehot=False)
        model.ids.view((len(pending),)).write(model.check_ids(pending))
        rows, pos = len(pending), cache.length
        for i in range(k):
            rec = model.registry.recorder()
            model.record_forward(rec, rows, cache, pos, logits="last", num_layers=self.num_layers)
            session.record_draft_sample(rec, model, i)
            # The sampled token is the next draft forward's only input (never seen by the host).
            rec.copy(session.draft_pick, model.ids, 4)
            session.submit_draft(rec, i)
            pos, rows = pos + rows, 1
        return Draft(k, onehot=False)


class DraftModelDrafter(_GpuDrafter):
    """A smaller model with the same vocabulary drafting on the GPU with its own KV cache."""

    name = "draft-model"

    def __init__(self, draft: Transformer, target_vocab: int):
        check_vocabularies(draft.config.vocab_size, target_vocab)
        super().__init__(draft, None)
        self.cache = None
        self.consumed = 0  # committed tokens in the draft cache

    def _cache(self, session: StepSession):
        return self.cache

    def start(self, session: StepSession) -> None:
        if self.cache is not None:
            self.model.release_cache(self.cache)
        self.cache = self.model.new_cache(session.capacity)
        self.consumed = 0
        prompt = self._known(session.tokens[:-1])
        for begin in range(0, len(prompt), self.model.max_rows):
            part = prompt[begin : begin + self.model.max_rows]
            self.model.forward(part, self.cache, begin, logits="none")
        self.consumed = len(prompt)

    def _pending(self, session: StepSession) -> list[int]:
        return self._known(session.tokens[self.consumed :])

    def _known(self, tokens: Sequence[int]) -> list[int]:
        """Committed tokens as this draft's input. A target whose vocabulary is padded beyond the draft's may
        commit an id the draft lacks; it is fed as the draft's last id, which costs acceptance at most (the
        verification keeps the output exact) instead of stopping the generation."""
        last = self.model.config.vocab_size - 1
        return [min(token, last) for token in tokens]

    def commit(self, session: StepSession, accepted: int, drafted: int) -> None:
        # The draft cache consumed the pending tokens and draft tokens 0..drafted-2; keep what was accepted.
        if drafted:
            before = len(session.tokens) - accepted - 1
            self.consumed = before + min(accepted, drafted - 1)
            self.cache.truncate(self.consumed)

    def close(self) -> None:
        """End of a generation: free the draft cache (the next `start` makes a new one)."""
        if self.cache is not None:
            self.model.release_cache(self.cache)
            self.cache = None


class LayerSkipDrafter(_GpuDrafter):
    """Self-speculation: the target's first `num_layers` layers and its head draft for it."""

    name = "layer-skip"

    def __init__(self, target: Transformer, num_layers: int | None = None):
        layers = num_layers if num_layers is not None else max(1, target.num_layers // 2)
        if not 1 <= layers < target.num_layers:
            raise GenerationOptionError(
                f"layer-skip drafting needs 1 <= layers < {target.num_layers} (the target's depth), got {layers}"
            )
        super().__init__(target, layers)

    def _cache(self, session: StepSession):
        return session.target_cache

    def _pending(self, session: StepSession) -> list[int]:
        return session.tokens[-1:]

    def start(self, session: StepSession) -> None:
        pass

    def commit(self, session: StepSession, accepted: int, drafted: int) -> None:
        pass  # the engine truncates the shared cache

    def close(self) -> None:
        pass


def check_vocabularies(draft_vocab: int, target_vocab: int) -> None:
    """Refuse a draft whose vocabulary is not the target's up to padding rows."""
    if abs(draft_vocab - target_vocab) > MAX_VOCAB_PADDING:
        raise VocabularyMismatchError(
            f"draft vocabulary ({draft_vocab} tokens) does not match the target's ({target_vocab}); a draft model "
            f"must share the tokenizer (sizes may differ only by up to {MAX_VOCAB_PADDING} padding entries)"
        )
