"""Speculative decoding: a drafter proposes tokens, the target model verifies them in one forward on the GPU.

The drafter contract is `contract.Drafter`; the drafters by name are in `registry.DRAFTERS`; the port of the JS
original's SpeculativeDecoder class lives in `doppler_py.parity`. The names below are imported on first use, so
reading the registry (every CLI start does) does not load the GPU stack.
"""

import importlib

_EXPORTS = {
    "NO_PROPOSAL": "contract",
    "Drafter": "contract",
    "NoOpHooks": "contract",
    "Proposal": "contract",
    "StepContext": "contract",
    "DraftModelDrafter": "drafters.draft_model",
    "SpecResult": "engine",
    "SpeculativeEngine": "engine",
    "LayerSkipDrafter": "drafters.layer_skip",
    "PromptLookupDrafter": "drafters.prompt_lookup",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
