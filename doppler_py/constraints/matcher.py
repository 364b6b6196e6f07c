"""One generation's position in a grammar: token masks for the sampler, commits, rollbacks, forced tokens.

Mask layout (what the GPU sampler reads): a row of `words = ceil(V / 32)` uint32 words for the model's vocabulary
size V; token t is allowed when bit `t % 32` of word `t // 32` is set (little-endian bit order, as llguidance
writes it). Ids the tokenizer does not have (a model's vocabulary is often padded past the tokenizer's) are
never allowed. When the text so far is a complete match, the end-of-sequence ids are allowed; once the grammar
can take nothing more, only they are.

A mask is exact: a token is allowed iff its bytes keep the output a prefix of some text the grammar derives,
except where the grammar forces bytes (a schema's next key, say); then llguidance allows only the first token of
their canonical tokenization (`forced_tokens()[0]`), not every token that spells a prefix of them.

One matcher must not be used from two threads at once (llguidance answers RuntimeError "Already borrowed");
different matchers may compute masks in parallel threads, as llguidance drops the GIL meanwhile.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from doppler_py.constraints.grammar import Constraint
from doppler_py.errors import GenerationOptionError, InternalError, VocabularyMismatchError
from doppler_py.ops.token_mask import mask_words  # the layout the GPU reads (shaders/token_mask.wgsl)

if TYPE_CHECKING:
    import llguidance


def allowed_ids(row: np.ndarray) -> np.ndarray:
    """The token ids a mask row allows, ascending (a host-side reading of the layout above)."""
    return np.flatnonzero(np.unpackbits(np.ascontiguousarray(row, dtype="<u4").view(np.uint8), bitorder="little"))


class GrammarMatcher:
    """The grammar state of one generation over a model with `vocab_size` output ids.

    The committed tokens are the generated ones only (not the prompt). Every method leaves the matcher usable:
    a refused token raises and changes nothing, instead of llguidance's permanent error state.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, constraint: Constraint | str, vocab_size: int):
        import llguidance

        self.tokenizer_size = tokenizer.vocab_size
        if vocab_size < self.tokenizer_size:
            raise VocabularyMismatchError(
                f"the model has {vocab_size} output ids but its tokenizer {self.tokenizer_size}: a grammar mask "
                "must cover every token"
            )
        self.vocab_size = vocab_size
        self.words = mask_words(vocab_size)
        self.option = constraint.option if isinstance(constraint, Constraint) else "grammar"
        grammar = constraint.grammar if isinstance(constraint, Constraint) else constraint
        # log_level=0: llguidance would print its warnings to stderr; errors are read with get_error() instead.
        self._matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        self._tokenizer = tokenizer
        self._raise_if_error()
        self._ll_words = mask_words(self.tokenizer_size)  # llguidance writes exactly its own vocabulary's words
        self._in_vocabulary = np.zeros(self.words, dtype=np.uint32)  # bit set for ids the tokenizer has
        bits = np.zeros(self.words * 32, dtype=np.uint8)
        bits[: self.tokenizer_size] = 1
        self._in_vocabulary[:] = np.packbits(bits, bitorder="little").view("<u4")
        self._eos_ids = frozenset(tokenizer.eos_tokens)
        self._eos_after_stop = 0  # eos tokens committed after llguidance stopped (it does not record them)
        self.length = 0  # committed tokens

    # --- state -------------------------------------------------------------------------------------------
    @property
    def accepting(self) -> bool:
        """The committed text is a complete match: end-of-sequence is allowed now."""
        return self._matcher.is_accepting()

    @property
    def finished(self) -> bool:
        """Nothing but end-of-sequence can follow (the grammar is complete and cannot grow, or eos was committed)."""
        return self._matcher.is_stopped()

    def _raise_if_error(self) -> None:
        if self._matcher.is_error():
            # Grammars are checked when made, so an error here is a resource limit llguidance hit on this input.
            raise GenerationOptionError(f"{self.option}: {self._matcher.get_error().splitlines()[0]}")

    # --- masks -------------------------------------------------------------------------------------------
    def mask(self, out: np.ndarray | None = None) -> np.ndarray:
        """The allowed next tokens as one row of `words` uint32 (written into `out` when given, and returned)."""
        row = np.empty(self.words, dtype=np.uint32) if out is None else out
        if row.shape != (self.words,) or row.dtype != np.uint32 or not row.flags.c_contiguous:
            raise InternalError(f"a mask row is {self.words} contiguous uint32 words, got {row.dtype} {row.shape}")
        # llguidance writes the tokenizer's ids straight into the row (it drops the GIL meanwhile); the model's
        # padded ids past them are cleared here.
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, self._ll_words * 4)
        self._raise_if_error()
        row[self._ll_words :] = 0
        row &= self._in_vocabulary
        return row

    def draft_masks(self, drafts: Sequence[int], out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """Masks for verifying a chain of draft tokens d_0..d_{n-1} in one target pass: `(rows, valid)`.

        Row i (0 <= i <= valid) is the mask after committing d_0..d_{i-1}; `valid` is how many drafts the grammar
        allows in a row (the walk stops at the first refused draft). Rows past `valid` are all zero: the
        verifier never reaches them, since row `valid` refuses d_valid. The matcher ends where it started.
        `out`, when given, is an (n+1, words) uint32 array to fill.
        """
        rows = np.empty((len(drafts) + 1, self.words), dtype=np.uint32) if out is None else out
        if rows.shape != (len(drafts) + 1, self.words):
            raise InternalError(f"draft masks are {(len(drafts) + 1, self.words)} words, got {rows.shape}")
        valid = 0
        try:
            for i, token in enumerate(drafts):
                self.mask(rows[i])
                if not self._allows(rows[i], int(token)) or not self._commit(int(token)):
                    break
                valid = i + 1
            else:
                self.mask(rows[len(drafts)])
        finally:
            self.rollback(valid)
        rows[valid + 1 :] = 0
        return rows, valid

    @staticmethod
    def _allows(row: np.ndarray, token: int) -> bool:
        return 0 <= token < row.size * 32 and bool((int(row[token // 32]) >> (token % 32)) & 1)

    # --- commits -----------------------------------------------------------------------------------------
    def _commit(self, token: int) -> bool:
        """Commit one token if the grammar allows it; False (and nothing changed) if not."""
        if token in self._eos_ids and self._matcher.is_stopped():
            # llguidance takes no token once stopped, not even eos (it would not count it, and rollback would
            # then undo a real token instead), so an eos that ends a finished grammar is counted here.
            self._eos_after_stop += 1
        elif not (0 <= token < self.tokenizer_size and self._matcher.try_consume_tokens([token]) == 1):
            return False
        self.length += 1
        return True

    def advance(self, tokens: Sequence[int]) -> None:
        """Commit generated tokens (eos included). A token the grammar refuses raises and commits none of them:
        the sampler had a mask that forbade it, so reaching here is an engine bug."""
        tokens = [int(t) for t in tokens]
        for done, token in enumerate(tokens):
            if not self._commit(token):
                self.rollback(done)
                raise InternalError(
                    f"{self.option}: token {token} (at {done} of the {len(tokens)} being committed) is not allowed "
                    f"after {self.length} generated tokens"
                )

    def rollback(self, count: int) -> None:
        """Undo the last `count` committed tokens (rejected speculation), back to the state before them."""
        if not 0 <= count <= self.length:
            raise InternalError(f"cannot roll back {count} tokens: {self.length} are committed")
        own = min(count, self._eos_after_stop)  # the newest tokens are the eos counted here, if any
        self._eos_after_stop -= own
        if count > own and not self._matcher.rollback(count - own):
            raise InternalError(f"llguidance could not roll back {count - own} tokens: {self._matcher.get_error()}")
        self.length -= count

    def walk(self, tokens: Sequence[int]) -> tuple[int, list[int]]:
        """How many of `tokens` the grammar allows in a row from here, and the forced bytes' spelling after those
        (`forced_spelling` there). The matcher ends where it started."""
        valid = 0
        try:
            for token in tokens:
                if not self._allows(self.mask(), int(token)) or not self._commit(int(token)):
                    break
                valid += 1
            return valid, self.forced_spelling()
        finally:
            self.rollback(valid)

    def forced_spelling(self) -> list[int]:
        """The bytes the grammar forces next, as tokens: `forced_tokens()`, then the canonical tokens of the rest.

        The rest are only likely: llguidance stops forcing tokens where the model may still merge the forced bytes
        with free ones into a longer token (after `"name":` the forced ` "` may open ` "Dan`). They are drafts to
        verify, not forced tokens; `forced_tokens()` alone where the spelling does not start with them.
        """
        return self.forced_run()[0]

    def forced_run(self) -> tuple[list[int], int]:
        """`forced_spelling()` and how many of its leading tokens are forced (`forced_tokens()`), in one pass."""
        forced = self.forced_tokens()
        spelled = list(self._tokenizer.tokenize_bytes(bytes(self._matcher.compute_ff_bytes())))
        self._raise_if_error()
        return (spelled if spelled[: len(forced)] == forced else forced), len(forced)

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, whatever the model says (e.g. `{"name": "` after a schema's start).

        They are the canonical tokenization of the bytes that are forced, cut where a later byte could still
        merge into a different token; committing them with `advance` is always allowed. Empty when the next
        byte is not forced.
        """
        tokens = self._matcher.compute_ff_tokens()
        self._raise_if_error()
        return list(tokens)
