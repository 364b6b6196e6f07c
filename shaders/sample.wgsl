// sample: one token id per row of logits: the argmax (temperature 0), or a draw from the temperature-scaled
// distribution restricted to an exact top-k and then a top-p set, by inverse CDF with a host-drawn uniform u.
// The contract (NaN, ties, infinities, rounding) is the docstring of doppler_py/sampling.py, whose numpy
// functions are the reference this kernel is tested against.
// Bindings: 0 params (uniform Params), 1 logits (read, [rows, vocab] f32), 2 randoms (read, [rows] f32 in
//   [0, 1]), 3 out_ids (read_write, [rows] u32; always a valid id in [0, vocab), whatever the inputs).
// Params: vocab (1 <= vocab < 2^24); temperature (<= 0 = greedy); top_k (0 or >= vocab = off);
//   top_p (>= 1 = off).
// Dispatch: (rows, 1, 1) workgroups of 256, one workgroup per row.
// Method: logits are compared through an order-preserving u32 key of their bits, so a threshold is found
// exactly by bisection over the 32 key bits: top-k counts the tokens at or above a candidate key, top-p sums
// their weights (32 passes each over the row, invocation j reading tokens j, j + 256, ...). The steps that
// need token-index order (breaking top-k ties, the CDF) give each invocation one contiguous chunk of the row
// and prefix-sum the chunk totals.

