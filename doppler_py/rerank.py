"""Reranking as Qwen3-Reranker's model card defines it: a document's relevance to a query is the model's
probability of answering "yes" rather than "no" when asked whether the document meets the query.

    pair = "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}"
    ids = tokens(PREFIX) + tokens(pair) + tokens(SUFFIX)
    logits = the model's logits at the last position
    score = exp(logit_yes) / (exp(logit_yes) + exp(logit_no))

The prefix and suffix are encoded without the tokenizer's additions, the middle with them, as the card does. Any
causal LM whose vocabulary has "yes" and "no" tokens can be asked; a model trained for it (Qwen3-Reranker) answers
meaningfully.

Batching: the tokens every pair starts with (the system prompt, the instruction, the query: the longest common
prefix of their ids) run once, into a cache each document's copies (not on hybrid models, whose recurrent state is
not copied at a position of choice); then the documents' own tokens run side by side in forwards of up to
`Transformer.rows_alone` rows, each over its own cache (`Transformer.record_batch`, planned as the embeddings are:
`plan_forwards`), and each document's logits come from its last row when its forward holds it
(`Transformer.record_row_logits`; its yes and no logits copied out, one small read per forward). Each score equals
the one of a forward per document within rounding (f32: 1e-5, tests/test_rerank.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.embeddings import input_groups, plan_forwards
from doppler_py.errors import DopplerError, GenerationOptionError, UnsupportedModelError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.tokenizer import Tokenizer

SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)
PREFIX = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"


@dataclass(frozen=True)
class RerankResult:
    index: int  # the document's position in the request
    relevance_score: float  # P(yes) / (P(yes) + P(no)), in [0, 1]


def pair_text(query: str, document: str, instruction: str | None = None) -> str:
    return f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"


class Reranker:
    """Scores documents against a query with a model's yes/no logits (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        gpu_lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.gpu_lock = gpu_lock
        yes, no = tokenizer.token_to_id("yes"), tokenizer.token_to_id("no")
        if yes is None or no is None:
            raise UnsupportedModelError(
                f"{tokenizer.source}: no 'yes' and 'no' tokens in the vocabulary, which a yes/no reranker "
                "(Qwen3-Reranker) answers with"
            )
        self.yes, self.no = yes, no
        # The (yes, no) logits of each pair a forward finishes (at most one per row).
        self.picked = Tensor.empty(model.gpu, (model.max_rows, 2), "f32", "rerank yes/no logits")
        self.closed = False
        self.prefix = tokenizer.encode(PREFIX, add_special_tokens=False)
        self.suffix = tokenizer.encode(SUFFIX, add_special_tokens=False)

    def token_ids(self, query: str, documents: Sequence[str], instruction: str | None = None) -> list[list[int]]:
        if not isinstance(query, str) or not query:
            raise GenerationOptionError("query must be a non-empty string", option="query")
        if isinstance(documents, str) or not isinstance(documents, Sequence) or not documents:
            raise GenerationOptionError("documents must be a non-empty list of strings", option="documents")
        if instruction is not None and not isinstance(instruction, str):
            raise GenerationOptionError("instruction must be a string", option="instruction")
        out = []
        for n, document in enumerate(documents):
            if not isinstance(document, str) or not document:
                raise GenerationOptionError(f"documents[{n}] must be a non-empty string", option="documents")
            ids = self.prefix + self.tokenizer.encode(pair_text(query, document, instruction)) + self.suffix
            if len(ids) > self.model.max_positions:
                raise GenerationOptionError(
                    f"documents[{n}] with the query is {len(ids)} tokens, past the context of "
                    f"{self.model.max_positions}",
                    option="documents",
                )
            out.append(ids)
        return out

    def rerank(
        self, query: str, documents: Sequence[str], *, instruction: str | None = None, top_n: int | None = None
    ) -> tuple[list[RerankResult], int]:
        """The documents by relevance, highest first (the first `top_n`), and the tokens read."""
        if top_n is not None and (isinstance(top_n, bool) or not isinstance(top_n, int) or top_n < 1):
            raise GenerationOptionError(f"top_n must be a whole number >= 1, got {top_n!r}", option="top_n")
        pairs = self.token_ids(query, documents, instruction)
        scores = self.scores(pairs)
        ranked = sorted((RerankResult(n, s) for n, s in enumerate(scores)), key=lambda r: -r.relevance_score)
        return ranked[:top_n], sum(len(ids) for ids in pairs)

    def scores(self, pairs: list[list[int]]) -> list[float]:
        """Each pair's yes probability, batched (module docstring)."""
        model = self.model
        shared = 0 if model.hybrid else common_prefix(pairs)
        rows = model.rows_alone
        rests = [np.asarray(ids[shared:], np.uint32) for ids in pairs]
        groups = input_groups([r.size for r in rests], rows)
        pair_logits: list[tuple[float, float] | None] = [None] * len(pairs)
        prefix: KVCache | None = None
        try:
            if shared:
                with self.gpu_lock():
                    prefix = model.new_cache(shared)
                    model.forward(pairs[0][:shared], prefix, 0, logits="none")
            for group in groups:
                with self.gpu_lock():  # per group: generations step between them
                    if self.closed:
                        raise DopplerError("the engine was closed", advice="load the model again")
                    caches = [self._cache(prefix, shared + rests[n].size) for n in group]
                    try:
                        plan = plan_forwards([rests[n].size for n in group], rows)
                        for segments in plan:
                            for n, yes_no in self._forward(group, rests, caches, segments, shared):
                                pair_logits[n] = yes_no
                    finally:
                        for cache in caches:
                            model.release_cache(cache)
        finally:
            if prefix is not None:
                with self.gpu_lock():
                    model.release_cache(prefix)
        assert all(p is not None for p in pair_logits)
        return [yes_probability(*p) for p in pair_logits if p is not None]

    def scores_one_by_one(self, pairs: list[list[int]]) -> list[float]:
        """`scores` without batching: each pair's whole prompt in one forward over a cache of its own, its last
        logits read back. What the batched path is checked against (tests) and timed against (the bench)."""
        model, out = self.model, []
        for ids in pairs:
            with self.gpu_lock():
                cache = model.new_cache(len(ids))
                try:
                    logits = model.forward(ids, cache, 0, logits="last")
                finally:
                    model.release_cache(cache)
            out.append(yes_probability(float(logits[self.yes]), float(logits[self.no])))
        return out

    def close(self) -> None:
        if not self.closed:
            self.picked.destroy()
            self.closed = True

    def _cache(self, prefix: KVCache | None, length: int) -> KVCache:
        """A document's cache, holding the shared prefix's positions (copied from `prefix`) and room for its own."""
        if prefix is None:
            return self.model.new_cache(length)
        cache = self.model.new_cache(length)
        prefix.copy_prefix(cache, prefix.length)
        return cache

    def _forward(
        self,
        group: list[int],
        rests: list[np.ndarray],
        caches: list[KVCache],
        segments: list[tuple[int, int, int]],
        shared: int,
    ) -> list[tuple[int, tuple[float, float]]]:
        """One forward over the segments' rows (`plan_forwards`'s, indexed within the group); the (pair index,
        (yes logit, no logit)) of each pair whose last row it holds."""
        model = self.model
        row0 = 0
        for n, start, take in segments:
            model.ids.view((take,), offset_bytes=4 * row0).write(rests[group[n]][start : start + take])
            row0 += take
        rec = model.registry.recorder()
        model.record_batch(rec, [(caches[n], shared + start, take) for n, start, take in segments], logit_rows=0)
        done, row0 = [], 0
        for n, start, take in segments:
            row0 += take
            if start + take == rests[group[n]].size:
                model.record_row_logits(rec, row0 - 1)  # logits[0] = this pair's last row's; copied out before the next
                for k, token in enumerate((self.yes, self.no)):
                    rec.copy(model.logits, self.picked, 4, src_offset=4 * token, dst_offset=4 * (2 * len(done) + k))
                done.append(group[n])
        rec.submit()
        if not done:
            return []
        picked = np.frombuffer(model.gpu.queue.read_buffer(self.picked.buffer, 0, 8 * len(done)), np.float32)
        return [(n, (float(picked[2 * k]), float(picked[2 * k + 1]))) for k, n in enumerate(done)]


def common_prefix(pairs: Sequence[Sequence[int]]) -> int:
    """The length of the token prefix every pair starts with, leaving each at least its last token of its own (its
    logits)."""
    shortest = min(len(ids) for ids in pairs)
    first = pairs[0]
    length = 0
    while length < shortest - 1 and all(ids[length] == first[length] for ids in pairs):
        length += 1
    return length


def yes_probability(yes_logit: float, no_logit: float) -> float:
    """softmax([no, yes])[yes], in float64."""
    a, b = yes_logit, no_logit
    m = max(a, b)
    return math.exp(a - m) / (math.exp(a - m) + math.exp(b - m))
