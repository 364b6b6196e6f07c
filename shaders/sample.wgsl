// sample: token choice from rows of logits. The kernels share one definition of the filtered distribution
// (temperature, exact top-k, top-p), whose contract and numpy reference are in
// doppler_py/testing/sampling_reference.py:
// * `main`, the sampler: one token id per row — the argmax (temperature 0), or a draw from the filtered
//   distribution by inverse CDF with a host-drawn uniform u.
// * `spec_draft_filter`, `spec_rows`, `spec_finalize`: the verification of a speculative step (exact
//   speculative sampling: accept draft d_i iff u_i * q_i(d_i) < p_i(d_i), then a draw from max(0, p_n - q_n) or
//   the bonus draw from p_k); doppler_py/testing/verify_reference.py is its numpy reference and states the
//   contract, doppler_py/ops/speculative.py records it.
// * `tree_rows`, `tree_finalize`: the verification of a token tree of deterministic drafts (doppler_py/ops/
//   tree.py's layout): at each row, recursive rejection over its children (distinct tokens, row order): child c
//   is accepted iff u_c * (1 - p(earlier children)) < p(c); when all are rejected, a draw from p without the
//   children's tokens; at a leaf, from p. Greedy: the child equal to the argmax. doppler_py/testing/
//   tree_reference.py (`sampled_walk`, `greedy_walk`) is its numpy reference, doppler_py/ops/tree_verify.py
//   records it.
// * `top_tokens`: the k largest logits of each row in order, for a greedy drafter's tree branches
//   (doppler_py/ops/top_tokens.py).
//
// Bindings (each entry point binds only the ones it uses, at most 7 storage buffers):
//   0 params (uniform Params)                              all
//   1 logits (read, [rows, vocab] f32)                     main; spec_rows (target rows 0..k);
//                                                          spec_draft_filter (the draft's rows 0..k-1); tree_rows;
//                                                          top_tokens
//   2 randoms (read, f32 in [0, 1])                        main ([rows]); spec_rows ([2k+1]: k+i accepts d_i,
//                                                          2k is the final draw; 0..k-1 belong to drafting);
//                                                          tree_rows ([k+1]: k-1 tests node row k, k is the final draw)
//   3 out_ids (read_write, [rows] u32)                     main (always a valid id in [0, vocab)); top_tokens
//                                                          ([rows, k])
//   4 draft_logits (read, [k, vocab] f32)                  spec_rows (unread in one-hot mode and when greedy)
//   5 draft_states (read_write, [k] RowState)              spec_draft_filter writes, spec_rows reads
//   6 tokens (read, [k+1] u32; tokens[1+i] = d_i)          spec_rows, spec_finalize; tree_*: row r's token
//   7 row_results (read_write, [3 (k+1)] u32)              spec_rows / tree_rows write, *_finalize read
//   8 result (read_write)                                  spec_finalize ([k+3]: n, final token, status,
//                                                          d_0..d_{k-1}); tree_finalize ([3 + 2k]: n, final
//                                                          token, status, (token, row) per accepted node)
//   9 tree (read, [k+1] (depth, ancestor mask))            tree_rows
// Params: vocab (1 <= vocab < 2^24); temperature (<= 0 = greedy); top_k (0 or >= vocab = off);
//   top_p (>= 1 = off); k (draft tokens; tree entries: nodes, rows - 1, at most 31; top_tokens: tokens per row,
//   at most 32); onehot (1: the draft is deterministic, q_i = one-hot at d_i, so draft_logits are not read;
//   tree entries are always one-hot).
// Dispatch: main (rows, 1, 1); speculative step: spec_draft_filter (k, 1, 1) only when temperature > 0 and
//   onehot = 0, then spec_rows (k + 1, 1, 1), then spec_finalize (1, 1, 1); tree: tree_rows (k + 1, 1, 1), then
//   tree_finalize (1, 1, 1); top_tokens (rows, 1, 1). One workgroup of 256 per row (the finalize entries: a
//   single invocation).
// Method: logits are compared through an order-preserving u32 key of their bits, so a threshold is found
// exactly by bisection over the 32 key bits: top-k counts the tokens at or above a candidate key, top-p sums
// their weights (32 passes each over the row, invocation j reading tokens j, j + 256, ...). The steps that
// need token-index order (breaking top-k ties, the CDF) give each invocation one contiguous chunk of the row
// and prefix-sum the chunk totals. A speculative row i < k computes its accept decision AND the token it
// would emit if it were the first rejection (the residual draw), so rows run in parallel and spec_finalize
// only picks n, the first rejected row (k if none), and that row's token. Tree rows likewise: each row decides
// which child (if any) it accepts and the token it emits if the walk stops there; tree_finalize walks.

