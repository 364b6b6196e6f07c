// attention: causal (or bidirectional, see below) grouped-query attention of new tokens over one layer's KV cache.
//   out[row, h, :] = softmax_j(q[row, h, :] · k[j, g, :] * scale) · v[j, g, :]
//   over keys j in (p - window, p] (all j <= p when window == 0), p = start_pos + row, with kv head
//   g = h / (n_heads / n_kv_heads). The cache keeps every position; a sliding window only masks (and skips
//   the key steps that lie wholly before every query's window).
//
// Work split. The (row, head) pairs that share kv head g are packed four to a "block"; a lane holds its
// block's four queries and accumulators for one 16-dim slice of the head as mat4x4s (column c = dim c of
// the slice, one vec4 component per query), so each key/value load serves four queries and all per-lane
// state lives in registers (private arrays indexed by a loop variable are spilled to memory by some
// compilers, e.g. Mesa's, which made an earlier version of this kernel several times slower).
// HEAD_DIM / 16 lanes ("a group") cover one block. Per step, every group scores STEP keys: lanes write
// their slice's partial dot products to workgroup memory, then each lane sums its group's partials and
// runs the online softmax update (running max m, sum l, accumulators) on its slice. Entry point
// main_subgroups sums the partials by subgroup shuffles instead, with no barrier in the key loop (CPU
// adapters, see attend_subgroups); both share everything else (prepare, finish).
// When a workgroup has fewer blocks than groups, `key_lanes` groups share a block and take turns of STEP
// keys ("key lanes"); their states are merged in workgroup memory at the end. The last workgroup of a call
// may hold fewer blocks than the others; it doubles its key lanes (from Params.key_lanes) while its blocks
// still fit and each lane still gets a step of keys, so its spare groups share the work. Long contexts can
// also be split across workgroups (grid z, split_len keys each): each split then writes unnormalised partials that
// attention_reduce.wgsl combines (flash-decoding); with n_splits == 1 the result goes straight to `out`.
//
// Packed kv heads (CPU adapters, Params.pack_max_keys > 0): a call without key splits over fewer keys than
// pack_max_keys whose blocks per kv head fill at most a quarter of the lane groups with PACKED_KEY_LANES key
// lanes each (decode, a k=1 verification) gives each workgroup several kv heads (`packed_heads`, the same rule as
// ops/attention.py's): workgroup row y attends for kv heads y * per .., its blocks those heads' blocks in turn. A
// CPU adapter runs a workgroup's lanes as vectors on one core, and a workgroup's fixed costs (its barriers and key
// lane merges) then serve several heads; a block's arithmetic depends only on its workgroup's block count, so a
// sequence's call and its segment in a PAGED dispatch still give the same bits.
//
// RoPE inside (FUSED_ROPE and rope == 1, decode and verification): q holds the model's [q | k | v]
// projection rows as they come out of the matmul, not yet rotated. Queries are rotated as they are loaded;
// keys at positions >= start_pos (this call's rows) are read from the k section and rotated, values from the
// v section, in a second key pass after the cached keys; and workgroup (0, kv head, split 0) writes the
// rotated keys and the values of its kv head to the caches for the next calls. No other workgroup reads
// those cache positions in this dispatch, so the writes race with nothing. This saves the separate rope.wgsl
// dispatch per layer. It is compiled in only with FUSED_ROPE (GPUs): on lavapipe the second key pass cost
// more GPU time than the dispatch it saves (decode: 235-255 us against 150 + 36 per layer), and its mere
// presence slowed calls that did not use it.
//
// RoPE before the key loop (rope == 2, any adapter): when the grid holds ONE workgroup per kv head (x == 1,
// n_splits == 1: decode and verification on CPU adapters, and on GPUs at short contexts), that workgroup is
// the only reader of its kv head's cache, so it writes the rows' rotated keys and values to the caches first,
// and after a storageBarrier (which makes storage writes visible within the workgroup) attends over the caches
// as with rope == 0, its queries rotated as they are loaded. No second key pass, no rope.wgsl dispatch; the
// host picks rope == 2 only for such grids (ops/attention.py). Rotation follows rope.wgsl (HF "rotate half":
// dim i pairs with i +- HEAD_DIM / 2, so a vec4 of dims pairs with the vec4 HEAD_DIM / 8 away, and both halves
// use the angles of dims i mod HEAD_DIM / 2).
//
// KV-shared layers (rope == 3, any grid; Gemma 4's last layers): q holds only the layer's query rows
// (q_stride = n_heads * HEAD_DIM / 4), rotated as they are loaded; every key and value, this call's rows
// included, comes from the caches, which an earlier layer's dispatch of this forward wrote; nothing is written.
//
// Token trees (tree == 1, speculative verification of a tree proposal): row r sits at position
// start_pos + depth(r) (its query's RoPE and window) and sees the cached keys before start_pos plus the keys of
// the rows in its ancestor mask (itself and its ancestors, which come before it); its key and value stay in
// slot start_pos + r, and a tree key's RoPE and window position is start_pos + its row's depth. Chains
// (tree == 0) are the special case depth(r) = r, every earlier row an ancestor.
//
// Bidirectional (Params.bidirectional_end > 0, chains only; embedding models such as EmbeddingGemma): every row
// sees the keys before position bidirectional_end: the cached keys before start_pos, ALL of the call's rows' keys,
// later ones included (bidirectional_end = start_pos + rows), and past them the keys an input longer than one call
// has in the caches already (its later rows', written by earlier rope.wgsl dispatches; the host then passes
// rope == 0); with a window, the keys within window - 1 positions either way (|p - j| < window, transformers'
// Gemma 3 bidirectional sliding layers). Only a row's upper key limit and the workgroup's key end change; the
// host forbids key splits (attention_reduce combines splits up to a row's own position) and trees for such calls.
//
// Several sequences in one dispatch (PAGED, ops/attention.py BatchedAttention): grid (1, n_kv_heads, segments),
// ONE workgroup per (kv head, segment) holding all of its segment's blocks (no key splits). Segment s is
// described by words [8s, 8s + 8) of `words`: row0, rows, start_pos (as the Params fields of a solo call),
// tree_at (CHAIN for a chain, else the word of its row 0's (depth, ancestor mask) pair), table_at (the word of
// its block table), 0, 0, 0. k_cache / v_cache are pools shared by all sequences: the segment's cache slot j
// lives at pool position words[table_at + j / block] * block + j % block, for every read and for the rope == 2
// write. A header is read at an index from workgroup_id.z, so its values are uniform (barriers). rope is 2 (each
// workgroup writes its segment's new keys and values to its blocks, then attends) or 3 (read only); window and
// softcap hold for every segment; key_lanes is 1 and each workgroup grows its own from its segment's blocks.
//
// Bindings: 0 params (uniform Params), 1 q (read) [row0 + rows, q_stride * 4], query heads in the first
//           n_heads * HEAD_DIM floats of each row (RoPE applied when rope == 0; the model's fused
//           [q | k | v] rows, which rope 1 and 2 require; rope 3: only the query heads, not rotated),
//           2 k_cache and 3 v_cache (read_write; written only when rope is 1 or 2) [max_seq, n_kv_heads, HEAD_DIM]
//           (PAGED: the pools [pool_positions, n_kv_heads, HEAD_DIM]),
//           4 out (read_write) [row0 + rows, n_heads * HEAD_DIM],
//           5 part_acc (read_write) [n_splits, rows, n_heads, HEAD_DIM] unnormalised sums of p * v,
//           6 part_stats (read_write) [n_splits, rows, n_heads] (running max, sum of p) of each split,
//           7 cos_sin (read) [positions, HEAD_DIM / 2] of (cos, sin) pairs (ops/rope.py's table; rope 1, 2, 3),
//           8 words (read) u32: a tree's (depth, ancestor mask) per row, words 2r and 2r + 1 (ops/tree.py; read
//           when tree == 1); PAGED: the segments' headers, tree layouts and block tables (as above).
// Params: rows; start_pos (position of row 0); n_heads; n_kv_heads; key_lanes (a power of two, at most
//         64 / (HEAD_DIM / 16); the last workgroup may use more, as above); split_len (keys per split);
//         n_splits; q_stride (row stride of q in vec4s);
//         window (keys a query sees, itself included; 0 = all); scale (1 / sqrt(HEAD_DIM) for LLaMA);
//         rope (1: RoPE and the cache write inside, as above; 2: the same before the key loop, one workgroup
//         per kv head; 3: q rotated as loaded, the caches only read (KV-shared layers); 0: q rotated and the
//         caches written before);
//         softcap (Gemma 2: scores become softcap * tanh(score / softcap); 0 = not capped);
//         tree (1: the rows are a token tree laid out in `words`, as above; 0: consecutive positions);
//         row0 (the call's row r is row row0 + r of q and of out, so several sequences' rows, each with its own
//         cache and call, share one q and one out buffer; positions, cache slots, the tree layout and the
//         partials stay indexed by r);
//         block (PAGED: positions per pool block, a power of two);
//         pack_max_keys (packed kv heads for calls over fewer keys, as above; 0 = never);
//         bidirectional_end (> 0: every row sees the keys before it, later rows' included, as above; 0: causal).
//         PAGED reads rows, start_pos, tree and row0 from each segment's header instead, and needs n_splits 1
//         and a split_len above every context.
// Overrides: HEAD_DIM (a multiple of 16, at most 512: two lane groups of 32 lanes per workgroup); FUSED_ROPE
//            (compile the rope == 1 path; rope == 2 is always compiled); PAGED (several segments, as above).
// Entry points: main; main_subgroups (the same, needs subgroups of at least HEAD_DIM / 16 consecutive
//               invocations, HEAD_DIM / 16 a power of two; ops/attention.py attention_entry).
// Dispatch: workgroups of 64; x = ceil(blocks / (64 / (HEAD_DIM / 16) / key_lanes)) with
//           blocks = ceil(rows * n_heads / n_kv_heads / 4), y = ceil(n_kv_heads / packed_heads), z = n_splits.
//           PAGED: x = 1, y = ceil(n_kv_heads / the fewest packed heads of a segment), z = segments, each
//           segment's blocks at most 64 / (HEAD_DIM / 16).
// Workgroup memory: 9 KiB (main_subgroups uses it only to merge key lanes). Keys at or beyond start_pos + rows
// (bidirectional: bidirectional_end) are never read (they may hold garbage), nor, with rope == 1, those at or
// beyond start_pos.

