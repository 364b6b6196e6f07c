"""Causal grouped-query attention of new tokens over one layer's KV cache (shaders/attention.wgsl).

One op serves decode (rows=1), speculative verification (a few rows) and prefill (hundreds of rows); the
shader header explains the work split. Per call the op picks three numbers:

* key lanes: when a call has fewer 4-query blocks than a workgroup has lane groups (decode, verification),
  several groups take turns over the keys of one block instead of idling; on CPU adapters a prefill whose
  grid would have fewer than CPU_WORKGROUPS_PER_CORE workgroups per core also trades blocks per workgroup for
  key lanes (a chat turn's ~20 rows over a long cached context: the grid then shares out evenly over the
  cores), and the shader gives a part-filled last workgroup's spare groups to key lanes as well;
* splits: for few rows over a long context the key range is also split across workgroups (flash-decoding),
  merged by a second dispatch (shaders/attention_reduce.wgsl), so a call has enough workgroups to keep
  every core busy;
* packed kv heads (CPU adapters): a short call whose blocks leave most lane groups idle gives one workgroup
  several kv heads (`packed_heads`, PACK_MAX_KEYS).

With `rope=` (the model's cos/sin table) the op takes the [q | k | v] projection rows as they leave the
matmul and also applies RoPE and writes the new keys and values to the caches, in one of three ways per call
(shaders/attention.wgsl):

* "local" (rope == 2, any adapter): when the call's grid has one workgroup per kv head (no key splits, one
  workgroup of blocks: decode and verification on CPU adapters, short contexts on GPUs), that workgroup
  writes the caches and then attends over them; no extra dispatch and no extra key pass;
* "fused" (rope == 1, GPUs): other calls of up to FUSED_ROPE_MAX_ROWS rows rotate the new keys in a second
  key pass of every workgroup; CPU adapters measured that pass slower than a rope dispatch;
* otherwise a rope.wgsl dispatch goes first (prefill: every workgroup would repeat every new key's rotation).

`fuse_rope=` overrides whether the fused path is compiled in (tests run it on lavapipe), `local_rope=False`
turns the local path off (tests of the other two).

With `kv_shared=True` (and `rope=`) the op serves a layer that attends over another layer's caches and writes
none (Gemma 4's KV-shared layers): q holds only that layer's query rows, rotated as they are loaded, in every
call ("shared", rope == 3).

A call with `bidirectional=True` (embedding models: EmbeddingGemma) lets every row see all of the call's rows'
keys, later ones included, and the cached keys before start_pos; in a sliding window, the keys less than `window`
positions away either way. Such calls take no key splits and no token tree. An input longer than a call's rows
runs in two steps per layer (`Transformer.run_bidirectional`): `write_keys` puts every chunk's keys and values in
the caches (and rotates its queries in place), then each chunk's call with `key_end` = the input's length sees
them all.

`BatchedAttention` runs one layer's attention for the rows of several sequences (segments) in ONE dispatch, each
segment's keys and values read (and its new ones written) through its block table in pools shared by all
sequences (the shader's PAGED variant); `paged_layout_words` builds the u32 words that describe the segments.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from doppler_py.errors import DeviceLimitError
from doppler_py.gpu.kernels import KernelRegistry, workgroups
from doppler_py.gpu.recorder import Recorder
from doppler_py.gpu.subgroups import smallest_subgroup_size
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.uniforms import UniformSlot
from doppler_py.ops.rope import RoPE
from doppler_py.ops.tree import MAX_TREE_ROWS

LANES = 64  # invocations per workgroup in attention.wgsl
WEBGPU_MIN_SUBGROUP = 4  # the smallest subgroup size WebGPU allows a device
STEP = 8  # keys a lane group scores per step
QUERIES_PER_BLOCK = 4
MAX_HEAD_DIM = 512
MAX_SPLITS = 16
SPLIT_MAX_ROWS = 16  # only decode/verification-sized calls split the key range; prefill has blocks enough
MIN_SPLIT_KEYS = 256  # a split scores at least this many keys (two steps of 16 key lanes)
CPU_WORKGROUPS_PER_CORE = 4  # enough that uneven workgroups (causal rows, a part-filled last one) even out
GPU_TARGET_WORKGROUPS = 256  # enough to fill the multiprocessors of a large GPU
FUSED_ROPE_MAX_ROWS = 16  # longer calls rotate and write the cache by a rope.wgsl dispatch first
# The shader's Params.rope per mode (module docstring; None: no `rope=`, q arrives rotated).
ROPE_PARAM = {None: 0, "dispatch": 0, "fused": 1, "local": 2, "shared": 3}
HEADER_WORDS = 8  # layout words of a segment's header in attention.wgsl (PAGED)
# CPU adapters: a call over fewer keys than this whose blocks leave a workgroup's lane groups mostly idle (decode,
# a k=1 verification) packs several kv heads into one workgroup, each block keeping PACKED_KEY_LANES key lanes
# (`packed_heads`): there a workgroup's fixed costs (barriers, key-lane merges) outweigh its keys, and one
# workgroup per sequence instead of one per kv head is what lets a batch's attention grow slower than its
# sequences. Past ~250 keys a core per kv head pays more (lavapipe, docs/benchmarks.md).
PACK_MAX_KEYS = 256
PACKED_KEY_LANES = 4
CHAIN = 0xFFFFFFFF  # a header's tree_at for a chain segment
NO_SPLIT = 0xFFFFFFFF  # Params.split_len of a PAGED dispatch: one split holds every key


def target_workgroups(adapter_type: str) -> int:
    """Workgroups a call should have to keep the device busy.

    A CPU adapter (lavapipe) runs one workgroup per core at a time; measured on 2 cores, splitting the keys
    of a 3-workgroup decode call did not pay for the extra reduce dispatch even at 8192 keys. A GPU needs
    hundreds of workgroups, so decode over a long context is split there.
    """
    if adapter_type.lower() == "cpu":
        return os.cpu_count() or 1
    return GPU_TARGET_WORKGROUPS


def attention_entry(registry: KernelRegistry, head_dim: int) -> str:
    """The attention.wgsl entry point for this device: "main_subgroups" (a group's partial scores added up by
    subgroup shuffles, no barriers in the key loop) on CPU adapters with subgroups when a group's head_dim / 16
    lanes are a power of two within WebGPU's smallest subgroup (head_dim 16, 32, 64); "main" (through workgroup
    memory) elsewhere. Wider groups would fit this device's subgroups but not every device's: the same pipeline
    replayed under Dawn on SwiftShader, whose subgroups hold 4 lanes, summed partial scores across groups at
    head_dim 128 and 256, and a browser may pick a narrower subgroup size than the one measured here.

    Measured on lavapipe (2 cores, SmolLM2 shapes, rope "local", per call): decode 1922 -> 1205 us at context
    2000, 489 -> 374 us at 300; 5-row verification 1224 -> 778 us at 300. GPUs keep "main": WebGPU does not
    promise there that a subgroup is a run of consecutive invocations, and it was not measured there.
    """
    slices = head_dim // 16
    if not registry.gpu.on_cpu or slices & (slices - 1) or slices > WEBGPU_MIN_SUBGROUP:
        return "main"
    return "main_subgroups" if smallest_subgroup_size(registry) >= slices else "main"


def packed_heads(keys: int, blocks: int, n_kv_heads: int, lane_groups: int, pack_max_keys: int) -> int:
    """kv heads per workgroup of a call (one key split) whose workgroup sees `keys` keys and holds `blocks` blocks
    per kv head: as many as fit with PACKED_KEY_LANES key lanes per block, when the keys are fewer than
    `pack_max_keys` (0: never) and at least two fit; else 1. attention.wgsl `packed_heads` applies the same rule."""
    if keys >= pack_max_keys or PACKED_KEY_LANES * blocks * 2 > lane_groups:
        return 1
    return min(n_kv_heads, lane_groups // (PACKED_KEY_LANES * blocks))


def context_keys(rows: int, start_pos: int, window: int, key_end: int | None = None) -> int:
    """Keys the rows of a call see over all (those before `key_end`, default start_pos + rows): a sliding window
    caps them, whatever the context, at the keys from the first row's window on."""
    end = start_pos + rows if key_end is None else key_end
    return min(end, end - start_pos - 1 + window) if window else end


