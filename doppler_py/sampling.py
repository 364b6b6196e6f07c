"""Sampling options (`SamplingParams`): greedy, temperature, top-k, top-p, min-p, the penalties, the logit bias and
the seed of the host RNG.

What the GPU sampler does with temperature, top-k and top-p, exactly (ties, NaN, the top-p boundary), is the
contract written in `doppler_py/testing/sampling_reference.py`; what the penalties, the bias and min-p do to the
logits before it, and in which order, is `doppler_py/testing/penalty_reference.py`. Each is next to the numpy
reference the GPU is held to.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from numbers import Integral, Real
from typing import Any

import numpy as np

from doppler_py import defaults
from doppler_py.errors import GenerationOptionError

_F32_MAX = float(np.finfo(np.float32).max)
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100], as OpenAI's


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token: greedy when temperature is 0, else temperature / min-p / top-k / top-p sampling,
    of logits changed first by the penalties and the logit bias (`penalty_reference` has the exact definitions).

    `seed` seeds the host RNG whose draws become the sampler's `u` values; None means unseeded.
    presence_penalty, frequency_penalty: OpenAI's, in [-2, 2], over the tokens generated so far (not the prompt).
    repetition_penalty (> 0; 1 = off): the multiplicative one of HF and llama.cpp, over the last `repeat_last_n`
    tokens, prompt included (-1: every token; 0: off).
    logit_bias: token id -> a bias in [-100, 100] added to its logit; kept as sorted (id, bias) pairs.
    min_p in [0, 1] (0 = off): keep the tokens at least min_p times as likely as the likeliest, after temperature.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repeat_last_n: int = defaults.REPEAT_LAST_N
    logit_bias: Mapping[Any, float] | tuple[tuple[int, float], ...] | None = ()
    min_p: float = 0.0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, Real) or not (0.0 <= t <= _F32_MAX):
            raise GenerationOptionError(
                f"temperature must be a number >= 0 and finite (0 = greedy, 1 = the model's distribution), got {t!r}"
            )
        k = self.top_k
        if isinstance(k, bool) or not isinstance(k, Integral) or k < 0:
            raise GenerationOptionError(f"top_k must be an integer >= 0 (0 = keep every token), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, Real) or not (0.0 < p <= 1.0):
            raise GenerationOptionError(f"top_p must be a number in (0, 1] (1 = keep every token), got {p!r}")
        s = self.seed
        finite = isinstance(s, Integral) or (isinstance(s, Real) and math.isfinite(s))
        if s is not None and (isinstance(s, bool) or not finite):
            raise GenerationOptionError(f"seed must be an integer, or None for an unseeded run, got {s!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise GenerationOptionError(f"{name} must be a number in [-2, 2] (0 = off), got {value!r}")
        r = self.repetition_penalty
        if not _number(r) or not 0.0 < r <= _F32_MAX:
            raise GenerationOptionError(f"repetition_penalty must be a finite number > 0 (1 = off), got {r!r}")
        n = self.repeat_last_n
        if isinstance(n, bool) or not isinstance(n, Integral) or n < -1:
            raise GenerationOptionError(f"repeat_last_n must be an integer >= -1 (-1: every token, 0: off), got {n!r}")
        object.__setattr__(self, "logit_bias", check_logit_bias(self.logit_bias))
        m = self.min_p
        if not _number(m) or not 0.0 <= m <= 1.0:
            raise GenerationOptionError(f"min_p must be a number in [0, 1] (0 = off), got {m!r}")

    @property
    def greedy(self) -> bool:
        """True when the temperature is 0 in float32, which is what the GPU sees."""
        return np.float32(self.temperature) == 0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits (each row then depends on the tokens before it)."""
        repeats = self.repetition_penalty != 1.0 and self.repeat_last_n != 0
        return bool(self.presence_penalty or self.frequency_penalty or repeats or self.logit_bias)

    @property
    def filters_min_p(self) -> bool:
        """Whether min_p removes tokens (it never changes a greedy pick)."""
        return self.min_p > 0 and not self.greedy


def check_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    """A logit bias as sorted (token id, bias) pairs: from a mapping of ids (integers, or strings of them as in JSON,
    OpenAI's shape) to numbers in [-100, 100], or such pairs. Whether the ids are in the vocabulary is the engine's
    check (`check_bias_vocab`), which knows the model."""
    if bias is None:
        return ()
    pairs = bias.items() if isinstance(bias, Mapping) else bias
    if not isinstance(pairs, tuple | list | type({}.items())):
        raise GenerationOptionError(f"logit_bias must be an object of token id -> bias, got {_short(bias)}")
    out: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise GenerationOptionError(f"logit_bias must be an object of token id -> bias, got {_short(bias)}")
        key, value = pair
        token = _token_id(key)
        if token is None:
            raise GenerationOptionError(f"logit_bias keys must be token ids (integers >= 0), got {key!r}")
        if not _number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise GenerationOptionError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for {token}")
        out[token] = float(value)
    return tuple(sorted(out.items()))


def check_bias_vocab(params: SamplingParams, vocab: int) -> None:
    """Refuse a logit bias naming a token the model's vocabulary lacks."""
    outside = [token for token, _ in params.logit_bias if token >= vocab]
    if outside:
        message = f"logit_bias keys must be token ids below the vocabulary size {vocab}, got {outside[0]}"
        raise GenerationOptionError(message, option="logit_bias")


def _token_id(key: Any) -> int | None:
    if isinstance(key, str) and key.isascii() and key.isdigit():
        return int(key)
    if isinstance(key, Integral) and not isinstance(key, bool) and key >= 0:
        return int(key)
    return None


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, Real) and math.isfinite(value)


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