struct Params {
  vocab: u32,
  temperature: f32,
  top_k: u32,
  top_p: f32,
  k: u32,
  onehot: u32,
}

// What the filtered distribution of one row is, found by `filter_row`.
struct RowState {
  max_key: u32,  // key of the row maximum
  argmax: u32,  // lowest index holding it: the greedy answer, and every fallback's
  max_scaled: f32,  // the maximum / temperature
  // Top-k keeps key > topk_key, and key == topk_key up to index topk_last; zeros keep everything.
  topk_key: u32,
  topk_last: u32,
  min_key: u32,  // top-p keeps key >= min_key
  total: f32,  // the kept weight (set by `with_total`; the sampler does not need it)
  nonfinite: u32,  // 1 if the row holds NaN or +inf
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> randoms: array<f32>;
@group(0) @binding(3) var<storage, read_write> out_ids: array<u32>;
@group(0) @binding(4) var<storage, read> draft_logits: array<f32>;
@group(0) @binding(5) var<storage, read_write> draft_states: array<RowState>;
@group(0) @binding(6) var<storage, read> tokens: array<u32>;
@group(0) @binding(7) var<storage, read_write> row_results: array<u32>;
@group(0) @binding(8) var<storage, read_write> result: array<u32>;
@group(0) @binding(9) var<storage, read> tree: array<vec2<u32>>;

const WG: u32 = 256u;
// The key of -inf, which NaN shares. Every logit's key is >= this, so key 0 is below every token.
const NEG_INF_KEY: u32 = 0x007fffffu;
const POS_INF_BITS: u32 = 0x7f800000u;
// Status bits of a speculative step (doppler_py/ops/speculative.py names them).
const STATUS_TARGET_NONFINITE: u32 = 1u;
const STATUS_DRAFT_NONFINITE: u32 = 2u;
const STATUS_DRAFT_TOKEN_OUT_OF_RANGE: u32 = 4u;
const ROW_RESULT_WORDS: u32 = 3u;  // accepted (tree rows: the accepted child's row, 0 = none), token, status
const MAX_TREE_ROWS: u32 = 32u;  // ancestor masks are one u32

var<workgroup> partial: array<f32, 256>;  // workgroup_sum's tree
var<workgroup> bounds: array<f32, 257>;  // workgroup_prefix's result
var<workgroup> count: atomic<u32>;
var<workgroup> row_max_key: atomic<u32>;
var<workgroup> row_nonfinite: atomic<u32>;
var<workgroup> chosen: atomic<u32>;  // the argmax first, then a sampled token
var<workgroup> last_tie: atomic<u32>;
// One-hot residuals leave these tokens out (spec_rows: the rejected draft; tree_rows: the row's children).
// Every invocation holds the same list.
var<private> excluded: array<u32, 32>;
var<private> excluded_count: u32;

// a < b as reals iff order_key(a) < order_key(b); NaN gets the key of -inf and -0 the key of +0.
fn order_key(x: f32) -> u32 {
  let bits = bitcast<u32>(x);
  if ((bits & 0x7fffffffu) > POS_INF_BITS) {
    return NEG_INF_KEY;
  }
  if ((bits & 0x80000000u) == 0u || bits == 0x80000000u) {
    return bits | 0x80000000u;
  }
  return ~bits;
}

fn key_value(key: u32) -> f32 {
  if ((key & 0x80000000u) != 0u) {
    return bitcast<f32>(key & 0x7fffffffu);
  }
  return bitcast<f32>(~key);
}

fn is_nan_or_pos_inf(x: f32) -> bool {
  let bits = bitcast<u32>(x);
  return (bits & 0x7fffffffu) > POS_INF_BITS || bits == POS_INF_BITS;
}

// exp(s - max s) with s = x / temperature; the row's top tokens weigh exactly 1 (also when they are +inf or
// when the whole row is -inf), so no inf - inf is ever formed.
fn weight(x: f32, key: u32, s: RowState) -> f32 {
  if (key == NEG_INF_KEY) {
    return select(0.0, 1.0, s.max_key == NEG_INF_KEY);
  }
  let scaled = x / params.temperature;
  if (bitcast<u32>(scaled) == bitcast<u32>(s.max_scaled)) {
    return 1.0;
  }
  if (bitcast<u32>(s.max_scaled) == POS_INF_BITS) {
    return 0.0;
  }
  // The clamp keeps an overflowed difference away from exp(-inf); exp underflows to 0 long before -126.
  return exp(max(scaled - s.max_scaled, -126.0));
}

// Weight of token i (logit x) if top-k keeps it and its key is >= min_key, else 0.
fn kept_weight(x: f32, i: u32, s: RowState, min_key: u32) -> f32 {
  let key = order_key(x);
  let in_top_k = key > s.topk_key || (key == s.topk_key && i <= s.topk_last);
  if (!in_top_k || key < min_key) {
    return 0.0;
  }
  return weight(x, key, s);
}

// Sum of `value` over the workgroup by a fixed tree: equal inputs give equal sums, and since rounding is
// monotone a sum of non-negative terms never decreases when one term grows (top-p's bisection needs that).
fn workgroup_sum(lid: u32, value: f32) -> f32 {
  partial[lid] = value;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
    if (lid < stride) {
      partial[lid] = partial[lid] + partial[lid + stride];
    }
    workgroupBarrier();
  }
  let total = partial[0];
  workgroupBarrier();
  return total;
}

