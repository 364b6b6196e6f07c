// logit_softcap: logits[i] = cap * tanh(logits[i] / cap) for i < n, in place (Gemma 2's final logit
// soft-capping), with tanh(y) = 2 / (1 + exp(-2y)) - 1 so that no logit overflows to NaN.
// Bindings: 0 params (uniform Params), 1 logits (read_write).
// Params: n = number of elements; cap > 0.
// Dispatch: (min(ceil(n / 256), 65535), 1, 1) workgroups of 256; each invocation strides over the elements
// by the whole grid, so any n fits the per-dimension workgroup limit.

struct Params {
  n: u32,
  cap: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) grid: vec3<u32>) {
  for (var i = gid.x; i < params.n; i += grid.x * 256u) {
    logits[i] = params.cap * (2.0 / (1.0 + exp(-2.0 * logits[i] / params.cap)) - 1.0);
  }
}