def pack_max_keys(registry: KernelRegistry) -> int:
    """Params.pack_max_keys of this device's attention calls: PACK_MAX_KEYS on CPU adapters, 0 (never) on GPUs."""
    return PACK_MAX_KEYS if registry.gpu.on_cpu else 0


def call_heads(op: Attention | BatchedAttention, rows: int, start_pos: int, key_end: int | None = None) -> int:
    """kv heads per workgroup of `op`'s call (or PAGED segment) of `rows` rows at start_pos, without key splits."""
    blocks = workgroups(rows * op.group, QUERIES_PER_BLOCK)
    keys = context_keys(rows, start_pos, op.window, key_end)
    return packed_heads(keys, blocks, op.n_kv_heads, op.lane_groups, op.pack_max_keys)


def balance_workgroups(adapter_type: str) -> int:
    """Workgroups below which `plan` gives a call's blocks more key lanes, so the grid shares out evenly.

    A CPU adapter takes workgroups one at a time per core, so a grid of a few unequal workgroups leaves cores
    idle at its end: ask for CPU_WORKGROUPS_PER_CORE per core. GPUs keep the split target's own rule (the
    blocks of a call fill `target_workgroups` or not; this was not measured there), so 0: never.
    """
    if adapter_type.lower() == "cpu":
        return CPU_WORKGROUPS_PER_CORE * (os.cpu_count() or 1)
    return 0


