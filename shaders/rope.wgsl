// rope: rotary position embedding (HF LLaMA "rotate half" convention) fused with the KV-cache write, over
// the fused QKV projection output. Each qkv row is [q heads | k heads | v heads] (row_stride =
// (n_heads + 2 * n_kv_heads) * head_dim); the call's row t (qkv row row0 + t) is the token at position
// p = start_pos + t. One dispatch:
//   q heads: rotated in place in qkv;
//   k heads: rotated and written to k_cache[p] (qkv's k section keeps the unrotated keys);
//   v heads: copied to v_cache[p].
// For a head vector v of length head_dim = 2 * half and i < half:
//   v'[i]        = v[i] * cos(p, i) - v[i + half] * sin(p, i)
//   v'[i + half] = v[i + half] * cos(p, i) + v[i] * sin(p, i)
// cos/sin come from a host-computed table (bit-matching HF's float32 angles; WGSL's sin/cos are only
// accurate on [-pi, pi]). k and v live in the same buffer as q, so qkv is bound read_write only (WebGPU
// forbids binding one buffer both read and read_write in a dispatch).
// Token trees (tree == 1): row t is rotated for position start_pos + depth(t), read from `tree` (the layout of
// doppler_py/ops/tree.py), and still written to cache slot start_pos + t.
// Bindings: 0 params (uniform Params), 1 cos_sin (read, [n_positions, half] of vec2(cos, sin)),
//           2 qkv (read_write, [row0 + rows, row_stride]),
//           3 k_cache (read_write, [max_seq, n_kv_heads, head_dim]), 4 v_cache (read_write, same layout),
//           5 tree (read, [rows] of (depth, ancestor mask); read when tree == 1).
// Params: start_pos = position of row 0, n_heads, n_kv_heads, half = head_dim / 2,
//         pos_limit = min(table positions, max_seq): a row at a position >= pos_limit writes nothing at all
//         (q stays unrotated, the caches untouched); tree (1: rows are a token tree, as above);
//         row0 = qkv row of the call's row 0 (several sequences' rows share one qkv buffer, each sequence with
//         its own cache and call; positions, cache slots and the tree layout stay indexed by the call's row).
// Dispatch: (ceil((n_heads + n_kv_heads) * half / 64), rows, 1) workgroups of 64. One invocation per
// (row, head, i) rotation pair, q heads first, then k heads; a k-head invocation also copies the matching
// (i, i + half) pair of the v head with the same index.

struct Params {
  start_pos: u32,
  n_heads: u32,
  n_kv_heads: u32,
  half: u32,
  pos_limit: u32,
  tree: u32,
  row0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> cos_sin: array<vec2<f32>>;
@group(0) @binding(2) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(3) var<storage, read_write> k_cache: array<f32>;
@group(0) @binding(4) var<storage, read_write> v_cache: array<f32>;
@group(0) @binding(5) var<storage, read> tree: array<vec2<u32>>;

fn rotate(v1: f32, v2: f32, cs: vec2<f32>) -> vec2<f32> {
  return vec2<f32>(v1 * cs.x - v2 * cs.y, v2 * cs.x + v1 * cs.y);
}

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let row = gid.y;
  let slot = params.start_pos + row;
  let head = gid.x / params.half;
  let i = gid.x % params.half;
  if (slot >= params.pos_limit || head >= params.n_heads + params.n_kv_heads) {
    return;
  }
  var pos = slot;
  if (params.tree == 1u) {
    pos = params.start_pos + tree[row].x;
  }
  let cs = cos_sin[pos * params.half + i];
  let head_dim = 2u * params.half;
  let q_size = params.n_heads * head_dim;
  let kv_size = params.n_kv_heads * head_dim;
  let row_base = (params.row0 + row) * (q_size + 2u * kv_size);
  if (head < params.n_heads) {
    let a = row_base + head * head_dim + i;
    let r = rotate(qkv[a], qkv[a + params.half], cs);
    qkv[a] = r.x;
    qkv[a + params.half] = r.y;
  } else {
    let in_head = (head - params.n_heads) * head_dim + i;
    let k_src = row_base + q_size + in_head;
    let v_src = k_src + kv_size;
    let dst = slot * kv_size + in_head;
    let r = rotate(qkv[k_src], qkv[k_src + params.half], cs);
    k_cache[dst] = r.x;
    k_cache[dst + params.half] = r.y;
    v_cache[dst] = qkv[v_src];
    v_cache[dst + params.half] = qkv[v_src + params.half];
  }
}
