"""The A3M router's speculative-decoding interface, in Python names, over a loaded `Engine`.

A3M's interface names four draft types: medusa, lookahead, eagle and spark. Here each is a doppler-py drafter
(`DRAFT_MODES`) and every answer comes from this engine and device: whether a type is usable (its head is
loaded; lookahead needs none), the windows its verification can take and what they measured, the recommended
window (the policy's best draft length by measured costs and acceptance), whether to speculate at all (the
policy's measured prediction), the speedup of a result (measured plain cost per token against the time
spent). `generate_draft` and `verify_draft` are the engine's own two halves of a step: a real drafter
proposal after a real prefill, and one target forward that keeps exactly the accepted drafts and the target's
own next token. Nothing is accepted optimistically and nothing is generated twice.

Like eagle and medusa, spark (the block drafter) needs a trained head for the model (`doppler-py train-draft
MODEL --kind spark`); without one, `get_draft_model("spark")` is None and `should_use` says no.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from doppler_py.api import Engine, GenerationResult, Messages
from doppler_py.errors import GenerationOptionError
from doppler_py.model.config import ModelConfig
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.contract import Proposal, StepContext
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.registry import DRAFTERS, HEAD_KINDS

DRAFT_TYPES = ("medusa", "lookahead", "eagle", "spark")  # A3M's names for its draft types
DRAFT_MODES = {name: name for name in DRAFT_TYPES if name in DRAFTERS}  # each the drafter of the same name
HEAD_TYPES = tuple(name for name in DRAFT_TYPES if name in HEAD_KINDS)  # the types that need a trained head


@dataclass(frozen=True)
class DraftModel:
    """A draft type usable with the loaded model.

    mode                the `speculative=` mode that runs it
    source              where its drafts come from (a head folder, or lookahead's n-gram pool)
    supported_windows   the draft lengths one step can verify on this engine (1 .. its capacity)
    measured_windows    window -> measured seconds of verifying window + 1 rows on this device (the other
                        windows' costs are interpolated from these)
    """

    type: str
    mode: str
    source: str
    supported_windows: tuple[int, ...]
    measured_windows: dict[int, float]


@dataclass
class SpeculationConfig:
    enabled: bool = True
    draft_model_type: str = "eagle"
    speculation_window: int | None = None  # None: the policy's window (adapted per step)
    temperature: float = 0.0

    def check(self) -> None:
        if not isinstance(self.enabled, bool):
            raise GenerationOptionError(f"enabled must be True or False, got {self.enabled!r}")
        if self.draft_model_type not in DRAFT_TYPES:
            raise GenerationOptionError(
                f"draft_model_type must be one of {', '.join(DRAFT_TYPES)}, got {self.draft_model_type!r}"
            )
        window = self.speculation_window
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise GenerationOptionError(f"speculation_window must be None or an integer >= 1, got {window!r}")
        SamplingParams(temperature=self.temperature)  # refuses a bad temperature with its own message


@dataclass
class SpeculationResult:
    """What one generation did. estimated_time_saved: measured plain seconds per token (live plain steps of
    this process) times the tokens, minus the decoding time spent; None until enough plain steps were seen."""

    used: bool
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float
    estimated_time_saved: float | None
    generation: GenerationResult | None = field(default=None, repr=False)


@dataclass
class Draft:
    """`generate_draft`'s proposal, open for ONE `verify_draft`: tokens (and a tree's parents) after `context`."""

    context: list[int]
    tokens: list[int]
    parents: list[int] | None
    window: int
    step: StepContext = field(repr=False)
    proposal: Proposal = field(repr=False)
    engine: SpeculativeEngine = field(repr=False)
    open: bool = True


@dataclass(frozen=True)
class Verification:
    """`verify_draft`'s answer: the first `accepted` drafts were kept, then the target's own token, so
    `tokens` (accepted + 1 of them) continue the context exactly as the target's sampling would."""

    accepted: int
    drafted: int
    tokens: list[int]


class SpeculativeDecoding:
    """A3M's `SpeculativeDecoding`, answering from `engine`'s measurements (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        *,
        enabled: bool = True,
        draft_model_type: str = "eagle",
        speculation_window: int | None = None,
        temperature: float = 0.0,
    ):
        self.engine = engine
        self.config = SpeculationConfig(enabled, draft_model_type, speculation_window, temperature)
        self.config.check()
        self._draft: Draft | None = None

    # -- configuration ----------------------------------------------------------------------------------
    def update_config(self, **changes: Any) -> dict:
        unknown = set(changes) - set(SpeculationConfig.__dataclass_fields__)
        if unknown:
            raise GenerationOptionError(f"unknown setting(s) {', '.join(sorted(unknown))}")
        config = replace(self.config, **changes)
        config.check()
        self.config = config
        return self.get_config()

    def get_config(self) -> dict:
        return dict(vars(self.config))

    # -- what this model and device support --------------------------------------------------------------
    def get_draft_model(self, draft_type: str | None = None) -> DraftModel | None:
        """The type's record when it is usable with the loaded model (default: the configured type), else None."""
        draft_type = draft_type or self.config.draft_model_type
        if draft_type not in DRAFT_TYPES:
            raise GenerationOptionError(f"draft type must be one of {', '.join(DRAFT_TYPES)}, got {draft_type!r}")
        mode = DRAFT_MODES.get(draft_type)
        if mode is None or (draft_type in HEAD_TYPES and draft_type not in self.engine.heads):
            return None
        spec = self.engine.speculative_engine(mode)  # made and calibrated (or read from the cost cache) once
        measured = {rows - 1: seconds for rows, seconds in sorted(spec.policy.costs.verify.items()) if rows > 1}
        if draft_type in HEAD_TYPES:
            source = str(self.engine.heads[draft_type].folder)
        else:
            source = "n-grams of the model's own Jacobi iterations (no draft model)"
        return DraftModel(draft_type, mode, source, tuple(range(1, spec.capacity + 1)), measured)

    def supports_speculative_decoding(self, draft_type: str | None = None) -> bool:
        """Whether `draft_type` (None: any of the four) can draft for the loaded model."""
        types = DRAFT_TYPES if draft_type is None else (draft_type,)
        return any(self.get_draft_model(t) is not None for t in types)

    def get_recommended_window(self, model_size: int | None = None) -> int:
        """The draft length with the best predicted speedup for the loaded model on this device, from measured
        verification costs and the acceptance measured so far (0: speculation is predicted not to pay).
        `model_size` (parameters), if given, must be the loaded model's (within 5%): windows for other models
        would need their own measurements."""
        loaded = parameter_count(self.engine.model.config)
        if model_size is not None and abs(model_size - loaded) > 0.05 * loaded:
            raise GenerationOptionError(
                f"model_size {model_size} is not the loaded model's (~{loaded} parameters); windows are recommended "
                "from this model's measured costs only"
            )
        spec = self._spec_engine()
        if spec is None or not spec.policy.should_speculate():
            return 0
        return spec.fixed_nodes or spec.policy.best_k() or spec.policy.k  # lookahead: its step shape

    def should_use(self, force_enable: bool | None = None) -> bool:
        """force_enable True/False decides (True only where the type is usable); None: enabled, usable, and
        predicted to pay by the measured costs and acceptance (`DraftLengthPolicy.should_speculate`)."""
        if force_enable is False:
            return False
        spec = self._spec_engine()
        if spec is None:
            return False
        return True if force_enable else self.config.enabled and spec.policy.should_speculate()

    def calculate_speedup(self, result: SpeculationResult | GenerationResult) -> float | None:
        """Measured speedup over plain decoding: (time spent + measured time saved) / time spent; 1.0 for a
        plain generation; None where the plain cost per token is not measured yet."""
        generation = result.generation if isinstance(result, SpeculationResult) else result
        if generation is None or generation.speculative is None:
            return 1.0
        if generation.time_saved_s is None:
            return None
        stats = generation.stats
        spent = stats["plain_s"] + stats["draft_s"] + stats["verify_s"]
        return (spent + generation.time_saved_s) / spent if spent > 0 else None

    # -- one step by hand --------------------------------------------------------------------------------
    def generate_draft(self, context: str | Messages | list[int], window: int | None = None) -> Draft:
        """Prefill `context` (text, chat messages or token ids) and let the configured type's drafter propose up
        to `window` tokens (default: the configured or recommended window). Opening a draft closes the last one."""
        spec = self._spec_engine()
        if spec is None:
            raise GenerationOptionError(f"draft type {self.config.draft_model_type!r} is not usable with this model")
        k = window or self.config.speculation_window or self.get_recommended_window() or 1
        spec.policy.check_k(k)
        self.close_draft()
        is_ids = isinstance(context, list) and all(isinstance(x, int) and not isinstance(x, bool) for x in context)
        ids = context if is_ids and context else self.engine.encode_prompt(context)
        params = SamplingParams(temperature=self.config.temperature)
        step = spec.open_context(ids, k + 1, params, k=k)
        try:
            proposal = spec.steps.propose(step, k)
            tokens = proposal_tokens(spec, proposal)
        except BaseException:
            spec.close_context(step)
            raise
        parents = None if proposal.parents is None else list(proposal.parents)
        self._draft = Draft(list(ids), tokens, parents, k, step, proposal, spec)
        return self._draft

    def verify_draft(self, draft: Draft) -> Verification:
        """One target forward over `draft` (see `Verification`); a draft is verified once."""
        if not draft.open or draft is not self._draft:
            raise GenerationOptionError("this draft was verified or replaced by a newer one; generate a new draft")
        try:
            outcome = draft.engine.steps.step(draft.step, draft.window, proposal=draft.proposal)
        finally:
            self.close_draft()
        return Verification(outcome.accepted, outcome.drafted, outcome.new)

    def close_draft(self) -> None:
        """Free the open draft's KV cache and drafter state (it can no longer be verified)."""
        if self._draft is not None and self._draft.open:
            self._draft.open = False
            self._draft.engine.close_context(self._draft.step)
        self._draft = None

    def _spec_engine(self) -> SpeculativeEngine | None:
        record = self.get_draft_model()
        return None if record is None else self.engine.speculative_engine(record.mode)


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a LLaMA-family decoder of this shape (norm weights and biases included only roughly)."""
    h, q, kv = config.hidden_size, config.num_attention_heads * config.head_dim, config.num_key_value_heads
    per_layer = h * (q + 2 * kv * config.head_dim) + q * h + 3 * h * config.intermediate_size + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_hidden_layers * per_layer + h


def proposal_tokens(spec: SpeculativeEngine, proposal: Proposal) -> list[int]:
    """The proposal's token ids on the host (a GPU proposal's are read back: an extra readback, for the record)."""
    if not proposal.on_gpu:
        return list(proposal.tokens)
    queue = spec.registry.gpu.queue
    raw = queue.read_buffer(proposal.tokens.buffer, 0, 4 * proposal.count) if proposal.count else b""
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


class SpeculativeDecodingWrapper:
    """A3M's wrapper: `generate(prompt, max_tokens, ...)` → (text, SpeculationResult), speculating when the
    router says so (or `use_spec_dec` decides). Built over a router, or from settings of a new one as A3M's is
    (`SpeculativeDecodingWrapper(engine, enabled=False, draft_model_type="lookahead")`; the rest defaults)."""

    def __init__(self, engine: Engine, router: SpeculativeDecoding | None = None, **config: Any):
        unknown = set(config) - set(SpeculationConfig.__dataclass_fields__)
        if unknown:
            raise GenerationOptionError(f"unknown setting(s) {', '.join(sorted(unknown))}")
        if router is not None and config:
            raise GenerationOptionError("give the wrapper a router or the settings of a new one, not both")
        self.engine = engine
        self.router = router or SpeculativeDecoding(engine, **config)

    def generate(
        self,
        prompt: str | Messages,
        max_tokens: int = 128,
        *,
        temperature: float | None = None,
        use_spec_dec: bool | None = None,
        **options: Any,
    ) -> tuple[str, SpeculationResult]:
        config = self.router.config
        used = self.router.should_use(force_enable=use_spec_dec)
        mode = DRAFT_MODES[config.draft_model_type] if used else None
        k = config.speculation_window if used and config.speculation_window else None
        generation = self.engine.generate(
            prompt,
            max_tokens=max_tokens,
            temperature=config.temperature if temperature is None else temperature,
            speculative=mode,
            k=k,
            **options,
        )
        result = SpeculationResult(
            used=used,
            draft_tokens=generation.drafted,
            accepted_tokens=generation.accepted,
            acceptance_rate=generation.acceptance_rate,
            estimated_time_saved=generation.time_saved_s if used else 0.0,
            generation=generation,
        )
        return generation.text, result