fn workgroup_count(lid: u32, value: u32) -> u32 {
  if (lid == 0u) {
    atomicStore(&count, 0u);
  }
  workgroupBarrier();
  atomicAdd(&count, value);
  workgroupBarrier();
  let total = atomicLoad(&count);
  workgroupBarrier();
  return total;
}

// bounds[j] = sum of the values of invocations < j, bounds[WG] = the total. One invocation adds them in
// order, so the bounds never decrease and [bounds[j], bounds[j + 1]) tile [0, total) without overlap.
fn workgroup_prefix(lid: u32, value: f32) {
  bounds[lid + 1u] = value;
  workgroupBarrier();
  if (lid == 0u) {
    bounds[0] = 0.0;
    for (var j = 1u; j <= WG; j = j + 1u) {
      bounds[j] = bounds[j - 1u] + bounds[j];
    }
  }
  workgroupBarrier();
}

// Invocation lid's contiguous chunk [x, y) of the row, for the passes that need token-index order.
fn chunk_range(lid: u32) -> vec2<u32> {
  let chunk = (params.vocab + WG - 1u) / WG;
  let start = min(lid * chunk, params.vocab);
  return vec2<u32>(start, min(start + chunk, params.vocab));
}

// The chunk holding goal in [bounds[lid], bounds[lid + 1]); when rounding puts goal at the total, the last
// chunk with any mass. At most one invocation owns the goal.
fn owns_goal(lid: u32, goal: f32) -> bool {
  let start = bounds[lid];
  let end = bounds[lid + 1u];
  return start <= goal && (goal < end || (start < end && end == bounds[WG]));
}

// One token of the inverse-CDF walk through the chunk that owns the goal: a kept token (w > 0) adds its weight
// to `running` and becomes the candidate; true once the running mass passes the goal, where the walk stops.
fn walk_passes_goal(i: u32, w: f32, goal: f32, running: ptr<function, f32>, token: ptr<function, u32>) -> bool {
  if (w > 0.0) {
    *running = *running + w;
    *token = i;
    return *running > goal;
  }
  return false;
}

// -- one row of `logits`, starting at `base` ---------------------------------------------------------------

