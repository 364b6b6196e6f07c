// standardize: x[t, i] = (x[t, i] - mean[i]) / std[i], in place over the first rows of x [rows, width] — an EAGLE
// head's input features (the target's hidden state, and each tapped layer's), put in the space its input
// projection was trained on before that projection runs, so the projection's weights can be quantised like any
// other matmul's: folded into the weights instead (W / std, with -W·mean / std as a bias) the two terms cancel
// on the target's massive-activation dimensions (|x|, |mean| in the thousands), which only f32 weights survive.
// Bindings: 0 params (uniform Params), 1 mean (read, [width]), 2 spread (read, [width]: the std), 3 x (read_write).
// Params: width = elements per row.
// Dispatch: (ceil(width / 256), rows, 1) workgroups of 256; one invocation per element.

struct Params {
  width: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> mean: array<f32>;
@group(0) @binding(2) var<storage, read> spread: array<f32>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  if (i < params.width) {
    let at = gid.y * params.width + i;
    x[at] = (x[at] - mean[i]) / spread[i];
  }
}
