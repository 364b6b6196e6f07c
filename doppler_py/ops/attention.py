"""Causal grouped-query attention of new tokens over one layer's KV cache (shaders/attention.wgsl).

One op serves decode (rows=1), speculative verification (a few rows) and prefill (hundreds of rows); the
shader header explains the work split. Per call the op picks two numbers:

* key lanes: when a call has fewer 4-query blocks than a workgroup has lane groups (decode, verification),
  several groups take turns over the keys of one block instead of idling; on CPU adapters a prefill whose
  grid would have fewer than CPU_WORKGROUPS_PER_CORE workgroups per core also trades blocks per workgroup for
  key lanes (a chat turn's ~20 rows over a long cached context: the grid then shares out evenly over the
  cores), and the shader gives a part-filled last workgroup's spare groups to key lanes as well;
* splits: for few rows over a long context the key range is also split across workgroups (flash-decoding),
  merged by a second dispatch (shaders/attention_reduce.wgsl), so a call has enough workgroups to keep
  every core busy.

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
"""

from __future__ import annotations

import os

from doppler_py.errors import DeviceLimitError
from doppler_py.gpu.kernels import KernelRegistry, Recorder, UniformSlot, workgroups
from doppler_py.gpu.tensor import Tensor
from doppler_py.ops.rope import RoPE
from doppler_py.ops.tree import MAX_TREE_ROWS

LANES = 64  # invocations per workgroup in attention.wgsl
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


def target_workgroups(adapter_type: str) -> int:
    """Workgroups a call should have to keep the device busy.

    A CPU adapter (lavapipe) runs one workgroup per core at a time; measured on 2 cores, splitting the keys
    of a 3-workgroup decode call did not pay for the extra reduce dispatch even at 8192 keys. A GPU needs
    hundreds of workgroups, so decode over a long context is split there.
    """
    if adapter_type.lower() == "cpu":
        return os.cpu_count() or 1
    return GPU_TARGET_WORKGROUPS


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
            registry.kernel("attention", HEAD_DIM=head_dim, **({"FUSED_ROPE": True} if self.fuse_rope else {})),
            params={
                "n_heads": n_heads,
                "n_kv_heads": n_kv_heads,
                "q_stride": q_row_stride // 4,
                "window": window,
                "scale": head_dim**-0.5 if scale is None else scale,
                "softcap": softcap,
            },
            q=q,
            k_cache=k_cache,
            v_cache=v_cache,
            out=out,
            part_acc=self.part_acc,
            part_stats=self.part_stats,
            cos_sin=rope if rope is not None else registry.placeholder(4),
            tree=tree if tree is not None else registry.placeholder(2 * MAX_TREE_ROWS),
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

    def plan(self, rows: int, start_pos: int, splits: int | None = None) -> tuple[int, int, int]:
        """(key_lanes, split_len, n_splits) for a call; `splits` forces the split count (clamped)."""
        blocks = workgroups(rows * self.group, QUERIES_PER_BLOCK)
        context = start_pos + rows
        # Keys the rows see: a sliding window caps them, whatever the context.
        keys = min(context, self.window + rows - 1) if self.window else context
        if splits is None:
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
        self, rows: int, start_pos: int, splits: int | None = None, *, tree: bool = False, row0: int = 0
    ) -> tuple[dict[str, dict], tuple[int, int, int]]:
        """What a call sets, per kind of uniform slot its dispatches use ("attention", and "rope" when a rope.wgsl
        dispatch goes first), and the attention dispatch's grid (`record` records the call)."""
        if not 1 <= rows <= self.max_rows:
            raise ValueError(f"rows={rows} must be in 1..{self.max_rows}")
        if row0 < 0 or row0 + rows > self.max_rows:
            raise ValueError(f"row0={row0}: rows {row0}..{row0 + rows - 1} must lie in the op's 0..{self.max_rows - 1}")
        if tree and not (self.has_tree and rows <= MAX_TREE_ROWS):
            raise ValueError(f"a tree call needs the op's tree layout tensor and rows <= {MAX_TREE_ROWS}, got {rows}")
        if start_pos < 0 or start_pos + rows > self.max_seq:
            raise DeviceLimitError(f"positions {start_pos}..{start_pos + rows - 1} exceed the cache ({self.max_seq})")
        key_lanes, split_len, n_splits = self.plan(rows, start_pos, splits)
        blocks = workgroups(rows * self.group, QUERIES_PER_BLOCK)
        grid = (workgroups(blocks, self.lane_groups // key_lanes), self.n_kv_heads, n_splits)
        rope = self.rope_mode(rows, grid)
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
    ) -> list[tuple[str, UniformSlot]]:
        """Record attention for `rows` queries at positions start_pos..start_pos+rows-1; returns the uniform slots
        the dispatches used (the ops' own, or in a phase their copies), each with its kind as in `call`.

        `splits` forces the number of key-range splits (tests, benchmarks); None lets `plan` choose. `tree`: the
        rows are the token tree laid out in the op's tree tensor. `row0`: the rows' first row in q and out (class
        docstring).
        """
        values, grid = self.call(rows, start_pos, splits, tree=tree, row0=row0)
        used = []
        if "rope" in values:
            used.append(("rope", self.rope.record(rec, rows, start_pos, tree=tree, row0=row0)))
        self.params.set(**values["attention"])
        used.append(("attention", rec.dispatch(self.bound, *grid).params))
        if grid[2] > 1:
            reduce = rec.dispatch(self.reduce, workgroups(rows * self.n_heads * self.head_dim // 4, LANES))
            used.append(("attention", reduce.params))
        return used
