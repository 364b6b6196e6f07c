"""The KV rows of earlier sequences, kept so that a prompt sharing a prefix with one of them prefills only its tail.

An entry is a finished generation's committed tokens (prompt and answer, all but the last, whose K/V were never
written) and a compact copy of their K/V rows in every layer. A new prompt takes the longest common prefix with
any entry, to the token, when it is at least MIN_HIT tokens (a shorter one is not worth its copy: one copy per
layer and K/V), and at least one token is always left to prefill: the engine feeds the prompt's last token with
its first step. A chat's next turn shares everything up to where the template closes the last answer. The rows
are copied into the new generation's own cache on the GPU, so entries are never written while in use and a
generation may outlive them.

Entries are evicted least recently used first when their total size passes the budget (`budget_bytes`); an entry
whose tokens are a prefix of a new one is replaced by it. K/V rows depend only on the tokens before them, so a
hit gives the rows a prefill of the same tokens gives (the tests check greedy and seeded outputs are the same
with and without hits).

A hybrid model's entry (Qwen 3.5) also holds its sequence's recurrent states, which exist only at the entry's end:
it is hit only by a prompt that extends all of its tokens (a chat's next turn), never by a shorter shared prefix.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from doppler_py.errors import GenerationOptionError
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer

MIN_HIT = 16  # tokens: a shorter shared prefix is prefilled


@dataclass
class _Entry:
    tokens: tuple[int, ...]
    cache: KVCache


class PrefixCache:
    """Earlier sequences' K/V rows for one model, within `budget_bytes` of GPU memory (0: keep nothing)."""

    def __init__(self, model: Transformer, budget_bytes: int):
        if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes < 0:
            raise GenerationOptionError(
                f"the prefix cache budget must be a whole number of bytes >= 0, got {budget_bytes!r}"
            )
        self.model = model
        self.budget_bytes = budget_bytes
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # by id, least recently used first
        self.hits = self.lookups = self.hit_tokens = 0

    @property
    def nbytes(self) -> int:
        return sum(entry.cache.nbytes for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int], adapter: str | None = None) -> tuple[_Entry | None, int]:
        """The entry sharing the longest prefix with `prompt` and that prefix's length, below len(prompt) (None, 0:
        no entry shares MIN_HIT tokens), among those computed with the LoRA `adapter` (None: the base model), whose
        K/V the adapter changes."""
        self.lookups += 1
        best, best_len = None, 0
        for entry in self._entries.values():
            if entry.cache.adapter != adapter:
                continue
            shared = _common_prefix(entry.tokens, prompt)
            if entry.cache.recurrent is not None and not len(entry.tokens) == shared < len(prompt):
                continue
            if shared > best_len:
                best, best_len = entry, shared
        usable = min(best_len, len(prompt) - 1)
        if best is None or usable < MIN_HIT:
            return None, 0
        self._entries.move_to_end(id(best.cache))
        self.hits += 1
        self.hit_tokens += usable
        return best, usable

    def restore(self, entry: _Entry, length: int, cache: KVCache) -> None:
        """Copy the entry's first `length` positions into `cache` (which must be empty) on the GPU."""
        entry.cache.copy_prefix(cache, length)

    def store(self, tokens: Sequence[int], cache: KVCache) -> None:
        """Keep `cache`'s rows of `tokens` (its first len(tokens) positions), evicting as the budget needs."""
        tokens = tuple(tokens)
        if len(tokens) < MIN_HIT or self.budget_bytes == 0:
            return
        for key, entry in list(self._entries.items()):
            if entry.cache.adapter != cache.adapter:
                continue
            if entry.tokens[: len(tokens)] == tokens:  # already held by a longer or equal entry
                self._entries.move_to_end(key)
                return
            if tokens[: len(entry.tokens)] == entry.tokens:  # a prefix of the new one: replaced by it
                self._drop(key)
        copy = cache.empty_like(len(tokens), "prefix")
        if copy.nbytes > self.budget_bytes:
            copy.close()
            return
        self.model.settle(cache)
        cache.copy_prefix(copy, len(tokens))
        self._entries[id(copy)] = _Entry(tokens, copy)
        while self.nbytes > self.budget_bytes:
            self._drop(next(iter(self._entries)))

    def forget_adapter(self, adapter: str) -> None:
        """Drop the entries computed with LoRA `adapter` (unloaded: a later one of that name is another adapter)."""
        for key, entry in list(self._entries.items()):
            if entry.cache.adapter == adapter:
                self._drop(key)

    def _drop(self, key: int) -> None:
        self._entries.pop(key).cache.close()

    def clear(self) -> None:
        for key in list(self._entries):
            self._drop(key)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
