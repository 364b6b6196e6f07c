"""numpy reference of the GPU verification of a speculative step (`shaders/sample.wgsl`, entries `spec_*`).

Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) over k draft tokens d_0..d_{k-1}:
p_i is the target's filtered distribution after the prefix that ends before d_i (row i of the target's
k+1 rows) and q_i the draft's filtered distribution that d_i was drawn from, both filtered exactly as the
sampler does (`sampling_reference.filtered_probs`: temperature, exact top-k, top-p) with the SAME options.

* temperature > 0: d_i is accepted iff u_i * q_i(d_i) < p_i(d_i) (u_i < p/q without dividing; q_i(d_i) = 0
  accepts whatever p_i gives d_i some mass). n is the number of leading accepted drafts. If n < k the final
  token is drawn from normalise(max(0, p_n - q_n)) by inverse CDF with u_final in token-index order, or from
  p_n when that residual has no mass (possible only through rounding); if n == k it is drawn from p_k.
* One-hot mode (a deterministic drafter such as prompt lookup): q_i is one-hot at d_i, so d_i is accepted
  iff u_i < p_i(d_i), and the residual is p_n without d_n.
* temperature 0 (greedy): d_i is accepted iff it is the argmax of row i (lowest index on ties); the final
  token is the argmax of row n.
* A draft token outside [0, vocab) is never accepted (the kernel also flags it in its status word).

Each emitted token is then distributed exactly as the target would sample it (the property the tests check
statistically). The GPU computes in float32 where this reference uses float64, so the two can differ only
where a u lies within float rounding of a decision boundary (see tests/kernels/test_spec_verify.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.sampling import SamplingParams
from doppler_py.testing.sampling_reference import filtered_probs, inverse_cdf


def accepts(p: np.ndarray, q: np.ndarray | None, token: int, u: float) -> bool:
    """Whether draft `token` survives the test u * q(token) < p(token); q None means one-hot at `token`."""
    if not 0 <= token < p.size:
        return False
    q_token = 1.0 if q is None else float(q[token])
    return u * q_token < float(p[token])


def residual(p: np.ndarray, q: np.ndarray | None, token: int) -> np.ndarray:
    """max(0, p - q), unnormalised; q None means one-hot at `token` (so: p without `token`)."""
    if q is None:
        r = p.copy()
        if 0 <= token < p.size:
            r[token] = 0.0
        return r
    return np.maximum(p - q, 0.0)


def final_draw(p: np.ndarray, q: np.ndarray | None, token: int, u: float) -> int:
    """The token emitted after rejecting `token`: a draw from the residual, or from p if it has no mass."""
    r = residual(p, q, token)
    return inverse_cdf(r if r.sum() > 0 else p, u)


def verify_reference(
    target_logits: np.ndarray,
    draft_logits: np.ndarray | None,
    draft_tokens: Sequence[int],
    u_accept: Sequence[float],
    u_final: float,
    params: SamplingParams,
    onehot: bool = False,
) -> tuple[int, int]:
    """(n accepted drafts, final token) for one step; target_logits [k+1, vocab], draft_logits [k, vocab].

    `u_accept[i]` tests d_i and `u_final` draws the residual or bonus token (randoms[k:2k] and randoms[2k] of
    the GPU op). draft_logits are unused in one-hot mode and may be None there.
    """
    target = np.asarray(target_logits, dtype=np.float32)
    k = len(draft_tokens)
    if target.ndim != 2 or target.shape[0] != k + 1:
        raise ValueError(f"target_logits must be [k+1, vocab] = [{k + 1}, vocab], got {target.shape}")
    if len(u_accept) != k:
        raise ValueError(f"need one accept draw per draft token ({k}), got {len(u_accept)}")
    if not onehot and not params.greedy and draft_logits is None:
        raise ValueError("draft_logits are needed unless onehot=True or the temperature is 0")

    for i, token in enumerate(int(t) for t in draft_tokens):
        p = filtered_probs(target[i], params)
        if params.greedy:
            if token != int(np.argmax(p)):
                return i, int(np.argmax(p))
            continue
        q = None if onehot else filtered_probs(np.asarray(draft_logits[i], dtype=np.float32), params)
        if not accepts(p, q, token, float(np.float32(u_accept[i]))):
            return i, final_draw(p, q, token, float(np.float32(u_final)))
    p = filtered_probs(target[k], params)
    if params.greedy:
        return k, int(np.argmax(p))
    return k, inverse_cdf(p, float(np.float32(u_final)))