struct Params {
  vocab: u32,
  temperature: f32,
  top_k: u32,
  top_p: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> randoms: array<f32>;
@group(0) @binding(3) var<storage, read_write> out_ids: array<u32>;

const WG: u32 = 256u;
// The key of -inf, which NaN shares. Every logit's key is >= this, so key 0 is below every token.
const NEG_INF_KEY: u32 = 0x007fffffu;
const POS_INF_BITS: u32 = 0x7f800000u;

var<workgroup> partial: array<f32, 256>;  // workgroup_sum's tree
var<workgroup> bounds: array<f32, 257>;  // workgroup_prefix's result
var<workgroup> count: atomic<u32>;
var<workgroup> row_max_key: atomic<u32>;
var<workgroup> chosen: atomic<u32>;  // the argmax first, then the sampled token
var<workgroup> last_tie: atomic<u32>;

// Per-invocation copies of the row's state, so the helpers below need few arguments.
var<private> row_base: u32;
var<private> max_key: u32;
var<private> max_scaled: f32;
// Top-k keeps key > topk_key, and key == topk_key up to index topk_last; the defaults keep everything.
var<private> topk_key: u32;
var<private> topk_last: u32;

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

// exp(s - max s) with s = x / temperature; the row's top tokens weigh exactly 1 (also when they are +inf or
// when the whole row is -inf), so no inf - inf is ever formed.
fn weight(x: f32, key: u32) -> f32 {
  if (key == NEG_INF_KEY) {
    return select(0.0, 1.0, max_key == NEG_INF_KEY);
  }
  let s = x / params.temperature;
  if (bitcast<u32>(s) == bitcast<u32>(max_scaled)) {
    return 1.0;
  }
  if (bitcast<u32>(max_scaled) == POS_INF_BITS) {
    return 0.0;
  }
  // The clamp keeps an overflowed difference away from exp(-inf); exp underflows to 0 long before -126.
  return exp(max(s - max_scaled, -126.0));
}

// Weight of token i if top-k keeps it and its key is >= min_key, else 0.
fn kept_weight(i: u32, min_key: u32) -> f32 {
  let x = logits[row_base + i];
  let key = order_key(x);
  let in_top_k = key > topk_key || (key == topk_key && i <= topk_last);
  if (!in_top_k || key < min_key) {
    return 0.0;
  }
  return weight(x, key);
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

fn count_at_or_above(lid: u32, min_key: u32) -> u32 {
  var n = 0u;
  for (var i = lid; i < params.vocab; i = i + WG) {
    n = n + select(0u, 1u, order_key(logits[row_base + i]) >= min_key);
  }
  return workgroup_count(lid, n);
}

fn mass_at_or_above(lid: u32, min_key: u32) -> f32 {
  var mass = 0.0;
  for (var i = lid; i < params.vocab; i = i + WG) {
    mass = mass + kept_weight(i, min_key);
  }
  return workgroup_sum(lid, mass);
}

// Restricts to exactly k tokens: finds the k-th largest key, then which tied tokens fill the last slots.
fn select_top_k(lid: u32, k: u32, chunk_start: u32, chunk_end: u32) {
  // The largest key t with at least k tokens >= t is the k-th largest logit's key.
  var t = 0u;
  for (var bit = 0u; bit < 32u; bit = bit + 1u) {
    let candidate = t | (0x80000000u >> bit);
    let n = count_at_or_above(lid, candidate);
    if (n >= k) {
      t = candidate;
    }
  }
  var above = 0u;
  var ties = 0u;
  for (var i = chunk_start; i < chunk_end; i = i + 1u) {
    let key = order_key(logits[row_base + i]);
    above = above + select(0u, 1u, key > t);
    ties = ties + select(0u, 1u, key == t);
  }
  let slots = k - workgroup_count(lid, above);  // >= 1 tied tokens still to keep, lowest index first
  workgroup_prefix(lid, f32(ties));  // counts below 2^24 are exact in f32
  let ties_before = u32(bounds[lid]);
  if (ties_before < slots && slots <= ties_before + ties) {
    var seen = ties_before;
    for (var i = chunk_start; i < chunk_end; i = i + 1u) {
      if (order_key(logits[row_base + i]) == t) {
        seen = seen + 1u;
        if (seen == slots) {
          atomicStore(&last_tie, i);
          break;
        }
      }
    }
  }
  workgroupBarrier();
  topk_key = t;
  topk_last = atomicLoad(&last_tie);
}

// The smallest key v such that the top-k tokens >= v hold at least top_p of the top-k mass.
fn top_p_min_key(lid: u32) -> u32 {
  let needed = params.top_p * mass_at_or_above(lid, 0u);
  var t = 0u;
  for (var bit = 0u; bit < 32u; bit = bit + 1u) {
    let candidate = t | (0x80000000u >> bit);
    let mass = mass_at_or_above(lid, candidate);
    if (mass >= needed) {
      t = candidate;
    }
  }
  return t;
}

// Inverse CDF over the kept tokens in index order: the first token whose running mass exceeds u * total.
fn pick(lid: u32, row: u32, min_key: u32, chunk_start: u32, chunk_end: u32) {
  var mass = 0.0;
  for (var i = chunk_start; i < chunk_end; i = i + 1u) {
    mass = mass + kept_weight(i, min_key);
  }
  workgroup_prefix(lid, mass);
  let start = bounds[lid];
  let end = bounds[lid + 1u];
  let total = bounds[WG];
  let goal = randoms[row] * total;
  // The chunk holding goal; when rounding puts goal at the total, the last chunk with any mass.
  if (start <= goal && (goal < end || (start < end && end == total))) {
    var running = start;
    var token = chunk_start;
    for (var i = chunk_start; i < chunk_end; i = i + 1u) {
      let w = kept_weight(i, min_key);
      if (w > 0.0) {
        running = running + w;
        token = i;
        if (running > goal) {
          break;
        }
      }
    }
    atomicStore(&chosen, token);
  }
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let vocab = params.vocab;
  let row = wid.x;
  row_base = row * vocab;

  // Row maximum and the lowest index holding it: the greedy answer, and every fallback's.
  var best_key = 0u;
  var best_index = 0u;
  for (var i = lid; i < vocab; i = i + WG) {
    let key = order_key(logits[row_base + i]);
    if (key > best_key) {
      best_key = key;
      best_index = i;
    }
  }
  if (lid == 0u) {
    atomicStore(&row_max_key, 0u);
    atomicStore(&chosen, vocab - 1u);
    atomicStore(&last_tie, vocab - 1u);
  }
  workgroupBarrier();
  atomicMax(&row_max_key, best_key);
  workgroupBarrier();
  max_key = atomicLoad(&row_max_key);
  if (best_key == max_key) {
    atomicMin(&chosen, best_index);
  }
  workgroupBarrier();

  if (params.temperature > 0.0) {
    max_scaled = key_value(max_key) / params.temperature;
    let chunk = (vocab + WG - 1u) / WG;
    let chunk_start = min(lid * chunk, vocab);
    let chunk_end = min(chunk_start + chunk, vocab);
    topk_key = 0u;
    topk_last = 0u;
    if (params.top_k > 0u && params.top_k < vocab) {
      select_top_k(lid, params.top_k, chunk_start, chunk_end);
    }
    var min_key = 0u;
    if (params.top_p < 1.0) {
      min_key = top_p_min_key(lid);
    }
    pick(lid, row, min_key, chunk_start, chunk_end);
    workgroupBarrier();
  }
  if (lid == 0u) {
    out_ids[row] = atomicLoad(&chosen);
  }
}
