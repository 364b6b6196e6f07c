// min_p: in place, per row, every logit below max + offset becomes -inf, where max is the row's largest logit and
// offset = temperature * ln(min_p) (<= 0, computed by the host): the tokens whose probability after temperature is
// below min_p times the most likely token's. Compared as ordered integer keys, so -inf needs no float arithmetic.
// NaN logits are left as they are (the verifier flags them) and take no part in the max; a row whose max is not
// finite (only -inf, or a +inf the verifier flags) is left as it is. Contract and numpy reference:
// doppler_py/testing/penalty_reference.py (`min_p_filter`).
// Bindings: 0 params (uniform Params), 1 logits (read_write, f32 [rows, vocab]).
// Params: vocab, offset.
// Dispatch: (rows, 1, 1) workgroups of 256; one workgroup per row: a max reduction, then one pass that masks.

const WG: u32 = 256u;
const NEG_INF_BITS: u32 = 0xff800000u;
const EXPONENT_BITS: u32 = 0x7f800000u;

struct Params {
  vocab: u32,
  offset: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<f32>;

var<workgroup> wg_max: array<u32, WG>;

fn is_nan(bits: u32) -> bool {
  return (bits & 0x7fffffffu) > EXPONENT_BITS;
}

// A key whose unsigned order is the floats' order (-inf lowest).
fn key(bits: u32) -> u32 {
  return select(bits | 0x80000000u, ~bits, (bits & 0x80000000u) != 0u);
}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let base = wid.x * params.vocab;
  var best = key(NEG_INF_BITS);
  for (var i = lid; i < params.vocab; i += WG) {
    let bits = bitcast<u32>(logits[base + i]);
    if (!is_nan(bits)) {
      best = max(best, key(bits));
    }
  }
  wg_max[lid] = best;
  workgroupBarrier();
  for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
    if (lid < stride) {
      wg_max[lid] = max(wg_max[lid], wg_max[lid + stride]);
    }
    workgroupBarrier();
  }
  let top_key = wg_max[0];
  let top_bits = select(~top_key, top_key & 0x7fffffffu, (top_key & 0x80000000u) != 0u);
  if ((top_bits & EXPONENT_BITS) != EXPONENT_BITS) {  // a finite max
    let threshold = key(bitcast<u32>(bitcast<f32>(top_bits) + params.offset));
    let neg_inf_bits = NEG_INF_BITS;
    for (var i = lid; i < params.vocab; i += WG) {
      let bits = bitcast<u32>(logits[base + i]);
      if (!is_nan(bits) && key(bits) < threshold) {
        logits[base + i] = bitcast<f32>(neg_inf_bits);
      }
    }
  }
}
