"""The Python API: load a model once, then generate or stream text, with speculative decoding if asked.

    import doppler_py
    with doppler_py.load("smollm2-135m-instruct", weights="q4_1") as engine:
        result = engine.generate([{"role": "user", "content": "Hi!"}], max_tokens=64)  # speculative="auto"
        print(result.text, result.acceptance_rate, result.tokens_per_s)

The CLI and the HTTP server are thin layers over `Engine`; nothing lives only there.
"""

from __future__ import annotations

import bisect
import contextlib
import math
import statistics
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from doppler_py import defaults
from doppler_py.embeddings import Embedder, EmbeddingHead, EmbeddingResult, Inputs, check_causal
from doppler_py.errors import DopplerError, GenerationOptionError, VocabularyMismatchError
from doppler_py.gpu.device import Gpu, default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.model.catalog import DEFAULT_MODEL, known_head, open_model
from doppler_py.model.config import ModelConfig
from doppler_py.model.loader import WEIGHT_FORMATS, load_weights
from doppler_py.model.lora import LoraAdapter, merged_deltas, read_adapter
from doppler_py.model.prefix_cache import PrefixCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.logprobs import TokenLogprob
from doppler_py.options import GenerationOptions, check_speculative, request_options
from doppler_py.rerank import Reranker, RerankResult
from doppler_py.sampling import check_bias_vocab
from doppler_py.speculative.batch import StepBatch
from doppler_py.speculative.contract import Drafter
from doppler_py.speculative.drafters.best_of import BestOfDrafter
from doppler_py.speculative.drafters.draft_model import check_vocabularies
from doppler_py.speculative.drafters.heads.files import head_kind
from doppler_py.speculative.engine import SpeculativeEngine, check_fits
from doppler_py.speculative.kv_budget import KVBudget
from doppler_py.speculative.policy.draft_length import trees_pay
from doppler_py.speculative.readiness.cost_cache import cost_key, load_costs, save_costs
from doppler_py.speculative.registry import DRAFTERS, HEAD_KINDS, DraftSources
from doppler_py.speculative.stats import SpecStats
from doppler_py.tokenizer import Tokenizer
from doppler_py.tool_calls import ToolPlan, chat_messages, parse_answer

if TYPE_CHECKING:
    from doppler_py.constraints.matcher import GrammarMatcher

Messages = Sequence[dict]


