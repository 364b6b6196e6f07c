// token_mask: in place, logits[row * vocab + i] = -inf for every token i whose bit is clear in the row's mask
// (bit i % 32 of word row * words + i / 32), for rows 0..rows-1; allowed entries are left as they are. A
// structured-output constraint's allowed tokens (doppler_py/constraints): the kernels after it (sampling,
// verification, log-probs) treat -inf as masked, so the distribution they see is the model's renormalised over
// the allowed tokens.
// Bindings: 0 params (uniform Params), 1 mask (read, u32 [rows, words]), 2 logits (read_write, f32 [rows, vocab]).
// Params: n = rows * vocab, vocab, words = ceil(vocab / 32).
// Dispatch: (min(ceil(n / 256), 65535), 1, 1) workgroups of 256; each invocation strides over the elements by
// the whole grid, so any n fits the per-dimension workgroup limit.
//
// -inf is written as its bit pattern, from a `let`: WGSL lets implementations assume infinities do not occur, and
// Tint refuses a constant expression that evaluates to one (bitcast of the const itself).

const NEG_INF_BITS: u32 = 0xff800000u;

struct Params {
  n: u32,
  vocab: u32,
  words: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read_write> logits: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) grid: vec3<u32>) {
  let neg_inf_bits = NEG_INF_BITS;
  for (var i = gid.x; i < params.n; i += grid.x * 256u) {
    let row = i / params.vocab;
    let token = i - row * params.vocab;
    let word = mask[row * params.words + token / 32u];
    if ((word & (1u << (token % 32u))) == 0u) {
      logits[i] = bitcast<f32>(neg_inf_bits);
    }
  }
}
