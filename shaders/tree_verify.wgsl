// tree_verify: greedy verification of a token tree (doppler_py/ops/tree.py's layout) in two entry points.
//   row_argmax: best[r] = the lowest index holding the maximum of logits row r, NaN ranked as -inf (the plain
//               greedy sampler's choice, shaders/sample.wgsl); a NaN or +inf sets STATUS_TARGET_NONFINITE.
//   walk:       from the root (row 0): take the child row whose token equals best[row] (the first such, in
//               row order), repeat from it; stop at a row with no such child. Writes
//               result[0] = accepted nodes, result[1] = best of the last row (the token emitted after them),
//               result[2] = status, result[3 + 2 i] = token and result[4 + 2 i] = row of accepted node i.
// A row's parent is the highest other bit of its ancestor mask.
// Bindings: 0 params (uniform Params), 1 logits (read) [rows, vocab], 2 tokens (read) [rows] (row 0's unread),
//           3 tree (read) [rows] of (depth, ancestor mask), 4 best (read_write) [rows], 5 flags (read_write)
//           [1], 6 result (read_write) [3 + 2 * (rows - 1)].
// Params: rows (tree rows, root included, <= 32); vocab.
// Dispatch: row_argmax (rows, 1, 1) workgroups of 64, then walk (1, 1, 1). flags[0] must be 0 before
// row_argmax (walk clears it for the next step).

struct Params {
  rows: u32,
  vocab: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> tokens: array<u32>;
@group(0) @binding(3) var<storage, read> tree: array<vec2<u32>>;
@group(0) @binding(4) var<storage, read_write> best: array<u32>;
@group(0) @binding(5) var<storage, read_write> flags: array<atomic<u32>>;
@group(0) @binding(6) var<storage, read_write> result: array<u32>;

const LANES: u32 = 64u;
const NONE: u32 = 0xffffffffu;
const STATUS_TARGET_NONFINITE: u32 = 1u;
const POS_INF_BITS: u32 = 0x7f800000u;
const NEG_INF_KEY: u32 = 0x007fffffu;

var<workgroup> best_key: array<u32, 64>;
var<workgroup> best_index: array<u32, 64>;

// The order of sample.wgsl's greedy choice: a < b as reals iff key(a) < key(b), NaN ranks with -inf and -0
// with +0 (bit tests: compilers may fold float NaN comparisons away). Every key is above 0.
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

fn is_nan_or_pos_inf(x: f32) -> bool {
  let bits = bitcast<u32>(x);
  return (bits & 0x7fffffffu) > POS_INF_BITS || bits == POS_INF_BITS;
}

// Whether (key k, index i) beats (bk, bi): a larger key, or the same key at a lower index.
fn better(k: u32, i: u32, bk: u32, bi: u32) -> bool {
  return k > bk || (k == bk && i < bi);
}

@compute @workgroup_size(64)
fn row_argmax(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let row = wid.x;
  let base = row * params.vocab;
  var bk = 0u;
  var bi = NONE;
  var bad = false;
  for (var i = t; i < params.vocab; i += LANES) {
    let v = logits[base + i];
    bad = bad || is_nan_or_pos_inf(v);
    let k = order_key(v);
    if (better(k, i, bk, bi)) {
      bk = k;
      bi = i;
    }
  }
  if (bad) {
    atomicOr(&flags[0], STATUS_TARGET_NONFINITE);
  }
  best_key[t] = bk;
  best_index[t] = bi;
  workgroupBarrier();
  for (var half = LANES / 2u; half > 0u; half /= 2u) {
    if (t < half && better(best_key[t + half], best_index[t + half], best_key[t], best_index[t])) {
      best_key[t] = best_key[t + half];
      best_index[t] = best_index[t + half];
    }
    workgroupBarrier();
  }
  if (t == 0u) {
    best[row] = best_index[0];
  }
}

@compute @workgroup_size(1)
fn walk() {
  var node = 0u;
  var accepted = 0u;
  for (var child = 1u; child < params.rows; child++) {
    let parent = firstLeadingBit(tree[child].y & ~(1u << child));
    if (parent == node && tokens[child] == best[node]) {
      result[3u + 2u * accepted] = tokens[child];
      result[4u + 2u * accepted] = child;
      accepted += 1u;
      node = child;
    }
  }
  result[0] = accepted;
  result[1] = best[node];
  result[2] = atomicLoad(&flags[0]);
  atomicStore(&flags[0], 0u);
}
