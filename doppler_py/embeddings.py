"""Embeddings: a text's vector from the model's final hidden states, pooled as its sentence-transformers files say.

    texts ─ tokenizer (its post-processor: Qwen3-Embedding appends <|endoftext|>) ─▶ ids
    ids ─ the transformer's layers (causal or bidirectional attention, each input over its own KV cache; several
          inputs' rows in one forward, `Transformer.record_batch`) ─▶ x ─ final RMSNorm ─▶ h [T, H]   (no LM head)
    h ─ pooling (last token | mean | first token) ─ Dense layers ─ [:dimensions] ─ L2 normalise ─▶ vector

The head (pooling, Dense layers, Normalize, named prompts) comes from the files sentence-transformers keeps beside
the model (`EmbeddingHead.from_folder`): `modules.json`, the pooling module's `config.json` (both the
`pooling_mode_lasttoken: true` keys of sentence-transformers 2–5 and the `pooling_mode: "lasttoken"` of 6), each
Dense module's `config.json` and weights, and `config_sentence_transformers.json`'s `prompts`. A folder without them
(a plain causal LM) is pooled at its last token and normalised, and keeps its full width.

A model whose config asks for bidirectional attention (Gemma 3's `use_bidirectional_attention`: EmbeddingGemma) runs
its embedding forwards with every token seeing every token of its input (sliding layers: those less than
sliding_window // 2 + 1 positions away either way, as transformers reads the field). A token then depends on the
tokens after it, so an input cannot be split across forwards as a causal prefill is: an input of up to a forward's
rows (`Transformer.max_rows`, 64) runs whole in one forward, several such inputs side by side (forwards of up to
max_rows rows, not `rows_alone`: on GPUs an input batched with others may round differently from the same input
alone, within the tolerance); a longer one, up to the model's context, runs alone, layer by layer over chunks of
max_rows rows, every chunk's keys written before any chunk attends (`Transformer.run_bidirectional`). Generation
from such a model stays causal. A config that asks for it on another architecture, or says `is_causal: false`, is
refused (`check_causal`). The context is the engine's, the model's max_position_embeddings or sentence-transformers'
max_seq_length, whichever is least: a longer input is refused.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from doppler_py.errors import DopplerError, GenerationOptionError, ModelFormatError, UnsupportedModelError
from doppler_py.gpu.tensor import Tensor
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.transformer import Transformer
from doppler_py.ops.linear import compile_at_once
from doppler_py.ops.norms import RMSNorm
from doppler_py.tokenizer import Tokenizer

POOLING_MODES = ("lasttoken", "mean", "cls")
ENCODING_FORMATS = ("float", "base64")
# Dense activations sentence-transformers writes by their torch class path, by the class name: numpy forms.
_ACTIVATIONS = {"Identity": lambda v: v, "Tanh": np.tanh}
# KV caches kept between calls for the next inputs (each sized to a power of two of positions), at most this much.
CACHE_POOL_BYTES = 64 << 20
MIN_CACHE_POSITIONS = 16


@dataclass(frozen=True)
class DenseLayer:
    """y = act(x·Wᵀ + b): a sentence-transformers Dense module (EmbeddingGemma's 768 → 3072 → 768)."""

    weight: np.ndarray  # [out, in] float32
    bias: np.ndarray | None
    activation: str  # a key of _ACTIVATIONS

    def __call__(self, v: np.ndarray) -> np.ndarray:
        y = v @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return _ACTIVATIONS[self.activation](y).astype(np.float32)


@dataclass(frozen=True)
class EmbeddingHead:
    """What turns final hidden states into the model's embedding (module docstring)."""

    pooling: str = "lasttoken"
    include_prompt: bool = True  # mean pooling over the prompt's tokens too
    dense: tuple[DenseLayer, ...] = ()
    normalize: bool = True
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    # Whether the folder declares an embedding model (sentence-transformers files): only then may `dimensions`
    # truncate the vector (Matryoshka); a plain LM's vector is its hidden state, which no training made truncatable.
    declared: bool = False
    max_length: int | None = None  # the Transformer module's max_seq_length (sentence-transformers truncates there)

    def width(self, hidden_size: int) -> int:
        return self.dense[-1].weight.shape[0] if self.dense else hidden_size

    @classmethod
    def from_folder(cls, folder: Path, hidden_size: int) -> EmbeddingHead:
        modules_file = folder / "modules.json"
        if not modules_file.exists():
            return cls()
        modules = _json(modules_file)
        if not isinstance(modules, list):
            raise ModelFormatError(f"{modules_file}: expected a list of modules")
        pooling, include_prompt, normalize, dense = None, True, False, []
        width = hidden_size
        for module in modules:
            kind = str(module.get("type", "")).rsplit(".", 1)[-1] if isinstance(module, dict) else ""
            path = folder / str(module.get("path", "")) if isinstance(module, dict) else folder
            if kind == "Transformer":
                continue
            if kind == "Pooling":
                if pooling is not None or dense or normalize:
                    raise UnsupportedModelError(f"{modules_file}: a Pooling module after another Pooling or a head")
                pooling, include_prompt = _pooling(path / "config.json")
            elif kind == "Dense":
                if pooling is None or normalize:
                    raise UnsupportedModelError(f"{modules_file}: a Dense module before pooling or after Normalize")
                layer = _dense(path, width)
                dense.append(layer)
                width = layer.weight.shape[0]
            elif kind == "Normalize":
                normalize = True
            else:
                raise UnsupportedModelError(
                    f"{modules_file}: sentence-transformers module {module.get('type')!r} is not supported "
                    "(Transformer, Pooling, Dense and Normalize are)"
                )
        if pooling is None:
            raise UnsupportedModelError(f"{modules_file}: no Pooling module (token embeddings are not served)")
        settings = folder / "config_sentence_transformers.json"
        data = _json(settings) if settings.exists() else {}
        prompts = data.get("prompts") or {}
        if not isinstance(prompts, dict) or not all(isinstance(v, str) for v in prompts.values()):
            raise ModelFormatError(f"{settings}: 'prompts' must map names to strings")
        default = data.get("default_prompt_name")
        if default is not None and default not in prompts:
            raise ModelFormatError(f"{settings}: default_prompt_name {default!r} is not one of its prompts")
        bert = folder / "sentence_bert_config.json"
        max_length = (_json(bert) if bert.exists() else {}).get("max_seq_length")
        if max_length is not None and (
            isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1
        ):
            raise ModelFormatError(f"{bert}: max_seq_length must be a positive whole number, got {max_length!r}")
        return cls(
            pooling,
            include_prompt,
            tuple(dense),
            normalize,
            dict(prompts),
            default,
            declared=True,
            max_length=max_length,
        )


def _json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path}: cannot be read as JSON ({exc})") from None