// The workgroup's best of every invocation's (key, index): the largest key, the lowest index among equals.
fn workgroup_best(lid: u32, key: u32, index: u32) -> vec2<u32> {
  if (lid == 0u) {
    atomicStore(&row_max_key, 0u);
    atomicStore(&chosen, params.vocab - 1u);
  }
  workgroupBarrier();
  atomicMax(&row_max_key, key);
  workgroupBarrier();
  let max_key = atomicLoad(&row_max_key);
  if (key == max_key) {
    atomicMin(&chosen, index);
  }
  workgroupBarrier();
  let best = vec2<u32>(max_key, atomicLoad(&chosen));
  workgroupBarrier();
  return best;
}

// The row maximum, the lowest index holding it, and whether the row holds NaN or +inf.
fn scan_row(lid: u32, base: u32) -> RowState {
  var best_key = 0u;
  var best_index = 0u;
  var nonfinite = 0u;
  for (var i = lid; i < params.vocab; i = i + WG) {
    let x = logits[base + i];
    let key = order_key(x);
    if (key > best_key) {
      best_key = key;
      best_index = i;
    }
    nonfinite = nonfinite | select(0u, 1u, is_nan_or_pos_inf(x));
  }
  if (lid == 0u) {
    atomicStore(&row_nonfinite, 0u);
  }
  let best = workgroup_best(lid, best_key, best_index);  // its first barrier orders the store above
  atomicOr(&row_nonfinite, nonfinite);
  workgroupBarrier();
  var s: RowState;  // zero: top-k and top-p keep everything
  s.max_key = best.x;
  s.argmax = best.y;
  s.nonfinite = atomicLoad(&row_nonfinite);
  workgroupBarrier();
  return s;
}

fn count_at_or_above(lid: u32, base: u32, min_key: u32) -> u32 {
  var n = 0u;
  for (var i = lid; i < params.vocab; i = i + WG) {
    n = n + select(0u, 1u, order_key(logits[base + i]) >= min_key);
  }
  return workgroup_count(lid, n);
}

fn mass_at_or_above(lid: u32, base: u32, s: RowState, min_key: u32) -> f32 {
  var mass = 0.0;
  for (var i = lid; i < params.vocab; i = i + WG) {
    mass = mass + kept_weight(logits[base + i], i, s, min_key);
  }
  return workgroup_sum(lid, mass);
}

// Restricts to exactly k tokens: finds the k-th largest key, then which tied tokens fill the last slots.
fn select_top_k(lid: u32, base: u32, state: RowState, k: u32) -> RowState {
  // The largest key t with at least k tokens >= t is the k-th largest logit's key.
  var t = 0u;
  for (var bit = 0u; bit < 32u; bit = bit + 1u) {
    let candidate = t | (0x80000000u >> bit);
    let n = count_at_or_above(lid, base, candidate);
    if (n >= k) {
      t = candidate;
    }
  }
  let chunk = chunk_range(lid);
  var above = 0u;
  var ties = 0u;
  for (var i = chunk.x; i < chunk.y; i = i + 1u) {
    let key = order_key(logits[base + i]);
    above = above + select(0u, 1u, key > t);
    ties = ties + select(0u, 1u, key == t);
  }
  if (lid == 0u) {
    atomicStore(&last_tie, params.vocab - 1u);
  }
  let slots = k - workgroup_count(lid, above);  // >= 1 tied tokens still to keep, lowest index first
  workgroup_prefix(lid, f32(ties));  // counts below 2^24 are exact in f32
  let ties_before = u32(bounds[lid]);
  if (ties_before < slots && slots <= ties_before + ties) {
    var seen = ties_before;
    for (var i = chunk.x; i < chunk.y; i = i + 1u) {
      if (order_key(logits[base + i]) == t) {
        seen = seen + 1u;
        if (seen == slots) {
          atomicStore(&last_tie, i);
          break;
        }
      }
    }
  }
  workgroupBarrier();
  var s = state;
  s.topk_key = t;
  s.topk_last = atomicLoad(&last_tie);
  workgroupBarrier();
  return s;
}

