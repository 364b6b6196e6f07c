"""A reference decoder for tests: the target's logits read back to the host and a token picked by the numpy
reference of the sampler contract. Independent of the engine's GPU token choice, so "speculative == plain"
tests compare the engine with something it does not share (beyond the forward pass itself)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from doppler_py.model.transformer import Transformer
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams
from doppler_py.testing.penalty_reference import sampler_logits
from doppler_py.testing.sampling_reference import sample_reference


def reference_decode(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    *,
    stop_ids: Sequence[int] = (),
    grammar=None,
    adapter: str | None = None,
) -> list[int]:
    """Decode one token per forward, stopping after any of `stop_ids` (u drawn as the engine's plain step).
    `grammar` (a fresh `constraints.GrammarMatcher`): each row's disallowed tokens are set to -inf on the host
    before the pick, and the matcher advanced by it. The penalties, logit bias and min-p of `params` are applied on
    the host to each row, token by token (`testing.penalty_reference`). `adapter`: the LoRA adapter the rows use.

    The prompt is fed as the engine feeds it (all but its last token, then the last token alone), so the same
    kernels produce every logit the engine's plain steps see.
    """
    ids = model.check_ids(prompt_ids).tolist()
    cache = model.new_cache(len(ids) + max_new_tokens)
    cache.adapter = adapter
    rng = Mulberry32(params.seed or 0)
    out: list[int] = []
    try:
        if len(ids) > 1:
            model.forward(ids[:-1], cache, 0, logits="none")
        logits = model.forward(ids[-1:], cache)
        while True:
            mask = allowed(grammar.mask(), logits.size) if grammar is not None else None
            logits = sampler_logits(logits, ids + out, len(ids), params, mask)
            token = sample_reference(logits, rng.random(), params)
            if grammar is not None:
                grammar.advance([token])
            out.append(token)
            if token in stop_ids or len(out) == max_new_tokens:
                return out
            logits = model.forward([token], cache)
    finally:
        model.release_cache(cache)


def allowed(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    """A mask row's bits as a boolean per token (token t: bit t % 32 of word t // 32)."""
    bits = np.unpackbits(np.ascontiguousarray(mask_row, dtype="<u4").view(np.uint8), bitorder="little")
    return bits[:vocab].astype(bool)
