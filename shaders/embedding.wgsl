// embedding: out[t, :] = table[ids[t], :] * scale for t < rows (scale: Gemma's sqrt(hidden), else 1), dequantising one row of a weight table in any format
// of doppler_py/gpu/weights.py (tied embeddings share the LM head's weight). An id at or past `vocab` gives a
// row of zeros and never reads out of bounds.
//
// Bindings:
//   0 params  (uniform Params)
//   1 ids     (read)        u32 [rows]
//   2 weights (read)        one part of the table (rows row_start .. row_start + part_rows), layout as in
//                           shaders/matmul.wgsl
//   3 scales  (read)        packed f16 block scales (block formats; a 4-byte dummy otherwise)
//   4 out     (read_write)  f32 [rows, k] as vec4
// Params: rows, k (multiple of 32), row_start, part_rows, vocab (rows of the whole table), zero_missing
//   (1 for the part that writes zeros for ids >= vocab: exactly one part per table), scale.
// Overrides: FORMAT (0 f32, 1 f16, 2 q4_0, 3 q4_1, 4 q8_0).
// Dispatch: (ceil(k / 4 / 64), rows, 1) workgroups of 64; invocation (e, t) writes out[t] vec4 e. Each part
//   writes only the rows whose id it holds.

struct Params {
  rows: u32,
  k: u32,
  row_start: u32,
  part_rows: u32,
  vocab: u32,
  zero_missing: u32,
  scale: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> scales: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;

const F32: u32 = 0u;
const F16: u32 = 1u;
const Q4_0: u32 = 2u;
const Q4_1: u32 = 3u;

override FORMAT: u32 = F32;

fn block_scale(b: u32) -> f32 {
  let pair = unpack2x16float(scales[b >> 1u]);
  return select(pair.x, pair.y, (b & 1u) == 1u);
}

// Weights 4e .. 4e + 3 of row `row` of this part.
fn weight_vec4(row: u32, e: u32) -> vec4<f32> {
  let b = ((row / 8u) * (params.k / 32u) + e / 8u) * 8u + row % 8u;
  let i = e % 8u;
  if (FORMAT == F32) {
    return bitcast<vec4<f32>>(weights[b * 8u + i]);
  }
  if (FORMAT == F16) {
    let q = weights[b * 4u + i / 2u];
    let pair = select(q.xy, q.zw, (i & 1u) == 1u);
    return vec4<f32>(unpack2x16float(pair.x), unpack2x16float(pair.y));
  }
  if (FORMAT == Q4_0 || FORMAT == Q4_1) {
    // Byte j of the block holds weights j (low nibble) and j + 16 (high): vec4s 0..3 low, 4..7 high.
    let shift = (i / 4u) * 4u;
    let q = (vec4<u32>(weights[b][i % 4u]) >> vec4<u32>(shift, shift + 8u, shift + 16u, shift + 24u)) & vec4<u32>(15u);
    if (FORMAT == Q4_1) {
      let dm = unpack2x16float(scales[b]);
      return vec4<f32>(q) * dm.x + dm.y;
    }
    return (vec4<f32>(q) - 8.0) * block_scale(b);
  }
  let word = bitcast<i32>(weights[2u * b + i / 4u][i % 4u]);
  let q = (vec4<i32>(word) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u);
  return vec4<f32>(q) * block_scale(b);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let e = gid.x;
  let t = gid.y;
  if (e < params.k / 4u && t < params.rows) {
    let id = ids[t];
    if (id >= params.row_start && id < params.row_start + params.part_rows) {
      out[t * (params.k / 4u) + e] = weight_vec4(id - params.row_start, e) * params.scale;
    } else if (id >= params.vocab && params.zero_missing == 1u) {
      out[t * (params.k / 4u) + e] = vec4<f32>(0.0);
    }
  }
}