// The smallest key v such that the top-k tokens >= v hold at least top_p of the top-k mass.
fn top_p_min_key(lid: u32, base: u32, s: RowState) -> u32 {
  let needed = params.top_p * mass_at_or_above(lid, base, s, 0u);
  var t = 0u;
  for (var bit = 0u; bit < 32u; bit = bit + 1u) {
    let candidate = t | (0x80000000u >> bit);
    let mass = mass_at_or_above(lid, base, s, candidate);
    if (mass >= needed) {
      t = candidate;
    }
  }
  return t;
}

// The row's filtered distribution: argmax only when greedy, else temperature, top-k and top-p.
fn filter_row(lid: u32, base: u32) -> RowState {
  var s = scan_row(lid, base);
  if (params.temperature > 0.0) {
    s.max_scaled = key_value(s.max_key) / params.temperature;
    if (params.top_k > 0u && params.top_k < params.vocab) {
      s = select_top_k(lid, base, s, params.top_k);
    }
    if (params.top_p < 1.0) {
      s.min_key = top_p_min_key(lid, base, s);
    }
  }
  return s;
}

fn with_total(lid: u32, base: u32, state: RowState) -> RowState {
  var s = state;
  s.total = mass_at_or_above(lid, base, s, s.min_key);
  return s;
}

// Inverse CDF over the kept tokens in index order: the first token whose running mass exceeds u * total.
fn pick(lid: u32, base: u32, s: RowState, u: f32) -> u32 {
  let chunk = chunk_range(lid);
  var mass = 0.0;
  for (var i = chunk.x; i < chunk.y; i = i + 1u) {
    mass = mass + kept_weight(logits[base + i], i, s, s.min_key);
  }
  if (lid == 0u) {
    atomicStore(&chosen, s.argmax);
  }
  workgroup_prefix(lid, mass);
  let goal = u * bounds[WG];
  if (owns_goal(lid, goal)) {
    var running = bounds[lid];
    var token = chunk.x;
    for (var i = chunk.x; i < chunk.y; i = i + 1u) {
      if (walk_passes_goal(i, kept_weight(logits[base + i], i, s, s.min_key), goal, &running, &token)) {
        break;
      }
    }
    atomicStore(&chosen, token);
  }
  workgroupBarrier();
  let token = atomicLoad(&chosen);
  workgroupBarrier();
  return token;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x;
  let base = row * params.vocab;
  let s = filter_row(lid, base);
  var token = s.argmax;
  if (params.temperature > 0.0) {
    token = pick(lid, base, s, randoms[row]);
  }
  if (lid == 0u) {
    out_ids[row] = token;
  }
}

// -- speculative verification -------------------------------------------------------------------------------

// q_i for every draft row i, with its total, so spec_rows can read the draft's distribution beside the target's.
@compute @workgroup_size(256)
fn spec_draft_filter(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.x * params.vocab;
  let s = with_total(lid, base, filter_row(lid, base));
  if (lid == 0u) {
    draft_states[wid.x] = s;
  }
}

fn is_excluded(i: u32) -> bool {
  for (var j = 0u; j < excluded_count; j = j + 1u) {
    if (excluded[j] == i) {
      return true;
    }
  }
  return false;
}

// The residual max(0, p(i) - q(i)) of token i; in one-hot mode q is one-hot at each rejected deterministic
// draft (the `excluded` tokens), so it is p without them.
fn residual_weight(i: u32, row: u32, p: RowState, q: RowState) -> f32 {
  let p_i = kept_weight(logits[row * params.vocab + i], i, p, p.min_key) / p.total;
  if (params.onehot != 0u) {
    return select(p_i, 0.0, is_excluded(i));
  }
  let q_i = kept_weight(draft_logits[row * params.vocab + i], i, q, q.min_key) / q.total;
  return max(p_i - q_i, 0.0);
}