enable subgroups;

struct Params {
  rows: u32,
  start_pos: u32,
  n_heads: u32,
  n_kv_heads: u32,
  key_lanes: u32,
  split_len: u32,
  n_splits: u32,
  q_stride: u32,
  window: u32,
  scale: f32,
  rope: u32,
  softcap: f32,
  tree: u32,
  row0: u32,
  block: u32,
  pack_max_keys: u32,
  bidirectional_end: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<vec4<f32>>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> part_acc: array<vec4<f32>>;
@group(0) @binding(6) var<storage, read_write> part_stats: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read> cos_sin: array<vec4<f32>>;
@group(0) @binding(8) var<storage, read> words: array<u32>;

override HEAD_DIM: u32 = 64u;
override FUSED_ROPE: bool = false;
override PAGED: bool = false;

const LANES: u32 = 64u;
const STEP: u32 = 8u;  // keys a group scores between two barriers
const STATE: u32 = 18u;  // vec4s of one lane's softmax state: 4 accumulator matrices, m, l
// Masks a score: real scores are far above it, and exp(NEG - m) is 0 without overflowing.
const NEG: f32 = -3.0e38;
const CHAIN: u32 = 0xFFFFFFFFu;  // Segment.tree_at of a chain
const HEADER_WORDS: u32 = 8u;  // layout words of a PAGED segment's header
const PACKED_KEY_LANES: u32 = 4u;  // the fewest key lanes a block keeps when kv heads share a workgroup

// Partial scores [LANES][STEP] during the key loop; at the end, the states of half the lanes being merged.
var<workgroup> exchange: array<vec4<f32>, 576>;

struct State {
  a0: mat4x4<f32>,
  a1: mat4x4<f32>,
  a2: mat4x4<f32>,
  a3: mat4x4<f32>,
  m: vec4<f32>,
  l: vec4<f32>,
}

// Scales query c's entries (row c of every column) by s[c].
fn scale_queries(a: mat4x4<f32>, s: vec4<f32>) -> mat4x4<f32> {
  return mat4x4<f32>(a[0] * s, a[1] * s, a[2] * s, a[3] * s);
}

// Column c = p * v[c]: query weights times one vec4 of value dims.
fn outer(p: vec4<f32>, v: vec4<f32>) -> mat4x4<f32> {
  return mat4x4<f32>(p * v.x, p * v.y, p * v.z, p * v.w);
}

// c * tanh(s / c), with tanh(y) = 2 / (1 + exp(-2y)) - 1: exp overflows to inf, not NaN, for any score.
fn soft_cap(s: vec4<f32>, c: f32) -> vec4<f32> {
  return c * (2.0 / (1.0 + exp(-2.0 * s / c)) - 1.0);
}

// Dims 4c..4c+3 of the head vector at q[head..], rotated for position `pos` (rope == 1 or 2).
fn rotated(head: u32, c: u32, pos: u32) -> vec4<f32> {
  let half4 = HEAD_DIM / 8u;
  let first = c < half4;
  let pair = select(c - half4, c, first);
  let at = pos * (HEAD_DIM / 4u) + 2u * pair;  // vec4 (cos, sin, cos, sin) pairs of dims 4 * pair ..
  let a = cos_sin[at];
  let b = cos_sin[at + 1u];
  let cosines = vec4<f32>(a.x, a.z, b.x, b.z);
  let sines = vec4<f32>(a.y, a.w, b.y, b.w);
  let x = q[head + c];
  if (first) {
    return x * cosines - q[head + c + half4] * sines;
  }
  return x * cosines + q[head + pair] * sines;
}

// The rows a workgroup serves and where their keys live: the call's (Params) or, with PAGED, its segment's
// (the layout header at word HEADER_WORDS * segment). tree_at: word of row 0's (depth, ancestor mask) in
// `words`, CHAIN for consecutive positions; table_at: word of the block table (PAGED).
struct Segment {
  row0: u32,
  rows: u32,
  start_pos: u32,
  tree_at: u32,
  table_at: u32,
}

// Loaded from a read-only buffer at an index from workgroup_id, so uniform over the workgroup (barriers).
fn segment(s: u32) -> Segment {
  if (PAGED) {
    let h = HEADER_WORDS * s;
    return Segment(words[h], words[h + 1u], words[h + 2u], words[h + 3u], words[h + 4u]);
  }
  return Segment(params.row0, params.rows, params.start_pos, select(CHAIN, 0u, params.tree == 1u), 0u);
}

// Vec4 index of kv head `kv_head` of cache slot j in k_cache / v_cache: with PAGED, slot j lives at pool
// position table[j / block] * block + j % block (block a power of two).
fn cache_at(seg: Segment, j: u32, kv_head: u32) -> u32 {
  var at = j;
  if (PAGED) {
    let shift = countTrailingZeros(params.block);
    at = (words[seg.table_at + (j >> shift)] << shift) | (j & (params.block - 1u));
  }
  return (at * params.n_kv_heads + kv_head) * (HEAD_DIM / 4u);
}

// Depth of the segment's row r (a tree's, from its layout; a chain's is r).
fn tree_depth(seg: Segment, r: u32) -> u32 {
  if (seg.tree_at == CHAIN) {
    return r;
  }
  return words[seg.tree_at + 2u * r];
}

// Position of key j (its slot in the cache): a tree row's is start_pos + its depth.
fn key_position(seg: Segment, j: u32) -> u32 {
  if (seg.tree_at != CHAIN && j >= seg.start_pos) {
    return seg.start_pos + words[seg.tree_at + 2u * (j - seg.start_pos)];
  }
  return j;
}

// Whether q holds raw projection rows that this dispatch rotates, and writes their keys and values (rope 1, 2).
fn rope_inside() -> bool {
  return (FUSED_ROPE && params.rope == 1u) || params.rope == 2u;
}

// Dims 4c..4c+3 of the query head at q[head..] of the row at position `pos`.
fn query(head: u32, c: u32, pos: u32) -> vec4<f32> {
  if (rope_inside() || params.rope == 3u) {
    return rotated(head, c, pos);
  }
  return q[head + c];
}

// Slice i of the queries as a matrix: column c holds dims 4 * i .. 4 * i + 3 of query c (its head at
// q[head[c]..], its row at position pos[c]).
fn query_slice(head: vec4<u32>, i: u32, pos: vec4<u32>, scale: f32) -> mat4x4<f32> {
  let m = mat4x4<f32>(query(head.x, i, pos.x), query(head.y, i, pos.y), query(head.z, i, pos.z),
                      query(head.w, i, pos.w));
  return transpose(m) * scale;
}

// Vec4 index of kv head `kv_head` of key j's k section in q (v section: + n_kv_heads * HEAD_DIM / 4), for
// a key of this call's rows (rope 1 and 2).
fn new_key_head(seg: Segment, j: u32, kv_head: u32) -> u32 {
  return (seg.row0 + j - seg.start_pos) * params.q_stride + (params.n_heads + kv_head) * (HEAD_DIM / 4u);
}

// Dims 4c..4c+3 of key j of kv head `kv_head`, RoPE applied; `new_key`: one of this call's rows (rope 1 and 2),
// else read from the caches at `at` (cache_at of j). Callers pass a constant `new_key`, so the compiled loops
// hold no branch on it.
fn key(seg: Segment, j: u32, at: u32, kv_head: u32, c: u32, new_key: bool) -> vec4<f32> {
  if (new_key) {
    return rotated(new_key_head(seg, j, kv_head), c, key_position(seg, j));
  }
  return k_cache[at + c];
}

fn value(seg: Segment, j: u32, at: u32, kv_head: u32, c: u32, new_key: bool) -> vec4<f32> {
  if (new_key) {
    return q[new_key_head(seg, j, kv_head) + params.n_kv_heads * (HEAD_DIM / 4u) + c];
  }
  return v_cache[at + c];
}

// What a lane scores keys with, fixed for the call (see main).
struct Lane {
  q0: mat4x4<f32>,
  q1: mat4x4<f32>,
  q2: mat4x4<f32>,
  q3: mat4x4<f32>,
  limit: vec4<u32>,
  lower: vec4<u32>,
  ancestors: vec4<u32>,
  seg: Segment,
  kv_head: u32,
  slice: u32,
  t: u32,
  lane_group: u32,
  key_lane: u32,
  has_block: bool,
}

// Key j's partial score for the lane's slice: the four queries' dot products over its 16 dims.
fn partial_score(lane: Lane, j: u32, new_keys: bool) -> vec4<f32> {
  let c = 4u * lane.slice;
  let at = cache_at(lane.seg, j, lane.kv_head);
  return lane.q0 * key(lane.seg, j, at, lane.kv_head, c, new_keys)
    + lane.q1 * key(lane.seg, j, at, lane.kv_head, c + 1u, new_keys)
    + lane.q2 * key(lane.seg, j, at, lane.kv_head, c + 2u, new_keys)
    + lane.q3 * key(lane.seg, j, at, lane.kv_head, c + 3u, new_keys);
}

// The online softmax update of the lane's state with key j, `s` its whole score (summed over the group).
fn add_key(state: State, lane: Lane, j: u32, score: vec4<f32>, new_keys: bool) -> State {
  var st = state;
  var s = score;
  if (params.softcap > 0.0) {
    s = soft_cap(s, params.softcap);
  }
  var visible = (vec4<u32>(j) < lane.limit) & (vec4<u32>(j) >= lane.lower);
  if (lane.seg.tree_at != CHAIN && j >= lane.seg.start_pos) {
    let row = j - lane.seg.start_pos;
    let ancestor = ((lane.ancestors >> vec4<u32>(row)) & vec4<u32>(1u)) != vec4<u32>(0u);
    visible = (vec4<u32>(j) < lane.limit) & (vec4<u32>(key_position(lane.seg, j)) >= lane.lower) & ancestor;
  }
  let m = max(st.m, select(vec4<f32>(NEG), s, visible));
  let rescale = exp(st.m - m);
  let p = select(vec4<f32>(0.0), exp(s - m), visible);
  let c = 4u * lane.slice;
  let at = cache_at(lane.seg, j, lane.kv_head);
  st.a0 = scale_queries(st.a0, rescale) + outer(p, value(lane.seg, j, at, lane.kv_head, c, new_keys));
  st.a1 = scale_queries(st.a1, rescale) + outer(p, value(lane.seg, j, at, lane.kv_head, c + 1u, new_keys));
  st.a2 = scale_queries(st.a2, rescale) + outer(p, value(lane.seg, j, at, lane.kv_head, c + 2u, new_keys));
  st.a3 = scale_queries(st.a3, rescale) + outer(p, value(lane.seg, j, at, lane.kv_head, c + 3u, new_keys));
  st.m = m;
  st.l = st.l * rescale + p;
  return st;
}

// Steps of key_lanes * STEP keys over [begin, end): key lane k of a block takes keys first(k) .. + STEP.
fn key_steps(begin: u32, end: u32, key_lanes: u32) -> u32 {
  if (end <= begin) {
    return 0u;
  }
  return (end - begin + key_lanes * STEP - 1u) / (key_lanes * STEP);
}

// The online softmax over keys [begin, end): each step, the key lanes of a block score STEP keys each, in
// turn; a group's lanes add up their slices' partial scores through workgroup memory. begin, end and
// key_lanes must be uniform over the workgroup (the barriers); `new_keys` as in `key`.
fn attend(state: State, lane: Lane, begin: u32, end: u32, key_lanes: u32, new_keys: bool) -> State {
  var st = state;
  let slices = HEAD_DIM / 16u;
  let n_steps = key_steps(begin, end, key_lanes);
  for (var it = 0u; it < n_steps; it++) {
    let first = begin + (it * key_lanes + lane.key_lane) * STEP;
    for (var u = 0u; u < STEP; u++) {
      let j = first + u;
      var s = vec4<f32>(0.0);
      if (lane.has_block && j < end) {
        s = partial_score(lane, j, new_keys);
      }
      exchange[lane.t * STEP + u] = s;
    }
    workgroupBarrier();
    for (var u = 0u; u < STEP; u++) {
      let j = first + u;
      if (lane.has_block && j < end) {
        var s = vec4<f32>(0.0);
        for (var d = 0u; d < slices; d++) {
          s += exchange[(lane.lane_group * slices + d) * STEP + u];
        }
        st = add_key(st, lane, j, s, new_keys);
      }
    }
    workgroupBarrier();
  }
  return st;
}

// `attend` with the group's partial scores added up by subgroup shuffles (main_subgroups): no workgroup memory
// and no barriers in the key loop, whose barrier pair per step dominated decode calls on lavapipe (there a
// barrier switches the compiled workgroup through all its invocations and spills their state). Needs each
// group's HEAD_DIM / 16 lanes (consecutive invocations, aligned) inside one subgroup. The sums pair lanes
// (s0 + s1) + (s2 + s3), so every lane of a group gets the same bits.
fn attend_subgroups(state: State, lane: Lane, begin: u32, end: u32, key_lanes: u32, new_keys: bool) -> State {
  var st = state;
  let slices = HEAD_DIM / 16u;
  let n_steps = key_steps(begin, end, key_lanes);
  for (var it = 0u; it < n_steps; it++) {
    let first = begin + (it * key_lanes + lane.key_lane) * STEP;
    for (var u = 0u; u < STEP; u++) {
      let j = first + u;
      var s = vec4<f32>(0.0);
      if (lane.has_block && j < end) {
        s = partial_score(lane, j, new_keys);
      }
      for (var d = 1u; d < slices; d *= 2u) {
        s += subgroupShuffleXor(s, d);  // in uniform control flow: n_steps, STEP and slices are uniform
      }
      if (lane.has_block && j < end) {
        st = add_key(st, lane, j, s, new_keys);
      }
    }
  }
  return st;
}

fn combine(x: State, y: State) -> State {
  let m = max(x.m, y.m);
  let cx = exp(x.m - m);
  let cy = exp(y.m - m);
  return State(
    scale_queries(x.a0, cx) + scale_queries(y.a0, cy),
    scale_queries(x.a1, cx) + scale_queries(y.a1, cy),
    scale_queries(x.a2, cx) + scale_queries(y.a2, cy),
    scale_queries(x.a3, cx) + scale_queries(y.a3, cy),
    m,
    x.l * cx + y.l * cy,
  );
}

fn store_state(at: u32, s: State) {
  exchange[at] = s.a0[0];
  exchange[at + 1u] = s.a0[1];
  exchange[at + 2u] = s.a0[2];
  exchange[at + 3u] = s.a0[3];
  exchange[at + 4u] = s.a1[0];
  exchange[at + 5u] = s.a1[1];
  exchange[at + 6u] = s.a1[2];
  exchange[at + 7u] = s.a1[3];
  exchange[at + 8u] = s.a2[0];
  exchange[at + 9u] = s.a2[1];
  exchange[at + 10u] = s.a2[2];
  exchange[at + 11u] = s.a2[3];
  exchange[at + 12u] = s.a3[0];
  exchange[at + 13u] = s.a3[1];
  exchange[at + 14u] = s.a3[2];
  exchange[at + 15u] = s.a3[3];
  exchange[at + 16u] = s.m;
  exchange[at + 17u] = s.l;
}

fn load_state(at: u32) -> State {
  return State(
    mat4x4<f32>(exchange[at], exchange[at + 1u], exchange[at + 2u], exchange[at + 3u]),
    mat4x4<f32>(exchange[at + 4u], exchange[at + 5u], exchange[at + 6u], exchange[at + 7u]),
    mat4x4<f32>(exchange[at + 8u], exchange[at + 9u], exchange[at + 10u], exchange[at + 11u]),
    mat4x4<f32>(exchange[at + 12u], exchange[at + 13u], exchange[at + 14u], exchange[at + 15u]),
    exchange[at + 16u],
    exchange[at + 17u],
  );
}

// The keys a workgroup attends over and its key lanes: uniform over the workgroup (they bound the loops that
// hold barriers; kept apart from the lanes' own values so that uniformity analysis sees it).
struct Keys {
  begin: u32,
  cached_end: u32,  // keys [begin, cached_end) come from the caches,
  new_begin: u32,  // [new_begin, end) from q (rope == 1)
  end: u32,
  lanes: u32,
  heads_per_wg: u32,  // kv heads per workgroup row (grid y): a workgroup attends for heads y * heads_per_wg ..
  heads: u32,  // .. of which this one has `heads` (fewer in the last row; 0 in a row past the last kv head)
  blocks: u32,  // the blocks the workgroup holds (its heads' blocks, in turn)
}

// How many kv heads share a workgroup (see "Packed kv heads" above): the same rule as ops/attention.py
// `packed_heads`, from values uniform over the workgroup.
fn packed_heads(keys: u32, n_blocks: u32) -> u32 {
  let groups = LANES / (HEAD_DIM / 16u);
  if (params.n_splits > 1u || keys >= params.pack_max_keys || PACKED_KEY_LANES * n_blocks * 2u > groups) {
    return 1u;
  }
  return min(params.n_kv_heads, groups / (PACKED_KEY_LANES * n_blocks));
}

fn key_range(wid: vec3<u32>) -> Keys {
  let slices = HEAD_DIM / 16u;
  let groups = LANES / slices;
  let blocks_per_wg = groups / params.key_lanes;
  let group = params.n_heads / params.n_kv_heads;
  // With PAGED, grid z is the segment (no key splits); otherwise the split, all of the call's rows one segment.
  let seg = segment(select(0u, wid.z, PAGED));
  let split = select(wid.z, 0u, PAGED);
  let n_pairs = seg.rows * group;
  let n_blocks = (n_pairs + 3u) / 4u;
  // The workgroup's last pair sits on its latest row, which bounds the keys any of its lanes needs.
  let last_pair = min(n_pairs, 4u * (wid.x + 1u) * blocks_per_wg) - 1u;
  // Its first pair sits on its earliest row: keys before that row's window are masked for every lane (a
  // tree row may sit as early as start_pos + 1, whatever its index).
  var first_pos = seg.start_pos + (4u * wid.x * blocks_per_wg) / group;
  if (seg.tree_at != CHAIN) {
    first_pos = seg.start_pos;
  }
  var window_begin = 0u;
  if (params.window > 0u && first_pos + 1u > params.window) {
    window_begin = first_pos + 1u - params.window;
  }
  let key_begin = max(split * params.split_len, window_begin);
  // Causal: up to the latest row's own key; bidirectional: up to bidirectional_end.
  let causal_end = seg.start_pos + last_pair / group + 1u;
  let seen_end = select(causal_end, params.bidirectional_end, params.bidirectional_end > 0u);
  let key_end = min((split + 1u) * params.split_len, seen_end);
  let per = packed_heads(key_end - key_begin, n_blocks);
  let heads = min(per, params.n_kv_heads - min(wid.y * per, params.n_kv_heads));
  // The last workgroup may hold fewer blocks than the others: its spare groups become more key lanes while
  // each lane still gets a step of keys (prefills of a few dozen rows have one such workgroup per kv head,
  // which would otherwise take as long as a full one). The count is uniform over the workgroup.
  let wg_blocks = select(0u, min(blocks_per_wg, n_blocks * heads - wid.x * blocks_per_wg), heads > 0u);
  var key_lanes = params.key_lanes;
  while (2u * key_lanes * wg_blocks <= groups && key_begin + 2u * key_lanes * STEP <= key_end) {
    key_lanes *= 2u;
  }
  // With rope == 1, keys from start_pos on come from q (this call's rows), after those in the caches.
  var cached_end = key_end;
  var new_begin = key_end;
  if (FUSED_ROPE && params.rope == 1u) {
    cached_end = min(key_end, seg.start_pos);
    new_begin = max(key_begin, seg.start_pos);
  }
  return Keys(key_begin, cached_end, new_begin, key_end, key_lanes, per, heads, wg_blocks);
}

// With rope 1 or 2, workgroup (0, kv head, split 0) writes its kv head's rotated new keys and values to the
// caches; with rope 2 its lanes then attend over them.
fn write_new_keys(wid: vec3<u32>, t: u32, keys: Keys) {
  let hd4 = HEAD_DIM / 4u;
  let seg = segment(select(0u, wid.z, PAGED));
  let split = select(wid.z, 0u, PAGED);
  let head_words = seg.rows * hd4;
  if (rope_inside() && wid.x == 0u && split == 0u) {
    for (var e = t; e < keys.heads * head_words; e += LANES) {
      let kv_head = wid.y * keys.heads_per_wg + e / head_words;
      let j = seg.start_pos + e % head_words / hd4;
      let c = e % hd4;
      let at = cache_at(seg, j, kv_head) + c;
      k_cache[at] = key(seg, j, 0u, kv_head, c, true);
      v_cache[at] = value(seg, j, 0u, kv_head, c, true);
    }
  }
  if (params.rope == 2u) {
    storageBarrier();  // params is uniform: the barrier stays in uniform control flow
  }
}

// A lane's own part of the work (its queries, block, key lane), set up before the key loop, used after it.
struct Work {
  lane: Lane,
  local_block: u32,
  split: u32,
  row_head: vec4<u32>,
}

fn prepare(wid: vec3<u32>, t: u32, keys: Keys) -> Work {
  let hd4 = HEAD_DIM / 4u;
  let slices = HEAD_DIM / 16u;
  let groups = LANES / slices;
  let blocks_per_wg = groups / params.key_lanes;
  let group = params.n_heads / params.n_kv_heads;
  // With PAGED, grid z is the segment (no key splits); otherwise the split, all of the call's rows one segment.
  let seg = segment(select(0u, wid.z, PAGED));
  let split = select(wid.z, 0u, PAGED);
  let n_pairs = seg.rows * group;
  let n_blocks = (n_pairs + 3u) / 4u;

  let key_lanes = keys.lanes;
  let slice = t % slices;
  let lane_group = t / slices;
  let key_lane = lane_group % key_lanes;
  let local_block = lane_group / key_lanes;
  // The workgroup's blocks are its kv heads' blocks in turn (one kv head unless they are packed).
  let wg_block = wid.x * blocks_per_wg + local_block;
  let block = wg_block % n_blocks;
  let kv_head = wid.y * keys.heads_per_wg + wg_block / n_blocks;
  let has_block = local_block < keys.blocks;

  // Query c of the block is (row, head) pair 4 * block + c of this kv head; key j is visible to it when
  // lower[c] <= j < limit[c] (for a tree key: its position >= lower[c] and its row among ancestors[c]). An
  // empty slot (past the last pair) keeps limit 0 and reads pair 0's query harmlessly.
  var limit = vec4<u32>(0u);
  var lower = vec4<u32>(0u);
  var ancestors = vec4<u32>(0u);
  var row_head = vec4<u32>(0u);
  var q_head = vec4<u32>(0u);
  var q_pos = vec4<u32>(0u);
  for (var c = 0u; c < 4u; c++) {
    let pair = 4u * block + c;
    if (has_block && pair < n_pairs) {
      let head = kv_head * group + pair % group;
      let row = pair / group;
      q_pos[c] = seg.start_pos + tree_depth(seg, row);
      if (seg.tree_at != CHAIN) {
        ancestors[c] = words[seg.tree_at + 2u * row + 1u];
      }
      limit[c] = seg.start_pos + row + 1u;  // slots up to the row's own (a tree's ancestors come before it)
      if (params.window > 0u && q_pos[c] + 1u > params.window) {
        lower[c] = q_pos[c] + 1u - params.window;
      }
      if (params.bidirectional_end > 0u) {  // every key before it, within window - 1 positions after its own
        limit[c] = params.bidirectional_end;
        if (params.window > 0u) {
          limit[c] = min(limit[c], q_pos[c] + params.window);
        }
      }
      row_head[c] = (pair / group) * params.n_heads + head;
      q_head[c] = (seg.row0 + row) * params.q_stride + head * hd4;
    }
  }
  var lane = Lane(mat4x4<f32>(), mat4x4<f32>(), mat4x4<f32>(), mat4x4<f32>(), limit, lower, ancestors, seg,
                  kv_head, slice, t, lane_group, key_lane, has_block);
  if (has_block) {
    lane.q0 = query_slice(q_head, 4u * slice, q_pos, params.scale);
    lane.q1 = query_slice(q_head, 4u * slice + 1u, q_pos, params.scale);
    lane.q2 = query_slice(q_head, 4u * slice + 2u, q_pos, params.scale);
    lane.q3 = query_slice(q_head, 4u * slice + 3u, q_pos, params.scale);
  }
  return Work(lane, local_block, split, row_head);
}

fn initial_state() -> State {
  return State(mat4x4<f32>(), mat4x4<f32>(), mat4x4<f32>(), mat4x4<f32>(), vec4<f32>(NEG), vec4<f32>(0.0));
}

// The part of both entry points after the key loop: merge the key lanes' states, write the results.
fn finish(w: Work, keys: Keys, state: State) {
  var st = state;
  let hd4 = HEAD_DIM / 4u;
  let slices = HEAD_DIM / 16u;
  let lane = w.lane;
  let seg = lane.seg;
  let slice = lane.slice;
  let key_lane = lane.key_lane;
  let has_block = lane.has_block;
  let local_block = w.local_block;
  let split = w.split;
  let key_lanes = keys.lanes;
  let limit = lane.limit;

  // Merge the key lanes of each block pairwise: the upper half hands its states to the lower half.
  for (var half = key_lanes / 2u; half > 0u; half /= 2u) {
    let at = ((local_block * half + key_lane % half) * slices + slice) * STATE;
    if (has_block && key_lane >= half && key_lane < 2u * half) {
      store_state(at, st);
    }
    workgroupBarrier();
    if (has_block && key_lane < half) {
      st = combine(st, load_state(at));
    }
    workgroupBarrier();
  }

  // A split whose keys all lie before the workgroup's windows has no steps; it still writes its (empty)
  // partials, which attention_reduce reads for every split up to the row's position.
  if (has_block && key_lane == 0u && (keys.end > keys.begin || params.n_splits > 1u)) {
    let r0 = transpose(st.a0);
    let r1 = transpose(st.a1);
    let r2 = transpose(st.a2);
    let r3 = transpose(st.a3);
    for (var c = 0u; c < 4u; c++) {
      if (limit[c] > 0u) {
        if (params.n_splits == 1u) {
          let at = (seg.row0 * params.n_heads + w.row_head[c]) * hd4 + 4u * slice;
          let inv = 1.0 / st.l[c];
          out[at] = r0[c] * inv;
          out[at + 1u] = r1[c] * inv;
          out[at + 2u] = r2[c] * inv;
          out[at + 3u] = r3[c] * inv;
        } else {
          let part = split * seg.rows * params.n_heads + w.row_head[c];
          let at = part * hd4 + 4u * slice;
          part_acc[at] = r0[c];
          part_acc[at + 1u] = r1[c];
          part_acc[at + 2u] = r2[c];
          part_acc[at + 3u] = r3[c];
          if (slice == 0u) {
            part_stats[part] = vec2<f32>(st.m[c], st.l[c]);
          }
        }
      }
    }
  }
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let keys = key_range(wid);
  if (keys.heads == 0u) {
    return;  // a workgroup row past the last kv head (packed segments of a PAGED grid sized for unpacked ones)
  }
  write_new_keys(wid, t, keys);
  let w = prepare(wid, t, keys);
  var st = attend(initial_state(), w.lane, keys.begin, keys.cached_end, keys.lanes, false);
  if (FUSED_ROPE) {
    st = attend(st, w.lane, keys.new_begin, keys.end, keys.lanes, true);
  }
  finish(w, keys, st);
}

// main with the key loop's score sums in subgroups (attend_subgroups); the host picks it on CPU adapters whose
// subgroups hold a group (HEAD_DIM / 16 lanes), where a subgroup is a run of consecutive invocations.
@compute @workgroup_size(64)
fn main_subgroups(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let keys = key_range(wid);
  if (keys.heads == 0u) {
    return;  // a workgroup row past the last kv head (packed segments of a PAGED grid sized for unpacked ones)
  }
  write_new_keys(wid, t, keys);
  let w = prepare(wid, t, keys);
  var st = attend_subgroups(initial_state(), w.lane, keys.begin, keys.cached_end, keys.lanes, false);
  if (FUSED_ROPE) {
    st = attend_subgroups(st, w.lane, keys.new_begin, keys.end, keys.lanes, true);
  }
  finish(w, keys, st);
}