@dataclass
class GenerationResult:
    """Text plus what it cost; speculation figures are zero when it was not used."""

    text: str
    # With a stop string: the tokens whose text ends before the stop string starts. A token that straddles
    # it (text before the stop and the stop's first characters in one token) is dropped, though its text
    # before the stop is kept in `text`; so `text` may hold a few characters more than decode(tokens).
    tokens: list[int]
    prompt_tokens: int
    finish_reason: str  # "stop" (end of sequence or a stop string), "length", or "tool_calls" (see `stream`'s tools)
    speculative: str | None  # the drafter used, or None for plain decoding
    drafted: int
    accepted: int
    acceptance_rate: float
    mean_accepted_per_step: float
    tokens_per_s: float
    elapsed_s: float
    # Estimated plain-decoding time of the tokens generated minus the decoding steps' time actually spent
    # (negative: speculation was slower). The plain cost per token is the median of live plain steps measured
    # in this process (not calibration, not a generation's first step, not the first steps after loading);
    # None where fewer than PlainStepCosts.MIN_SAMPLES such steps exist, or for plain decoding itself.
    time_saved_s: float | None
    # One standard error of time_saved_s: the median's own uncertainty times the tokens, plus the spread of a
    # sum of that many plain steps (1.4826·MAD per step); None when time_saved_s is.
    time_saved_s_err: float | None = None
    # Prompt tokens whose K/V came from the prefix cache (an earlier sequence shared them), not prefilled.
    cached_tokens: int = 0
    stats: dict = field(default_factory=dict)
    # With logprobs=N: one entry per token of `tokens` (see `Engine.stream`); None when not asked for.
    logprobs: list[TokenLogprob] | None = None
    # With tools: the calls the answer made, in OpenAI's shape ({"id", "type", "function": {"name", "arguments"}});
    # None without tools. `text` stays the answer as written (the <tool_call> blocks, see `doppler_py.tool_calls`).
    tool_calls: list[dict] | None = None
    # The stop string that ended the text (finish_reason "stop" by a stop string, not by end of sequence), or None.
    stop_sequence: str | None = None

    def as_dict(self) -> dict:
        record = {k: v for k, v in self.__dict__.items() if k not in ("tokens", "logprobs")}
        if self.logprobs is not None:
            record["logprobs"] = [
                {"token": e.token, "logprob": e.logprob, "top": [list(t) for t in e.top]} for e in self.logprobs
            ]
        return record | {"completion_tokens": len(self.tokens)}


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
        heads: dict | None = None,
        owns_registry: bool = False,
        folder: Path | None = None,
        warmup: str = defaults.WARMUP,
        kv_cache_mb: int = defaults.KV_CACHE_MB,
        progress: bool = False,
        parallel: int = 1,
        kv_budget_mb: int | None = None,
    ):
        """`heads`: trained draft heads for `model` by kind ("eagle", "medusa", "spark"); `owns_registry`: the
        models' kernel registry was made for this engine and is closed with it; `folder`: the model's files,
        which key the on-disk cache of measured verification costs (None: no cache); `warmup`, `kv_cache_mb`,
        `progress` (say on stderr when speculation compiles or measures), `parallel`, `kv_budget_mb`: see `load`."""
        check_warmup(warmup)
        check_kv_cache_mb(kv_cache_mb)
        check_parallel(parallel)
        check_kv_budget_mb(kv_budget_mb)
        self.prefix_cache = PrefixCache(model, kv_cache_mb << 20)
        self.kv_budget = KVBudget(kv_budget_mb << 20) if kv_budget_mb else None
        self.model = model
        self.tokenizer = tokenizer
        self.name = name
        self.weights = weights
        self.draft = draft
        self.heads = dict(heads or {})
        self._spec: dict[str, SpeculativeEngine] = {}
        self.plain_costs = PlainStepCosts()
        # The loop every stream's generation runs in (`speculative.batch`). With `parallel` > 1 concurrent streams'
        # steps share its forwards, their caches paged in its arena, each stream leasing an engine of its mode.
        self.parallel = parallel
        kv_limit = self.kv_budget.limit if self.kv_budget is not None else None
        self.batch = StepBatch(model, paged=parallel > 1, kv_limit_bytes=kv_limit)
        if parallel > 1:
            self.batch.warm_up(background=warmup != "now")
        self._idle: dict[str, list[SpeculativeEngine]] = {}  # leased engines back from their streams
        self._leases = threading.Lock()
        # Per thread (concurrent streams each have their own): `piece_logprobs` and `thread_result`.
        self._streaming = threading.local()
        self._last_result: GenerationResult | None = None
        self.owns_registry = owns_registry
        self.folder = folder
        self.warmup = warmup
        self.progress = progress
        self._embedder: Embedder | None = None
        self._reranker: Reranker | None = None
        self.closed = False

    @property
    def piece_logprobs(self) -> list[TokenLogprob] | None:
        """While streaming with logprobs: the entries of the tokens whose text the piece being yielded completes
        (this thread's stream)."""
        return getattr(self._streaming, "piece_logprobs", None)

    @piece_logprobs.setter
    def piece_logprobs(self, entries: list[TokenLogprob] | None) -> None:
        self._streaming.piece_logprobs = entries

    @property
    def last_result(self) -> GenerationResult | None:
        """The record of the last stream that ended (on any thread; see `thread_result`)."""
        return self._last_result

    @last_result.setter
    def last_result(self, result: GenerationResult | None) -> None:
        self._last_result = result
        self._streaming.last_result = result

    @property
    def thread_result(self) -> GenerationResult | None:
        """The record of the last stream that ended on this thread: with `parallel` > 1, other threads' streams
        end in between."""
        return getattr(self._streaming, "last_result", None)

    # -- lifecycle --------------------------------------------------------------------------------------
    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release every GPU buffer this engine owns (weights, KV caches, step buffers)."""
        if self.closed:
            return
        self.batch.stop()  # first: its loop may be stepping the engines closed next
        for spec in [*self._spec.values(), *(e for idle in self._idle.values() for e in idle)]:
            spec.close()
        self.batch.close()
        if self._embedder is not None:
            self._embedder.close()
        if self._reranker is not None:
            self._reranker.close()
        self.prefix_cache.clear()
        for head in self.heads.values():
            head.close()
        if self.owns_registry:
            # First, while its cache still lists every bound buffer (ops' own scratch and placeholders too).
            self.model.registry.close()
        for model in (self.model, self.draft):
            if model is not None:
                model.close()
                model.weights.destroy()
        self.closed = True

    # -- LoRA adapters ----------------------------------------------------------------------------------------
    @property
    def adapters(self) -> list[str]:
        """The names of the loaded LoRA adapters (a generation picks one with `adapter=`)."""
        return self.model.adapters.names

    def add_adapter(self, name: str, path: str | Path, dtype: str = "f32") -> LoraAdapter:
        """Load the PEFT LoRA folder `path` as `name` beside the base weights (kept in `dtype`: f32 or f16), while
        other generations run: it joins between two of the loop's steps. Bad folders raise `AdapterError`."""
        adapter = read_adapter(path)  # the files are read before the loop is paused
        with self.batch.gpu():
            return self.model.adapters.add(name, adapter, dtype)

    def remove_adapter(self, name: str) -> None:
        """Unload adapter `name` (`UnknownAdapterError` if none is loaded so) and forget the prompts the prefix cache
        kept with it; a generation still running with it fails at its next step."""
        with self.batch.gpu():
            self.model.adapters.remove(name)
            self.prefix_cache.forget_adapter(name)

    # -- embeddings -------------------------------------------------------------------------------------------
    def embed(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool = True,
        prompt_name: str | None = None,
    ) -> list[list[float]]:
        """One vector per input (a string, a list of strings, a token list or a list of token lists): the model's
        final hidden states pooled as its sentence-transformers files say (last token without them), truncated to
        `dimensions` (Matryoshka, embedding models only) and L2-normalised unless `normalize` is False. `prompt_name`
        prepends one of the model's named prompts ("query", "document") to each text. See `doppler_py.embeddings`."""
        return self.embeddings(
            inputs, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name
        ).vectors.tolist()

    def embeddings(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool = True,
        prompt_name: str | None = None,
    ) -> EmbeddingResult:
        """`embed`'s vectors as one float32 array, with the tokens they took (the server's usage)."""
        return self.embedder.embed(inputs, dimensions=dimensions, normalize=normalize, prompt_name=prompt_name)

    @property
    def embedder(self) -> Embedder:
        """The model's embedding head and buffers, made on first use (`doppler_py.embeddings`)."""
        if self._embedder is None:
            with self._leases:
                if self._embedder is None:
                    check_causal(self.folder)
                    config = self.model.config
                    head = (
                        EmbeddingHead.from_folder(self.folder, config.hidden_size) if self.folder else EmbeddingHead()
                    )
                    with self.batch.gpu():
                        self._embedder = Embedder(self.model, self.tokenizer, head, gpu_lock=self.batch.gpu)
        return self._embedder

    def rerank(
        self, query: str, documents: Sequence[str], *, instruction: str | None = None, top_n: int | None = None
    ) -> list[RerankResult]:
        """`documents` by relevance to `query`, highest first (the first `top_n`): each one's probability of "yes"
        over "no" as Qwen3-Reranker's card asks it (`doppler_py.rerank`); `instruction` replaces the card's default
        task line."""
        return self.rerank_with_usage(query, documents, instruction=instruction, top_n=top_n)[0]

    def rerank_with_usage(
        self, query: str, documents: Sequence[str], *, instruction: str | None = None, top_n: int | None = None
    ) -> tuple[list[RerankResult], int]:
        """`rerank`'s results and the tokens it read (the server's usage)."""
        if self._reranker is None:
            with self._leases:
                if self._reranker is None:
                    self._reranker = Reranker(self.model, self.tokenizer, gpu_lock=self.batch.gpu)
        return self._reranker.rerank(query, documents, instruction=instruction, top_n=top_n)

    # -- speculative engines ----------------------------------------------------------------------------
    def resolve_mode(self, speculative: str | None) -> str:
        """The mode a checked `speculative` (`GenerationOptions`) runs here: "none", "auto"'s choice (what a
        benchmark labels its `auto` row with), or itself; a mode this engine cannot run is a GenerationOptionError."""
        if speculative is None:
            return "none"
        if speculative == "auto":  # an explicitly loaded draft model, else a head with lookup, else lookup
            if self.draft is not None:
                return "draft-model"
            kind = next((kind for kind in HEAD_KINDS if kind in self.heads), None)
            return f"{kind}+prompt-lookup" if kind else "prompt-lookup"
        spec = DRAFTERS[speculative]
        if spec.needs_draft_model and self.draft is None:
            raise GenerationOptionError(f"speculative={speculative!r} needs a draft model: load(..., draft=PATH)")
        if spec.head is not None and speculative not in self.heads:
            raise GenerationOptionError(
                f"speculative={speculative!r} needs {spec.head.article} head trained for {self.name}",
                advice=f"train one with `doppler-py train-draft MODEL --kind {speculative} --out DIR` and load it "
                "with load(..., draft_head=DIR) or --draft-head DIR",
            )
        return speculative

    def speculative_engine(self, mode: str) -> SpeculativeEngine:
        """The (cached) engine for a drafter; its cost model and acceptance estimate persist across calls."""
        if mode not in self._spec:
            engine = SpeculativeEngine(self.model, self._drafter(mode), batch=self.batch)
            engine.prefix_cache = self.prefix_cache
            engine.kv_budget = self.kv_budget
            if mode != "none":
                self._prepare(engine)
            self._spec[mode] = engine
        return self._spec[mode]

    def _lease(self, mode: str) -> SpeculativeEngine:
        """The engine a stream of `mode` generates with: the cached one, or with `parallel` > 1 one of its own
        (an idle one, or a new one made ready now), so that concurrent streams' generations are each their own."""
        if self.parallel == 1:
            return self.speculative_engine(mode)
        with self._leases:
            idle = self._idle.setdefault(mode, [])
            if idle:
                return idle.pop()
        with self.batch.gpu():
            engine = SpeculativeEngine(self.model, self._drafter(mode), batch=self.batch)
            try:
                engine.prefix_cache = self.prefix_cache
                engine.kv_budget = self.kv_budget
                if mode != "none":  # the batch's warm-up compiles what its steps run
                    self._prepare(engine, background=False, compile_now=False)
            except BaseException:
                engine.close()
                raise
            return engine

    def _give_back(self, mode: str, engine: SpeculativeEngine) -> None:
        if self.parallel > 1:
            with self._leases:
                self._idle[mode].append(engine)

    def _drafter(self, mode: str) -> Drafter | None:
        """A new drafter for `mode` (None: plain decoding)."""
        if mode == "none":
            return None
        sources = DraftSources(self.model, self.draft, self.heads)
        name, paired = mode.removesuffix("+prompt-lookup"), mode.endswith("+prompt-lookup")  # "auto"'s pair
        drafter = DRAFTERS[name].make(sources)
        return BestOfDrafter(DRAFTERS["prompt-lookup"].make(sources), drafter) if paired else drafter

    def _prepare(self, engine: SpeculativeEngine, *, background: bool | None = None, compile_now: bool = True) -> None:
        """Costs from the on-disk cache when this device and model were measured before, else a calibration
        whose result is stored there; now, or with the pipelines compiling in the background (`warmup`, unless
        `background` says). `compile_now`: see `SpeculativeEngine.prepare`."""
        costs = None
        if self.folder is not None:
            key = cost_key(
                self.model.gpu, self.folder, self.weights, max_rows=self.model.max_rows, capacity=engine.capacity
            )
            costs = load_costs(key)
            engine.readiness.on_calibrated = lambda measured: save_costs(key, measured)
        background = self.warmup != "now" if background is None else background
        if self.progress:  # before the first token: a CPU adapter would otherwise sit silent or run slower unsaid
            adapter = self.model.gpu.summary()["adapter"]
            doing = "compile" if costs else "compile and time"
            when = "in the background after the first token (tokens stream plainly until then)" if background else "now"
            if background and self.warmup == "auto":
                when += ", once the tokens to come can repay it"
            print(
                f"doppler-py: {engine.drafter.name}: {doing} its verification pipelines for {adapter} {when}; "
                f"pipelines compile once per process{'' if costs else ', costs are measured once per device'}",
                file=sys.stderr,
                flush=True,
            )
        start = time.perf_counter()
        engine.prepare(costs=costs, background=background, compile_now=compile_now, weigh=self.warmup == "auto")
        if self.progress and not background:
            print(f"doppler-py: ready in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)

    def should_speculate(self, speculative: str = "auto") -> bool:
        """Whether `speculative` is predicted to pay here, from measured costs and acceptance so far."""
        mode = self.resolve_mode(check_speculative(speculative))
        return mode != "none" and self.speculative_engine(mode).policy.should_speculate()

    # -- generation --------------------------------------------------------------------------------------
    def encode_prompt(
        self, prompt: str | Messages, chat: bool | None = None, tools: ToolPlan | None = None
    ) -> list[int]:
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
            if (
                not isinstance(message, dict)
                or "role" not in message
                or not ("content" in message or "tool_calls" in message)
            ):
                raise GenerationOptionError(f"chat messages need 'role' and 'content', got {message!r}")
        # Tool calls and results in the history made renderable, and the tools shown (`doppler_py.tool_calls`).
        messages, variables = chat_messages(prompt, self.tokenizer, tools)
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **variables)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: str | Messages, *, options: GenerationOptions | None = None, **keywords) -> Iterator[str]:
        """Yield text pieces as tokens are accepted; `last_result` holds the record when the stream ends.

        The options are `GenerationOptions`' fields, given as keywords (`max_tokens=64, stop="\\n"`), or made once
        and passed as `options=` (keywords given beside it replace its fields); what they mean and their defaults
        (`doppler_py.defaults`, the same in the CLI and the server: speculative "auto", greedy) are there. A bad
        value raises `GenerationOptionError` naming the option when the stream starts.

        Closing the iterator early cancels the generation and frees its KV caches; a matched stop string does the
        same at once. With logprobs, `piece_logprobs` holds, while streaming, the entries of the tokens whose text
        each yielded piece completes (tokens with no text of their own, like an end-of-sequence token, come with the
        last piece or only in the result). With tools, the stream yields the answer as written;
        `last_result.tool_calls` holds the parsed calls and finish_reason is "tool_calls" when the answer made calls
        and ended by itself.
        """
        if self.closed:
            raise DopplerError(f"the engine for {self.name} is closed", advice="load the model again")
        options = request_options(options, **keywords)
        self.model.adapters.check(options.adapter)
        constraint = self._constraint(options)
        ids = self.encode_prompt(prompt, options.chat, tools=options.tool_plan)
        self.model.check_ids(ids)
        check_bias_vocab(options.sampling, self.model.config.vocab_size)
        max_tokens = options.max_tokens
        if options.shorten_to_fit:
            max_tokens = max(1, min(max_tokens, self.model.max_positions - len(ids)))  # no room: refused below
        check_fits(len(ids), max_tokens, self.model.max_positions)
        mode = self.resolve_mode(options.speculative)
        engine = self._lease(mode)
        try:
            yield from self._stream(engine, mode, ids, max_tokens, options, constraint)
        finally:
            self._give_back(mode, engine)

    def _stream(
        self,
        engine: SpeculativeEngine,
        mode: str,
        ids: list[int],
        max_tokens: int,
        options: GenerationOptions,
        constraint: GrammarMatcher | None,
    ) -> Iterator[str]:
        """`stream`'s generation with the engine leased for it (`max_tokens`: the options', or what fits)."""
        logprobs = options.logprobs
        engine.policy.check_k(options.k)  # the engine's buffers
        use_trees(engine, options.tree, logprobs)
        stats = SpecStats()
        decoder = self.tokenizer.stream_decoder(skip_special_tokens=True)
        matcher = StopMatcher(options.stop)
        eos_ids = tuple(self.tokenizer.eos_token_ids) + tuple(self.model.config.eos_token_ids)
        tokens: list[int] = []
        token_logprobs: list[TokenLogprob] = []
        ends: list[int] = []  # [i] = length of the text once token i is decoded (tokens still incomplete: none)
        sent = 0  # token_logprobs[:sent] went out with earlier pieces

        def piece_logprobs(released: int) -> list[TokenLogprob] | None:
            nonlocal sent
            if logprobs is None:
                return None
            done = bisect.bisect_right(ends, released)
            entries, sent = token_logprobs[sent:done], max(sent, done)
            return entries

        start = time.perf_counter()
        steps = engine.iter_generate(
            ids,
            max_tokens,
            options.sampling,
            stats=stats,
            k=options.k,
            stop_ids=eos_ids,
            logprobs=logprobs,
            logprob_entries=token_logprobs,
            grammar=constraint,
            adapter=options.adapter,
        )
        try:
            for new in self.plain_costs.watch(steps, stats):
                piece = ""
                for token in new:
                    tokens.append(token)
                    text = decoder.push(token)
                    piece += text
                    if text:  # this token completes the text so far, and so do earlier tokens still waiting
                        ends.extend([len(matcher.text) + len(piece)] * (len(tokens) - len(ends)))
                released = matcher.push(piece)
                if matcher.stop_at is not None:
                    steps.close()  # frees the KV caches before the last piece is handed over
                if released:
                    self.piece_logprobs = piece_logprobs(matcher.released)
                    yield released
                if matcher.stop_at is not None:
                    break
            else:
                released = matcher.push(decoder.flush()) + (matcher.finish() if matcher.stop_at is None else "")
                ends.extend([len(matcher.text)] * (len(tokens) - len(ends)))
                if released:
                    self.piece_logprobs = piece_logprobs(len(matcher.text))
                    yield released
        finally:
            steps.close()
        if matcher.stop_at is not None:
            kept = bisect.bisect_right(ends, matcher.stop_at)
            del tokens[kept:], token_logprobs[kept:]
        self.last_result = self._result(tokens, ids, stats, mode, elapsed=time.perf_counter() - start, stop=matcher)
        if logprobs is not None:
            self.last_result.logprobs = token_logprobs
        if options.tools is not None:
            called = options.tool_plan is not None
            self.last_result.tool_calls = parse_answer(self.last_result.text)[1] if called else []
            if self.last_result.tool_calls and self.last_result.finish_reason == "stop":
                self.last_result.finish_reason = "tool_calls"

    def _constraint(self, options: GenerationOptions) -> GrammarMatcher | None:
        """A matcher for the constraint asked for (the tools' calls are one), or None (llguidance is imported only
        when one is)."""
        plan = options.tool_plan
        response_format, regex = options.response_format, options.regex
        grammar = plan.grammar if plan is not None else options.grammar
        if response_format is None and regex is None and grammar is None:
            return None
        from doppler_py.constraints.grammar import constraint_from_options
        from doppler_py.constraints.matcher import GrammarMatcher
        from doppler_py.constraints.tokenizer_bridge import ll_tokenizer

        ll = ll_tokenizer(self.tokenizer)
        constraint = constraint_from_options(
            response_format=response_format, regex=regex, grammar=grammar, tokenizer=ll
        )
        return None if constraint is None else GrammarMatcher(ll, constraint, self.model.config.vocab_size)

    def generate(
        self, prompt: str | Messages, *, options: GenerationOptions | None = None, **keywords
    ) -> GenerationResult:
        """Generate to completion; the same options as `stream`."""
        for _ in self.stream(prompt, options=options, **keywords):
            pass
        return self.last_result

    def _result(
        self, tokens: list[int], ids: list[int], stats: SpecStats, mode: str, *, elapsed: float, stop: StopMatcher
    ) -> GenerationResult:
        saved = saved_err = None
        if mode != "none" and stats.drafted == 0:  # every step was a plain one: nothing to compare
            saved = saved_err = 0.0
        elif mode != "none" and (cost := self.plain_costs.estimate()) is not None:
            per_step, spread, samples = cost
            n = stats.generated
            saved = per_step * n - (stats.plain_s + stats.draft_s + stats.verify_s)
            saved_err = math.hypot(n * 1.2533 * spread / math.sqrt(samples), spread * math.sqrt(n))
        if stop.stop_at is not None:
            finish, text = "stop", stop.text[: stop.stop_at]
        else:
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
            tokens_per_s=stats.generated / stats.decode_s if stats.decode_s > 0 else 0.0,
            elapsed_s=elapsed,
            time_saved_s=saved,
            time_saved_s_err=saved_err,
            stats=stats.as_dict(),
            cached_tokens=stats.cached_tokens,
            stop_sequence=stop.matched,
        )