// A draw from normalise(max(0, p - q)) by inverse CDF with u; from p when the residual is empty (rounding, or
// one-hot drafts that covered all of p's mass).
fn residual_pick(lid: u32, row: u32, p: RowState, q: RowState, u: f32) -> u32 {
  let chunk = chunk_range(lid);
  var mass = 0.0;
  for (var i = chunk.x; i < chunk.y; i = i + 1u) {
    mass = mass + residual_weight(i, row, p, q);
  }
  if (lid == 0u) {
    atomicStore(&chosen, p.argmax);
  }
  workgroup_prefix(lid, mass);
  let goal = u * bounds[WG];
  if (bounds[WG] > 0.0 && owns_goal(lid, goal)) {
    var running = bounds[lid];
    var token = chunk.x;
    for (var i = chunk.x; i < chunk.y; i = i + 1u) {
      if (walk_passes_goal(i, residual_weight(i, row, p, q), goal, &running, &token)) {
        break;
      }
    }
    atomicStore(&chosen, token);
  }
  // The uniform load lets the fallback's barriers sit under a branch that Tint can prove uniform.
  let residual_mass = workgroupUniformLoad(&bounds[WG]);
  let token = atomicLoad(&chosen);
  workgroupBarrier();
  if (residual_mass > 0.0) {
    return token;
  }
  return pick(lid, row * params.vocab, p, u);
}

// Row i < k: whether d_i is accepted, and the token emitted if row i is the first rejection. Row k: the bonus.
@compute @workgroup_size(256)
fn spec_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let k = params.k;
  let row = wid.x;
  let base = row * params.vocab;
  let u_final = randoms[2u * k];
  let p = filter_row(lid, base);
  var status = select(0u, STATUS_TARGET_NONFINITE, p.nonfinite != 0u);
  var accepted = 0u;
  var token = p.argmax;
  if (row == k) {
    if (params.temperature > 0.0) {
      token = pick(lid, base, p, u_final);
    }
  } else {
    let d = tokens[1u + row];
    let valid = d < params.vocab;
    status = status | select(STATUS_DRAFT_TOKEN_OUT_OF_RANGE, 0u, valid);
    let safe_d = min(d, params.vocab - 1u);  // never index past the row
    if (params.temperature > 0.0) {
      let p_full = with_total(lid, base, p);
      var q = p_full;  // not read in one-hot mode
      var q_d = 1.0;
      if (params.onehot == 0u) {
        q = draft_states[row];  // no barrier depends on q, so a read_write binding is fine
        q_d = select(0.0, kept_weight(draft_logits[base + safe_d], safe_d, q, q.min_key) / q.total, valid);
        status = status | select(0u, STATUS_DRAFT_NONFINITE, q.nonfinite != 0u);
      }
      let p_d = select(0.0, kept_weight(logits[base + safe_d], safe_d, p_full, p_full.min_key) / p_full.total, valid);
      accepted = select(0u, 1u, randoms[k + row] * q_d < p_d);
      excluded[0] = d;
      excluded_count = 1u;
      token = residual_pick(lid, row, p_full, q, u_final);
    } else {
      accepted = select(0u, 1u, valid && d == p.argmax);
    }
  }
  if (lid == 0u) {
    row_results[ROW_RESULT_WORDS * row] = accepted;
    row_results[ROW_RESULT_WORDS * row + 1u] = token;
    row_results[ROW_RESULT_WORDS * row + 2u] = status;
  }
}

// n = the first rejected row (k if none), its token, the status of all rows, and a copy of the drafts.
@compute @workgroup_size(1)
fn spec_finalize() {
  let k = params.k;
  var n = k;
  var status = 0u;
  for (var i = 0u; i <= k; i = i + 1u) {
    status = status | row_results[ROW_RESULT_WORDS * i + 2u];
    if (i < n && row_results[ROW_RESULT_WORDS * i] == 0u) {
      n = i;
    }
  }
  result[0] = n;
  result[1] = row_results[ROW_RESULT_WORDS * n + 1u];
  result[2] = status;
  for (var i = 0u; i < k; i = i + 1u) {
    result[3u + i] = tokens[1u + i];
  }
}

// -- token-tree verification --------------------------------------------------------------------------------

// A tree row's parent: the highest bit of its ancestor mask other than its own.
fn tree_parent(row: u32) -> u32 {
  return u32(firstLeadingBit(tree[row].y & ~(1u << row)));
}

