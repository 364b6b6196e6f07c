"""The LLaMA-family forward pass on the GPU, recorded into one command encoder per call.

    ids ─ embedding ─▶ x ─┬─ for each layer ────────────────────────────────────────────────┐
                          │ qkv = rmsnorm(x)·Wqkv (+b)   Qwen3, Gemma 3: rmsnorm(q, k heads) │
                          │ rope(q); cache[pos] = rope(k), v        a = attention(q, cache)  │
                          │ x += a·Wo                  gu = rmsnorm(x)·[Wg;Wu]               │
                          │ x += (silu(g)·u)·Wd                                              │
                          └──────────────────────────────────────────────────────────────────┘
    x ─ rmsnorm ─ LM head ─▶ logits       (stay on the GPU: the speculative engine's verifier picks tokens)

Qwen 3.5 (hybrid) replaces most layers' attention with a Gated DeltaNet (ops/linear_attention.py): mix =
rmsnorm(x)·Win; a causal conv over its [q | k | v] channels, the gated delta rule over the sequence's recurrent
state, a gated RMSNorm; x += core·Wout. Its attention layers multiply their output by sigmoid(rmsnorm(x)·Wgate)
and rotate only part of each head (rope_inv_freq). A forward leaves the recurrent states as they were; the next
forward on the cache first commits the rows that were kept (`_settle`).

Gemma 3 departs from this in a few places, all set by the config: embeddings × sqrt(H); (1 + w) norms (the
loader folds the 1 in); the attention and MLP outputs are normalised before the residual add (y = a·Wo;
x += rmsnorm(y), the same after the MLP); gelu_tanh(g)·u instead of silu(g)·u; scores scaled by
query_pre_attn_scalar^-1/2; sliding-window layers, with their own RoPE base, see only the last W positions.

Gemma 4 adds, again from the config: head_dim (and the qkv width, and a cache shape) per layer; partial RoPE on
full layers (a table whose last frequencies are 0: ops/rope.py); v heads normalised beside q and k; the last
num_kv_shared_layers layers project q only and attend over an earlier layer's cache (`kv_source`), writing
none; per-layer inputs, computed once after the embedding
    pli = (rmsnorm(x·Wp^T / sqrt(H)) + E_ple[ids]·sqrt(P)) / sqrt(2)      [T, L·P]
and added at the end of every layer, x += rmsnorm((act(x·Wg^T) * pli[:, layer])·Wpp^T), whose add (or the MLP's,
without them) is multiplied by the layer's layer_scalar.

Shapes (T = new tokens in this call, at most `max_rows`; H hidden; Q = n_heads·hd; KV = n_kv_heads·hd):
    x, xn, y [T, H]   qkv [T, Q + 2·KV] laid out [q | k | v]   attn [T, Q]   gate_up [T, 2F]
    logits [L, V] with L = 1 ("last") or T ("all", T ≤ max_logit_rows)

The RMSNorms before the projections run inside them (Linear's `norm`, the final norm too; xn and xn_head are
only written when a long prefill takes the tiled GEMM on a GPU), and the down projection computes silu(g)·u
as it loads gate_up (Linear's `glu`; act is only written by prefills of more than 16 rows), and
attention applies RoPE and writes the cache itself for decode and verification calls (ops/attention.py; a
prefill's rope dispatch goes first): a decode step is 5 dispatches per layer plus 2. All buffers and bind
groups are created once here; a forward only sets uniforms (rows, positions) and records dispatches. Ops bound
to a KV cache (cache write, attention) are built once per cache. `record_batch` runs several sequences' rows in
one forward, each segment of rows attending over its own cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import CapacityError, GenerationOptionError
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.recorder import Recorder, Tape
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.uniforms import UniformSlot
from doppler_py.model.adapters import Adapters
from doppler_py.model.kv_arena import BLOCK, KVArena, KVSlab
from doppler_py.model.kv_cache import KVCache
from doppler_py.model.loader import LayerWeights, ModelWeights
from doppler_py.ops.attention import (
    Attention,
    BatchedAttention,
    PagedSegment,
    paged_layout_capacity,
    paged_max_rows,
)
from doppler_py.ops.elementwise import LogitSoftCap, PerLayerGate, SigmoidGate
from doppler_py.ops.embedding import Embedding
from doppler_py.ops.kv_compact import KVCompact
from doppler_py.ops.linear import (
    LONG_PROMPT_ROWS,
    REGISTER_TILED_MAX_ROWS,
    GatedInput,
    InputNorm,
    Linear,
    compile_at_once,
)
from doppler_py.ops.linear_attention import (
    GatedDeltaNet,
    LayerState,
    RecurrentState,
    l2_norm_weight,
    recurrent_bytes,
)
from doppler_py.ops.norms import HeadRMSNorm, RMSNorm
from doppler_py.ops.rope import rope_table
from doppler_py.ops.tree import MAX_TREE_ROWS

LOGITS_MODES = ("last", "all", "none")


@dataclass
class _LayerOps:
    qkv: Linear  # normalises x first (input_layernorm); a linear-attention layer's input projection, into mix
    qk_norm: HeadRMSNorm | None  # q_norm / k_norm of every head, in place in qkv (Qwen3, Gemma 3)
    o: Linear  # into x (residual add), or into y when post_attn normalises it
    post_attn: RMSNorm | None  # x += rmsnorm(y) (Gemma post_attention_layernorm)
    gate_up: Linear  # normalises x first (LLaMA post_attention_layernorm, Gemma pre_feedforward_layernorm)
    down: Linear  # silu(gate)·up from gate_up, into x, or into y when post_mlp normalises it
    post_mlp: RMSNorm | None  # x += rmsnorm(y) (Gemma post_feedforward_layernorm)
    linear: bool = False  # a Gated DeltaNet layer: its cache op is a GatedDeltaNet, o reads core
    attn_gate: Linear | None = None  # gate = rmsnorm(x)·Wgate (Qwen 3.5 attention layers)
    gate: SigmoidGate | None = None  # attn *= sigmoid(gate)
    # Gemma 4's per-layer input: ple = x·Wg^T; ple = act(ple) * pli[:, layer]; y = ple·Wpp^T; x += rmsnorm(y)
    per_layer: tuple[Linear, PerLayerGate, Linear, RMSNorm] | None = None


@dataclass(frozen=True)
class Segment:
    """One sequence's rows in a forward: rows row0..row0+rows-1 of the activations, at positions start_pos..,
    attending through `attention` (its cache's ops); `tree`: the rows are a token tree laid out in `tree` (at most
    one such segment per forward: the layout tensor is one)."""

    attention: list[Attention | GatedDeltaNet]
    rows: int
    start_pos: int
    row0: int = 0
    tree: bool = False


@dataclass(frozen=True)
class Paged:
    """The segments of a batched forward whose attention runs once per layer (`Transformer._pageable`): each
    attention layer's batched op over their slab, the segments its layout lists, and their indices."""

    ops: list[BatchedAttention | None]
    listed: list[PagedSegment]  # as the layout lists them
    segments: frozenset[int]


