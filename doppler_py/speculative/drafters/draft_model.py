"""A smaller model with the target's vocabulary drafting on the GPU with its own KV cache.

With `branches` > 1 it proposes a token tree (`gpu_drafting.TreeBranches`): its greedy chain plus each draft
row's second-best token as a side leaf.
"""

from __future__ import annotations

from collections.abc import Sequence

from doppler_py.errors import VocabularyMismatchError
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.speculative.contract import NO_PROPOSAL, Proposal, StepContext
from doppler_py.speculative.drafters.gpu_drafting import GREEDY, Branching, ModelDrafter, TreeBranches, matching_prefix

# Draft and target vocabularies may differ by this many padding rows (e.g. 49152 vs 49280).
MAX_VOCAB_PADDING = 1024


class DraftModelDrafter(Branching, ModelDrafter):
    """Keeps its own cache in step with the committed tokens: it consumes them lazily before drafting and
    truncates what it drafted past the accepted prefix.

    `branches`: tokens per depth of a tree proposal (1: chains, sampled from the draft at the generation's
    temperature; more: greedy trees, module docstring)."""

    name = "draft-model"

    def __init__(self, draft: Transformer, target_vocab: int, branches: int = 1):
        check_vocabularies(draft.config.vocab_size, target_vocab)
        super().__init__(draft, target_vocab)
        self.draft_cache: KVCache | None = None
        self.consumed = 0  # committed tokens in the draft cache
        self.branching = TreeBranches(self.sampling, branches)
        self.chain: list[int] | None = None  # the last tree's chain (None: the last proposal was a GPU chain)

    def propose(self, ctx: StepContext, k: int) -> Proposal:
        self.chain = None
        if self.branches == 1 or k < 2:
            return super().propose(ctx, k)
        depth = self.branching.chain_length(k)
        if not self.draft(ctx, depth, GREEDY, last=lambda rec: self.branching.record(rec, depth)):
            return NO_PROPOSAL
        proposal, self.chain = self.branching.read(depth, k)
        return proposal

    def cache(self, ctx: StepContext) -> KVCache:
        return self.draft_cache

    def start(self, ctx: StepContext) -> None:
        self.finish()
        self.branching.reset()
        self.draft_cache = self.model.new_cache(ctx.capacity)
        prompt = self._known(ctx.tokens[:-1])
        for begin in range(0, len(prompt), self.model.max_rows):
            part = prompt[begin : begin + self.model.max_rows]
            # nothing reads the draft's prompt outputs: only its layers that write K/V run (Gemma 4)
            self.model.forward(part, self.draft_cache, begin, logits="none", num_layers=self.model.prefill_layers)
        self.consumed = len(prompt)

    def pending(self, ctx: StepContext) -> list[int]:
        return self._known(ctx.tokens[self.consumed :])

    def _known(self, tokens: Sequence[int]) -> list[int]:
        """Committed tokens as this draft's input. A target whose vocabulary is padded beyond the draft's may
        commit an id the draft lacks; it is fed as the draft's last id, which costs acceptance at most (the
        verification keeps the output exact) instead of stopping the generation."""
        last = self.model.config.vocab_size - 1
        return [min(token, last) for token in tokens]

    def commit(self, ctx: StepContext, accepted: int) -> None:
        self.branching.observe(ctx.tokens[-(accepted + 1) :])
        # Drafting consumed the pending tokens and drafts 0..k-2 (the last draft was never fed); of those,
        # the committed ones are the accepted drafts, or after a tree step the accepted path's leading run of
        # chain tokens (a side leaf was never fed).
        if self.draft_cache.length > self.consumed:
            before = len(ctx.tokens) - accepted - 1
            kept = accepted
            if self.chain is not None:
                kept = matching_prefix(ctx.tokens[before : before + accepted], self.chain)
            self.consumed = min(before + kept, self.draft_cache.length)
            self.draft_cache.truncate(self.consumed)

    def finish(self) -> None:
        if self.draft_cache is not None:
            self.model.release_cache(self.draft_cache)
            self.draft_cache = None
        self.consumed = 0

    def close(self) -> None:
        super().close()
        self.branching.close()


def check_vocabularies(draft_vocab: int, target_vocab: int) -> None:
    """Refuse a draft whose vocabulary is not the target's up to padding rows."""
    if abs(draft_vocab - target_vocab) > MAX_VOCAB_PADDING:
        raise VocabularyMismatchError(
            f"draft vocabulary ({draft_vocab} tokens) does not match the target's ({target_vocab}); a draft model "
            f"must share the tokenizer (sizes may differ only by up to {MAX_VOCAB_PADDING} padding entries)"
        )
