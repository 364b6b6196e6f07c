"""Self-speculation: the target's first L layers, its final norm and its head draft for it.

It shares the target's KV cache: layers < L at a position depend only on layers < L, so the draft's cache
writes are exactly what the target would write, and the verification overwrites them anyway; the engine's
truncation after the step is its rollback.
"""

from __future__ import annotations

from doppler_py.errors import GenerationOptionError
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.speculative.contract import StepContext
from doppler_py.speculative.drafters.gpu_drafting import ModelDrafter


class LayerSkipDrafter(ModelDrafter):
    name = "layer-skip"

    def __init__(self, target: Transformer, num_layers: int | None = None):
        layers = num_layers if num_layers is not None else max(1, target.num_layers // 2)
        if not 1 <= layers < target.num_layers:
            raise GenerationOptionError(
                f"layer-skip drafting needs 1 <= layers < {target.num_layers} (the target's depth), got {layers}"
            )
        super().__init__(target, target.config.vocab_size, layers)

    def cache(self, ctx: StepContext) -> KVCache:
        return ctx.target_cache

    def pending(self, ctx: StepContext) -> list[int]:
        return ctx.tokens[-1:]
