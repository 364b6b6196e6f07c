// logprobs: the log-probabilities a speculative step's verified rows give to the committed tokens, plus each
// row's top_n most likely tokens. It only selects: the log-probabilities themselves are softmax.wgsl's
// LOG_SOFTMAX output for the same rows (the one copy of the online softmax), which the host dispatches just
// before this kernel, from the rows already in the target's logits (no extra forward).
// Distribution: log_softmax(logits[row] / temperature) over the whole vocabulary (the host passes 1 for greedy
// requests), before any top-k/top-p filtering. Masked (-inf) logits arrive as -inf log-probabilities (their
// own bits), and a row with no finite entry as -inf everywhere, as softmax.wgsl writes them; they are copied
// bit for bit. +inf and NaN logits are not supported (the verifier's status word reports them).
// Bindings: 0 params (uniform Params), 1 logprobs (read, f32 [rows, vocab]: softmax.wgsl's LOG_SOFTMAX out),
// 2 result (read, u32: the verifier's [accepted, token, status, d_0 .. d_{k-1}]), 3 out (read_write, f32
// [rows, ROW_WORDS]).
// The chosen token of row r is d_r for r < accepted and the final token for r = accepted; rows after
// `accepted` are written too (with a meaningless chosen token) and ignored by the host.
// out[row] = [chosen id, chosen logprob, (id, logprob) x top_n], ids as f32 (exact below 2^24): the top entries
// in order of decreasing log-probability, ties by increasing id; id -1 (and a -inf log-probability) pads a
// row whose vocabulary has fewer than top_n entries. (f32, not u32 bits, so the Dawn replay compares the
// log-probabilities with a tolerance.)
// Params: vocab, top_n (0 .. MAX_TOP).
// Dispatch: (rows, 1, 1) workgroups of 256, one per row: top_n selection rounds, each a strided scan for the
// best entry ordered after the previous round's pick, and a tree reduction.
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
  top_n: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logprobs: array<f32>;
@group(0) @binding(2) var<storage, read> result: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> wg_val: array<f32, WG>;  // the round's best value
var<workgroup> wg_id: array<u32, WG>;  // the round's best id
var<workgroup> wg_prev_val: f32;
var<workgroup> wg_prev_id: u32;

// The ordering key of a log-probability: itself, LOWEST when masked.
fn key(lp: f32) -> f32 {
  return select(lp, LOWEST, bitcast<u32>(lp) == NEG_INF_BITS);
}

// (v, id) comes before (bv, bid) in the order: larger value first, then smaller id; NO_TOKEN comes last.
fn before(v: f32, id: u32, bv: f32, bid: u32) -> bool {
  return id != NO_TOKEN && (bid == NO_TOKEN || v > bv || (v == bv && id < bid));
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let row = wid.x;
  let base = row * params.vocab;
  let out_base = row * ROW_WORDS;
  if (lid == 0u) {
    var chosen = result[1];
    if (row < result[0]) {
      chosen = result[3u + row];
    }
    out[out_base] = f32(chosen);
    var bits = bitcast<u32>(0.0);  // a chosen token outside the vocabulary cannot happen; keep the word defined
    if (chosen < params.vocab) {
      bits = bitcast<u32>(logprobs[base + chosen]);
    }
    out[out_base + 1u] = bitcast<f32>(bits);
    wg_prev_val = LOWEST;
    wg_prev_id = NO_TOKEN;
  }
  workgroupBarrier();  // the first round reads wg_prev_*

  let top_n = min(params.top_n, MAX_TOP);
  for (var round = 0u; round < top_n; round++) {
    let prev_val = wg_prev_val;
    let prev_id = wg_prev_id;
    var best_val = LOWEST;
    var best_id = NO_TOKEN;
    for (var i = lid; i < params.vocab; i += WG) {
      let v = key(logprobs[base + i]);
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
      // A runtime u32, not a constant bitcast: constant evaluation rejects an infinite f32.
      var bits = NEG_INF_BITS;
      var id_value = -1.0;
      if (id != NO_TOKEN) {
        bits = bitcast<u32>(logprobs[base + id]);
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
