// kv_compact: after a token tree's verification, moves the accepted path's keys and values into place.
//   for m in 0 .. n_moves (in order): cache[start_pos + dst_m] = cache[start_pos + src_m], for k and v
// (moves from doppler_py/ops/tree.py's compaction_moves: in that order no move overwrites a row a later one
// reads). Each invocation copies one vec4 of a row through every move in turn, so the order holds without
// barriers; only this dispatch touches those rows.
// Bindings: 0 params (uniform Params), 1 moves (read) [n_moves] of (src row, dst row), 2 k_cache and
//           3 v_cache (read_write) [max_seq, row_vec4s] (one layer's).
// Params: start_pos (slot of tree row 0); n_moves; row_vec4s (vec4s per cache row: n_kv_heads * head_dim / 4).
// Dispatch: (ceil(row_vec4s / 64), 1, 1) workgroups of 64, once per layer.

struct Params {
  start_pos: u32,
  n_moves: u32,
  row_vec4s: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> moves: array<vec2<u32>>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<vec4<f32>>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let e = gid.x;
  if (e >= params.row_vec4s) {
    return;
  }
  for (var m = 0u; m < params.n_moves; m++) {
    let src = (params.start_pos + moves[m].x) * params.row_vec4s + e;
    let dst = (params.start_pos + moves[m].y) * params.row_vec4s + e;
    k_cache[dst] = k_cache[src];
    v_cache[dst] = v_cache[src];
  }
}
