// residual: acc[i] += delta[i] for i < n — adds a layer's output into the residual stream in place.
// Bindings: 0 params (uniform Params), 1 delta (read), 2 acc (read_write).
// Params: n = number of elements.
// Dispatch: (ceil(n / 256), 1, 1) workgroups of 256.
// (WebGPU forbids binding one buffer as both read and read_write in a dispatch, hence in place.)

struct Params {
  n: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> delta: array<f32>;
@group(0) @binding(2) var<storage, read_write> acc: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i < params.n) {
    acc[i] = acc[i] + delta[i];
  }
}