class Attention:
    """out = causal GQA attention of `q` (rows at positions start_pos..) over `k_cache`/`v_cache`.

    Shapes (f32): q, out [max_rows, n_heads * head_dim]; k_cache, v_cache [max_seq, n_kv_heads, head_dim],
    holding keys/values for positions 0..start_pos + rows - 1 when the op runs (later positions may hold
    anything). Query head h reads kv head h // (n_heads // n_kv_heads); scores are q·k * scale (default
    1 / sqrt(head_dim)). With `window` > 0 the query at position p sees only keys in (p - window, p] (sliding-
    window layers; the cache still holds every position). head_dim must be a multiple of 16, at most 512 (Gemma 4's
    full-attention layers).

    `rope`: a `rope_table` tensor of at least max_seq positions. Then `q` holds whole [q | k | v] rows (row
    stride (n_heads + 2 * n_kv_heads) * head_dim) before RoPE, and the op rotates q and k and writes the rows'
    keys and values to the caches itself (module docstring): the caches need only hold positions before
    start_pos. `softcap` > 0 caps every score s (scaled) at softcap * tanh(s / softcap) (Gemma 2).

    `tree`: a u32 tensor of at least 2 * MAX_TREE_ROWS elements holding a token tree's layout
    (`ops.tree.layout_words`); calls with `tree=True` read it (rows at start_pos + depth, each seeing
    its ancestors; see shaders/attention.wgsl).

    A call's `row0` places its rows at rows row0..row0+rows-1 of `q` and `out`, so the rows of several
    sequences, each with its own cache and op, share the activation buffers of one forward; positions, cache
    slots and the tree layout stay indexed from the call's first row.
    """

    def __init__(
        self,
        registry: KernelRegistry,
        q: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        out: Tensor,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        max_seq: int,
        max_rows: int,
        q_row_stride: int | None = None,
        window: int = 0,
        scale: float | None = None,
        rope: Tensor | None = None,
        softcap: float = 0.0,
        fuse_rope: bool | None = None,
        local_rope: bool = True,
        tree: Tensor | None = None,
        kv_shared: bool = False,
    ):
        width = n_heads * head_dim
        # A KV-shared layer's q rows hold its queries only: its keys and values are another layer's.
        qkv_width = width if kv_shared else width + 2 * n_kv_heads * head_dim
        if kv_shared and rope is None:
            raise ValueError("kv_shared: the op rotates the queries, so it needs the rope= table")
        q_row_stride = (qkv_width if rope is not None else width) if q_row_stride is None else q_row_stride
        if rope is not None and q_row_stride != qkv_width:
            raise ValueError(
                f"q_row_stride={q_row_stride}: with rope, q holds [q | k | v] rows of exactly {qkv_width} floats"
            )
        if q_row_stride < width or q_row_stride % 4:
            raise ValueError(
                f"q_row_stride={q_row_stride} must be a multiple of 4 and at least n_heads*head_dim={width}"
            )
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads}")
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 (0 = no sliding window)")
        if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 16 in 16..{MAX_HEAD_DIM}")
        for name, tensor, need in [
            ("q", q, (max_rows - 1) * q_row_stride + width),
            ("out", out, max_rows * width),
            ("k_cache", k_cache, max_seq * n_kv_heads * head_dim),
            ("v_cache", v_cache, max_seq * n_kv_heads * head_dim),
        ]:
            if tensor.dtype != "f32" or tensor.numel < need:
                raise ValueError(f"{name}: need at least {need} f32 elements, got {tensor.numel} {tensor.dtype}")
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.group = n_heads // n_kv_heads
        self.head_dim = head_dim
        self.max_seq = max_seq
        self.max_rows = max_rows
        self.window = window
        self.lane_groups = LANES // (head_dim // 16)
        self.pack_max_keys = pack_max_keys(registry)
        adapter_type = str(registry.gpu.info.get("adapter_type", ""))
        self.target_workgroups = target_workgroups(adapter_type)
        self.balance_workgroups = balance_workgroups(adapter_type)
        self.rope: RoPE | None = None  # the rope.wgsl dispatch of calls that do not fuse it
        self.kv_shared = kv_shared
        writes = rope is not None and not kv_shared
        self.fuse_rope = writes and (not registry.gpu.on_cpu if fuse_rope is None else fuse_rope)
        self.local_rope = writes and local_rope
        if rope is not None and rope.numel < max_seq * head_dim:
            raise ValueError(f"rope: the cos/sin table covers {rope.numel // head_dim} positions, needs {max_seq}")
        if writes:
            self.rope = RoPE(
                registry,
                q,
                rope,
                k_cache,
                v_cache,
                n_heads=n_heads,
                n_kv_heads=n_kv_heads,
                head_dim=head_dim,
                max_seq=max_seq,
                max_rows=max_rows,
                tree=tree,
            )

        split_rows = min(max_rows, SPLIT_MAX_ROWS)
        self.part_acc = Tensor.empty(registry.gpu, (MAX_SPLITS, split_rows, n_heads, head_dim), label="attn partials")
        self.part_stats = Tensor.empty(registry.gpu, (MAX_SPLITS, split_rows, n_heads, 2), label="attn partial stats")
        self.bound = registry.bind(
            registry.kernel(
                "attention",
                attention_entry(registry, head_dim),
                HEAD_DIM=head_dim,
                **({"FUSED_ROPE": True} if self.fuse_rope else {}),
            ),
            params={
                "n_heads": n_heads,
                "n_kv_heads": n_kv_heads,
                "q_stride": q_row_stride // 4,
                "window": window,
                "scale": head_dim**-0.5 if scale is None else scale,
                "softcap": softcap,
                "pack_max_keys": self.pack_max_keys,
            },
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            out=out,
            part_acc=self.part_acc,
            part_stats=self.part_stats,
            cos_sin=rope if rope is not None else registry.placeholder(4),
            words=tree if tree is not None else registry.placeholder(2 * MAX_TREE_ROWS),
        )
        self.has_tree = tree is not None
        self.params = self.bound.params
        self.reduce = registry.bind(
            registry.kernel("attention_reduce", HEAD_DIM=head_dim),
            params=self.params,  # the same Params struct: one slot serves both dispatches
            part_acc=self.part_acc,
            part_stats=self.part_stats,
            out=out,
        )

    def release(self, registry: KernelRegistry) -> None:
        """Free what the op owns (partial-result buffers, uniform slots); the caches, q, out and table stay."""
        registry.release_tensors(self.part_acc, self.part_stats)
        registry.release_slot(self.params)
        if self.rope is not None:
            self.rope.release(registry)

    def plan(
        self,
        rows: int,
        start_pos: int,
        splits: int | None = None,
        *,
        bidirectional: bool = False,
        key_end: int | None = None,
    ) -> tuple[int, int, int]:
        """(key_lanes, split_len, n_splits) for a call; `splits` forces the split count (clamped). A bidirectional
        call is never split: attention_reduce combines a row's splits up to its own position only. `key_end`: the
        end of the keys a bidirectional call sees (`call`)."""
        blocks = workgroups(rows * self.group, QUERIES_PER_BLOCK)
        context = start_pos + rows if key_end is None else key_end
        keys = context_keys(rows, start_pos, self.window, key_end)
        if bidirectional:
            if splits is not None and splits > 1:
                raise ValueError(f"splits={splits}: a bidirectional call is not split")
            splits = 1
        elif splits is None:
            if rows > SPLIT_MAX_ROWS:
                splits = 1
            else:
                base = workgroups(blocks, self.lane_groups) * self.n_kv_heads
                splits = min(workgroups(self.target_workgroups, base), keys // MIN_SPLIT_KEYS)
        elif splits > 1 and rows > SPLIT_MAX_ROWS:
            raise ValueError(f"splitting the key range needs rows <= {SPLIT_MAX_ROWS}, got {rows}")
        splits = max(1, min(splits, MAX_SPLITS, context))
        split_len = workgroups(context, splits)
        key_lanes = 1
        # Double the key lanes while blocks still fill the workgroup and each lane still gets a step of keys.
        while 2 * key_lanes * blocks <= self.lane_groups and 2 * key_lanes * STEP <= min(split_len, keys):
            key_lanes *= 2
        # Then, while a prefill's grid is too coarse to share out evenly over the cores, trade blocks per workgroup
        # for key lanes (a short prefill over a long context: 23 rows of SmolLM2 fill two workgroups per kv head,
        # one of them nearly empty; the shader gives a last, part-filled workgroup's spare groups to key lanes).
        # Decode and verification keep their grid: one workgroup per kv head is what lets them write the caches
        # in place (rope_mode "local").
        while (
            rows > SPLIT_MAX_ROWS
            and workgroups(blocks, self.lane_groups // key_lanes) * self.n_kv_heads * splits < self.balance_workgroups
            and 2 * key_lanes <= self.lane_groups
            and 2 * key_lanes * STEP <= min(split_len, keys)
        ):
            key_lanes *= 2
        return key_lanes, split_len, workgroups(context, split_len)

    def call(
        self,
        rows: int,
        start_pos: int,
        splits: int | None = None,
        *,
        tree: bool = False,
        row0: int = 0,
        bidirectional: bool = False,
        key_end: int | None = None,
    ) -> tuple[dict[str, dict], tuple[int, int, int]]:
        """What a call sets, per kind of uniform slot its dispatches use ("attention", and "rope" when a rope.wgsl
        dispatch goes first), and the attention dispatch's grid (`record` records the call). `key_end`
        (bidirectional calls): the rows see every key before it, which `write_keys` has put in the caches, this
        call's rows' included, their queries rotated; the call then writes nothing (`record`)."""
        if tree and bidirectional:
            raise ValueError("a token tree attends causally: tree and bidirectional exclude each other")
        if key_end is not None and not (bidirectional and start_pos + rows <= key_end <= self.max_seq):
            raise ValueError(
                f"key_end={key_end}: a bidirectional call's keys end at or past its rows' ({start_pos + rows}) and "
                f"within the cache ({self.max_seq})"
            )
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows={rows} must be in 1..{self.max_rows}")
        if row0 < 0 or row0 + rows > self.max_rows:
            raise ValueError(f"row0={row0}: rows {row0}..{row0 + rows - 1} must lie in the op's 0..{self.max_rows - 1}")
        if tree and not (self.has_tree and rows <= MAX_TREE_ROWS):
            raise ValueError(f"a tree call needs the op's tree layout tensor and rows <= {MAX_TREE_ROWS}, got {rows}")
        if start_pos < 0 or start_pos + rows > self.max_seq:
            raise DeviceLimitError(f"positions {start_pos}..{start_pos + rows - 1} exceed the cache ({self.max_seq})")
        key_lanes, split_len, n_splits = self.plan(
            rows, start_pos, splits, bidirectional=bidirectional, key_end=key_end
        )
        blocks = workgroups(rows * self.group, QUERIES_PER_BLOCK)
        heads = call_heads(self, rows, start_pos, key_end) if n_splits == 1 else 1
        grid = (workgroups(blocks, self.lane_groups // key_lanes), workgroups(self.n_kv_heads, heads), n_splits)
        if heads > 1:
            key_lanes = 1  # the workgroup grows its key lanes for all of its heads' blocks (attention.wgsl)
        # With key_end the caches hold every key and q is rotated already (`write_keys`): nothing to rotate or write.
        rope = None if key_end is not None else self.rope_mode(rows, grid)
        values: dict[str, dict] = {
            "attention": {
                "rows": rows,
                "start_pos": start_pos,
                "key_lanes": key_lanes,
                "split_len": split_len,
                "n_splits": n_splits,
                "rope": ROPE_PARAM[rope],
                "tree": int(tree),
                "row0": row0,
                "bidirectional_end": (start_pos + rows if key_end is None else key_end) if bidirectional else 0,
            }
        }
        if rope == "dispatch":
            values["rope"] = {"start_pos": start_pos, "tree": int(tree), "row0": row0}
        return values, grid

    def rope_mode(self, rows: int, grid: tuple[int, int, int]) -> str | None:
        """How a call with this grid applies RoPE and writes the caches: "local", "fused", "dispatch", "shared"
        (module docstring), or None without `rope=`."""
        if self.kv_shared:
            return "shared"
        if self.rope is None:
            return None
        if self.local_rope and grid[0] == 1 and grid[2] == 1:
            return "local"
        if self.fuse_rope and rows <= FUSED_ROPE_MAX_ROWS:
            return "fused"
        return "dispatch"

    def record(
        self,
        rec: Recorder,
        rows: int,
        start_pos: int,
        *,
        splits: int | None = None,
        tree: bool = False,
        row0: int = 0,
        bidirectional: bool = False,
        key_end: int | None = None,
    ) -> list[tuple[str, UniformSlot]]:
        """Record attention for `rows` queries at positions start_pos..start_pos+rows-1; returns the uniform slots
        the dispatches used (the ops' own, or in a phase their copies), each with its kind as in `call`.

        `splits` forces the number of key-range splits (tests, benchmarks); None lets `plan` choose. `tree`: the
        rows are the token tree laid out in the op's tree tensor. `row0`: the rows' first row in q and out (class
        docstring). `bidirectional`: the rows also see each other's later keys (module docstring), and with `key_end`
        every key before it, put in the caches by `write_keys` (`call`).
        """
        values, grid = self.call(
            rows, start_pos, splits, tree=tree, row0=row0, bidirectional=bidirectional, key_end=key_end
        )
        used = []
        if "rope" in values:
            used.append(("rope", self.rope.record(rec, rows, start_pos, tree=tree, row0=row0)))
        self.params.set(**values["attention"])
        used.append(("attention", rec.dispatch(self.bound, *grid).params))
        if grid[2] > 1:
            reduce = rec.dispatch(self.reduce, workgroups(rows * self.n_heads * self.head_dim // 4, LANES))
            used.append(("attention", reduce.params))
        return used

    def write_keys(self, rec: Recorder, rows: int, start_pos: int) -> None:
        """Record the rope.wgsl dispatch alone: the rows' queries rotated in place in q, their keys rotated and
        their values copied into the caches at start_pos.. (an input longer than a call, before its calls with
        `key_end`; module docstring)."""
        if self.rope is None:
            raise ValueError("write_keys: the op has no rope= table (or serves a KV-shared layer): it writes no keys")
        self.rope.record(rec, rows, start_pos)


# -- several sequences in one dispatch, K/V through block tables (PAGED) --------------------------------------
@dataclass(frozen=True)
class PagedSegment:
    """One sequence's rows in a batched forward: rows row0..row0+rows-1 of q and out, at positions (cache slots)
    start_pos.. of the sequence; cache slot j lives at pool position table[j // block] * block + j % block.
    `tree`: `ops.tree.layout_words(parents)` when the rows are a token tree (slot start_pos + r, position
    start_pos + depth(r)), None for a chain."""

    row0: int
    rows: int
    start_pos: int
    table: tuple[int, ...]
    tree: np.ndarray | None = None


def paged_max_rows(n_heads: int, n_kv_heads: int, head_dim: int) -> int:
    """The most rows a segment may have so all its 4-query blocks fit one workgroup (the PAGED grid has one per
    kv head and segment); the caller runs larger segments through `Attention`."""
    lane_groups = LANES // (head_dim // 16)
    return lane_groups * QUERIES_PER_BLOCK // (n_heads // n_kv_heads)


def paged_layout_capacity(max_segments: int, max_rows: int, max_blocks_per_segment: int) -> int:
    """Words a layout tensor needs for up to `max_segments` segments of up to `max_rows` rows (trees among them)
    and `max_blocks_per_segment` table entries each."""
    tree_words = 2 * min(max_rows, MAX_TREE_ROWS)
    return max_segments * (HEADER_WORDS + tree_words + max_blocks_per_segment)


def _check_block(block: int) -> None:
    if block < 1 or block & (block - 1):
        raise ValueError(f"block={block}: positions per block must be a positive power of two")


def paged_layout_words(segments: Sequence[PagedSegment], block: int) -> np.ndarray:
    """The u32 words attention.wgsl (PAGED) reads for `segments`: a header per segment (row0, rows, start_pos,
    tree_at, table_at, 0, 0, 0), then each segment's tree layout (if any) and block table.

    Refuses segments whose rows overlap in q/out, tables too short for start_pos + rows slots or naming a block
    twice, tree layouts of another row count, and pool positions one segment writes (its rows' slots) that
    another segment reads or writes: the workgroups of one dispatch run in no defined order.
    """
    _check_block(block)
    if not segments:
        raise ValueError("paged_layout_words: no segments")
    words = np.zeros(HEADER_WORDS * len(segments), np.uint32)
    tails: list[np.ndarray] = []
    at = len(words)
    rows_taken: list[tuple[int, int, int]] = []
    reads, written, writer = [], [], []
    for s, seg in enumerate(segments):
        if seg.rows < 1 or seg.row0 < 0 or seg.start_pos < 0:
            raise ValueError(f"segment {s}: row0={seg.row0}, rows={seg.rows}, start_pos={seg.start_pos}")
        context = seg.start_pos + seg.rows
        needed = -(-context // block)
        if len(seg.table) < needed:
            raise ValueError(
                f"segment {s}: its table has {len(seg.table)} blocks, "
                f"slots 0..{context - 1} need {needed} blocks of {block}"
            )
        table = np.asarray(seg.table[:needed], np.int64)
        if (table < 0).any() or len(set(table.tolist())) < needed:
            raise ValueError(f"segment {s}: table {list(seg.table[:needed])} has a negative or repeated block id")
        for row0, end, t in rows_taken:
            if seg.row0 < end and row0 < seg.row0 + seg.rows:
                raise ValueError(f"segments {t} and {s} overlap: rows {row0}..{end - 1} and {seg.row0}..")
        rows_taken.append((seg.row0, seg.row0 + seg.rows, s))
        tree_at = CHAIN
        if seg.tree is not None:
            tree = np.asarray(seg.tree, np.uint32).reshape(-1, 2)
            if len(tree) != seg.rows or seg.rows > MAX_TREE_ROWS:
                raise ValueError(
                    f"segment {s}: a tree layout of {len(tree)} rows for {seg.rows} rows (at most {MAX_TREE_ROWS})"
                )
            tree_at = at
            tails.append(tree.reshape(-1))
            at += tree.size
        words[HEADER_WORDS * s : HEADER_WORDS * s + 5] = (seg.row0, seg.rows, seg.start_pos, tree_at, at)
        tails.append(table.astype(np.uint32))
        at += needed
        slots = np.arange(context)
        positions = table[slots // block] * block + slots % block
        reads.append(positions)
        written.append(positions[seg.start_pos :])
        writer.append(np.full(seg.rows, s))
    # A segment reads its own slots (new rows included), so this also catches two segments writing one position.
    written_all, writer_all = np.concatenate(written), np.concatenate(writer)
    for t, read in enumerate(reads):
        clash = np.isin(written_all, read) & (writer_all != t)
        if clash.any():
            raise ValueError(
                f"segment {writer_all[clash][0]} writes pool positions that segment {t} reads: "
                f"{written_all[clash][:4].tolist()} (give each sequence its own blocks for its new rows)"
            )
    return np.concatenate([words, *tails])


class BatchedAttention:
    """One layer's attention for several sequences' rows in one dispatch (shaders/attention.wgsl, PAGED).

    `q` holds the rows of every segment: [q | k | v] projection rows before RoPE (row stride (n_heads + 2 *
    n_kv_heads) * head_dim; rope "local": the dispatch rotates the queries and new keys and writes the new keys
    and values to the pools through each segment's table), or with `kv_shared` the query rows only (n_heads *
    head_dim; rope "shared": every key is already in the pools, nothing is written). `out` [max_rows, n_heads *
    head_dim]. `k_pool`, `v_pool` [pool_positions, n_kv_heads, head_dim]: every sequence's cache slots in blocks
    of `block` positions (a power of two). `layout`: a u32 tensor of `paged_layout_words` (the caller writes it
    before the submit; every layer's op may share it). `rope`: the cos/sin table (`ops.rope.rope_table`).

    Each segment's rows must fit one workgroup (`paged_max_rows`); windows and the softcap hold for every segment.
    """

    def __init__(
        self,
        registry: KernelRegistry,
        q: Tensor,
        k_pool: Tensor,
        v_pool: Tensor,
        out: Tensor,
        layout: Tensor,
        *,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        pool_positions: int,
        block: int,
        max_rows: int,
        rope: Tensor,
        window: int = 0,
        scale: float | None = None,
        softcap: float = 0.0,
        kv_shared: bool = False,
    ):
        if n_kv_heads < 1 or n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} must be a positive multiple of n_kv_heads={n_kv_heads}")
        if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
            raise ValueError(f"head_dim={head_dim} must be a multiple of 16 in 16..{MAX_HEAD_DIM}")
        if window < 0:
            raise ValueError(f"window={window} must be >= 0 (0 = no sliding window)")
        _check_block(block)
        if pool_positions < block or pool_positions % block:
            raise ValueError(f"pool_positions={pool_positions} must be a positive multiple of block={block}")
        width = n_heads * head_dim
        q_stride = width if kv_shared else width + 2 * n_kv_heads * head_dim
        for name, tensor, need in [
            ("q", q, max_rows * q_stride),
            ("out", out, max_rows * width),
            ("k_pool", k_pool, pool_positions * n_kv_heads * head_dim),
            ("v_pool", v_pool, pool_positions * n_kv_heads * head_dim),
        ]:
            if tensor.dtype != "f32" or tensor.numel < need:
                raise ValueError(f"{name}: need at least {need} f32 elements, got {tensor.numel} {tensor.dtype}")
        if layout.dtype != "u32" or layout.numel < HEADER_WORDS:
            raise ValueError(
                f"layout: need a u32 tensor of at least {HEADER_WORDS} words, got {layout.numel} {layout.dtype}"
            )
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.pool_positions, self.block, self.max_rows = pool_positions, block, max_rows
        self.max_segment_rows = paged_max_rows(n_heads, n_kv_heads, head_dim)
        self.window, self.group, self.lane_groups = window, n_heads // n_kv_heads, LANES // (head_dim // 16)
        self.pack_max_keys = pack_max_keys(registry)
        self.rope_positions = rope.numel // head_dim
        self.layout = layout
        self.bound = registry.bind(
            registry.kernel("attention", attention_entry(registry, head_dim), HEAD_DIM=head_dim, PAGED=True),
            params={
                "n_heads": n_heads,
                "n_kv_heads": n_kv_heads,
                "key_lanes": 1,  # each workgroup grows its own from its segment's blocks
                "split_len": NO_SPLIT,
                "n_splits": 1,
                "q_stride": q_stride // 4,
                "window": window,
                "scale": head_dim**-0.5 if scale is None else scale,
                "rope": ROPE_PARAM["shared" if kv_shared else "local"],
                "softcap": softcap,
                "block": block,
                "pack_max_keys": self.pack_max_keys,
            },
            q=q,
            k_cache=k_pool,
            v_cache=v_pool,
            out=out,
            # Never written with n_splits 1, but writable: two buffers, since WebGPU refuses writable aliases.
            part_acc=registry.placeholder(4),
            part_stats=registry.placeholder(2),
            cos_sin=rope,
            words=layout,
        )
        self.params = self.bound.params

    def layout_words(self, segments: Sequence[PagedSegment]) -> np.ndarray:
        """`paged_layout_words` after the checks that need this op's shapes: rows per segment, rows within q/out,
        blocks within the pools, positions within the rope table, words within the layout tensor."""
        for s, seg in enumerate(segments):
            if seg.rows > self.max_segment_rows:
                raise ValueError(
                    f"segment {s}: {seg.rows} rows, above paged_max_rows={self.max_segment_rows} "
                    "(run it through Attention)"
                )
            if seg.row0 + seg.rows > self.max_rows:
                raise ValueError(
                    f"segment {s}: rows {seg.row0}..{seg.row0 + seg.rows - 1} past max_rows={self.max_rows}"
                )
            if seg.start_pos + seg.rows > self.rope_positions:
                raise ValueError(
                    f"segment {s}: positions up to {seg.start_pos + seg.rows - 1}, "
                    f"the rope table covers {self.rope_positions}"
                )
            used = seg.table[: -(-(seg.start_pos + seg.rows) // self.block)]
            if any(b >= self.pool_positions // self.block for b in used):
                raise ValueError(
                    f"segment {s}: table names block {max(used)}, the pools hold {self.pool_positions // self.block}"
                )
        words = paged_layout_words(segments, self.block)
        if words.size > self.layout.numel:
            raise ValueError(f"layout: {words.size} words needed, the tensor holds {self.layout.numel}")
        return words

    def record(self, rec: Recorder, segments: Sequence[PagedSegment]) -> None:
        """Record the dispatch over `segments`, the first segments of the layout tensor (written by the caller from
        them): one workgroup row per kv head, or per group of kv heads where a segment packs them (each segment as
        its own `Attention` call would; the rows a segment does not need end at once)."""
        if not 1 <= len(segments) <= self.layout.numel // HEADER_WORDS:
            raise ValueError(
                f"segments={len(segments)}: the layout tensor holds headers for 1..{self.layout.numel // HEADER_WORDS}"
            )
        heads = min(call_heads(self, seg.rows, seg.start_pos) for seg in segments)
        rec.dispatch(self.bound, 1, workgroups(self.n_kv_heads, heads), len(segments))

    def release(self, registry: KernelRegistry) -> None:
        """Free the op's uniform slot; the pools, q, out, layout and rope table stay."""
        registry.release_slot(self.params)
