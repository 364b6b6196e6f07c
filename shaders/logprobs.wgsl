// logprobs: the log-probabilities a speculative step's verified rows give to the committed tokens, plus each
// row's top_n most likely tokens, from the rows already in `logits` (no extra forward).
// Distribution: log_softmax(logits[row] / temperature) over the whole vocabulary (the host passes 1 for greedy
// requests), before any top-k/top-p filtering. Entries equal to -inf are masked: log-probability -inf (their
// own bits), as softmax.wgsl; a row with no finite entry gives -inf everywhere. +inf and NaN are not
// supported (the verifier's status word reports them).
// Bindings: 0 params (uniform Params), 1 logits (read, f32 [rows, vocab]), 2 result (read, u32: the verifier's
// [accepted, token, status, d_0 .. d_{k-1}]), 3 out (read_write, f32 [rows, ROW_WORDS]).
// The chosen token of row r is d_r for r < accepted and the final token for r = accepted; rows after
// `accepted` are written too (with a meaningless chosen token) and ignored by the host.
// out[row] = [chosen id, chosen logprob, (id, logprob) x top_n], ids as f32 (exact below 2^24): the top entries
// in order of decreasing log-probability, ties by increasing id; id -1 (and a -inf log-probability) pads a
// row whose vocabulary has fewer than top_n entries. (f32, not u32 bits, so the Dawn replay compares the
// log-probabilities with a tolerance.)
// Params: vocab, temperature (> 0), top_n (0 .. MAX_TOP).
// Dispatch: (rows, 1, 1) workgroups of 256, one per row. One pass keeps a running (max, sum of exp) per
// invocation, a tree reduction gives the row's log-sum-exp; then top_n selection rounds, each a strided scan
// for the best entry ordered after the previous round's pick, and a tree reduction.
//
// -inf is recognised by its bit pattern and never used in arithmetic or comparisons (WGSL lets implementations
// assume that infinities do not occur); for ordering, a masked entry counts as LOWEST.

const WG: u32 = 256u;
const MAX_TOP: u32 = 20u;
const ROW_WORDS: u32 = 2u + 2u * MAX_TOP;
const NEG_INF_BITS: u32 = 0xff800000u;
const NO_TOKEN: u32 = 0xffffffffu;
const LOWEST: f32 = -0x1.fffffep+127f;  // -FLT_MAX

struct Params {
  vocab: u32,
  temperature: f32,
  top_n: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> result: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> wg_val: array<f32, WG>;  // running max, then the round's best value
var<workgroup> wg_aux: array<f32, WG>;  // running sum of exp
var<workgroup> wg_id: array<u32, WG>;  // the round's best id
var<workgroup> wg_prev_val: f32;
var<workgroup> wg_prev_id: u32;

fn is_masked(raw: f32) -> bool {
  return bitcast<u32>(raw) == NEG_INF_BITS;
}

fn exp_nonpositive(d: f32) -> f32 {
  return select(0.0, exp(d), d > -87.0);
}

fn rescale(sum: f32, shift: f32) -> f32 {
  return sum * exp_nonpositive(shift);
}

// The ordering key of an entry: its scaled logit, LOWEST when masked.
fn key(raw: f32) -> f32 {
  return select(raw / params.temperature, LOWEST, is_masked(raw));
}

// Log-probability bits of an entry, given the row's log-sum-exp (lse_ok false: the row has no finite entry).
fn logprob_bits(raw: f32, lse: f32, lse_ok: bool) -> u32 {
  return select(bitcast<u32>(raw / params.temperature - lse), NEG_INF_BITS, is_masked(raw) || !lse_ok);
}

// (v, id) comes before (bv, bid) in the order: larger value first, then smaller id; NO_TOKEN comes last.
fn before(v: f32, id: u32, bv: f32, bid: u32) -> bool {
  return id != NO_TOKEN && (bid == NO_TOKEN || v > bv || (v == bv && id < bid));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x;
  let base = row * params.vocab;
  var run_max = LOWEST;
  var run_sum = 0.0;
  for (var i = lid; i < params.vocab; i += WG) {
    let raw = logits[base + i];
    if (!is_masked(raw)) {
      let x = raw / params.temperature;
      let new_max = max(run_max, x);
      run_sum = rescale(run_sum, run_max - new_max) + exp_nonpositive(x - new_max);
      run_max = new_max;
    }
  }
  wg_val[lid] = run_max;
  wg_aux[lid] = run_sum;
  wg_id[lid] = NO_TOKEN;
  if (lid == 0u) {
    wg_prev_val = LOWEST;
    wg_prev_id = NO_TOKEN;
  }
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      let m = max(wg_val[lid], wg_val[lid + stride]);
      wg_aux[lid] = rescale(wg_aux[lid], wg_val[lid] - m) + rescale(wg_aux[lid + stride], wg_val[lid + stride] - m);
      wg_val[lid] = m;
    }
    workgroupBarrier();
  }
  let lse_ok = wg_aux[0] > 0.0;
  let lse = wg_val[0] + log(select(1.0, wg_aux[0], lse_ok));
  workgroupBarrier();  // everyone has read the sums before the rounds reuse wg_val

  let out_base = row * ROW_WORDS;
  if (lid == 0u) {
    var chosen = result[1];
    if (row < result[0]) {
      chosen = result[3u + row];
    }
    out[out_base] = f32(chosen);
    var bits = bitcast<u32>(0.0);  // a chosen token outside the vocabulary cannot happen; keep the word defined
    if (chosen < params.vocab) {
      bits = logprob_bits(logits[base + chosen], lse, lse_ok);
    }
    out[out_base + 1u] = bitcast<f32>(bits);
  }

  let top_n = min(params.top_n, MAX_TOP);
  for (var round = 0u; round < top_n; round++) {
    let prev_val = wg_prev_val;
    let prev_id = wg_prev_id;
    var best_val = LOWEST;
    var best_id = NO_TOKEN;
    for (var i = lid; i < params.vocab; i += WG) {
      let v = key(logits[base + i]);
      // Only entries ordered after the previous pick (all in the first round; none once a round found none).
      let after = round == 0u || v < prev_val || (v == prev_val && i > prev_id);
      if (after && before(v, i, best_val, best_id)) {
        best_val = v;
        best_id = i;
      }
    }
    wg_val[lid] = best_val;
    wg_id[lid] = best_id;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
      if (lid < stride && before(wg_val[lid + stride], wg_id[lid + stride], wg_val[lid], wg_id[lid])) {
        wg_val[lid] = wg_val[lid + stride];
        wg_id[lid] = wg_id[lid + stride];
      }
      workgroupBarrier();
    }
    if (lid == 0u) {
      let id = wg_id[0];
      var bits = NEG_INF_BITS;
      var id_value = -1.0;
      if (id != NO_TOKEN) {
        bits = logprob_bits(logits[base + id], lse, lse_ok);
        id_value = f32(id);
      }
      out[out_base + 2u + 2u * round] = id_value;
      out[out_base + 3u + 2u * round] = bitcast<f32>(bits);
      wg_prev_val = wg_val[0];
      wg_prev_id = id;
    }
    workgroupBarrier();
  }
}
