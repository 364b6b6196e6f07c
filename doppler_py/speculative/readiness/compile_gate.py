"""Whether compiling a speculative mode's verification pipelines can pay for itself, before it starts.

On a CPU adapter (lavapipe) the shader compiler and the decoding share the same cores: while the verification
pipelines compile in the background (`warmup.py`), every plain token is slower, and compiling all of them takes
tens of seconds there (0.4-2 s to create a pipeline and about as much again at its first dispatch; SmolLM2's
verification needs 10 matmul pipelines, its EAGLE head 16). A short answer cannot win that back: on a
fresh 2-core machine the first `generate` of 128 tokens finished ~9 s later than plain decoding, its speculation
never started. So before each generation while the warm-up has not started, and again before each step of a
generation that began plainly (its own plain tokens timed by then), the engine weighs the compile's cost against
what speculation can save over the tokens to come:

    cost = (matmul pipelines not compiled yet) × (mean compile time of this process's matmul pipelines so far)
    gain = (tokens) × (plain seconds per token) × (1 − 1 / expected speedup)

where `tokens` is what is left of this answer plus what the engine generated before in this process (this answer's
tokens so far included: a process that has generated much is likely to generate more: a chat, a server), and the
expected speedup is the policy's prediction from measured costs (cached on disk per device) or a prior. The
warm-up starts once gain ≥ cost, which on a GPU (the compiler runs on the CPU, beside the device's work, and
pipelines take milliseconds) is at once. Until then a generation runs without its drafter: plain decoding, with no
drafter upkeep (an EAGLE head runs over every committed token and compiles pipelines of its own) and the plain
seconds per token measured for the next weighing. Where the gate opens during an answer, the drafter joins it
once its first row counts are compiled (`Drafter.join`), so a long answer speculates in its later part.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import SHADER as MATMUL_SHADER

PRIOR_COMPILE_S = 1.0  # a matmul pipeline's compile on a CPU adapter, before this process compiled any
PRIOR_SPEEDUP = 1.3  # speculation's speedup before anything was measured


# Per target and row counts, the pipeline keys its steps need: a generation that began plainly weighs them before
# each step, and building them anew (SmolLM2: 122 matmuls × 9 row counts) took ~14 ms, a tenth of a plain step.
_KEYS: weakref.WeakKeyDictionary[Transformer, dict[tuple[int, ...], frozenset[tuple]]] = weakref.WeakKeyDictionary()


def pipelines_to_compile(target: Transformer, rows: Sequence[int]) -> int:
    """The target's matmul pipelines a step of any of `rows` rows needs that are not compiled yet (the bulk of
    the verification's pipelines: one per row tile and matmul shape)."""
    known = _KEYS.setdefault(target, {})
    keys = known.get(tuple(rows))
    if keys is None:
        linears = target.linears()
        keys = frozenset(linear.pipeline_key(n) for linear in linears for n in rows if n <= linear.max_rows)
        known[tuple(rows)] = keys
    return sum(not target.registry.compiled(key) for key in keys)


def compile_pays(
    target: Transformer, rows: Sequence[int], *, tokens: int, plain_token_s: float | None, speedup: float | None
) -> tuple[bool, float, float | None]:
    """(whether the warm-up should start, its estimated cost in seconds, the estimated gain in seconds: None before
    this process timed a plain token), for `target` verifying `rows` on its device (`weigh` is the rule)."""
    if not target.gpu.on_cpu:
        return True, 0.0, 0.0
    per_pipeline = target.registry.pipelines.mean_compile_s(MATMUL_SHADER) or PRIOR_COMPILE_S
    return weigh(pipelines_to_compile(target, rows), per_pipeline, tokens, plain_token_s, speedup)


def weigh(
    pipelines: int, per_pipeline_s: float, tokens: int, plain_token_s: float | None, speedup: float | None
) -> tuple[bool, float, float | None]:
    """The gate's rule on a CPU adapter (module docstring): `pipelines` still to compile at `per_pipeline_s` each
    against `tokens` plain tokens of `plain_token_s` sped up by `speedup` (None: the prior)."""
    cost = pipelines * per_pipeline_s
    if plain_token_s is None:
        return cost == 0, cost, None
    gain = tokens * plain_token_s * (1 - 1 / max(speedup or PRIOR_SPEEDUP, 1.0))
    return gain >= cost, cost, gain
