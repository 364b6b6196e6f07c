// attention_reduce: combines the per-split partials of attention.wgsl (flash-decoding) into the output.
//   out[row, h, :] = sum_s exp(m_s - M) acc_s / sum_s exp(m_s - M) l_s,  M = max_s m_s,
//   over the splits s that hold keys of that row (s * split_len <= start_pos + row).
// Bindings: 0 params (uniform Params), 1 part_acc (read) [n_splits, rows, n_heads, HEAD_DIM],
//           2 part_stats (read) [n_splits, rows, n_heads] (max m_s, sum l_s), 3 out (read_write)
//           [row0 + rows, n_heads * HEAD_DIM].
// Params: the same struct as attention.wgsl, so both share one uniform slot; read here: rows, start_pos,
//         n_heads, split_len, n_splits and row0 (the call's row r is written to row row0 + r of out; the
//         partials are indexed by r).
// Overrides: HEAD_DIM (multiple of 4).
// Dispatch: ceil(rows * n_heads * HEAD_DIM / 4 / 64) workgroups of 64; one invocation per (row, head, vec4).

struct Params {
  rows: u32,
  start_pos: u32,
  n_heads: u32,
  n_kv_heads: u32,
  key_lanes: u32,
  split_len: u32,
  n_splits: u32,
  q_stride: u32,
  window: u32,
  scale: f32,
  rope: u32,
  softcap: f32,
  tree: u32,
  row0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> part_acc: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> part_stats: array<vec2<f32>>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

override HEAD_DIM: u32 = 64u;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let hd4 = HEAD_DIM / 4u;
  let row_head = gid.x / hd4;
  if (row_head < params.rows * params.n_heads) {
    let col = gid.x % hd4;
    let keys = params.start_pos + row_head / params.n_heads + 1u;
    let used = min(params.n_splits, (keys + params.split_len - 1u) / params.split_len);
    let stride = params.rows * params.n_heads;
    var m = part_stats[row_head].x;
    for (var s = 1u; s < used; s++) {
      m = max(m, part_stats[s * stride + row_head].x);
    }
    var total = 0.0;
    var acc = vec4<f32>(0.0);
    for (var s = 0u; s < used; s++) {
      let stats = part_stats[s * stride + row_head];
      let w = exp(stats.x - m);
      total += w * stats.y;
      acc += w * part_acc[(s * stride + row_head) * hd4 + col];
    }
    out[(params.row0 * params.n_heads + row_head) * hd4 + col] = acc / total;
  }
}