class StopMatcher:
    """Finds the first stop string in text that arrives in pieces, releasing only text that cannot be part of
    one: the longest tail of the unreleased text that is a prefix of a stop string is held back. A match can
    therefore never start inside released text, and the search starts where the released text ends."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""  # everything pushed
        self.released = 0  # text[:released] has been handed out
        self.stop_at: int | None = None  # where the first stop string starts, once found
        self.matched: str | None = None  # that stop string (the first listed, where several start there)

    def push(self, piece: str) -> str:
        """Add a piece; return the text now known to precede any stop string."""
        if self.stop_at is not None:
            return ""
        self.text += piece
        hits = [i for s in self.stops if (i := self.text.find(s, self.released)) >= 0]
        if hits:
            self.stop_at = min(hits)
            self.matched = next(s for s in self.stops if self.text.startswith(s, self.stop_at))
            return self._release(self.stop_at)
        pending = len(self.text) - self.released
        hold = next(
            (
                n
                for n in range(min(pending, max(map(len, self.stops), default=1) - 1), 0, -1)
                if any(s.startswith(self.text[-n:]) for s in self.stops)
            ),
            0,
        )
        return self._release(len(self.text) - hold)

    def finish(self) -> str:
        """The held-back tail, at the end of a stream that met no stop string."""
        return self._release(len(self.text))

    def _release(self, end: int) -> str:
        out, self.released = self.text[self.released : end], end
        return out


class PlainStepCosts:
    """Seconds per token of live plain decoding measured in this process, for `time_saved_s`: one sample per
    single plain step, and one per batch of plain steps (`Stepper.step`'s plain_steps: its time / tokens,
    what plain decoding costs a token there).

    Excluded: calibration (it never goes through `watch`), each generation's first step, and the first
    WARMUP plain steps or batches after loading (pipelines, bind groups and buffers are created on first use).
    """

    WARMUP = 3
    MIN_SAMPLES = 8
    KEEP = 512  # the most recent steps only

    def __init__(self):
        self.seen = 0
        self.samples: list[float] = []

    def watch(self, steps: Iterator[list[int]], stats: SpecStats) -> Iterator[list[int]]:
        """Pass a generation's steps through, recording each plain step's or batch's time per token."""
        plain_steps, plain_s, drafted, first = stats.plain_steps, stats.plain_s, stats.drafted, True
        for new in steps:
            tokens = stats.plain_steps - plain_steps
            if tokens >= 1 and stats.drafted == drafted:  # only plain steps since the last yield
                self.seen += 1
                if not first and self.seen > self.WARMUP:
                    self.samples = [*self.samples[-self.KEEP + 1 :], (stats.plain_s - plain_s) / tokens]
            plain_steps, plain_s, drafted, first = stats.plain_steps, stats.plain_s, stats.drafted, False
            yield new

    def estimate(self) -> tuple[float, float, int] | None:
        """(median seconds per plain step, robust spread of one step, samples), or None with too few."""
        if len(self.samples) < self.MIN_SAMPLES:
            return None
        median = statistics.median(self.samples)
        spread = 1.4826 * statistics.median(abs(x - median) for x in self.samples)
        return median, spread, len(self.samples)


