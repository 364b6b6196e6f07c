"""Plain (non-speculative) decoding: one forward + GPU sampling per token, reading back only the token id."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams


@dataclass
class DecodeResult:
    tokens: list[int]
    prompt_tokens: int
    prefill_s: float
    decode_s: float
    stopped_by: str  # "eos", "max_tokens" or "stop"
    timeline: list[float] = field(default_factory=list)  # seconds since start when each token was known

    @property
    def decode_tokens_per_s(self) -> float:
        n = max(0, len(self.tokens) - 1)  # the first token comes from the prefill
        return n / self.decode_s if self.decode_s > 0 and n else 0.0


def sample_next(model: Transformer, rng: Mulberry32, params: SamplingParams, rec_fn: Callable) -> int:
    """Record a forward via `rec_fn(rec)` plus the GPU sampler over its last logits row, submit, read the id."""
    model.randoms.view((1,)).write([rng.random()])
    rec = model.registry.recorder()
    rec_fn(rec)
    model.sampler.record(rec, rows=1, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
    rec.submit()
    return model.read_token_ids(1)[0]


def prefill(model: Transformer, ids: Sequence[int], cache: KVCache) -> None:
    """Feed all but the last prompt token (no logits); the last one is fed by the first decode step."""
    if len(ids) > 1:
        model.forward(ids[:-1], cache, cache.length, logits="none")


def decode_one(
    model: Transformer,
    token: int,
    cache: KVCache,
    rng: Mulberry32,
    params: SamplingParams,
    num_layers: int | None = None,
) -> int:
    """Feed one token at the cache's end and sample the next one on the GPU."""
    model.ids.view((1,)).write(model.check_ids([token]))
    pos = cache.length
    return sample_next(
        model, rng, params, lambda rec: model.record_forward(rec, 1, cache, pos, logits="last", num_layers=num_layers)
    )


def generate(
    model: Transformer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    params: SamplingParams,
    *,
    cache: KVCache | None = None,
    stop_ids: Sequence[int] = (),
    on_token: Callable[[int], bool | None] | None = None,
) -> DecodeResult:
    """Greedy or sampled decoding. `on_token(id)` may return True to stop early (e.g. a stop string)."""
    ids = model.check_ids(prompt_ids).tolist()
    own_cache = cache is None
    cache = cache or model.new_cache(len(ids) + max_new_tokens)
    cache.check_room(cache.length, len(ids) + max_new_tokens - 1)
    rng = Mulberry32(params.seed or 0)
    start = time.perf_counter()
    out: list[int] = []
    timeline: list[float] = []
    stopped = "max_tokens"
    try:
        prefill(model, ids, cache)
        token = ids[-1]
        prefill_s = 0.0
        for step in range(max_new_tokens):
            token = decode_one(model, token, cache, rng, params)
            now = time.perf_counter() - start
            if step == 0:
                prefill_s = now
            out.append(token)
            timeline.append(now)
            if token in stop_ids:
                stopped = "eos"
                break
            if on_token is not None and on_token(token):
                stopped = "stop"
                break
        total = time.perf_counter() - start
    finally:
        if own_cache:
            model.release_cache(cache)
    return DecodeResult(out, len(ids), prefill_s, total - prefill_s, stopped, timeline)
