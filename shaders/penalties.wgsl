// penalties: in place, each verified row's logits with the repetition, presence and frequency penalties and the
// logit bias of one generation (the contract and its numpy reference: doppler_py/testing/penalty_reference.py).
// Row r is penalised as if its path's drafts were committed: the tokens of rows 1..r that are row r itself or
// its ancestors (a chain: rows 1..r; a tree: bits of the row's ancestor mask), in row order, follow the committed
// tokens. Workgroup w works on logits row w as row r = row0 + w, and row j's token is tokens[drafts_at + j - 1]:
// a verification has row0 = 0 and drafts_at = 1 (tokens[0] is row 0's input); a drafter's row for its draft i,
// penalised as the target's row i will be so that it proposes what the penalised target samples, has row0 = i and
// drafts_at = 0 (tokens: the drafts so far). For a token t, with c = its count among the generated tokens plus
// among the path's, and `seen` = t is among the last `window` tokens of (committed tokens, path):
//   x = logits[r, t];  if seen: x = x > 0 ? x * inv_repetition : x * repetition
//   x = x - frequency * f32(c);  if c > 0: x = x - presence;  x = x + bias(t)
// Only finite logits change (-inf, +inf and NaN are left as they are, so the verifier still flags the last two).
// The work is sparse: the tokens of `entries` (every token with a generated count, one in the committed window, or
// a bias; sorted by token id) and the row's path tokens that are not among them.
// Bindings: 0 params (uniform Params), 1 tokens (read, u32: the rows' tokens, from tokens[drafts_at] on),
// 2 tree (read, u32 [rows, 2]: (depth, ancestor mask) per row; read only when params.is_tree = 1),
// 3 entries (read, u32 [entries, 4]: token, generated count, age = committed tokens after its last occurrence
// (0xffffffff: none), bias as f32 bits), 4 logits (read_write, f32 [rows, vocab]).
// Params: vocab, entries (how many), window (last tokens the repetition penalty looks at; 0xffffffff: all),
// is_tree (0: a chain, row r's path is rows 1..r), presence, frequency, repetition, inv_repetition = f32(1 / repetition),
// row0 and drafts_at (above).
// Dispatch: (rows, 1, 1) workgroups of 256; one workgroup per row.

const WG: u32 = 256u;
const MAX_PATH: u32 = 32u;  // ops/tree.py's MAX_TREE_ROWS: ancestor masks are one u32
const EXPONENT_BITS: u32 = 0x7f800000u;

struct Params {
  vocab: u32,
  entries: u32,
  window: u32,
  is_tree: u32,
  presence: f32,
  frequency: f32,
  repetition: f32,
  inv_repetition: f32,
  row0: u32,
  drafts_at: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read> tree: array<u32>;
@group(0) @binding(3) var<storage, read> entries: array<u32>;
@group(0) @binding(4) var<storage, read_write> logits: array<f32>;

var<workgroup> path: array<u32, MAX_PATH>;
var<workgroup> path_len: u32;

// The index of `token` in the sorted entries, or params.entries when it is not there.
fn find_entry(token: u32) -> u32 {
  var low = 0u;
  var high = params.entries;
  while (low < high) {
    let mid = (low + high) / 2u;
    let t = entries[4u * mid];
    if (t == token) {
      return mid;
    }
    if (t < token) {
      low = mid + 1u;
    } else {
      high = mid;
    }
  }
  return params.entries;
}

fn penalise(index: u32, token: u32, committed_count: u32, age: u32, bias: f32) {
  let x0 = logits[index];
  if ((bitcast<u32>(x0) & EXPONENT_BITS) == EXPONENT_BITS) {  // inf or NaN: left as it is
    return;
  }
  let m = path_len;
  var count = committed_count;
  var last = 0u;  // 1 + the index of the token's last occurrence in the path; 0: none
  for (var j = 0u; j < m; j++) {
    if (path[j] == token) {
      count += 1u;
      last = j + 1u;
    }
  }
  // In the last `window` tokens of (committed, path): among the path's last ones, or in the committed ones the
  // path leaves inside the window.
  let in_path = last > 0u && m - last < params.window;
  let in_committed = m < params.window && age < params.window - m;
  var x = x0;
  if (in_path || in_committed) {
    x = select(x * params.repetition, x * params.inv_repetition, x > 0.0);
  }
  x = x - params.frequency * f32(count);
  if (count > 0u) {
    x = x - params.presence;
  }
  logits[index] = x + bias;
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = params.row0 + wid.x;
  if (lid < MAX_PATH) {
    path[lid] = 0u;
  }
  // The zeros must land before invocation 0 writes the path: without this barrier an invocation scheduled after it
  // (SwiftShader runs a workgroup's invocations 4 at a time, up to each barrier) wipes path[4..].
  workgroupBarrier();
  if (lid == 0u) {
    var mask = (2u << row) - 1u;  // a chain: rows 0..row (row < MAX_PATH)
    if (params.is_tree != 0u) {
      mask = tree[2u * row + 1u];
    }
    var m = 0u;
    for (var j = 1u; j <= row; j++) {
      if ((mask & (1u << j)) != 0u) {
        path[m] = tokens[params.drafts_at + j - 1u];
        m += 1u;
      }
    }
    path_len = m;
  }
  workgroupBarrier();
  let base = wid.x * params.vocab;
  let m = path_len;
  for (var i = lid; i < params.entries + m; i += WG) {
    if (i < params.entries) {
      let token = entries[4u * i];
      if (token < params.vocab) {
        penalise(base + token, token, entries[4u * i + 1u], entries[4u * i + 2u], bitcast<f32>(entries[4u * i + 3u]));
      }
    } else {
      // A path token none of the entries holds, at its first occurrence in the path.
      let j = i - params.entries;
      let token = path[j];
      var first = token < params.vocab;
      for (var e = 0u; e < j; e++) {
        first = first && path[e] != token;
      }
      if (first && find_entry(token) == params.entries) {
        penalise(base + token, token, 0u, 0xffffffffu, 0.0);
      }
    }
  }
}