def load(
    model: str | Path = DEFAULT_MODEL,
    weights: str = "keep",
    *,
    draft: str | Path | None = None,
    draft_weights: str | None = None,
    draft_head: str | Path | Sequence[str | Path] | bool | None = None,
    max_seq: int | None = 2048,
    browser_limits: bool = False,
    progress: bool = True,
    gpu: Gpu | None = None,
    warmup: str = defaults.WARMUP,
    kv_cache_mb: int = defaults.KV_CACHE_MB,
    parallel: int = 1,
    kv_budget_mb: int | None = None,
    lora: Mapping[str, str | Path] | None = None,
    merge: bool = False,
    webgpu: str | None = None,
) -> Engine:
    """Load a known model name, an HF folder or a .gguf file (converted once into the cache) onto the GPU.

    weights: "keep" (default: as stored; the default model is Q4_1 with a Q8_0 embedding), "f32", "f16",
    "q8_0", "q4_0" or "q4_1" (dense tensors quantised on load; block-quantised ones keep their blocks).
    draft: an optional smaller model with the same vocabulary for speculative="draft-model".
    draft_head: a trained head folder (or several: one per kind) for speculative="eagle"/"medusa"/"spark" and "auto";
    None: the heads shipped for a known model, if any; False: none.
    warmup: how a speculative mode gets ready on first use. "now": compile its pipelines and measure this
    device's verification costs before its first generation starts (its step structure is then the same from
    the first token). "background": compile them in a background thread while the first generations stream
    plain tokens, then switch speculation on (the first token comes as fast as without speculation). "auto" (the
    default, as in the CLI and the server): the same, but the compile starts only once it pays for itself
    (`speculative.readiness.compile_gate`): at once on a GPU; on a CPU adapter, where compiling competes with
    decoding for the cores and takes tens of seconds, once the tokens to come (this answer's, plus as many as
    this engine generated before) could save more than it costs, so a short answer is never slower than plain
    decoding. Measured costs are cached on disk per device, model and precision, so later processes skip the
    measuring.
    kv_cache_mb: GPU memory (MiB) kept for earlier sequences' K/V (`model.prefix_cache`): a prompt that shares a
    prefix with an earlier prompt or answer (a chat's next turn, a common system prompt) prefills only the rest
    (`GenerationResult.cached_tokens`); the output is the same either way. 0: keep none.
    progress: a progress bar while a model converts, and a line on stderr when a speculative mode compiles its
    pipelines or measures this device (before its first generation).
    parallel: streams that may run at once from different threads (the server's `--parallel`). With more than
    one, concurrent streams decode together: each step of every running stream shares one forward of the model
    (`speculative.batch`), and each stream's output is the same as alone, with any drafter (each stream's own:
    trained heads, a draft model, lookup, trees).
    kv_budget_mb: GPU memory (MiB) the KV caches of generations running at once may take together
    (`speculative.kv_budget`): a generation whose cache does not fit waits until running ones end; one that could
    never fit gets a `CapacityError`. None: no limit of our own.
    lora: LoRA adapters by name, each a PEFT folder (adapter_config.json + adapter_model.safetensors) trained on this
    model; a generation picks one with `adapter="name"` (docs/lora.md). More can come and go later
    (`Engine.add_adapter`, `remove_adapter`). merge: with exactly one adapter in `lora`, add it into the weights as
    they load instead (B·A into W, then converted to `weights`): no cost per token, every generation answers with it,
    and there is no adapter to pick or remove.
    webgpu: the WebGPU implementation, "wgpu-native" or "dawn" (Chrome's, compiling WGSL with Tint); None: the
    DOPPLER_WEBGPU environment variable, else wgpu-native. Ignored when `gpu` is given (its device decides).
    """
    check_warmup(warmup)
    check_kv_cache_mb(kv_cache_mb)
    check_parallel(parallel)
    check_kv_budget_mb(kv_budget_mb)
    if weights not in WEIGHT_FORMATS:
        raise GenerationOptionError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {weights!r}")
    if merge and len(lora or {}) != 1:
        raise GenerationOptionError(
            f"merge=True merges one LoRA adapter into the weights; lora names {len(lora or {})}"
        )
    gpu = gpu or default_gpu(browser_limits, webgpu)
    # The model's files are read under a shared lock (`catalog.open_model`): no converter moves them aside meanwhile.
    with contextlib.ExitStack() as files:
        # GGUF sources are converted keeping their blocks, so every precision is derived from the exact values.
        folder = files.enter_context(open_model(model, "keep", progress=progress))
        tokenizer = Tokenizer.from_dir(folder)
        draft_folder = None
        if draft is not None:
            # Everything that can refuse the draft is checked before any weights reach the GPU.
            draft_folder = files.enter_context(open_model(draft, "keep", progress=progress))
            check_same_tokenizer(Tokenizer.from_dir(draft_folder), tokenizer, draft_folder)
            check_vocabularies(
                ModelConfig.from_file(draft_folder / "config.json").vocab_size,
                ModelConfig.from_file(folder / "config.json").vocab_size,
            )
        deltas = None
        if merge:
            assert lora is not None
            (path,) = lora.values()
            deltas = merged_deltas(read_adapter(path), ModelConfig.from_file(folder / "config.json"))
        registry = KernelRegistry(gpu)
        models: list[Transformer] = []
        try:
            for source, precision in ((folder, weights), (draft_folder, draft_weights or weights)):
                if source is not None:
                    loaded = load_weights(source, gpu, precision, deltas=deltas if source is folder else None)
                    try:
                        models.append(Transformer(loaded, registry, max_positions=max_seq))
                    except BaseException:
                        loaded.destroy()
                        raise
            target, draft_model = models[0], (models[1] if len(models) > 1 else None)
            heads = load_heads(model, draft_head, target, weights, tokenizer)
        except BaseException:
            # A failed load (a bad draft file or head, a buffer past the device's limits...) leaves nothing on the GPU.
            for loaded_model in models:
                loaded_model.close()
                loaded_model.weights.destroy()
            registry.close()
            raise
    engine = Engine(
        target,
        tokenizer,
        name=str(model),
        weights=weights,
        draft=draft_model,
        heads=heads,
        owns_registry=True,
        folder=folder,
        warmup=warmup,
        kv_cache_mb=kv_cache_mb,
        progress=progress,
        parallel=parallel,
        kv_budget_mb=kv_budget_mb,
    )
    try:
        for name, path in (lora or {}).items() if not merge else ():
            engine.add_adapter(name, path)
    except BaseException:
        engine.close()
        raise
    return engine


