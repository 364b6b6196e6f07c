"""numpy reference of what happens to a row's logits before the sampler (`shaders/penalties.wgsl`,
`shaders/min_p.wgsl`, `doppler_py.ops.penalties`): the contract both implementations follow.

For the row that picks the token after `context` (the prompt's n_prompt tokens, then the generated ones), in this
order, every step in float32:

1. Repetition penalty (r = repetition_penalty, 1 = off). Each token among the last `repeat_last_n` tokens of the
   context (prompt included, as HF and llama.cpp; -1: the whole context; 0: off) is penalised once, however often
   it occurs there: x = x * f32(1 / r) if x > 0, else x * r. (HF divides; a product by the float32 reciprocal is
   what every GPU rounds alike. It differs from the quotient by at most an ulp.)
2. Presence and frequency penalties (OpenAI's). With c = the token's occurrences among the GENERATED tokens (not
   the prompt's, as OpenAI): x = x - frequency_penalty * f32(c), then x = x - presence_penalty if c > 0.
3. Logit bias: x = x + bias[token]. A bias of -100 makes a token e^-100 times less likely: in effect a ban, though
   not an exact one (as OpenAI's); +100 in effect forces a token.
   Steps 1-3 change only finite logits: -inf (masked), +inf and NaN stay as they are, so the verifier still
   reports +inf and NaN rows.
4. The constraint's mask (response_format / regex / grammar / tools), when there is one: disallowed tokens -inf.
5. Min-p (min_p in (0, 1], after temperature T > 0; never for greedy picks, whose argmax it keeps anyway): with m
   the row's largest non-NaN logit, when finite, every token whose logit is below f32(m + f32(T * ln(min_p))) becomes
   -inf: exactly the tokens with exp((x - m) / T) < min_p, that is p(x) < min_p * p_max, up to the rounding of
   that one offset.
6. The sampler contract (`sampling_reference`): temperature, top-k, top-p, the pick. So min-p comes before top-k
   and top-p (top-p's mass is then that of the tokens min-p kept, as vLLM's order).

Log-probs (`ops.logprobs`) report the distribution after steps 1-4 at the request's temperature (OpenAI's shape:
penalties and bias included), before the truncations 5 and 6.

Under speculation, row r of a verification is the row after the committed tokens AND the drafts on its own path
(a chain's d_0..d_{r-1}; a tree row's ancestors): they count as generated tokens and as the context's last tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from doppler_py.sampling import SamplingParams


def penalize(logits: np.ndarray, context: Sequence[int], n_prompt: int, params: SamplingParams) -> np.ndarray:
    """Steps 1-3 for one row (float32 [vocab]) after `context`, whose first n_prompt tokens are the prompt."""
    x = np.array(logits, dtype=np.float32).reshape(-1)
    out = x.copy()
    finite = np.isfinite(x)
    context = [int(t) for t in context]
    r = np.float32(params.repetition_penalty)
    window = params.repeat_last_n
    if r != 1 and window != 0:
        recent = context if window < 0 else context[-window:]
        seen = np.zeros(x.size, bool)
        seen[[t for t in recent if t < x.size]] = True
        seen &= finite
        inv = np.float32(1.0 / params.repetition_penalty)
        out[seen] = np.where(out[seen] > 0, out[seen] * inv, out[seen] * r)
    counts = np.bincount([t for t in context[n_prompt:] if t < x.size], minlength=x.size)[: x.size]
    frequency, presence = np.float32(params.frequency_penalty), np.float32(params.presence_penalty)
    changed = finite & (counts > 0)
    out[changed] = out[changed] - frequency * counts[changed].astype(np.float32)
    out[changed] = out[changed] - presence
    for token, bias in params.logit_bias:
        if token < x.size and finite[token]:
            out[token] = out[token] + np.float32(bias)
    return out


def min_p_offset(params: SamplingParams) -> float:
    """f32(T * ln(min_p)) (<= 0): how far below the row's max a kept logit may lie."""
    return float(np.float32(params.temperature * math.log(params.min_p)))


def min_p_filter(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Step 5 for one row (a copy); the row unchanged when min_p is off or the pick greedy."""
    x = np.array(logits, dtype=np.float32).reshape(-1)
    if not params.filters_min_p:
        return x
    values = x[~np.isnan(x)]
    if values.size == 0 or not np.isfinite(values.max()):
        return x
    threshold = np.float32(values.max()) + np.float32(min_p_offset(params))
    with np.errstate(invalid="ignore"):
        x[~np.isnan(x) & (x < threshold)] = -np.inf
    return x


def sampler_logits(
    logits: np.ndarray, context: Sequence[int], n_prompt: int, params: SamplingParams, allowed: np.ndarray | None = None
) -> np.ndarray:
    """Steps 1-5: the row the sampler contract then picks from; `allowed`, a boolean per token, is step 4's mask."""
    x = penalize(logits, context, n_prompt, params)
    if allowed is not None:
        x = np.where(allowed, x, np.float32(-np.inf))
    return min_p_filter(x, params)
