// softmax: per row, out = softmax(logits / temperature) or, with LOG_SOFTMAX, log_softmax(logits / temperature).
// Entries equal to -inf are masked: probability exactly 0, log-probability -inf (the input's bits, copied).
// A row with no finite entry has no distribution: every probability is 0 (a sampler detects the row by its
// zero total mass) and every log-probability is -inf. +inf and NaN logits are not supported.
// Bindings: 0 params (uniform Params), 1 logits (read, [rows, cols]), 2 out (read_write, [rows, cols]).
// Params: cols = row length, temperature (> 0; logits are divided by it, as the reference does).
// Overrides: LOG_SOFTMAX (bool, default false).
// Dispatch: (rows, 1, 1) workgroups of 256; one workgroup per row. Each invocation keeps a running
// (max, sum of exp(x - max)) over its strided slice in one pass, the pairs meet in a tree reduction, and a
// second pass writes the outputs.
//
// -inf is recognised by its bit pattern, and no result of arithmetic on it is ever used: WGSL lets
// implementations assume that infinities do not occur, so comparisons or exp() on them are not portable.

override LOG_SOFTMAX: bool = false;

const WG: u32 = 256u;
const NEG_INF_BITS: u32 = 0xff800000u;
// Running max before any finite entry was seen; an entry equal to it still counts (its sum term is 1).
const LOWEST: f32 = -0x1.fffffep+127f;  // -FLT_MAX

struct Params {
  cols: u32,
  temperature: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

var<workgroup> wg_max: array<f32, WG>;
var<workgroup> wg_sum: array<f32, WG>;

fn is_masked(raw: f32) -> bool {
  return bitcast<u32>(raw) == NEG_INF_BITS;
}

// exp(d) for d <= 0, exactly 0 where the result would be subnormal. WGSL bounds exp's error by 3 + 2|d| ulp,
// which promises nothing for the huge |d| that logits of +-1e30 produce; this keeps such terms exactly 0.
fn exp_nonpositive(d: f32) -> f32 {
  return select(0.0, exp(d), d > -87.0);
}

// sum * exp(shift) for shift <= 0; an empty sum stays 0 whatever its (sentinel) max.
fn rescale(sum: f32, shift: f32) -> f32 {
  return sum * exp_nonpositive(shift);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.x * params.cols;
  var run_max = LOWEST;
  var run_sum = 0.0;
  for (var i = lid; i < params.cols; i += WG) {
    let raw = logits[base + i];
    if (!is_masked(raw)) {
      let x = raw / params.temperature;
      let new_max = max(run_max, x);
      run_sum = rescale(run_sum, run_max - new_max) + exp_nonpositive(x - new_max);
      run_max = new_max;
    }
  }
  wg_max[lid] = run_max;
  wg_sum[lid] = run_sum;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      let m = max(wg_max[lid], wg_max[lid + stride]);
      wg_sum[lid] = rescale(wg_sum[lid], wg_max[lid] - m) + rescale(wg_sum[lid + stride], wg_max[lid + stride] - m);
      wg_max[lid] = m;
    }
    workgroupBarrier();
  }
  let row_max = wg_max[0];
  let row_sum = wg_sum[0];
  let empty_row = row_sum == 0.0;
  let log_sum = log(select(row_sum, 1.0, empty_row));
  for (var i = lid; i < params.cols; i += WG) {
    let raw = logits[base + i];
    let masked = is_masked(raw) || empty_row;
    let shifted = raw / params.temperature - row_max;
    if (LOG_SOFTMAX) {
      // A masked entry of a non-empty row is -inf itself; an empty row holds only -inf entries.
      out[base + i] = select(shifted - log_sum, raw, masked);
    } else {
      out[base + i] = select(exp_nonpositive(shifted) / row_sum, 0.0, masked);
    }
  }
}
