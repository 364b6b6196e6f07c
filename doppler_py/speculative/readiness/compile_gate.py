"""Whether compiling a speculative mode's verification pipelines can pay for itself, before it starts.

On a CPU adapter (lavapipe) the shader compiler and the decoding share the same cores: while the verification
pipelines compile in the background (`warmup.py`), every plain token is slower, and compiling all of them takes
tens of seconds there (0.4-2 s to create a pipeline and about as much again at its first dispatch; SmolLM2's
verification needs 10 matmul pipelines, its EAGLE head none more when kept in the target's format, 16 in
f16). A short answer cannot win that back: on a fresh 2-core machine the first `generate` of 128 tokens finished
~9 s later than plain decoding, its speculation never started. So the compile comes in stages (FIRST_STAGE_ROWS:
the one-draft row counts, 2 pipelines, ~2 s there, then the rest), and before each generation while a stage's
warm-up has not started, and again before each step of a generation that began plainly (its own plain tokens
timed by then) or that drafts within the stages compiled so far, the engine weighs the next stage's cost against
what speculation can save over the tokens to come:

    cost = Σ over the matmul pipelines not compiled yet: (its row tile's weight) × (this process's matmul
           compile seconds so far per unit of weight)
    gain = (tokens) × (plain seconds per token) × (1 − 1 / expected speedup)

A tile's weight is what lavapipe takes to create its pipeline, relative to the others (TILE_COMPILE_WEIGHTS): an
8-row tile ~3x a 1-row one. The mean of all pipelines compiled so far, the estimate before, counted every missing
pipeline at whatever mix of tiles the process had compiled: after a first generation whose prompt compiled the
8-row tiles (two at once, 8.7 s each), ~4 s for each of verification's 2-row tiles (~1 s alone).

where `tokens` is what is left of this answer plus what the engine generated in this process's earlier answers (a
process that has generated much is likely to generate more: a chat, a server; not this answer's own tokens so far,
whose compile would slow the rest of the answer for what only later answers gain, `Readiness.weigh_during`), and the
expected speedup is the policy's prediction from measured costs (cached on disk per device) or a prior. The
warm-up starts once gain ≥ cost, which on a GPU (the compiler runs on the CPU, beside the device's work, and
pipelines take milliseconds) is at once, and for every stage together. Until the first stage opens a generation
runs without its drafter: plain decoding, with no
drafter upkeep (an EAGLE head runs over every committed token and compiles pipelines of its own) and the plain
seconds per token measured for the next weighing. Where the gate opens during an answer, the drafter joins it
once its first row counts are compiled (`Drafter.join`), so a long answer speculates in its later part.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from doppler_py.gpu.kernels import PipelineCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import SHADER as MATMUL_SHADER
from doppler_py.ops.linear import Linear

PRIOR_COMPILE_S = 1.0  # a 2-row matmul pipeline's compile on a CPU adapter, before this process compiled any
# Seconds to create a matmul pipeline relative to a 2-row tile's, by row tile (0: the tiled GEMM). Lavapipe, each
# alone (`tools/bench_compile.py`'s verification and head phases, issue 65): 1 row 0.76-0.87 s, 2 rows 0.94-1.13 s,
# 4 rows 1.42-1.67 s, 8 rows 2.7-3.1 s.
TILE_COMPILE_WEIGHTS = {0: 1.0, 1: 0.8, 2: 1.0, 4: 1.6, 8: 2.9}
PRIOR_SPEEDUP = 1.3  # speculation's speedup before anything was measured
# On a CPU adapter the compile comes in two stages, each weighed on its own: first the row counts of steps that
# verify one draft (most steps on a 2-core lavapipe host: with every count compiled, `auto` drafted 82-86 tokens
# in ~82 steps of the default story answer), then the rest, once the tokens to come repay those too. The first
# stage is 2 pipelines (with a head in the target's format, `dense_format`: the target's 2-row tile with the fused
# activation and its 2-row LM head), the rest 8.
FIRST_STAGE_ROWS = 2


# Per target and row counts, the pipeline keys its steps need (and its drafter's matmuls'): a generation weighs
# them before each step while the gate is closed, and building them anew (SmolLM2: 122 matmuls × 9 row counts)
# took ~14 ms, a tenth of a plain step.
_KEYS: weakref.WeakKeyDictionary[Transformer, dict[tuple, frozenset[tuple]]] = weakref.WeakKeyDictionary()


def missing_pipelines(target: Transformer, rows: Sequence[int], drafter: Sequence[Linear] = ()) -> list[tuple]:
    """The keys of the matmul pipelines a step of any of `rows` rows needs that are not compiled yet: the target's
    (the bulk of the verification's: one per row tile and matmul shape) and its `drafter`'s matmuls'."""
    known = _KEYS.setdefault(target, {})
    cache_key = (tuple(rows), tuple(id(linear) for linear in drafter))
    keys = known.get(cache_key)
    if keys is None:
        linears = (*target.linears(), *drafter)
        keys = frozenset(linear.pipeline_key(n) for linear in linears for n in rows if n <= linear.max_rows)
        known[cache_key] = keys
    return [key for key in keys if not target.registry.compiled(key)]


def _tile_weight(key: tuple) -> float:
    return TILE_COMPILE_WEIGHTS.get(int(dict(key[2]).get("ROWS", 0)), 1.0)


def compile_estimate_s(cache: PipelineCache, keys: Sequence[tuple]) -> float:
    """Seconds to compile the matmul pipelines of `keys` here: each its tile's weight times this process's
    seconds per unit of weight so far (its matmul pipelines' seconds over their weights; the prior before any)."""
    done = [record for record in cache.records if record.key[0] == MATMUL_SHADER]
    weights = sum(_tile_weight(record.key) for record in done)
    per_weight = sum(r.module_s + r.pipeline_s for r in done) / weights if done else PRIOR_COMPILE_S
    return per_weight * sum(_tile_weight(key) for key in keys)


def compile_pays(
    target: Transformer,
    rows: Sequence[int],
    *,
    tokens: int,
    plain_token_s: float | None,
    speedup: float | None,
    drafter: Sequence[Linear] = (),
) -> tuple[bool, float, float | None]:
    """(whether the warm-up should start, its estimated cost in seconds, the estimated gain in seconds: None before
    this process timed a plain token), for `target` verifying `rows` on its device with a `drafter` running these
    matmuls (`weigh` is the rule)."""
    if not target.gpu.on_cpu:
        return True, 0.0, 0.0
    cost = compile_estimate_s(target.registry.pipelines, missing_pipelines(target, rows, drafter))
    return weigh(cost, tokens, plain_token_s, speedup)


def weigh(
    cost: float, tokens: int, plain_token_s: float | None, speedup: float | None
) -> tuple[bool, float, float | None]:
    """The gate's rule on a CPU adapter (module docstring): `cost` seconds still to compile against `tokens`
    plain tokens of `plain_token_s` sped up by `speedup` (None: the prior)."""
    if plain_token_s is None:
        return cost == 0, cost, None
    gain = tokens * plain_token_s * (1 - 1 / max(speedup or PRIOR_SPEEDUP, 1.0))
    return gain >= cost, cost, gain