def _pooling(path: Path) -> tuple[str, bool]:
    """(mode, include_prompt) from a pooling config: sentence-transformers 6's `pooling_mode`, or the boolean keys
    of earlier versions (exactly one set)."""
    data = _json(path) if path.exists() else {}
    mode = data.get("pooling_mode")
    if mode is None:
        flags = {
            "lasttoken": "pooling_mode_lasttoken",
            "mean": "pooling_mode_mean_tokens",
            "cls": "pooling_mode_cls_token",
            "max": "pooling_mode_max_tokens",
            "mean_sqrt_len_tokens": "pooling_mode_mean_sqrt_len_tokens",
            "weightedmean": "pooling_mode_weightedmean_tokens",
        }
        chosen = [name for name, key in flags.items() if data.get(key)]
        if len(chosen) != 1:
            raise UnsupportedModelError(f"{path}: pooling by {' + '.join(chosen) or 'nothing'}; one mode is supported")
        mode = chosen[0]
    if mode not in POOLING_MODES:
        raise UnsupportedModelError(f"{path}: pooling mode {mode!r} is not supported ({', '.join(POOLING_MODES)} are)")
    return mode, bool(data.get("include_prompt", True))


def _dense(path: Path, in_features: int) -> DenseLayer:
    config = _json(path / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.linear.Identity")).rsplit(".", 1)[-1]
    if activation not in _ACTIVATIONS:
        raise UnsupportedModelError(f"{path}: Dense activation {activation!r} is not supported")
    out = config.get("out_features")
    if config.get("in_features") != in_features or not isinstance(out, int):
        raise ModelFormatError(f"{path}: a Dense layer of {config.get('in_features')} inputs after {in_features}")
    weights_file = path / "model.safetensors"
    if not weights_file.exists():
        raise UnsupportedModelError(f"{path}: Dense weights are read from model.safetensors only")
    from safetensors.numpy import load_file

    tensors = load_file(str(weights_file))
    weight = tensors.get("linear.weight")
    if weight is None or weight.shape != (out, in_features):
        raise ModelFormatError(f"{weights_file}: linear.weight must be [{out}, {in_features}]")
    bias = tensors.get("linear.bias") if config.get("bias", True) else None
    return DenseLayer(
        weight.astype(np.float32), None if bias is None else bias.astype(np.float32).reshape(out), activation
    )


@dataclass
class EmbeddingResult:
    vectors: np.ndarray  # [inputs, dimensions] float32
    prompt_tokens: int  # tokens run through the model, over all inputs (prompts included)

    def encoded(self, encoding_format: str) -> list:
        """Each vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
        check_encoding_format(encoding_format)
        if encoding_format == "float":
            return self.vectors.tolist()
        return [base64.b64encode(v.astype("<f4").tobytes()).decode("ascii") for v in self.vectors]


def check_encoding_format(encoding_format: object) -> None:
    if encoding_format not in ENCODING_FORMATS:
        raise GenerationOptionError(
            f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {encoding_format!r}",
            option="encoding_format",
        )


Inputs = str | Sequence[int] | Sequence[str | Sequence[int]]


class Embedder:
    """Runs a model's layers over inputs and pools their final hidden states (module docstring)."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        head: EmbeddingHead,
        *,
        gpu_lock: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        """`gpu_lock`: held around every forward (the engine's loop's `gpu()`: other work on the model waits)."""
        self.model = model
        self.tokenizer = tokenizer
        self.head = head
        self.gpu_lock = gpu_lock
        cfg = model.config
        self.bidirectional = cfg.bidirectional_attention
        # The context: the engine's positions, the model's own (sentence-transformers truncates there) and the
        # sentence-transformers max_seq_length, whichever ends first.
        self.max_length = min(model.max_positions, cfg.max_position_embeddings, head.max_length or model.max_positions)
        # Bidirectional: an input's rows share one forward, of up to max_rows rows, or run layer by layer when it
        # is longer (module docstring).
        self.forward_rows = model.max_rows if self.bidirectional else model.rows_alone
        self.width = head.width(cfg.hidden_size)
        # h = rmsnorm(x)·w over a forward's rows: the final norm the LM head fuses into its matmul, on its own.
        self.hidden = Tensor.empty(model.gpu, (model.max_rows, cfg.hidden_size), "f32", "embedding rows")
        self.final_norm = RMSNorm(
            model.registry,
            model.x,
            model.weights.norm,
            self.hidden,
            dim=cfg.hidden_size,
            eps=cfg.rms_norm_eps,
            max_rows=model.max_rows,
        )
        self._caches: dict[int, list[KVCache]] = {}
        self.closed = False

    # -- inputs --------------------------------------------------------------------------------------------
    def token_lists(self, inputs: Inputs, prompt_name: str | None = None) -> list[np.ndarray]:
        """Each input's token ids: a string through the tokenizer (after the named prompt), a token list as given."""
        if isinstance(inputs, str) or (isinstance(inputs, Sequence) and inputs and all(_is_int(t) for t in inputs)):
            items: list = [inputs]
        elif isinstance(inputs, Sequence) and not isinstance(inputs, bytes):
            items = list(inputs)
        else:
            raise GenerationOptionError(
                "input must be a string, a list of strings, a token list or a list of token lists", option="input"
            )
        if not items:
            raise GenerationOptionError("input is empty: give at least one string or token list", option="input")
        prompt = self.prompt(prompt_name)
        vocab = self.model.config.vocab_size
        out = []
        for n, item in enumerate(items):
            where = f"input[{n}]" if len(items) > 1 else "input"
            if isinstance(item, str):
                if not item:
                    raise GenerationOptionError(f"{where} is an empty string", option="input")
                ids = np.asarray(self.tokenizer.encode(prompt + item), dtype=np.int64)
            elif isinstance(item, Sequence) and not isinstance(item, bytes) and all(_is_int(t) for t in item):
                if not item:
                    raise GenerationOptionError(f"{where} is an empty token list", option="input")
                if prompt:
                    raise GenerationOptionError(
                        f"{where}: a prompt ({prompt_name or self.head.default_prompt_name!r}) is prepended to text; "
                        "token lists are embedded as given",
                        option="prompt_name",
                    )
                ids = np.asarray(item, dtype=np.int64)
                bad = ids[(ids < 0) | (ids >= vocab)]
                if bad.size:
                    raise GenerationOptionError(
                        f"{where}: token id {int(bad[0])} is outside the vocabulary [0, {vocab})", option="input"
                    )
            else:
                raise GenerationOptionError(f"{where} must be a string or a list of token ids", option="input")
            if ids.size == 0:
                raise GenerationOptionError(f"{where} has no tokens", option="input")
            if ids.size > self.max_length:
                raise GenerationOptionError(
                    f"{where} is {ids.size} tokens, past the context of {self.max_length}", option="input"
                )
            out.append(ids.astype(np.uint32))
        return out

    def prompt(self, prompt_name: str | None) -> str:
        name = prompt_name if prompt_name is not None else self.head.default_prompt_name
        if name is None:
            return ""
        if name not in self.head.prompts:
            known = ", ".join(map(repr, self.head.prompts)) or "none"
            raise GenerationOptionError(
                f"prompt_name {name!r} is not one of this model's prompts ({known})", option="prompt_name"
            )
        return self.head.prompts[name]

    def check_dimensions(self, dimensions: int | None) -> int:
        if dimensions is None:
            return self.width
        if isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= self.width:
            raise GenerationOptionError(
                f"dimensions must be a whole number in 1..{self.width}, got {dimensions!r}", option="dimensions"
            )
        if dimensions != self.width and not self.head.declared:
            raise GenerationOptionError(
                f"dimensions={dimensions}: this model is not an embedding model (no sentence-transformers files), so "
                f"its vectors are not truncatable; only its full width {self.width} is given",
                option="dimensions",
            )
        return dimensions

    # -- running -------------------------------------------------------------------------------------------
    def embed(
        self,
        inputs: Inputs,
        *,
        dimensions: int | None = None,
        normalize: bool = True,
        prompt_name: str | None = None,
    ) -> EmbeddingResult:
        dims = self.check_dimensions(dimensions)
        if not isinstance(normalize, bool):
            raise GenerationOptionError(f"normalize must be true or false, got {normalize!r}", option="normalize")
        ids = self.token_lists(inputs, prompt_name)
        if self.head.pooling == "mean" and not self.head.include_prompt and self.prompt(prompt_name):
            raise UnsupportedModelError(
                "this model's mean pooling leaves its prompt's tokens out (include_prompt: false), which doppler-py "
                "does not do: embed without a prompt"
            )
        rows = self.forward_rows
        # Bidirectional inputs longer than a forward run alone, layer by layer; the others in shared forwards.
        alone = [n for n, i in enumerate(ids) if self.bidirectional and i.size > rows]
        batched = [n for n in range(len(ids)) if n not in alone]
        groups = [[batched[k] for k in group] for group in input_groups([ids[n].size for n in batched], rows)]
        plans = [plan_forwards([ids[n].size for n in group], rows, whole=self.bidirectional) for group in groups]
        row_counts = {sum(take for _, _, take in forward) for plan in plans for forward in plan}
        for n in alone:
            row_counts |= {rows, ids[n].size % rows or rows}
        self.compile(row_counts)  # before taking the GPU: generations step on
        pooled: list[np.ndarray | None] = [None] * len(ids)
        for group, plan in zip(groups, plans, strict=True):
            with self.gpu_lock():  # per group: generations step between them
                self._check_open()
                for n, v in zip(group, self.pool([ids[n] for n in group], plan), strict=True):
                    pooled[n] = v
        for n in alone:
            with self.gpu_lock():
                self._check_open()
                pooled[n] = self.pool_alone(ids[n])
        vectors = []
        for v in pooled:
            assert v is not None
            for layer in self.head.dense:
                v = layer(v)
            v = v[:dims]
            if normalize:
                # sentence-transformers' Normalize: v / max(|v|, 1e-12), here after truncation (Matryoshka).
                v = v / max(float(np.linalg.norm(v.astype(np.float64))), 1e-12)
            vectors.append(v.astype(np.float32))
        return EmbeddingResult(np.stack(vectors), int(sum(i.size for i in ids)))

    def _check_open(self) -> None:
        if self.closed:
            raise DopplerError("the engine was closed", advice="load the model again")

    def compile(self, rows: set[int]) -> None:
        """The matmul pipelines of the forwards' row counts, compiled several at once (a CPU adapter compiles
        each on one core) rather than one by one as the forwards meet them."""
        model = self.model
        heads = (model.lm_head, model.lm_head_last)
        compile_at_once([(linear, n) for n in sorted(rows) for linear in model.linears() if linear not in heads])

    def pool(self, ids: list[np.ndarray], plan: list[list[tuple[int, int, int]]]) -> list[np.ndarray]:
        """Each input's pooled final hidden state [H], run as `plan_forwards` planned: forwards of at most
        `rows_alone` rows (each row's result is its own forward's), several inputs' chunks side by side, each over
        its own cache."""
        model, mode = self.model, self.head.pooling
        caches = [self._take_cache(i.size) for i in ids]
        sums = [np.zeros(model.config.hidden_size, np.float64) for _ in ids]
        out: list[np.ndarray | None] = [None] * len(ids)
        try:
            for segments in plan:
                hidden = self._forward(ids, caches, segments, sum(take for _, _, take in segments))
                row0 = 0
                for n, start, take in segments:
                    h = hidden[row0 : row0 + take]
                    if mode == "mean":
                        sums[n] += h.sum(axis=0, dtype=np.float64)
                    elif mode == "cls" and start == 0:
                        out[n] = h[0].copy()
                    if start + take == ids[n].size:
                        if mode == "lasttoken":
                            out[n] = h[-1].copy()
                        elif mode == "mean":
                            out[n] = (sums[n] / ids[n].size).astype(np.float32)
                    row0 += take
        finally:
            for cache in caches:
                self._give_cache(cache)
        assert all(v is not None for v in out)
        return [v for v in out if v is not None]

    def pool_alone(self, ids: np.ndarray) -> np.ndarray:
        """One bidirectional input longer than a forward, pooled: its rows run layer by layer
        (`Transformer.run_bidirectional`), then the final norm over each chunk of max_rows rows."""
        model, mode = self.model, self.head.pooling
        n, h, step = ids.size, model.config.hidden_size, model.max_rows
        cache = self._take_cache(n)
        rows_out = Tensor.empty(model.gpu, (n, h), "f32", "bidirectional rows")
        try:
            model.run_bidirectional(cache, ids, rows_out)
            for p in range(0, n, step):  # a submit per chunk: the norm's uniforms hold one row count per submit
                rows = min(step, n - p)
                rec = model.registry.recorder()
                rec.copy(rows_out, model.x, rows * h * 4, src_offset=p * h * 4)  # copy: x = x_all[c]
                self.final_norm.record(rec, rows)  # rmsnorm: h = rmsnorm(x)·w_final
                rec.copy(self.hidden, rows_out, rows * h * 4, dst_offset=p * h * 4)  # copy: x_all[c] = h
                rec.submit()
            hidden = np.frombuffer(model.gpu.queue.read_buffer(rows_out.buffer, 0, n * h * 4), np.float32)
        finally:
            rows_out.destroy()
            self._give_cache(cache)
        hidden = hidden.reshape(n, h)
        if mode == "mean":
            return (hidden.sum(axis=0, dtype=np.float64) / n).astype(np.float32)
        return (hidden[-1] if mode == "lasttoken" else hidden[0]).copy()

    def _forward(self, ids: list[np.ndarray], caches: list[KVCache], segments: list, rows: int) -> np.ndarray:
        """One forward over the segments' rows (no LM head), then the final norm; the normed rows [rows, H]."""
        model = self.model
        row0 = 0
        for n, start, take in segments:
            model.ids.view((take,), offset_bytes=4 * row0).write(ids[n][start : start + take])
            row0 += take
        rec = model.registry.recorder()
        model.record_batch(
            rec,
            [(caches[n], start, take) for n, start, take in segments],
            logit_rows=0,
            bidirectional=self.bidirectional,
        )
        self.final_norm.record(rec, rows)  # rmsnorm: h = rmsnorm(x)·w_final
        rec.submit()
        h = model.config.hidden_size
        raw = model.gpu.queue.read_buffer(self.hidden.buffer, 0, rows * h * 4)
        return np.frombuffer(raw, dtype=np.float32).reshape(rows, h)

    def _take_cache(self, length: int) -> KVCache:
        model = self.model
        if model.hybrid:  # a recurrent state starts from zero only in a new cache
            return model.new_cache(length)
        positions = min(max(MIN_CACHE_POSITIONS, 1 << math.ceil(math.log2(length))), model.max_positions)
        pool = self._caches.get(positions)
        cache = pool.pop() if pool else model.new_cache(positions)
        cache.truncate(0)
        return cache

    def _give_cache(self, cache: KVCache) -> None:
        kept = sum(c.nbytes for pool in self._caches.values() for c in pool)
        if self.model.hybrid or self.closed or kept + cache.nbytes > CACHE_POOL_BYTES:
            self.model.release_cache(cache)
            return
        self._caches.setdefault(cache.max_seq, []).append(cache)

    def close(self) -> None:
        if self.closed:
            return
        for pool in self._caches.values():
            for cache in pool:
                self.model.release_cache(cache)
        self._caches.clear()
        self.model.registry.release_tensors(self.hidden)
        self.closed = True


GROUP_TOKENS = 4  # forwards' worth of rows a group of inputs may hold (its caches are made for it at once)


def input_groups(lengths: Sequence[int], max_rows: int) -> list[list[int]]:
    """Consecutive inputs run together (their KV caches held at once): at most `max_rows` of them (a forward has a
    segment per input) and GROUP_TOKENS forwards' worth of tokens, unless one input alone is longer."""
    groups: list[list[int]] = []
    tokens = 0
    for n, length in enumerate(lengths):
        if not groups or len(groups[-1]) >= max_rows or tokens + length > GROUP_TOKENS * max_rows:
            groups.append([])
            tokens = 0
        groups[-1].append(n)
        tokens += length
    return groups


def plan_forwards(lengths: Sequence[int], max_rows: int, *, whole: bool = False) -> list[list[tuple[int, int, int]]]:
    """The forwards that run inputs of these token counts: each a list of (input, start, rows) segments of at most
    `max_rows` rows in all, inputs in order, each input's next rows in the first forward with room after its previous
    ones (a long input's chunks in consecutive forwards, short ones filling the rest). `whole`: an input goes only
    into a forward with room for all of it (bidirectional attention; every length at most `max_rows`)."""
    if whole and any(length > max_rows for length in lengths):
        raise ValueError(f"inputs of {max(lengths)} tokens cannot run whole in forwards of {max_rows} rows")
    done = [0] * len(lengths)
    plan = []
    while any(d < n for d, n in zip(done, lengths, strict=True)):
        segments, rows = [], 0
        for n, length in enumerate(lengths):
            if done[n] < length and rows < max_rows and not (whole and rows + length > max_rows):
                take = min(length - done[n], max_rows - rows)
                segments.append((n, done[n], take))
                done[n] += take
                rows += take
        plan.append(segments)
    return plan


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


# model_type of the configs whose use_bidirectional_attention the loader reads (ModelConfig.bidirectional_attention).
BIDIRECTIONAL_MODEL_TYPES = ("gemma3_text",)


def check_causal(folder: Path | None) -> None:
    """Refuse a model whose config asks for bidirectional attention where it is not run: `is_causal: false`, or
    use_bidirectional_attention on an architecture other than Gemma 3's text model (EmbeddingGemma), since its
    vectors would be wrong."""
    if folder is None or not (folder / "config.json").exists():
        return
    config = _json(folder / "config.json")
    asks = config.get("use_bidirectional_attention") is True
    if config.get("is_causal") is False or (asks and config.get("model_type") not in BIDIRECTIONAL_MODEL_TYPES):
        raise UnsupportedModelError(
            f"{folder}: this model attends both ways (use_bidirectional_attention / is_causal: false); doppler-py runs "
            f"bidirectional attention for {', '.join(BIDIRECTIONAL_MODEL_TYPES)} models only (EmbeddingGemma), so "
            "its embeddings would be wrong"
        )
