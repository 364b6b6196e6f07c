// rmsnorm: out[t, i] = x[t, i] / sqrt(mean_j(x[t, j]^2) + eps) * weight[i] (HF LlamaRMSNorm, all in f32).
// Bindings: 0 params (uniform Params), 1 x (read, [rows, dim]), 2 weight (read, [dim]),
//           3 out (read_write, [rows, dim]).
// Params: dim = row length, eps = variance epsilon.
// Dispatch: (rows, 1, 1) workgroups of 256; one workgroup per row, each invocation strides over the row
// and the partial sums of squares meet in a tree reduction in workgroup memory.

const WG: u32 = 256u;

struct Params {
  dim: u32,
  eps: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> weight: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

var<workgroup> partial: array<f32, WG>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.x * params.dim;
  var sum_sq = 0.0;
  for (var i = lid; i < params.dim; i += WG) {
    let v = x[base + i];
    sum_sq += v * v;
  }
  partial[lid] = sum_sq;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
    if (lid < stride) {
      partial[lid] += partial[lid + stride];
    }
    workgroupBarrier();
  }
  // HF multiplies x by the reciprocal square root first and the weight second; keep that rounding order.
  let scale = inverseSqrt(partial[0] / f32(params.dim) + params.eps);
  for (var i = lid; i < params.dim; i += WG) {
    out[base + i] = weight[i] * (x[base + i] * scale);
  }
}
