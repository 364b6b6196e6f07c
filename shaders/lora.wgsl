// lora: the unmerged low-rank update of one matmul for the rows that use one adapter. For each row t < rows with
// row_adapter[t] == adapter, and each segment s of the adapter's table (a module's update, e.g. q, k and v of the
// fused qkv projection):
//     h_s = A_s · x[t]                    [r_s]        (A_s: [r_s, k], stored transposed: A_s[r, i] at i·r_s + r)
//     out[t, col0_s + n] += (B_s · h_s)[n]  n < cols_s  (B_s: [cols_s, r_s], stored transposed: B_s[n, r] at
//                                                        r·cols_s + n; PEFT's scale folded in)
// Rows of other adapters or none (row_adapter[t] == 0xffffffff) are left as they are, so one forward can serve rows
// of several adapters (a dispatch per adapter) and rows without one. With RMS_NORM, x[t] is first normalised as the
// base matmul normalises it (rmsnorm.wgsl's formula: norm_weight[i] * (x[t, i] / sqrt(mean(x[t]^2) + eps))), which
// saves the norm's own dispatch: on a CPU adapter a dispatch's fixed cost is most of this update's.
// One workgroup per row: its invocations first compute h for every segment (an invocation per rank index, each a
// dot product over k), then, after one barrier, the columns (an invocation per column, a dot product over r_s).
// Both are stored transposed so that neighbouring invocations read neighbouring words (a CPU adapter's vector lanes
// then load them together instead of gathering across rows: a decode step with rank-8 q, k, v, o adapters on
// SmolLM2 cost 1.30x the base forward with the PEFT layout, on lavapipe).
// An update costs k·R + N·r multiply-adds per row; the base matmul costs k·N, so rank 16 is a few percent of it.
//
// Bindings:
//   0 params      (uniform Params)
//   1 x           (read)        f32 [rows, k]: the matmul's input (normalised, or act(gate)·up, as the base sees it)
//   2 lora        (read)        u32: the table, then the weights (below)
//   3 row_adapter (read)        u32 [rows]: each row's adapter slot, 0xffffffff for none
//   4 out         (read_write)  f32 [rows, n_total]: the base matmul's output, added to
//   5 norm_weight (read)        f32 [k]: the RMSNorm gain (RMS_NORM; a dummy otherwise)
// Params: rows, k (x's row length), n_total (out's row length), adapter (the slot this dispatch serves), eps.
// Table (u32 words from 0): segments S (1..4), then per segment 5 words: col0, cols, rank, a (word offset of A),
//   b (word offset of B). Sum of the ranks <= MAX_RANK.
// Overrides: FORMAT (below), RMS_NORM (normalise x first), WORKGROUP_SIZE (a power of two, <= 256).
// Weights, by the FORMAT override: 0 f32 (word e of a block is element e's bits), 1 f16 (element e in the low
//   (e even) or high half of word e / 2); each block starts on a word, so odd sizes need no padding rule.
// Dispatch: (rows, 1, 1) workgroups of WORKGROUP_SIZE.

struct Params {
  rows: u32,
  k: u32,
  n_total: u32,
  adapter: u32,
  eps: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> lora: array<u32>;
@group(0) @binding(3) var<storage, read> row_adapter: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
@group(0) @binding(5) var<storage, read> norm_weight: array<f32>;

override FORMAT: u32 = 0u;
override WORKGROUP_SIZE: u32 = 64u;
override RMS_NORM: bool = false;
const MAX_RANK: u32 = 256u;
const MAX_WORKGROUP: u32 = 256u;
const SEGMENT_WORDS: u32 = 5u;

var<workgroup> h: array<f32, MAX_RANK>;
var<workgroup> partial: array<f32, MAX_WORKGROUP>;

// 1 / sqrt(mean(x[t]^2) + eps) of the row starting at x_base (every invocation calls it: it holds barriers).
fn inverse_rms(lid: u32, x_base: u32) -> f32 {
  var sum_sq = 0.0;
  for (var i = lid; i < params.k; i += WORKGROUP_SIZE) {
    sum_sq += x[x_base + i] * x[x_base + i];
  }
  partial[lid] = sum_sq;
  workgroupBarrier();
  for (var stride = WORKGROUP_SIZE / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      partial[lid] += partial[lid + stride];
    }
    workgroupBarrier();
  }
  return inverseSqrt(partial[0] / f32(params.k) + params.eps);
}

fn weight(block: u32, e: u32) -> f32 {
  if (FORMAT == 1u) {
    let pair = unpack2x16float(lora[block + e / 2u]);
    return select(pair.x, pair.y, (e & 1u) == 1u);
  }
  return bitcast<f32>(lora[block + e]);
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let t = wid.x;
  // Rows of another adapter run no iteration but still meet the barrier (uniform control flow).
  let segments = select(0u, lora[0], t < params.rows && row_adapter[t] == params.adapter);
  for (var i = lid; i < MAX_RANK; i += WORKGROUP_SIZE) {
    h[i] = 0.0;
  }
  workgroupBarrier();  // the zeros land before any invocation writes its h entries
  let x_base = t * params.k;
  var scale = 1.0;
  if (RMS_NORM) {
    scale = inverse_rms(lid, x_base);
  }
  var h_base = 0u;
  for (var s = 0u; s < segments; s++) {
    let entry = 1u + s * SEGMENT_WORDS;
    let rank = lora[entry + 2u];
    let a = lora[entry + 3u];
    for (var r = lid; r < rank; r += WORKGROUP_SIZE) {
      var acc = 0.0;
      for (var i = 0u; i < params.k; i++) {
        var input = x[x_base + i];
        if (RMS_NORM) {
          input = norm_weight[i] * (input * scale);
        }
        acc += weight(a, i * rank + r) * input;
      }
      h[h_base + r] = acc;
    }
    h_base += rank;
  }
  workgroupBarrier();
  h_base = 0u;
  for (var s = 0u; s < segments; s++) {
    let entry = 1u + s * SEGMENT_WORDS;
    let col0 = lora[entry];
    let cols = lora[entry + 1u];
    let rank = lora[entry + 2u];
    let b = lora[entry + 4u];
    for (var n = lid; n < cols; n += WORKGROUP_SIZE) {
      var acc = 0.0;
      for (var r = 0u; r < rank; r++) {
        acc += weight(b, r * cols + n) * h[h_base + r];
      }
      let o = t * params.n_total + col0 + n;
      out[o] = out[o] + acc;
    }
    h_base += rank;
  }
}
