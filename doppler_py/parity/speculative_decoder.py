"""A port of the JS original's SpeculativeDecoder (doppler-gpu@0.5.1, src/inference/speculative.js).

Same API in Python names, same validation, same numbers: with the same models and seed it produces the
same tokens and stats as the JS class (tests/parity holds it to that), quirks included:

- One mulberry32 stream (doppler_py.rng), drawn in JS order: one draw per draft token, one per verified
  position up to the first rejection, then one for the bonus token or the residual sample. When the residual
  mass is not positive the residual draw is skipped and a plain tempered sample of the main logits draws
  instead, so a step always draws k + (positions verified) + 1 numbers.
- Logits are float32. Scaled logits, log-probs and probabilities are stored as float32; the max, the sum of
  exponentials, log-sum-exp and cumulative sums are doubles summed left to right (np.cumsum is sequential;
  np.sum is pairwise and would round differently). Tests are strict (`r < cumsum`,
  `r < min(1, exp(main_lp - draft_lp))`) and a NaN never passes one; a sampler that runs off the end of its
  cumulative sum returns the last token id.
- Verification calls the main model once per draft token, plus once for the bonus token.
- The main log-probs in the acceptance test and the residual are NOT temperature-scaled while the draft's
  are. Rejection sampling then reproduces the T = 1 main distribution, so at T != 1 every token but the
  bonus token follows the wrong distribution. `correct=True` scales them by the same temperature, which
  makes each step exact rejection sampling from softmax(main / T).
- `step()` hands back the caller's main KV cache unchanged, and `get_stats()["speedup"]` is the JS estimate
  (1 + α·k) / (1 + 0.1·k), not a measurement.

exp and log come from numpy while V8 uses its own (fdlibm) routines; the two disagree in the last bit of a
double for a few percent of arguments. That reaches a result only when a value lies within that bit of a
float32 rounding boundary or of the drawn number r (a multiple of 2^-32), which tests/parity checks for.

Models are objects with `forward(input_ids, kv_cache=None)` returning a dict (or an object) with `logits`
(a float array or list of numbers; a 2-D value gives its last row) and optionally `new_kv_cache`.
This class exists for parity with the JS original; the GPU engine does the correct, batched thing.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypedDict

import numpy as np

from doppler_py.errors import DopplerError, GenerationOptionError
from doppler_py.rng import Mulberry32


class ForwardModel(Protocol):
    def forward(self, input_ids: list[int], kv_cache: Any = None) -> Any: ...


class DraftTokens(TypedDict):
    tokens: list[int]
    logprobs: list[np.ndarray]  # float32 log-probs of the whole vocabulary at the draft temperature


class Verification(TypedDict):
    accepted_count: int
    accepted_tokens: list[int]
    sampled_token: int
    all_accepted: bool


class StepResult(TypedDict):
    new_tokens: list[int]
    main_kv_cache: Any
    accept_rate: float


class Stats(TypedDict):
    total_drafted: int
    total_accepted: int
    total_rejected: int
    average_accept_rate: float


class StatsWithSpeedup(Stats):
    speedup: float


class SpeculativeDecoder:
    """Draft-then-verify decoding over two host-side models, token for token as the JS original does it.

    `enable_tree_draft` is kept exactly as the original keeps it: stored and reported, with no effect on
    decoding (the original has the flag and no tree implementation). Token trees for real are the engine's
    (`doppler_py.speculative.engine`, `ops/tree.py`), not this port's.
    """

    def __init__(
        self,
        *,
        num_draft_tokens: int | None = None,
        max_rejection_retries: int | None = None,
        enable_tree_draft: bool | None = None,
        temperature: float | None = None,
        random_seed: float | None = None,
        correct: bool = False,
    ) -> None:
        # Missing options are reported by name, as the JS constructor does, rather than by a TypeError.
        required = {
            "num_draft_tokens": num_draft_tokens,
            "max_rejection_retries": max_rejection_retries,
            "enable_tree_draft": enable_tree_draft,
            "temperature": temperature,
        }
        for name, value in required.items():
            if value is None:
                raise GenerationOptionError(f"SpeculativeDecoder requires {name}.")
        if not _is_finite_number(random_seed):
            raise GenerationOptionError(
                f"SpeculativeDecoder requires random_seed (a finite number), got {random_seed!r}."
            )
        _check_temperature(temperature, "temperature")

        self.num_draft_tokens = num_draft_tokens
        # Stored and never read, as in the JS original.
        self.max_rejection_retries = max_rejection_retries
        self.enable_tree_draft = enable_tree_draft
        self.temperature = temperature
        self.correct = correct
        # The uniform source in [0, 1); an attribute (like the JS `random` field) so callers can observe draws.
        self.random: Callable[[], float] = Mulberry32(random_seed).random
        self.draft_model: ForwardModel | None = None
        self.main_model: ForwardModel | None = None
        self.stats: Stats = _empty_stats()

    def set_draft_model(self, model: ForwardModel) -> None:
        self.draft_model = model

    def set_main_model(self, model: ForwardModel) -> None:
        self.main_model = model

    # --- sampling primitives -------------------------------------------------------------------------
    def log_softmax(self, logits: Any) -> np.ndarray:
        """float32 log-probs; max, sum of exponentials and log-sum-exp in double, summed left to right."""
        wide = _coerce_logits(logits, "log_softmax logits").astype(np.float64)
        # JS skips NaNs when taking the max, but a NaN makes its sum NaN too, so every result is NaN either way.
        peak = wide.max()
        with np.errstate(all="ignore"):
            log_sum_exp = peak + np.log(np.cumsum(np.exp(wide - peak))[-1])
            return (wide - log_sum_exp).astype(np.float32)

    def sample_token(self, logits: Any, temperature: float) -> tuple[int, np.ndarray]:
        """One draw from softmax(logits / temperature); returns the token and the float32 log-probs."""
        vector = _coerce_logits(logits, "sample logits")
        _check_temperature(temperature, "temperature")
        logprobs = self.log_softmax(_scaled(vector, temperature))
        token = _first_below(self.random(), np.cumsum(_exp_float32(logprobs), dtype=np.float64))
        return (vector.size - 1 if token is None else token), logprobs

    def sample_from_residual(self, main_logits: Any, draft_logprobs: Any, was_rejected: bool) -> int:
        """A draw from max(0, p_main - p_draft); a tempered main sample when not rejected or the mass is 0."""
        main_vector = _coerce_logits(main_logits, "residual main logits")
        if not was_rejected:
            return self.sample_token(main_vector, self.temperature)[0]
        draft_vector = _coerce_logits(draft_logprobs, "residual draft logprobs")
        if draft_vector.size != main_vector.size:
            raise GenerationOptionError(
                f"SpeculativeDecoder: residual draft/main length mismatch ({draft_vector.size} vs {main_vector.size})."
            )
        main_probs = _exp_float32(self._main_logprobs(main_vector)).astype(np.float64)
        draft_probs = _exp_float32(draft_vector).astype(np.float64)
        with np.errstate(all="ignore"):
            residual = np.maximum(0.0, main_probs - draft_probs).astype(np.float32)
        cumulative = np.cumsum(residual, dtype=np.float64)
        mass = float(cumulative[-1])
        if mass > 0:
            token = _first_below(self.random() * mass, cumulative)
            if token is not None:
                return token
        return self.sample_token(main_vector, self.temperature)[0]

    # --- the two phases of a step --------------------------------------------------------------------
    def generate_draft_tokens(
        self, input_ids: Sequence[int], kv_cache: Any = None, num_tokens: int | None = None
    ) -> DraftTokens:
        if self.draft_model is None:
            raise DopplerError("SpeculativeDecoder: draft model not set; call set_draft_model() first.")
        count = self.num_draft_tokens if num_tokens is None else num_tokens
        tokens: list[int] = []
        logprobs: list[np.ndarray] = []
        draft_cache = _cloned(kv_cache)
        current_ids = list(input_ids)
        for i in range(count):
            logits, draft_cache = self._forward_for_logits(
                self.draft_model, current_ids, draft_cache, f"draft step {i}"
            )
            token, token_logprobs = self.sample_token(logits, self.temperature)
            tokens.append(token)
            logprobs.append(token_logprobs)
            current_ids = [*current_ids, token]
        return {"tokens": tokens, "logprobs": logprobs}

    def verify_draft_tokens(
        self, input_ids: Sequence[int], draft_tokens: Sequence[int], draft_logprobs: Sequence[Any], kv_cache: Any = None
    ) -> Verification:
        if self.main_model is None:
            raise DopplerError("SpeculativeDecoder: main model not set; call set_main_model() first.")
        if not isinstance(draft_tokens, (list, tuple)) or not isinstance(draft_logprobs, (list, tuple)):
            raise GenerationOptionError("SpeculativeDecoder: draft tokens and logprobs must be lists.")
        if len(draft_tokens) != len(draft_logprobs):
            raise GenerationOptionError("SpeculativeDecoder: draft token/logprob length mismatch.")

        num_draft = len(draft_tokens)
        accepted: list[int] = []
        verify_ids = list(input_ids)
        verify_cache = _cloned(kv_cache)
        rejected_main_logits: np.ndarray | None = None
        for i, draft_token in enumerate(draft_tokens):
            main_logits, verify_cache = self._forward_for_logits(
                self.main_model, verify_ids, verify_cache, f"verify step {i}"
            )
            main_logprobs = self._main_logprobs(main_logits)
            draft_vector = _coerce_logits(draft_logprobs[i], f"draft logprobs[{i}]")
            token = _token_id(draft_token, main_logprobs.size)
            if token is None:
                raise GenerationOptionError(f"SpeculativeDecoder: draft token at index {i} is out of vocabulary range.")
            if draft_vector.size != main_logprobs.size:
                raise GenerationOptionError(
                    f"SpeculativeDecoder: draft logprobs[{i}] length ({draft_vector.size}) "
                    f"does not match main logits length ({main_logprobs.size})."
                )
            if self.random() < _acceptance(float(main_logprobs[token]), float(draft_vector[token])):
                accepted.append(token)
                verify_ids = [*verify_ids, token]
            else:
                rejected_main_logits = main_logits
                break

        if rejected_main_logits is None:
            continuation, _ = self._forward_for_logits(self.main_model, verify_ids, verify_cache, "verify continuation")
            sampled = self.sample_token(continuation, self.temperature)[0]
        else:
            sampled = self.sample_from_residual(rejected_main_logits, draft_logprobs[len(accepted)], True)

        stats = self.stats
        stats["total_drafted"] += num_draft
        stats["total_accepted"] += len(accepted)
        stats["total_rejected"] += num_draft - len(accepted)
        drafted = stats["total_drafted"]
        stats["average_accept_rate"] = stats["total_accepted"] / drafted if drafted > 0 else 0.0
        return {
            "accepted_count": len(accepted),
            "accepted_tokens": accepted,
            "sampled_token": sampled,
            "all_accepted": len(accepted) == num_draft,
        }

    def step(self, input_ids: Sequence[int], main_kv_cache: Any = None, draft_kv_cache: Any = None) -> StepResult:
        """Draft, verify, and return the new tokens; `main_kv_cache` comes back as given (as in the JS)."""
        draft = self.generate_draft_tokens(input_ids, draft_kv_cache)
        result = self.verify_draft_tokens(input_ids, draft["tokens"], draft["logprobs"], main_kv_cache)
        drafted = len(draft["tokens"])
        return {
            "new_tokens": [*result["accepted_tokens"], result["sampled_token"]],
            "main_kv_cache": main_kv_cache,
            "accept_rate": result["accepted_count"] / drafted if drafted > 0 else 0.0,
        }

    # --- statistics ----------------------------------------------------------------------------------
    def get_stats(self) -> StatsWithSpeedup:
        return {**self.stats, "speedup": self.estimate_speedup()}

    def estimate_speedup(self) -> float:
        """The JS model: (1 + α·k) tokens per main call over a draft cost of 0.1·k main calls."""
        if self.stats["total_drafted"] == 0:
            return 1.0
        k = self.num_draft_tokens
        tokens_per_call = 1 + self.stats["average_accept_rate"] * k
        return tokens_per_call / (1 + 0.1 * k)

    def reset_stats(self) -> None:
        self.stats = _empty_stats()

    # --- internals -----------------------------------------------------------------------------------
    def _main_logprobs(self, main_vector: np.ndarray) -> np.ndarray:
        if self.correct:
            return self.log_softmax(_scaled(main_vector, self.temperature))
        return self.log_softmax(main_vector)

    def _forward_for_logits(
        self, model: ForwardModel, input_ids: list[int], kv_cache: Any, label: str
    ) -> tuple[np.ndarray, Any]:
        result = model.forward(input_ids, kv_cache)
        if isinstance(result, Mapping):
            logits, new_cache = result.get("logits"), result.get("new_kv_cache")
        elif result is None or isinstance(result, (str, bytes, numbers.Number)):
            raise DopplerError(
                f"SpeculativeDecoder: {label} forward() must return a dict or an object, got {result!r}."
            )
        else:
            logits, new_cache = getattr(result, "logits", None), getattr(result, "new_kv_cache", None)
        return _coerce_logits(logits, f"{label} logits"), (kv_cache if new_cache is None else new_cache)


def _empty_stats() -> Stats:
    return {"total_drafted": 0, "total_accepted": 0, "total_rejected": 0, "average_accept_rate": 0.0}


def _is_number(value: Any) -> bool:
    """JS `typeof value === 'number'`: a real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _is_finite_number(value: Any) -> bool:
    """JS `Number.isFinite`; an int beyond the double range counts as infinite, as it would be in JS."""
    if not _is_number(value):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _check_temperature(temperature: Any, label: str) -> None:
    if not _is_finite_number(temperature) or temperature <= 0:
        raise GenerationOptionError(
            f"SpeculativeDecoder: {label} must be a positive finite number, got {temperature!r}."
        )


