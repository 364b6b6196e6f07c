"""Reranking as Qwen3-Reranker's model card defines it: a document's relevance to a query is the model's
probability of answering "yes" rather than "no" when asked whether the document meets the query.

    pair = "<Instruct>: {instruction}\\n<Query>: {query}\\n<Document>: {document}"
    ids = tokens(PREFIX) + tokens(pair) + tokens(SUFFIX)
    logits = the model's logits at the last position (one forward per document, over its own KV cache)
    score = exp(logit_yes) / (exp(logit_yes) + exp(logit_no))

The prefix and suffix are encoded without the tokenizer's additions, the middle with them, as the card does. Any
causal LM whose vocabulary has "yes" and "no" tokens can be asked; a model trained for it (Qwen3-Reranker) answers
meaningfully.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import GenerationOptionError, UnsupportedModelError
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
        scores = []
        for ids in pairs:
            with self.gpu_lock():
                cache = self.model.new_cache(len(ids))
                try:
                    logits = self.model.forward(ids, cache, 0, logits="last")
                finally:
                    self.model.release_cache(cache)
            scores.append(yes_probability(logits, self.yes, self.no))
        ranked = sorted((RerankResult(n, s) for n, s in enumerate(scores)), key=lambda r: -r.relevance_score)
        return ranked[:top_n], sum(len(ids) for ids in pairs)


def yes_probability(logits: np.ndarray, yes: int, no: int) -> float:
    """softmax([no, yes])[yes] of the last position's logits, in float64."""
    a, b = float(logits[yes]), float(logits[no])
    m = max(a, b)
    return math.exp(a - m) / (math.exp(a - m) + math.exp(b - m))
