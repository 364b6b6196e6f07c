// vocab_scatter: dst[index[j]] = src[j] for j < n — spreads a reduced-vocabulary logits row (a draft head's
// N most frequent target tokens) over the target's vocabulary, so the draft's distribution is a row the
// target's sampler and verifier read like any other. dst's other entries are never written: the host fills
// them with -inf once, so tokens outside the draft vocabulary are never proposed.
// Bindings: 0 params (uniform Params), 1 src (read, f32 [n]), 2 index (read, u32 [n]),
//           3 dst (read_write, f32 [target vocab]).
// Params: n = reduced vocabulary size.
// Dispatch: (ceil(n / 256), 1, 1) workgroups of 256.

struct Params {
  n: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> index: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x;
  if (j < params.n) {
    dst[index[j]] = src[j];
  }
}
