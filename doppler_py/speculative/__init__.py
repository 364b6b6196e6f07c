"""Speculative decoding: a drafter proposes tokens, the target model verifies them in one forward on the GPU.

The drafter contract is `contract.Drafter`; the port of the JS original's SpeculativeDecoder class lives in
`doppler_py.parity`.
"""

from doppler_py.speculative.contract import NO_PROPOSAL, Drafter, NoOpHooks, Proposal, StepContext
from doppler_py.speculative.draft_model import DraftModelDrafter
from doppler_py.speculative.engine import SpecResult, SpeculativeEngine
from doppler_py.speculative.layer_skip import LayerSkipDrafter
from doppler_py.speculative.prompt_lookup import PromptLookupDrafter

__all__ = [
    "NO_PROPOSAL",
    "DraftModelDrafter",
    "Drafter",
    "LayerSkipDrafter",
    "NoOpHooks",
    "PromptLookupDrafter",
    "Proposal",
    "SpecResult",
    "SpeculativeEngine",
    "StepContext",
]