def _token_id(value: Any, vocab_size: int) -> int | None:
    """The token id `value` names (JS `Number.isInteger`, so 3.0 counts), or None when it is not one."""
    if not _is_finite_number(value) or not float(value).is_integer():
        return None
    token = int(value)
    return token if 0 <= token < vocab_size else None


def _coerce_logits(value: Any, label: str) -> np.ndarray:
    """A float32 vector, as JS coerceLogitsVector: float32 input is used as is, a 2-D value gives its last row."""
    if isinstance(value, np.ndarray):
        if value.ndim == 2:
            if value.shape[0] == 0:
                raise GenerationOptionError(f"SpeculativeDecoder: {label} must not be empty.")
            value = value[-1]
        if value.ndim == 1:
            return _float32_vector(value, label)
    elif isinstance(value, (list, tuple)):
        if len(value) == 0:
            raise GenerationOptionError(f"SpeculativeDecoder: {label} must not be empty.")
        if _is_number(value[0]):
            return _float32_vector(value, label)
        last = value[-1]
        if (isinstance(last, np.ndarray) and last.ndim == 1) or (
            isinstance(last, (list, tuple)) and (len(last) == 0 or _is_number(last[0]))
        ):
            return _float32_vector(last, label)
    raise GenerationOptionError(
        f"SpeculativeDecoder: {label} must be a numeric logits vector (a float array or a list of numbers)."
    )


