"""A drafter's own confidence as the chance that the target accepts its draft (EAGLE-2's observation).

A draft head's probability of the token it drafts tracks acceptance closely. On SmolLM2's EAGLE head (231
held-out answers, 26,766 anchors, greedy) the first draft was accepted 21% of the time when the head gave it
less than 0.2, 59% at 0.4-0.5 and 99% above 0.9, the same at every depth; a fifth of the anchors fall in each
end. So the head's confidence, read back after each draft, says where a longer chain pays and where one draft
is already too many, step by step, where a running mean of acceptance can only say it on average.

`ConfidenceCalibration` maps a confidence to an acceptance rate measured on the head's own verified drafts
(in bins, starting from the confidence itself as the prior), so a head that is over- or under-confident on the
text at hand is read as it is. Each bin forgets (a weight of DECAY per new draft in it, a memory of about 20
drafts), so the rates follow the text being written: a head confident on stories is less right on lists. The
first, second and later drafts of a chain have rates of their own: a head's confidence can mean the same at
every depth on text like its training data and be confidently wrong deep in a chain on other text (measured in
docs/benchmarks.md, "Why the policy is what it is"). A chain's node i is accepted only if every
draft up to it is, so its expected contribution (`Proposal.values`) is the product of the rates of drafts 0..i.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.sampling import SamplingParams

BINS = 10  # confidence bins of width 0.1
DEPTHS = 3  # rates kept apart for a chain's first draft, its second, and the rest
PRIOR_WEIGHT = 4.0  # the prior (a bin's centre) counts as this many drafts of that bin
DECAY = 0.95  # what a bin's counts keep at each new draft in it


def draft_confidence(logits: np.ndarray, token: int, params: SamplingParams) -> float:
    """The probability of draft `token` in its row `logits` (the head's own vocabulary; -1: a token outside it,
    probability 0), at the sampling temperature (greedy: 1). Top-k and top-p are left out: the figure only
    ranks drafts, and verification stays exact whatever it says."""
    row = logits.astype(np.float64)
    if not params.greedy:
        row = row / params.temperature
    finite = np.isfinite(row)
    if token < 0 or not finite[token]:
        return 0.0
    top = row[finite].max()
    return float(np.exp(row[token] - top) / np.exp(row[finite] - top).sum())


class ConfidenceCalibration:
    """Acceptance rate by chain depth and confidence bin, over the latest drafts of a head (kept across
    generations, like the text it follows; on a seeded sampled generation the engine does not gate, so no output
    depends on it). rates[d, b] = accepted[d, b] / trials[d, b]."""

    def __init__(self) -> None:
        centres = (np.arange(BINS) + 0.5) / BINS
        self.accepted = np.tile(centres * PRIOR_WEIGHT, (DEPTHS, 1))
        self.trials = np.full((DEPTHS, BINS), PRIOR_WEIGHT)

    @staticmethod
    def _cell(depth: int, confidence: float) -> tuple[int, int]:
        return min(depth, DEPTHS - 1), min(BINS - 1, max(0, int(confidence * BINS)))

    def rate(self, confidence: float, depth: int = 0) -> float:
        cell = self._cell(depth, confidence)
        return float(self.accepted[cell] / self.trials[cell])

    def values(self, confidences: Sequence[float]) -> list[float]:
        """Expected accepted tokens of each node of a chain with these draft confidences."""
        return np.cumprod([self.rate(c, depth) for depth, c in enumerate(confidences)]).tolist()

    def observe(self, confidences: Sequence[float], outcomes: Sequence[bool]) -> None:
        """Drafts of one chain with their confidences and whether each was the target's token; the chain stops
        being evaluated at its first miss (nothing after it was tested)."""
        for depth, (confidence, hit) in enumerate(zip(confidences, outcomes, strict=False)):
            cell = self._cell(depth, confidence)
            self.trials[cell] = self.trials[cell] * DECAY + 1
            self.accepted[cell] = self.accepted[cell] * DECAY + hit
            if not hit:
                break
