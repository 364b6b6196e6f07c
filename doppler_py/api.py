"""The Python API: load a model once, then generate or stream text, with speculative decoding if asked.

    import doppler_py
    with doppler_py.load("smollm2-135m-instruct", weights="q4_1") as engine:
        result = engine.generate([{"role": "user", "content": "Hi!"}], max_tokens=64, speculative="auto")
        print(result.text, result.acceptance_rate, result.tokens_per_s)

The CLI and the HTTP server are thin layers over `Engine`; nothing lives only there.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from doppler_py.errors import DopplerError, GenerationOptionError, VocabularyMismatchError
from doppler_py.gpu.device import Gpu, default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.model.catalog import DEFAULT_MODEL, resolve_model
from doppler_py.model.config import ModelConfig
from doppler_py.model.loader import WEIGHT_FORMATS, load_weights
from doppler_py.model.transformer import Transformer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.draft_model import DraftModelDrafter, check_vocabularies
from doppler_py.speculative.engine import SpeculativeEngine, check_fits, check_max_tokens
from doppler_py.speculative.layer_skip import LayerSkipDrafter
from doppler_py.speculative.prompt_lookup import PromptLookupDrafter
from doppler_py.speculative.stats import SpecStats
from doppler_py.tokenizer import Tokenizer

SPECULATIVE_MODES = ("auto", "prompt-lookup", "draft-model", "layer-skip")
Messages = Sequence[dict]


@dataclass
class GenerationResult:
    """Text plus what it cost; speculation figures are zero when it was not used."""

    text: str
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (end of sequence) or "length"
    speculative: str | None  # the drafter used, or None for plain decoding
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_per_step: float
    tokens_per_s: float
    elapsed_s: float
    # Measured plain-decoding cost per token on this device × tokens, minus the decode time actually spent.
    time_saved_s: float | None
    stats: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "tokens"} | {"completion_tokens": len(self.tokens)}


class Engine:
    """A loaded model (and optional draft model) with its tokenizer, ready to generate."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        *,
        name: str,
        weights: str,
        draft: Transformer | None = None,
        owns_registry: bool = False,
    ):
        """`owns_registry`: the models' kernel registry was made for this engine and is closed with it."""
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.weights = weights
        self.draft = draft
        self._spec: dict[str, SpeculativeEngine] = {}
        self.last_result: GenerationResult | None = None
        self.owns_registry = owns_registry
        self.closed = False

    # -- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release every GPU buffer this engine owns (weights, KV caches, step buffers)."""
        if self.closed:
            return
        for spec in self._spec.values():
            spec.close()
        if self.owns_registry:
            # First, while its cache still lists every bound buffer (ops' own scratch and placeholders too).
            self.model.registry.close()
        for model in (self.model, self.draft):
            if model is not None:
                model.close()
                model.weights.destroy()
        self.closed = True

    # -- speculative engines ----------------------------------------------------------------------------
    def _resolve_mode(self, speculative: str | None) -> str:
        if speculative in (None, "none", "off", False):
            return "none"
        if speculative not in SPECULATIVE_MODES:
            raise GenerationOptionError(
                f"speculative must be one of None, {', '.join(SPECULATIVE_MODES)}; got {speculative!r}"
            )
        if speculative == "auto":
            return "draft-model" if self.draft is not None else "prompt-lookup"
        if speculative == "draft-model" and self.draft is None:
            raise GenerationOptionError("speculative='draft-model' needs a draft model: load(..., draft=PATH)")
        return speculative

    def speculative_engine(self, mode: str) -> SpeculativeEngine:
        """The (cached) engine for a drafter; its cost model and acceptance estimate persist across calls."""
        if mode not in self._spec:
            drafter = {
                "none": lambda: None,
                "prompt-lookup": PromptLookupDrafter,
                "layer-skip": lambda: LayerSkipDrafter(self.model),
                "draft-model": lambda: DraftModelDrafter(self.draft, self.model.config.vocab_size),
            }[mode]()
            engine = SpeculativeEngine(self.model, drafter)
            if mode != "none":
                engine.calibrate()
            self._spec[mode] = engine
        return self._spec[mode]

    def should_speculate(self, speculative: str = "auto") -> bool:
        """Whether `speculative` is predicted to pay here, from measured costs and acceptance so far."""
        mode = self._resolve_mode(speculative)
        return mode != "none" and self.speculative_engine(mode).policy.should_speculate()

    # -- generation --------------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Messages, chat: bool | None = None) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise GenerationOptionError("the prompt is empty")
            use_chat = chat if chat is not None else False
            if not use_chat:
                return self.tokenizer.encode(prompt, add_special_tokens=True)
            prompt = [{"role": "user", "content": prompt}]
        if not prompt:
            raise GenerationOptionError("no chat messages given")
        for message in prompt:
            if not isinstance(message, dict) or "role" not in message or "content" not in message:
                raise GenerationOptionError(f"chat messages need 'role' and 'content', got {message!r}")
        text = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(
        self,
        prompt: str | Messages,
        *,
        max_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        speculative: str | None = None,
        k: int | None = None,
        chat: bool | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; `last_result` holds the record when the stream ends.

        Closing the iterator early cancels the generation and frees its KV caches.
        """
        if self.closed:
            raise DopplerError(f"the engine for {self.name} is closed", advice="load the model again")
        check_max_tokens(max_tokens)
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
        ids = self.encode_prompt(prompt, chat)
        self.model.check_ids(ids)
        check_fits(len(ids), max_tokens, self.model.max_positions)
        mode = self._resolve_mode(speculative)
        engine = self.speculative_engine(mode)
        engine.policy.check_k(k)
        stats = SpecStats()
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        stop_ids = tuple(self.tokenizer.eos_token_ids) + tuple(self.model.config.eos_token_ids)
        tokens: list[int] = []
        start = time.perf_counter()
        for new in engine.iter_generate(ids, max_tokens, params, stats=stats, k=k, stop_ids=stop_ids):
            tokens.extend(new)
            piece = "".join(decoder.push(t) for t in new)
            if piece:
                yield piece
        tail = decoder.flush()
        if tail:
            yield tail
        self.last_result = self._result(tokens, ids, stats, mode, engine, time.perf_counter() - start)

    def generate(self, prompt: str | Messages, **options) -> GenerationResult:
        """Generate to completion; same options as `stream`."""
        for _ in self.stream(prompt, **options):
            pass
        return self.last_result

    def _result(
        self, tokens: list[int], ids: list[int], stats: SpecStats, mode: str, engine: SpeculativeEngine, elapsed: float
    ) -> GenerationResult:
        plain_cost = engine.policy.costs.verify_cost(1)
        if plain_cost is None or mode == "none":
            saved = None
        elif stats.drafted == 0:  # every step was a plain one: nothing to compare, only timing noise
            saved = 0.0
        else:
            saved = plain_cost * len(tokens) - stats.decode_s
        finish = "stop" if stats.stopped_by == "eos" else "length"
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return GenerationResult(
            text=text,
            tokens=tokens,
            prompt_tokens=len(ids),
            finish_reason=finish,
            speculative=None if mode == "none" else mode,
            drafted=stats.drafted,
            accepted=stats.accepted,
            acceptance_rate=stats.acceptance_rate,
            mean_accepted_per_step=stats.mean_accepted_per_step,
            tokens_per_s=len(tokens) / stats.decode_s if stats.decode_s > 0 else 0.0,
            elapsed_s=elapsed,
            time_saved_s=saved,
            stats=stats.as_dict(),
        )


def load(
    model: str | Path = DEFAULT_MODEL,
    weights: str = "keep",
    *,
    draft: str | Path | None = None,
    draft_weights: str | None = None,
    max_seq: int | None = 2048,
    browser_limits: bool = False,
    progress: bool = True,
    gpu: Gpu | None = None,
) -> Engine:
    """Load a known model name, an HF folder or a .gguf file (converted once into the cache) onto the GPU.

    weights: "keep" (default: as stored; the default model is Q4_1 with a Q8_0 embedding), "f32", "f16",
    "q8_0", "q4_0" or "q4_1" (dense tensors quantised on load; block-quantised ones keep their blocks).
    draft: an optional smaller model with the same vocabulary for speculative="draft-model".
    """
    if weights not in WEIGHT_FORMATS:
        raise GenerationOptionError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    gpu = gpu or default_gpu(browser_limits)
    # GGUF sources are converted keeping their blocks, so every precision is derived from the exact values.
    folder = resolve_model(model, "keep", progress=progress)
    tokenizer = Tokenizer.from_dir(folder)
    draft_folder = None
    if draft is not None:
        # Everything that can refuse the draft is checked before any weights reach the GPU.
        draft_folder = resolve_model(draft, "keep", progress=progress)
        check_same_tokenizer(Tokenizer.from_dir(draft_folder), tokenizer, draft_folder)
        check_vocabularies(
            ModelConfig.from_file(draft_folder / "config.json").vocab_size,
            ModelConfig.from_file(folder / "config.json").vocab_size,
        )
    registry = KernelRegistry(gpu)
    models: list[Transformer] = []
    try:
        for source, precision in ((folder, weights), (draft_folder, draft_weights or weights)):
            if source is not None:
                loaded = load_weights(source, gpu, precision)
                try:
                    models.append(Transformer(loaded, registry, max_positions=max_seq))
                except BaseException:
                    loaded.destroy()
                    raise
    except BaseException:
        # A failed load (bad draft file, a buffer beyond the device's limits, ...) leaves nothing on the GPU.
        for loaded_model in models:
            loaded_model.close()
            loaded_model.weights.destroy()
        registry.close()
        raise
    target, draft_model = models[0], (models[1] if len(models) > 1 else None)
    return Engine(target, tokenizer, name=str(model), weights=weights, draft=draft_model, owns_registry=True)


def check_same_tokenizer(draft: Tokenizer, target: Tokenizer, draft_folder: Path) -> None:
    """A draft model must tokenise like the target: same token strings for every shared id."""
    draft_vocab = {i: t for t, i in draft.backend.get_vocab(with_added_tokens=True).items()}
    target_vocab = {i: t for t, i in target.backend.get_vocab(with_added_tokens=True).items()}
    mismatched = sorted(i for i in draft_vocab.keys() & target_vocab.keys() if draft_vocab[i] != target_vocab[i])
    if mismatched:
        i = mismatched[0]
        raise VocabularyMismatchError(
            f"{draft_folder}: the draft tokenizer differs from the target's at {len(mismatched)} ids "
            f"(first: id {i} is {draft_vocab[i]!r} vs {target_vocab[i]!r}); use a draft trained with the same "
            "tokenizer"
        )