def _float32_vector(values: Any, label: str) -> np.ndarray:
    # float64 -> float32 rounds to nearest even, like a store into a JS Float32Array.
    with np.errstate(over="ignore"):
        vector = np.asarray(values, dtype=np.float32)
    if vector.size == 0:
        raise GenerationOptionError(f"SpeculativeDecoder: {label} must not be empty.")
    return vector


def _scaled(vector: np.ndarray, temperature: float) -> np.ndarray:
    """float32(logit / T) with the division in double, as JS stores `logits[i] / temperature`."""
    with np.errstate(over="ignore"):
        return (vector.astype(np.float64) / float(temperature)).astype(np.float32)


def _exp_float32(logprobs: np.ndarray) -> np.ndarray:
    """float32(exp(x)) with exp in double, as JS stores `Math.exp(logprobs[i])` into a Float32Array."""
    with np.errstate(all="ignore"):
        return np.exp(logprobs.astype(np.float64)).astype(np.float32)


def _first_below(r: float, cumulative: np.ndarray) -> int | None:
    """The first index whose cumulative sum is strictly above r (a NaN sum never is), or None."""
    hits = r < cumulative
    return int(np.argmax(hits)) if hits.any() else None


def _acceptance(main_logprob: float, draft_logprob: float) -> float:
    """JS `Math.min(1, Math.exp(main - draft))`: a NaN stays NaN (and so never accepts); overflow is +inf."""
    with np.errstate(all="ignore"):
        ratio = float(np.exp(np.float64(main_logprob - draft_logprob)))
    return ratio if ratio < 1 or math.isnan(ratio) else 1.0


def _cloned(kv_cache: Any) -> Any:
    """JS `kvCache?.clone?.() ?? kvCache`."""
    clone = getattr(kv_cache, "clone", None)
    copy = None if clone is None else clone()
    return kv_cache if copy is None else copy