// Row r: the child it accepts (0: none) and the token emitted if the walk stops at r; the children are tested
// in row order, each with its own uniform randoms[child - 1], against the mass the earlier ones left.
@compute @workgroup_size(256)
fn tree_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let rows = params.k + 1u;
  let row = wid.x;
  let base = row * params.vocab;
  let p = filter_row(lid, base);
  var status = select(0u, STATUS_TARGET_NONFINITE, p.nonfinite != 0u);
  var accepted = 0u;
  var token = p.argmax;
  if (params.temperature > 0.0) {
    let p_full = with_total(lid, base, p);
    excluded_count = 0u;
    var rejected_mass = 0.0;  // p of the distinct children tokens rejected so far
    for (var child = row + 1u; child < rows; child = child + 1u) {
      if (tree_parent(child) != row) {
        continue;
      }
      let d = tokens[child];
      if (d >= params.vocab) {
        status = status | STATUS_DRAFT_TOKEN_OUT_OF_RANGE;
        continue;
      }
      if (is_excluded(d)) {
        continue;  // a repeated sibling: its token's mass is gone already, so it cannot be accepted
      }
      let p_d = kept_weight(logits[base + d], d, p_full, p_full.min_key) / p_full.total;
      let remaining = 1.0 - rejected_mass;
      if (remaining > 0.0 && randoms[child - 1u] * remaining < p_d) {
        accepted = child;
        break;
      }
      rejected_mass = rejected_mass + p_d;
      excluded[excluded_count] = d;
      excluded_count = excluded_count + 1u;
    }
    // With no child tested (a leaf) nothing is excluded and this is a draw from p. No branch on the count:
    // Tint cannot prove a private variable uniform, and the draw has barriers.
    token = residual_pick(lid, row, p_full, p_full, randoms[params.k]);
  } else {
    for (var child = row + 1u; child < rows; child = child + 1u) {
      if (tree_parent(child) == row && tokens[child] == p.argmax) {
        accepted = child;
        break;
      }
    }
  }
  if (lid == 0u) {
    row_results[ROW_RESULT_WORDS * row] = accepted;
    row_results[ROW_RESULT_WORDS * row + 1u] = token;
    row_results[ROW_RESULT_WORDS * row + 2u] = status;
  }
}

// The walk from the root along accepted children; the status of every row.
@compute @workgroup_size(1)
fn tree_finalize() {
  let rows = params.k + 1u;
  var status = 0u;
  for (var r = 0u; r < rows; r = r + 1u) {
    status = status | row_results[ROW_RESULT_WORDS * r + 2u];
  }
  var node = 0u;
  var n = 0u;
  for (var next = row_results[0]; next != 0u && n < MAX_TREE_ROWS; next = row_results[ROW_RESULT_WORDS * next]) {
    result[3u + 2u * n] = tokens[next];
    result[4u + 2u * n] = next;
    n = n + 1u;
    node = next;
  }
  result[0] = n;
  result[1] = row_results[ROW_RESULT_WORDS * node + 1u];
  result[2] = status;
}

// -- a greedy drafter's branches ----------------------------------------------------------------------------

// The params.k (<= 32) largest logits of each row, best first (the lowest index first among equals, NaN ranked
// as -inf), into out_ids[row * k + j]; params.vocab where the row has fewer than k tokens.
@compute @workgroup_size(256)
fn top_tokens(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x;
  let base = row * params.vocab;
  excluded_count = 0u;
  for (var j = 0u; j < params.k; j = j + 1u) {
    var best_key = 0u;
    var best_index = 0u;
    for (var i = lid; i < params.vocab; i = i + WG) {
      let key = order_key(logits[base + i]);
      if (key > best_key && !is_excluded(i)) {
        best_key = key;
        best_index = i;
      }
    }
    let best = workgroup_best(lid, best_key, best_index);
    excluded[j] = best.y;
    excluded_count = j + 1u;
    if (lid == 0u) {
      out_ids[row * params.k + j] = select(best.y, params.vocab, best.x == 0u);
    }
  }
}
