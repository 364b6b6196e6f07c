// rmsnorm: out[t, i] (+)= src[t, i] / sqrt(mean_j(src[t, j]^2) + eps) * weight[i] (HF LlamaRMSNorm, all in f32;
// Gemma's (1 + w) is folded into the weight at load time).
//   main:  rows of src into out; with ACCUMULATE, added to out (Gemma's post-attention / post-MLP norms added
//          to the residual stream: x += rmsnorm(y)), the sum then times out_scale (Gemma 4's layer_scalar on the
//          layer's output: x = (x + rmsnorm(y)) * s; 1 elsewhere, which leaves the sum exact).
//   heads: per-head norm in place (Qwen3 / Gemma 3 q_norm and k_norm): in each row of `out` (row_stride
//          floats), heads 0 .. n_heads - 1 of `dim` floats each, normalised with weight[0 .. dim) for the
//          first q_heads heads (q), weight[dim .. 2 dim) for the next k_heads (k) and weight[2 dim .. 3 dim)
//          for any after them (v: Gemma 4's v_norm, whose weight is all ones).
// Bindings: 0 params (uniform Params), 1 src (read, [rows, dim]; main only; not `x`, which
//           would clash with the `.x` swizzles in the registry's scan of what an entry point uses), 2 weight (read, [dim], heads:
//           [2 dim]), 3 out (read_write, [rows, dim]; heads: [rows, row_stride]).
// Params: dim = row (head) length, eps = variance epsilon; main only: out_scale (read with ACCUMULATE);
//         heads only: q_heads, row_stride, k_heads.
// Overrides: ACCUMULATE (main: add to out instead of writing it).
// Dispatch: main (rows, 1, 1), heads (q_heads + k_heads + v heads, rows, 1) workgroups of 256; one workgroup per row (head),
// each invocation strides over it and the partial sums of squares meet in a tree reduction in workgroup
// memory.

const WG: u32 = 256u;

struct Params {
  dim: u32,
  eps: f32,
  q_heads: u32,
  row_stride: u32,
  k_heads: u32,
  out_scale: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

override ACCUMULATE: bool = false;

var<workgroup> partial: array<f32, WG>;

// 1 / sqrt(mean of squares + eps) of a row whose squares this invocation summed into sum_sq (all invocations
// of the workgroup call it: it holds barriers).
fn inverse_rms(lid: u32, sum_sq: f32) -> f32 {
  partial[lid] = sum_sq;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      partial[lid] += partial[lid + stride];
    }
    workgroupBarrier();
  }
  return inverseSqrt(partial[0] / f32(params.dim) + params.eps);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.x * params.dim;
  var sum_sq = 0.0;
  for (var i = lid; i < params.dim; i += WG) {
    let v = src[base + i];
    sum_sq += v * v;
  }
  // HF multiplies x by the reciprocal square root first and the weight second; keep that rounding order.
  let scale = inverse_rms(lid, sum_sq);
  for (var i = lid; i < params.dim; i += WG) {
    let y = weight[i] * (src[base + i] * scale);
    if (ACCUMULATE) {
      out[base + i] = (out[base + i] + y) * params.out_scale;
    } else {
      out[base + i] = y;
    }
  }
}

@compute @workgroup_size(256)
fn heads(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.y * params.row_stride + wid.x * params.dim;
  var w_base = 0u;
  if (wid.x >= params.q_heads + params.k_heads) {
    w_base = 2u * params.dim;
  } else if (wid.x >= params.q_heads) {
    w_base = params.dim;
  }
  var sum_sq = 0.0;
  for (var i = lid; i < params.dim; i += WG) {
    let v = out[base + i];
    sum_sq += v * v;
  }
  let scale = inverse_rms(lid, sum_sq);
  for (var i = lid; i < params.dim; i += WG) {
    out[base + i] = weight[w_base + i] * (out[base + i] * scale);
  }
}