WARMUP_MODES = ("auto", "background", "now")


def check_kv_budget_mb(kv_budget_mb: int | None) -> None:
    if kv_budget_mb is not None and (
        isinstance(kv_budget_mb, bool) or not isinstance(kv_budget_mb, int) or kv_budget_mb < 1
    ):
        raise GenerationOptionError(f"kv_budget_mb must be a whole number of MiB >= 1 or None, got {kv_budget_mb!r}")


def check_kv_cache_mb(kv_cache_mb: int) -> None:
    if isinstance(kv_cache_mb, bool) or not isinstance(kv_cache_mb, int) or kv_cache_mb < 0:
        raise GenerationOptionError(f"kv_cache_mb must be a whole number of MiB >= 0, got {kv_cache_mb!r}")


def check_parallel(parallel: int) -> None:
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        raise GenerationOptionError(f"parallel must be a whole number of streams >= 1, got {parallel!r}")


def use_trees(engine: SpeculativeEngine, tree: bool | None, logprobs) -> None:
    """Set the engine's drafter to propose trees or chains for this generation (see `stream`)."""
    # Drafters that can branch (prompt lookup, a draft model, an EAGLE or Medusa head) declare how many ways
    # when trees are on (`tree_branches` > 1); "auto"'s head + lookup pair declares chains. `GenerationOptions`
    # checked tree's type and refused trees with logprobs.
    if engine.fixed_nodes is not None:  # lookahead: every step is a tree of its shape
        if tree is not None:
            raise GenerationOptionError(
                f"tree={tree!r} does not apply to lookahead: every step verifies its window and candidates as one "
                "token tree (k sets its node budget)"
            )
        if logprobs is not None:
            raise GenerationOptionError("log-probs are not given for token trees, and every lookahead step is one")
        return
    brancher = engine.drafter if engine.drafter.tree_branches > 1 else None
    if tree is None or tree is False:
        wanted = (
            tree is None
            and brancher is not None
            and logprobs is None
            and trees_pay(engine.policy.costs, engine.policy.k_max + 1)
        )
    else:
        if brancher is None:
            raise GenerationOptionError(
                f"tree={tree!r} needs prompt-lookup, draft-model, EAGLE or Medusa drafts alone "
                f"(speculative='prompt-lookup', 'draft-model', 'eagle' or 'medusa'); this generation drafts "
                f"with {engine.drafter.name!r}"
            )
        wanted = True
    if brancher is not None:
        brancher.branches = brancher.tree_branches if wanted else 1


def check_warmup(warmup: str) -> None:
    if warmup not in WARMUP_MODES:
        raise GenerationOptionError(f"warmup must be one of {', '.join(WARMUP_MODES)}, got {warmup!r}")


def load_heads(model, draft_head, target: Transformer, weights: str, tokenizer: Tokenizer) -> dict:
    """kind -> loaded head, from `load`'s draft_head (see there); every head is checked against the target."""
    if draft_head is None:
        folders = [folder for kind in HEAD_KINDS if (folder := known_head(model, kind)) is not None]
    elif draft_head is False:
        folders = []
    else:
        folders = [draft_head] if isinstance(draft_head, str | Path) else list(draft_head)
    heads: dict = {}
    try:
        for folder in folders:
            kind = head_kind(folder)
            if kind in heads:
                raise GenerationOptionError(f"{folder}: a second {kind} head; give at most one head of each kind")
            heads[kind] = DRAFTERS[kind].head.load(folder, target, weights, tokenizer)
    except BaseException:
        for head in heads.values():
            head.close()
        raise
    return heads


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