@dataclass
class _ForwardTape:
    """A recorded forward to play again (`Recorder.play_tape`): the slots its attention (and rope) dispatches
    used, per attention group (window, head dim, KV sharing) and kind of slot, take each play's positions; every
    other uniform is as captured."""

    tape: Tape
    positioned_slots: dict[tuple[tuple, str], list[UniformSlot]]


MAX_TAPES = 64  # forwards kept for playing again (keys: rows, logits, layers, cache, phase, attention grids)


def _rope_key(theta: float, scaling: dict | None, head_dim: int) -> tuple:
    return (theta, tuple(sorted((scaling or {}).items())), head_dim)


class Transformer:
    """A loaded model ready to run forward passes over any number of new tokens."""

    def __init__(
        self,
        weights: ModelWeights,
        registry: KernelRegistry,
        *,
        max_rows: int = 64,
        max_logit_rows: int = 32,
        max_positions: int | None = None,
    ):
        cfg = weights.config
        self.config = cfg
        self.weights = weights
        self.registry = registry
        self.gpu = registry.gpu
        self.max_rows = max_rows
        self.max_logit_rows = min(max_logit_rows, max_rows)
        self.max_positions = max_positions or cfg.max_position_embeddings
        gpu, h = self.gpu, cfg.hidden_size
        n_layers = len(weights.layers)
        # Buffers hold the widest layer's rows; each layer's ops use its own row widths (Gemma 4's vary).
        self.q_size = max(cfg.num_attention_heads * cfg.layer_head_dim(i) for i in range(n_layers))
        qkv_width = max(self._qkv_width(i) for i in range(n_layers))
        ffn, vocab = max(cfg.layer_intermediate_size(i) for i in range(n_layers)), cfg.vocab_size

        self.ids = Tensor.empty(gpu, max_rows, "u32", "ids")
        self.tree = Tensor.empty(gpu, (MAX_TREE_ROWS, 2), "u32", "tree layout")  # ops/tree.py; `tree=True` calls
        self.x = Tensor.empty(gpu, (max_rows, h), "f32", "x")
        self.xn = Tensor.empty(gpu, (max_rows, h), "f32", "xn")
        # A sub-block's output before its norm and residual add (Gemma); without those norms, nothing uses it.
        self.y = Tensor.empty(gpu, (max_rows, h) if cfg.sandwich_norms else (1, 4), "f32", "y")
        self.qkv = Tensor.empty(gpu, (max_rows, qkv_width), "f32", "qkv")
        self.attn = Tensor.empty(gpu, (max_rows, self.q_size), "f32", "attn")
        self.gate_up = Tensor.empty(gpu, (max_rows, 2 * ffn), "f32", "gate_up")
        self.act = Tensor.empty(gpu, (max_rows, ffn), "f32", "act")  # silu(gate)·up, only for long prefills
        # Qwen 3.5: the linear layers' input projection rows and output (before Wout), the attention gate.
        shape = cfg.linear_attention
        self.mix = Tensor.empty(gpu, (max_rows, shape.mix_width) if shape else (1, 4), "f32", "mix")
        self.core = Tensor.empty(gpu, (max_rows, shape.value_width) if shape else (1, 4), "f32", "core")
        self.l2_weight = Tensor.from_numpy(gpu, l2_norm_weight(shape) if shape else np.zeros(4, np.float32), "f32")
        self.gate = Tensor.empty(gpu, (max_rows, self.q_size) if cfg.attention_gate else (1, 4), "f32", "gate")
        self.x_last = Tensor.empty(gpu, (1, h), "f32", "x_last")
        self.xn_head = Tensor.empty(gpu, (self.max_logit_rows, h), "f32", "xn_head")
        self.logits = Tensor.empty(gpu, (self.max_logit_rows, vocab), "f32", "logits")
        # Gemma 4's per-layer inputs [T, L·P] and the projection they start from; a layer's gate [T, P].
        per_layer = cfg.hidden_size_per_layer_input
        pli_shape = (max_rows, cfg.num_hidden_layers * per_layer) if per_layer else (1, 4)
        self.pli = Tensor.empty(gpu, pli_shape, "f32", "per-layer inputs")
        self.pli_proj = Tensor.empty(gpu, pli_shape, "f32", "per-layer projection")
        self.ple = Tensor.empty(gpu, (max_rows, per_layer) if per_layer else (1, 4), "f32", "per-layer gate")

        gpu.check_buffer_size(
            self.max_positions * max(cfg.layer_head_dim(i) for i in range(n_layers)) * 4,
            f"the RoPE table for {self.max_positions} positions",
            advice="load the model with a smaller max_seq",
        )
        # One cos/sin table per RoPE the layers use (Gemma 3: global and sliding layers differ; Gemma 4: their head
        # dims too); layer i's is rope_tables[layer_rope[i]].
        self.layer_rope = [(*cfg.layer_rope(i), cfg.layer_head_dim(i)) for i in range(n_layers)]
        self.rope_tables: dict[tuple, Tensor] = {}
        for theta, scaling, hd in self.layer_rope:
            key = _rope_key(theta, scaling, hd)
            if key not in self.rope_tables:
                table = rope_table(hd, self.max_positions, theta, scaling, cfg.rotary_dim)
                self.rope_tables[key] = Tensor.from_numpy(gpu, table, "f32", f"rope {theta:g}")
        self.embed = Embedding(registry, weights.embed, self.ids, self.x, max_rows=max_rows, scale=cfg.embed_scale)
        self.per_layer_inputs = self._per_layer_input_ops() if per_layer else None
        self.layers = [self._layer_ops(i, lw) for i, lw in enumerate(weights.layers)]
        # Final norm + LM head over the first rows of x ("all", and "last" of a one-row forward) or over the last
        # row copied into x_last ("last" of a longer forward).
        final_norm = InputNorm(weights.norm, cfg.rms_norm_eps, self.xn_head)
        self.lm_head = Linear(
            registry, weights.lm_head, self.x, self.logits, max_rows=self.max_logit_rows, norm=final_norm
        )
        self.lm_head_last = Linear(registry, weights.lm_head, self.x_last, self.logits, max_rows=1, norm=final_norm)
        self.logit_softcap = None
        if cfg.final_logit_softcapping:
            self.logit_softcap = LogitSoftCap(
                registry, self.logits, vocab=vocab, max_rows=self.max_logit_rows, cap=cfg.final_logit_softcapping
            )
        self._cache_ops: dict[int, tuple[KVCache, list[Attention]]] = {}
        self._compactors: dict[int, tuple[KVCache, list[KVCompact]]] = {}
        # Per arena slab: its layout words' tensor and each attention layer's batched op over it (None: a linear
        # layer), for batched forwards whose sequences all sit in that slab.
        self._paged: dict[int, tuple[KVSlab, Tensor, list[BatchedAttention | None]]] = {}
        # The first layer of each attention group: all layers of one window (0: full attention), head dim and
        # KV sharing share their attention uniforms' values in a call (Qwen 3.5's linear layers are in none).
        self._layer_group = [
            (cfg.layer_window(i), cfg.layer_head_dim(i), cfg.kv_source(i) != i) for i in range(n_layers)
        ]
        self._group_layers: dict[tuple, int] = {}
        for i, group in enumerate(self._layer_group):
            if not cfg.is_linear(i):
                self._group_layers.setdefault(group, i)
        # Cache layer of each attention layer's K/V: the caches hold the layers that write their own (`kv_source`).
        owners = sorted({cfg.kv_source(i) for i in range(n_layers) if not cfg.is_linear(i)})
        self._cache_layer = [-1 if cfg.is_linear(i) else owners.index(cfg.kv_source(i)) for i in range(n_layers)]
        self._cache_shapes = [(cfg.layer_num_kv_heads(i), cfg.layer_head_dim(i)) for i in owners]
        # State index of each linear-attention layer (Qwen 3.5) in a cache's `recurrent.layers`.
        linear = [i for i in range(n_layers) if cfg.is_linear(i)]
        self._state_layer = {layer: j for j, layer in enumerate(linear)}
        self._tapes: dict[tuple, _ForwardTape] = {}
        # Forwards recorded so far: whoever keeps rows of the activations (`speculative.batch`) knows from it
        # whether another forward has overwritten them since.
        self.forwards = 0
        self._generation_rows: set[tuple[int, bool]] = set()  # (row count, small tiles) `compile_generation` compiled
        self._small_tile_prompt_rows = 0  # the prompt rows `compile_generation` gave the small tiles so far
        # Layer index → [max_rows, H]: that layer's output (the residual stream after it) for the rows of the
        # latest forward that ran it (`tap_layers`).
        self.taps: dict[int, Tensor] = {}
        # LoRA adapters by name; a row uses its cache's (`KVCache.adapter`), and a forward with none costs nothing.
        self.adapters = Adapters(self)
        self.closed = False

    def forget_tapes(self) -> None:
        """Drop the recorded forwards (`Recorder.play_tape`): what a forward dispatches changed."""
        self._tapes.clear()

    def tap_layers(self, layers: Sequence[int]) -> None:
        """From now on keep the outputs of `layers` (0-based) for every forward's rows in `self.taps`: an EAGLE-3
        head reads them beside the final residual stream. Taps asked for earlier stay (a target may serve
        several drafters)."""
        for layer in layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < len(self.layers):
                raise GenerationOptionError(f"no layer {layer!r} to tap: the model has {len(self.layers)} layers")
            if layer not in self.taps:
                h = self.config.hidden_size
                self.taps[layer] = Tensor.empty(self.gpu, (self.max_rows, h), "f32", f"tap {layer}")
                self._tapes.clear()  # recorded without the new copy

    @property
    def feature_buffers(self) -> list[Tensor]:
        """The per-row features a drafter may read after a forward: x (the final residual stream), then the
        taps in layer order. Rows of all of them move together (tree compaction, plain batches)."""
        return [self.x, *(self.taps[layer] for layer in sorted(self.taps))]

    def _qkv_width(self, layer: int) -> int:
        """Floats in a qkv row of `layer`: [q | k | v], or q alone on a KV-shared layer."""
        cfg = self.config
        hd = cfg.layer_head_dim(layer)
        kv = 0 if cfg.kv_source(layer) != layer else 2 * cfg.layer_num_kv_heads(layer) * hd
        return cfg.num_attention_heads * hd + kv

    def _per_layer_input_ops(self) -> tuple[Embedding, Linear, RMSNorm]:
        """pli = E_ple[ids]·sqrt(P)/sqrt(2); pli_proj = x·Wp^T; pli += rmsnorm(pli_proj)·w/sqrt(2) over each
        layer's P floats. transformers normalises x·Wp^T / sqrt(H): rmsnorm(z / s) = rmsnorm(z) with eps·s² for
        eps, exactly, so the norm takes eps·H and the projection stays as stored."""
        cfg, w, rows = self.config, self.weights, self.max_rows
        per_layer, layers = cfg.hidden_size_per_layer_input, cfg.num_hidden_layers
        scale = float(np.float32(np.float32(per_layer**0.5) * np.float32(2**-0.5)))
        return (
            Embedding(self.registry, w.per_layer_embed, self.ids, self.pli, max_rows=rows, scale=scale),
            Linear(self.registry, w.per_layer_projection, self.x, self.pli_proj, max_rows=rows),
            RMSNorm(
                self.registry,
                self.pli_proj,
                w.per_layer_projection_norm,
                self.pli,
                dim=per_layer,
                eps=cfg.rms_norm_eps * cfg.hidden_size,
                max_rows=rows * layers,
                accumulate=True,
            ),
        )

    def _layer_ops(self, i: int, lw: LayerWeights) -> _LayerOps:
        cfg, reg, rows, eps = self.config, self.registry, self.max_rows, self.config.rms_norm_eps
        if lw.linear is not None:
            return _LayerOps(
                qkv=Linear(reg, lw.qkv, self.x, self.mix, max_rows=rows, norm=InputNorm(lw.attn_norm, eps, self.xn)),
                qk_norm=None,
                o=Linear(reg, lw.o, self.core, self.x, max_rows=rows, accumulate=True),
                post_attn=None,
                gate_up=self._gate_up(lw),
                down=self._down(lw, self.x),
                post_mlp=None,
                linear=True,
            )
        # Gemma normalises the o and down outputs (in y) before adding them to x; LLaMA adds them directly.
        out = self.y if cfg.sandwich_norms else self.x
        # Gemma 4's layer_scalar multiplies the layer's last add to x: the per-layer input's, else the MLP's.
        last_norm = lw.per_layer_norm if lw.per_layer_norm is not None else lw.post_mlp_norm

        def post_norm(weight: Tensor | None) -> RMSNorm | None:
            if weight is None:
                return None
            scale = lw.layer_scalar if weight is last_norm else 1.0
            return RMSNorm(
                reg,
                self.y,
                weight,
                self.x,
                dim=cfg.hidden_size,
                eps=eps,
                max_rows=rows,
                accumulate=True,
                out_scale=scale,
            )

        hd, shared = cfg.layer_head_dim(i), cfg.kv_source(i) != i
        kv_heads = 0 if shared else cfg.layer_num_kv_heads(i)
        qk_norm = None
        if lw.qk_norm is not None:
            qk_norm = HeadRMSNorm(
                reg,
                self.qkv,
                lw.qk_norm,
                q_heads=cfg.num_attention_heads,
                k_heads=kv_heads,
                v_heads=kv_heads if cfg.v_norm else 0,
                head_dim=hd,
                row_stride=self._qkv_width(i),
                eps=eps,
                max_rows=rows,
            )
        per_layer = None
        if lw.per_layer_gate is not None:
            per_layer = (
                Linear(reg, lw.per_layer_gate, self.x, self.ple, max_rows=rows),
                PerLayerGate(
                    reg,
                    self.pli,
                    self.ple,
                    width=cfg.hidden_size_per_layer_input,
                    layer=i,
                    n_layers=cfg.num_hidden_layers,
                    max_rows=rows,
                    activation=cfg.hidden_act,
                ),
                Linear(reg, lw.per_layer_proj, self.ple, self.y, max_rows=rows),
                post_norm(lw.per_layer_norm),
            )
        return _LayerOps(
            qkv=Linear(
                reg,
                lw.qkv,
                self.x,
                self.qkv,
                max_rows=rows,
                bias=lw.qkv_bias,
                norm=InputNorm(lw.attn_norm, eps, self.xn),
            ),
            qk_norm=qk_norm,
            o=Linear(reg, lw.o, self.attn, out, max_rows=rows, bias=lw.o_bias, accumulate=out is self.x),
            post_attn=post_norm(lw.post_attn_norm),
            gate_up=self._gate_up(lw),
            down=self._down(lw, out),
            post_mlp=post_norm(lw.post_mlp_norm),
            attn_gate=None
            if lw.attn_gate is None
            else Linear(
                reg, lw.attn_gate, self.x, self.gate, max_rows=rows, norm=InputNorm(lw.attn_norm, eps, self.xn)
            ),
            gate=None
            if lw.attn_gate is None
            else SigmoidGate(reg, self.gate, self.attn, width=self.q_size, max_rows=rows),
            per_layer=per_layer,
        )

    def _gate_up(self, lw: LayerWeights) -> Linear:
        norm = InputNorm(lw.mlp_norm, self.config.rms_norm_eps, self.xn)
        return Linear(self.registry, lw.gate_up, self.x, self.gate_up, max_rows=self.max_rows, norm=norm)

    def _down(self, lw: LayerWeights, out: Tensor) -> Linear:
        glu = GatedInput(self.config.hidden_act, self.act)
        return Linear(
            self.registry, lw.down, self.gate_up, out, max_rows=self.max_rows, accumulate=out is self.x, glu=glu
        )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def prefill_layers(self) -> int | None:
        """The layers a prefill must run when nobody reads its rows' outputs (`num_layers`): those that write K/V.
        Gemma 4's KV-shared layers write none, so a prefill may stop before them, as transformers' does
        (`_maybe_slice_kv_shared_inputs`); None (every layer) for models without them."""
        first_shared = self.config.num_hidden_layers - self.config.num_kv_shared_layers
        return first_shared if first_shared < self.num_layers else None

    def linears(self) -> list[Linear]:
        """Every matmul of the model (each layer's four, Qwen 3.5's attention gates, Gemma 4's per-layer input ones,
        then the LM head's two), e.g. to compile ahead of use."""
        layers = []
        for layer in self.layers:
            layers += [layer.qkv, layer.o, layer.gate_up, layer.down]
            if layer.attn_gate:
                layers.append(layer.attn_gate)
            if layer.per_layer:
                layers += [layer.per_layer[0], layer.per_layer[2]]
        first = [self.per_layer_inputs[1]] if self.per_layer_inputs else []
        return [*first, *layers, self.lm_head, self.lm_head_last]

    def compile_generation(self, prompt_rows: int) -> None:
        """Compile, several at once (`compile_at_once`), the matmul pipelines a generation runs first: its prefill's
        chunks of `prompt_rows` rows in all, then plain steps with the last row's logits. On a CPU adapter the
        prompts run in the small row tiles until they add up to LONG_PROMPT_ROWS rows (`row_tile`: the 8-row tiles
        cost more to compile than they save on fewer rows); the prompt that would pass that compiles its own tiles,
        so a long-lived process (`chat`, `serve`) does not prefill in small tiles for good."""
        small = self._small_tile_prompt_rows + prompt_rows < LONG_PROMPT_ROWS
        if small:
            self._small_tile_prompt_rows += prompt_rows
        chunks = {min(self.max_rows, prompt_rows - begin) for begin in range(0, prompt_rows, self.max_rows)}
        rows = sorted({(n, small) for n in {*chunks, 1}} - self._generation_rows)
        if not rows:
            return
        heads = (self.lm_head, self.lm_head_last)  # prefill chunks need no logits, plain steps the last row's
        layers = [linear for linear in self.linears() if linear not in heads]
        calls = [(linear, n) for n, _ in rows for linear in layers]
        compile_at_once([*calls, (self.lm_head_last, 1)], small_tiles=small)
        self._generation_rows.update(rows)

    @property
    def hybrid(self) -> bool:
        """Whether some layers keep a recurrent state (Qwen 3.5), which cannot go back to an earlier position."""
        return self.config.linear_attention is not None

    # -- KV caches -------------------------------------------------------------------------------------
    @property
    def rows_alone(self) -> int:
        """The most rows a forward may take with each row's result the one it gets in a forward of its own: every
        row count runs the register matmul kernels on CPU adapters, which compute each row alone; GPUs switch to
        the tiled GEMM past REGISTER_TILED_MAX_ROWS, whose sums round differently."""
        if any(linear.tiled_gemm for linear in self.linears()):
            return min(self.max_rows, REGISTER_TILED_MAX_ROWS)
        return self.max_rows

    def new_arena(self, limit_bytes: int | None = None) -> KVArena:
        """An arena for the caches of generations that batch (`new_cache(arena=)`), its slabs within `limit_bytes`
        of K/V when a KV budget applies."""
        per_position = 2 * 4 * sum(heads * dim for heads, dim in self._cache_shapes)
        limit = None if limit_bytes is None else limit_bytes // per_position
        return KVArena(self.gpu, self._cache_shapes, limit_positions=limit)

    def new_cache(self, max_seq: int | None = None, arena: KVArena | None = None) -> KVCache:
        """A cache for the layers that write their own K/V (all but Gemma 4's KV-shared ones), each its shape; with
        `arena`, a run of one of its slabs, so that batched forwards attend over it with the other sequences'."""
        max_seq = min(max_seq or self.max_positions, self.max_positions)
        shapes = self._cache_shapes
        cache = KVCache(self.gpu, len(shapes), max_seq, *shapes[0], layer_shapes=shapes, arena=arena)
        if self.config.linear_attention is not None:
            cache.recurrent = RecurrentState(
                self.gpu, self.config.linear_attention, len(self._state_layer), self.max_rows
            )
        return cache

    def cache_bytes(self, max_seq: int | None = None) -> int:
        """`new_cache(max_seq).nbytes` without making the cache (what a generation's cache will take)."""
        max_seq = min(max_seq or self.max_positions, self.max_positions)
        nbytes = 2 * 4 * max_seq * sum(heads * dim for heads, dim in self._cache_shapes)
        if self.config.linear_attention is not None:
            nbytes += recurrent_bytes(self.config.linear_attention, len(self._state_layer), self.max_rows)
        return nbytes

    def attention_ops(self, cache: KVCache) -> list[Attention]:
        """Each layer's attention over `cache` (RoPE and the cache write included), built once per cache."""
        entry = self._cache_ops.get(id(cache))
        if entry is None or entry[0] is not cache:
            ops = [
                self._linear_op(cache, cache.recurrent.layers[self._state_layer[i]], i)
                if layer.linear and cache.recurrent is not None
                else self._attention_op(cache, i)
                for i, layer in enumerate(self.layers)
            ]
            entry = (cache, ops)
            self._cache_ops[id(cache)] = entry
            self._drop_tapes(cache)  # a cache that was not released may have left tapes under the same id
        return entry[1]

    def _attention_op(self, cache: KVCache, layer: int) -> Attention:
        cfg, cache_layer = self.config, self._cache_layer[layer]
        return Attention(
            self.registry,
            self.qkv,
            cache.keys[cache_layer],
            cache.values[cache_layer],
            self.attn,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.layer_num_kv_heads(layer),
            head_dim=cfg.layer_head_dim(layer),
            max_seq=cache.max_seq,
            max_rows=self.max_rows,
            window=cfg.layer_window(layer),
            scale=cfg.attention_scale,
            rope=self.rope_tables[_rope_key(*self.layer_rope[layer])],
            softcap=cfg.attn_logit_softcapping or 0.0,
            tree=self.tree,
            kv_shared=cfg.kv_source(layer) != layer,
        )

    def _linear_op(self, cache: KVCache, state: LayerState, layer: int) -> GatedDeltaNet:
        """Layer `layer`'s Gated DeltaNet over `cache`'s recurrent state for it."""
        assert cache.recurrent is not None and self.config.linear_attention is not None
        weights = self.weights.layers[layer].linear
        assert weights is not None
        return GatedDeltaNet(
            self.registry,
            self.config.linear_attention,
            state,
            cache.recurrent.order,
            mix=self.mix,
            out=self.core,
            conv=weights.conv,
            gates=weights.gates,
            l2_weight=self.l2_weight,
            tree=self.tree,
            eps=self.config.rms_norm_eps,
            max_rows=self.max_rows,
        )

    def _settle(self, rec: Recorder, cache: KVCache, start_pos: int) -> None:
        """Before a forward at start_pos: commit the rows of the cache's previous forward that were kept (the
        cache was truncated to start_pos since) into its recurrent states (hybrid models; nothing otherwise)."""
        state = cache.recurrent
        if state is None:
            return
        kept = state.rows_kept(start_pos)
        if kept:
            for op in self.attention_ops(cache)[: state.pending_layers]:
                if isinstance(op, GatedDeltaNet):
                    op.record_commit(rec, kept, state.ordered)
        state.committed(start_pos)

    def settle(self, cache: KVCache) -> None:
        """Commit the rows of the cache's last forward that it kept (up to its length) into its recurrent states
        now, so that they hold the state at `cache.length` (before copying it); nothing for other models."""
        if cache.recurrent is not None and cache.recurrent.pending is not None:
            rec = self.registry.recorder()
            self._settle(rec, cache, cache.length)
            rec.submit()

    def compact(self, rec: Recorder, cache: KVCache, start_pos: int, moves: Sequence[tuple[int, int]]) -> None:
        """Record a token tree's compaction in every layer of `cache`: (source row, destination row) moves
        relative to start_pos (`ops.tree.compaction_moves`); nothing when there are none."""
        if not moves:
            return
        if cache.recurrent is not None:
            cache.recurrent.reorder(moves)
        entry = self._compactors.get(id(cache))
        if entry is None or entry[0] is not cache:
            # One op per cache row width (Gemma 4's layers differ), each over the layers of that width.
            widths: dict[int, list[tuple[Tensor, Tensor]]] = {}
            for k, v in zip(cache.keys, cache.values, strict=True):
                widths.setdefault(k.numel // cache.max_seq, []).append((k, v))
            ops = [KVCompact(self.registry, pairs, row_floats=width) for width, pairs in widths.items()]
            entry = self._compactors[id(cache)] = (cache, ops)
        for op in entry[1]:
            op.record(rec, start_pos, moves)

    def _drop_tapes(self, cache: KVCache) -> None:
        self._tapes = {key: tape for key, tape in self._tapes.items() if key[0] != id(cache)}

    def release_cache(self, cache: KVCache) -> None:
        """Free `cache` and everything built for it (ops, their scratch buffers and uniform slots)."""
        entry = self._cache_ops.pop(id(cache), None)
        self._drop_tapes(cache)
        if entry is not None and entry[0] is cache:
            for op in entry[1]:
                op.release(self.registry)
        compactor = self._compactors.pop(id(cache), None)
        if compactor is not None and compactor[0] is cache:
            for op in compactor[1]:
                op.release(self.registry)
        recurrent = cache.recurrent.tensors if cache.recurrent is not None else []
        own = cache.keys + cache.values if cache.slab is None else []  # a slab's buffers outlive its runs
        for t in own + recurrent:
            self.registry.forget_buffer(t.buffer)
        emptied = cache.close()
        if emptied is not None:
            self._release_slab(emptied)

    def release_arena(self, arena: KVArena) -> None:
        """Free an arena's slabs (its caches' runs with them) and what was built on them."""
        for slab in arena.slabs:
            self._release_slab(slab)
        arena.close()

    def _release_slab(self, slab: KVSlab) -> None:
        entry = self._paged.pop(id(slab), None)
        if entry is not None and entry[0] is slab:
            for op in entry[2]:
                if op is not None:
                    op.release(self.registry)
            self.registry.release_tensors(entry[1])
        for t in slab.keys + slab.values:
            self.registry.forget_buffer(t.buffer)

    def _paged_ops(self, slab: KVSlab) -> tuple[Tensor, list[BatchedAttention | None]]:
        """The layout tensor and per-layer batched attention over `slab` (made on its first batched forward)."""
        entry = self._paged.get(id(slab))
        if entry is None or entry[0] is not slab:
            cfg = self.config
            words = paged_layout_capacity(self.max_rows, self.max_rows, slab.blocks)  # at most a segment a row
            layout = Tensor.empty(self.gpu, words, "u32", "paged layout")
            ops: list[BatchedAttention | None] = []
            for i, layer in enumerate(self.layers):
                if layer.linear:
                    ops.append(None)
                    continue
                cache_layer = self._cache_layer[i]
                ops.append(
                    BatchedAttention(
                        self.registry,
                        self.qkv,
                        slab.keys[cache_layer],
                        slab.values[cache_layer],
                        self.attn,
                        layout,
                        n_heads=cfg.num_attention_heads,
                        n_kv_heads=cfg.layer_num_kv_heads(i),
                        head_dim=cfg.layer_head_dim(i),
                        pool_positions=slab.positions,
                        block=BLOCK,
                        max_rows=self.max_rows,
                        rope=self.rope_tables[_rope_key(*self.layer_rope[i])],
                        window=cfg.layer_window(i),
                        scale=cfg.attention_scale,
                        softcap=cfg.attn_logit_softcapping or 0.0,
                        kv_shared=cfg.kv_source(i) != i,
                    )
                )
            entry = self._paged[id(slab)] = (slab, layout, ops)
        return entry[1], entry[2]

    def _pageable(
        self, segments: Sequence[tuple[KVCache, int, int]], tree: int | None = None
    ) -> tuple[KVSlab | None, list[int]]:
        """The slab and the segments (indices) of a batched forward whose attention one dispatch per layer serves:
        those in the slab holding most of them whose own call would run as one workgroup per kv head writing its
        own keys (the "local" plan), which the batched kernel runs the same way, so each row's result is the one
        its own call gives; not the token tree `tree`, which attends with its own call, as alone. (None, []) when
        fewer than two qualify: the others attend one call each."""
        fit: dict[int, list[int]] = {}
        for n, (cache, start_pos, rows) in enumerate(segments):
            if cache.slab is None or n == tree:
                continue
            ops = self.attention_ops(cache)
            for i in self._group_layers.values():
                op = ops[i]
                if not isinstance(op, Attention) or rows > paged_max_rows(op.n_heads, op.n_kv_heads, op.head_dim):
                    break
                if op.rope_mode(rows, op.call(rows, start_pos)[1]) not in ("local", "shared"):
                    break
            else:
                fit.setdefault(id(cache.slab), []).append(n)
        chosen = max(fit.values(), key=len, default=[])
        if len(chosen) < 2:
            return None, []
        return segments[chosen[0]][0].slab, chosen

    # -- forward -----------------------------------------------------------------------------------------
    def check_ids(self, ids: Sequence[int]) -> np.ndarray:
        try:
            arr = np.asarray(ids).reshape(-1)
        except ValueError:  # ragged nesting: not a flat sequence of ids
            arr = np.full(1, None, dtype=object)
        if arr.size == 0:
            raise GenerationOptionError("no input tokens: the prompt is empty")
        if arr.dtype.kind not in "iu":  # floats would be truncated, huge ints overflow, others are not ids
            raise GenerationOptionError(
                f"token ids must be integers below the vocabulary size {self.config.vocab_size}, got {ids!r:.80}"
            )
        bad = arr[(arr < 0) | (arr >= self.config.vocab_size)]
        if bad.size:
            raise GenerationOptionError(
                f"token id {int(bad[0])} is outside the vocabulary [0, {self.config.vocab_size})"
            )
        return arr.astype(np.uint32)

    def record_forward(
        self,
        rec: Recorder,
        rows: int,
        cache: KVCache,
        start_pos: int,
        *,
        logits: str = "last",
        num_layers: int | None = None,
        embedded: bool = False,
        tree: bool = False,
    ) -> None:
        """Record one forward over `rows` tokens whose ids are already in `self.ids`.

        Writes K/V for positions start_pos..start_pos+rows-1 into `cache` and, unless logits == "none",
        the logits of the last row (or of all rows) into `self.logits`. `num_layers` runs only the first
        layers (layer-skip drafting) before the final norm and head. `embedded`: the caller already wrote the
        layer input into `self.x` (an EAGLE head, whose input mixes a token's embedding with a feature).
        `tree`: the rows are a token tree whose layout is in `self.tree` (ops/tree.py): row r at position
        start_pos + depth(r), seeing its ancestors; its K/V still go to slot start_pos + r.
        """
        if not 1 <= rows <= self.max_rows:
            raise CapacityError(f"a forward takes 1..{self.max_rows} tokens, got {rows}")
        if logits == "all" and rows > self.max_logit_rows:
            raise CapacityError(f"logits for {rows} rows requested; at most {self.max_logit_rows} per forward")
        cache.check_room(start_pos, rows)
        attention = self.attention_ops(cache)
        self._settle(rec, cache, start_pos)
        lora = self.adapters.place([(0, rows, cache.adapter)])
        self.forwards += 1
        if cache.recurrent is not None:
            cache.recurrent.ran(start_pos, rows, num_layers)
        key = None
        if rec.can_play_tapes:
            calls = {group: attention[i].call(rows, start_pos, tree=tree) for group, i in self._group_layers.items()}
            grids = tuple((group, grid) for group, (_, grid) in calls.items())
            key = (id(cache), rows, logits, num_layers, embedded, rec.phase, tree, grids, lora)
            played = self._tapes.get(key)
            if played is not None:
                played.tape.restore()
                for (group, kind), slots in played.positioned_slots.items():
                    slots[0].set(**calls[group][0][kind])
                    for slot in slots[1:]:
                        slot.view[:] = slots[0].view
                rec.play_tape(played.tape)
                cache.advance_to(max(cache.length, start_pos + rows))
                return
            rec.capture()
        try:
            segments = [Segment(attention, rows, start_pos)]
            positioned = self._record_layers(rec, rows, segments, logits, num_layers, embedded, tree, lora=lora)
        finally:
            tape = rec.end_capture() if key is not None else None
        cache.advance_to(max(cache.length, start_pos + rows))
        if tape is not None:
            if len(self._tapes) >= MAX_TAPES:
                del self._tapes[next(iter(self._tapes))]
            self._tapes[key] = _ForwardTape(tape, positioned)

    def record_batch(
        self,
        rec: Recorder,
        segments: Sequence[tuple[KVCache, int, int]],
        logit_rows: int | None = None,
        *,
        tree: int | None = None,
        bidirectional: bool = False,
    ) -> bool:
        """Record one forward over the rows of several sequences, stacked in `self.ids` in the order given: each
        (cache, start_pos, rows) segment's rows attend over its own cache (and write their K/V there), every
        matmul runs once over all rows (≤ max_rows). Writes the logits of the first `logit_rows` rows (default all;
        ≤ max_logit_rows): steps first, then prefills, which need none. `tree`: the index of the one segment whose
        rows are a token tree, its layout in `self.tree` (as `record_forward`'s). True when attention ran once per
        layer for some of them (`_pageable`). `bidirectional`: each segment's rows also see each other's later keys
        (embedding forwards of a model that asks for it, `doppler_py.embeddings`; each segment attends alone)."""
        total = sum(rows for _, _, rows in segments)
        logit_rows = total if logit_rows is None else logit_rows
        if not 1 <= total <= self.max_rows or not 0 <= logit_rows <= min(total, self.max_logit_rows):
            raise CapacityError(
                f"a batched forward takes 1..{self.max_rows} rows in all and logits for at most "
                f"{self.max_logit_rows} of them, got {total} rows and {logit_rows} logit rows"
            )
        stacked, row0, adapted = [], 0, []
        for n, (cache, start_pos, rows) in enumerate(segments):
            cache.check_room(start_pos, rows)
            if n == tree and rows > MAX_TREE_ROWS:
                raise CapacityError(f"a token tree takes at most {MAX_TREE_ROWS} rows, got {rows}")
            stacked.append(Segment(self.attention_ops(cache), rows, start_pos, row0, tree=n == tree))
            adapted.append((row0, rows, cache.adapter))
            self._settle(rec, cache, start_pos)
            row0 += rows
        lora = self.adapters.place(adapted)  # each row's adapter: its sequence's (none: no LoRA dispatch at all)
        self.forwards += 1
        paged = None
        slab, shared = (None, []) if bidirectional else self._pageable(segments, tree)
        if slab is not None:
            layout, ops = self._paged_ops(slab)
            words = [
                PagedSegment(stacked[n].row0, stacked[n].rows, stacked[n].start_pos, segments[n][0].block_table)
                for n in shared
            ]
            filled = next(op for op in ops if op is not None).layout_words(words)
            layout.view((filled.size,)).write(filled)
            paged = Paged(ops, words, frozenset(shared))
        self._record_layers(
            rec,
            total,
            stacked,
            "all",
            None,
            False,
            paged=paged,
            logit_rows=logit_rows,
            lora=lora,
            bidirectional=bidirectional,
        )
        for cache, start_pos, rows in segments:
            cache.advance_to(max(cache.length, start_pos + rows))
            if cache.recurrent is not None:
                cache.recurrent.ran(start_pos, rows)
        return paged is not None

    def run_bidirectional(self, cache: KVCache, ids: np.ndarray, out: Tensor) -> None:
        """Run the layers over one input of any length up to the cache's with every token seeing every token of it
        (embedding models that attend both ways, `doppler_py.embeddings`), leaving x after the last layer in
        `out` [len(ids), H]; no logits. A token depends on the later ones at the layer before, so an input of more
        than `max_rows` rows cannot run chunk after chunk as a causal prefill does: it runs layer by layer, each
        layer over chunks of at most max_rows rows (the shapes of any forward), keys first:

            x_all[c] = E[ids[c]]                                                           each chunk c
            each layer:  x = x_all[c]; qkv = rmsnorm(x)·Wqkv; RoPE: q rotated, k, v → cache; qkv_all[c] = qkv
                                                                                           each chunk, then
                         qkv = qkv_all[c]; attn = attention(q over cache[0 : n]); x = x_all[c]
                         x += attn·Wo; x += MLP(x); x_all[c] = x                           each chunk

        One submit per chunk and step: an op's uniform slot holds one set of values per submit. The cache holds
        the input's keys and values afterwards. Only models whose every layer is plain attention writing its own
        keys (not a hybrid, no KV-shared layers, no per-layer inputs) and without taps."""
        n, h = int(ids.size), self.config.hidden_size
        if self.hybrid or self.per_layer_inputs or self.taps:
            raise GenerationOptionError(
                "a bidirectional input longer than a forward runs on attention-only models without per-layer inputs "
                "or taps"
            )
        if out.numel < n * h:
            raise ValueError(f"run_bidirectional: out holds {out.numel} floats, needs {n} x {h}")
        cache.truncate(0)
        cache.check_room(0, n)
        ops = self.attention_ops(cache)
        widths = [self._qkv_width(i) for i in range(len(self.layers))]
        qkv_all = Tensor.empty(self.gpu, (n, max(widths)), "f32", "bidirectional qkv rows")
        chunks = [(p, min(self.max_rows, n - p)) for p in range(0, n, self.max_rows)]
        try:
            for p, rows in chunks:
                self.ids.view((rows,)).write(ids[p : p + rows].astype(np.uint32))
                rec = self.registry.recorder()
                self.embed.record(rec, rows=rows)  # embedding: x = E[ids] (· sqrt(H) for Gemma)
                rec.copy(self.x, out, rows * h * 4, dst_offset=p * h * 4)  # copy: x_all[c] = x
                rec.submit()
            for i, layer in enumerate(self.layers):
                op, width = ops[i], widths[i] * 4
                assert isinstance(op, Attention)
                for p, rows in chunks:  # every chunk's keys and values into the cache first
                    rec = self.registry.recorder()
                    rec.copy(out, self.x, rows * h * 4, src_offset=p * h * 4)  # copy: x = x_all[c]
                    self._record_qkv(rec, layer, rows, i, ())
                    op.write_keys(rec, rows, p)  # rope: q rotated in qkv; k, v → cache[p ..]
                    rec.copy(self.qkv, qkv_all, rows * width, dst_offset=p * width)  # copy: qkv_all[c] = qkv
                    rec.submit()
                for p, rows in chunks:  # then each chunk's attention over all of them, and the rest of the layer
                    rec = self.registry.recorder()
                    rec.copy(qkv_all, self.qkv, rows * width, src_offset=p * width)  # copy: qkv = qkv_all[c]
                    op.record(rec, rows, p, bidirectional=True, key_end=n)  # attention: attn = softmax(q·K)·V
                    rec.copy(out, self.x, rows * h * 4, src_offset=p * h * 4)  # copy: x = x_all[c]
                    self._record_after_attention(rec, layer, rows, i, ())
                    rec.copy(self.x, out, rows * h * 4, dst_offset=p * h * 4)  # copy: x_all[c] = x
                    rec.submit()
        finally:
            qkv_all.destroy()
        self.forwards += 1
        cache.advance_to(n)

    def _record_layers(
        self,
        rec: Recorder,
        rows: int,
        segments: Sequence[Segment],
        logits: str,
        num_layers: int | None,
        embedded: bool,
        tree: bool = False,
        *,
        paged: Paged | None = None,
        logit_rows: int | None = None,
        lora: tuple[int, ...] = (),
        bidirectional: bool = False,
    ) -> dict[tuple[tuple, str], list[UniformSlot]]:
        """Record the forward's dispatches over `rows` rows, each segment's attending over its own cache (those of
        `paged` in one dispatch per attention layer, its layout written); returns the uniform slots whose values
        depend on the positions (those of the attention and rope dispatches), per attention group and kind of slot
        (`Attention.call`). With logits "all", `logit_rows` limits the LM head to the first rows (default all). `lora`:
        the adapter slots some rows use (`Adapters.place`), whose updates follow each matmul they adapt."""
        positioned: dict[tuple[tuple, str], list[UniformSlot]] = {}
        if not embedded:
            self.embed.record(rec, rows=rows)  # embedding: x = E[ids] (· sqrt(H) for Gemma)
        if self.per_layer_inputs:
            if embedded:
                raise GenerationOptionError("Gemma 4's per-layer inputs need token ids: the model takes no embeddings")
            ple_embed, ple_proj, ple_norm = self.per_layer_inputs
            ple_embed.record(rec, rows=rows)  # embedding: pli = E_ple[ids] · sqrt(P) / sqrt(2)
            ple_proj.record(rec, rows=rows)  # matmul: pli_proj = x·Wp^T
            ple_norm.record(rec, rows=rows * self.config.num_hidden_layers)  # rmsnorm: pli += rmsnorm(pli_proj)
        adapters = self.adapters
        for i, layer in enumerate(self.layers[:num_layers]):
            if layer.linear:
                layer.qkv.record(rec, rows=rows)  # matmul: mix = rmsnorm(x)·Win
                adapters.record(rec, i, "qkv", rows, lora)  # LoRA: mix += B·A·rmsnorm(x) (adapted rows)
                for seg in segments:  # conv, norms, gated delta rule: core = the gated DeltaNet's output
                    seg.attention[i].record(rec, rows=seg.rows, tree=tree or seg.tree, row0=seg.row0)
                layer.o.record(rec, rows=rows)  # matmul: x += core·Wout
                adapters.record(rec, i, "o", rows, lora)  # LoRA: x += B·A·core
                self._record_mlp(rec, layer, rows, i, lora)
                continue
            self._record_qkv(rec, layer, rows, i, lora)
            # attention: q, k rotated (RoPE); k, v → cache; attn = softmax(q·K)·V
            alone = segments
            if paged is not None:
                batched = paged.ops[i]
                assert batched is not None
                batched.record(rec, paged.listed)  # those segments' rows, each over its own blocks: one dispatch
                alone = [seg for n, seg in enumerate(segments) if n not in paged.segments]
            for seg in alone:
                op = seg.attention[i]
                segment_tree = tree or seg.tree
                for kind, slot in op.record(
                    rec,
                    rows=seg.rows,
                    start_pos=seg.start_pos,
                    tree=segment_tree,
                    row0=seg.row0,
                    bidirectional=bidirectional,
                ):
                    positioned.setdefault((self._layer_group[i], kind), []).append(slot)
            self._record_after_attention(rec, layer, rows, i, lora)
        head_rows = rows if logit_rows is None else logit_rows
        if logits == "all" and head_rows == 0:
            logits = "none"
        if logits == "all" or (logits == "last" and rows == 1):
            self.lm_head.record(rec, rows=head_rows if logits == "all" else 1)  # matmul: logits = rmsnorm(x)·Wlm
        elif logits == "last":
            self.record_row_logits(rec, rows - 1)
            return positioned
        if self.logit_softcap is not None and logits != "none":
            self.logit_softcap.record(rec, rows=head_rows if logits == "all" else 1)  # Gemma 2: cap·tanh(logits/cap)
        return positioned

    def record_row_logits(self, rec: Recorder, row: int) -> None:
        """The logits of row `row` of x alone, into logits[0] (after a forward's layers; a forward with logits
        "last" records it for its last row, a batch for each sequence's last row in turn: its uniforms are the same
        every time, so one submit may hold several, each read before the next, e.g. copied out)."""
        row_bytes = self.config.hidden_size * 4
        rec.copy(self.x, self.x_last, row_bytes, src_offset=row * row_bytes)  # copy: x_last = x[row]
        self.lm_head_last.record(rec, rows=1)  # matmul: logits = rmsnorm(x[row])·Wlm
        if self.logit_softcap is not None:
            self.logit_softcap.record(rec, rows=1)  # Gemma 2: logits = cap·tanh(logits/cap)

    def _record_qkv(self, rec: Recorder, layer: _LayerOps, rows: int, i: int, lora: tuple[int, ...]) -> None:
        """An attention layer's projection of x into [q | k | v] rows, before attention."""
        layer.qkv.record(rec, rows=rows)  # matmul: qkv = rmsnorm(x)·Wqkv (+ b)
        self.adapters.record(rec, i, "qkv", rows, lora)  # LoRA: qkv += B·A·rmsnorm(x) (adapted rows)
        if layer.qk_norm:
            layer.qk_norm.record(rec, rows=rows)  # rmsnorm: each q and k head of qkv, in place

    def _record_after_attention(
        self, rec: Recorder, layer: _LayerOps, rows: int, i: int, lora: tuple[int, ...]
    ) -> None:
        """An attention layer's rest after attention wrote attn: its output projection into x, then the MLP."""
        if layer.attn_gate is not None and layer.gate is not None:
            layer.attn_gate.record(rec, rows=rows)  # matmul: gate = rmsnorm(x)·Wgate
            self.adapters.record(rec, i, "attn_gate", rows, lora)  # LoRA: gate += B·A·rmsnorm(x)
            layer.gate.record(rec, rows=rows)  # attn *= sigmoid(gate)
        layer.o.record(rec, rows=rows)  # matmul: x += attn·Wo (Gemma: y = attn·Wo)
        self.adapters.record(rec, i, "o", rows, lora)  # LoRA: x (Gemma: y) += B·A·attn
        if layer.post_attn:
            layer.post_attn.record(rec, rows=rows)  # rmsnorm: x += rmsnorm(y)
        self._record_mlp(rec, layer, rows, i, lora)

    def _record_mlp(self, rec: Recorder, layer: _LayerOps, rows: int, i: int, lora: tuple[int, ...]) -> None:
        """The layer's MLP (and the updates of the adapters in `lora`), Gemma 4's per-layer input, and the copy of its
        output a tap keeps."""
        layer.gate_up.record(rec, rows=rows)  # matmul: gate_up = rmsnorm(x)·[Wg; Wu]
        self.adapters.record(rec, i, "gate_up", rows, lora)  # LoRA: gate_up += B·A·rmsnorm(x)
        layer.down.record(rec, rows=rows)  # matmul: x += (silu(gate)·up)·Wd (Gemma: gelu_tanh; into y)
        self.adapters.record(rec, i, "down", rows, lora)  # LoRA: x (Gemma: y) += B·A·(silu(gate)·up)
        if layer.post_mlp:
            layer.post_mlp.record(rec, rows=rows)  # rmsnorm: x += rmsnorm(y) (Gemma 4: then · layer_scalar)
        if layer.per_layer:
            gate, gated, proj, norm = layer.per_layer
            gate.record(rec, rows=rows)  # matmul: ple = x·Wg^T
            gated.record(rec, rows=rows)  # ple = gelu_tanh(ple) * pli[:, i]
            proj.record(rec, rows=rows)  # matmul: y = ple·Wpp^T
            norm.record(rec, rows=rows)  # rmsnorm: x = (x + rmsnorm(y)) · layer_scalar
        if i in self.taps:
            rec.copy(self.x, self.taps[i], rows * self.config.hidden_size * 4)  # copy: tap_i = x

    def forward(
        self,
        ids: Sequence[int],
        cache: KVCache,
        start_pos: int | None = None,
        *,
        logits: str = "last",
        num_layers: int | None = None,
    ) -> np.ndarray | None:
        """Run the model over `ids` at `start_pos` (default: the cache length) and return logits on the host.

        Prompts longer than `max_rows` are processed in chunks. Returns [V] for "last", [T, V] for "all",
        None for "none". Use `record_forward` to keep logits on the GPU.
        """
        if logits not in LOGITS_MODES:
            raise GenerationOptionError(f"logits must be one of {LOGITS_MODES}, got {logits!r}")
        arr = self.check_ids(ids)
        pos = cache.length if start_pos is None else start_pos
        outputs = []
        chunk = self.max_logit_rows if logits == "all" else self.max_rows
        for begin in range(0, arr.size, chunk):
            part = arr[begin : begin + chunk]
            is_last = begin + chunk >= arr.size
            mode = logits if (logits == "all" or is_last) else "none"
            self.ids.view((part.size,)).write(part)
            rec = self.registry.recorder()
            self.record_forward(rec, part.size, cache, pos + begin, logits=mode, num_layers=num_layers)
            rec.submit()
            if mode != "none":
                outputs.append(self.read_logits(part.size if mode == "all" else 1))
        if logits == "none":
            return None
        return np.concatenate(outputs) if logits == "all" else outputs[-1][0]

    def read_logits(self, rows: int) -> np.ndarray:
        vocab = self.config.vocab_size
        raw = self.gpu.queue.read_buffer(self.logits.buffer, 0, rows * vocab * 4)
        return np.frombuffer(raw, dtype=np.float32).reshape(rows, vocab).copy()

    def close(self) -> None:
        """Free the KV caches and the buffers this model allocated (the weights belong to the caller)."""
        self._tapes.clear()
        self.adapters.close()
        for cache, _ in list(self._cache_ops.values()):
            self.release_cache(cache)
        for slab, _, _ in list(self._paged.values()):
            self._release_slab(slab)
        if self.closed:
            return
        self.registry.release_tensors(
            self.ids, self.tree, self.x, self.xn, self.y, self.qkv, self.attn, self.gate_up, self.act, self.x_last,
            self.xn_head, self.logits, self.mix, self.core, self.l2_weight, self.gate, self.pli, self.pli_proj,
            self.ple, *self.rope_tables.values(),
            *self.taps.values(),
        )  # fmt: skip
        self.closed = True
