// linear_attention: Gated DeltaNet (Qwen 3.5's linear-attention layers) over a forward's rows, and the commit that
// advances a sequence's recurrent state by the rows it kept.
//
// A forward's rows never change the state: they read the committed state (and conv window) and the rows before
// them, so a speculative step's rejected rows need no undo. `commit_state` and `commit_conv` later run the kept
// rows again from the saved inputs (the layer's `mix` rows and normalised conv rows, copied per sequence).
//
// Per row r (one token), with the layer's projections in `mix` row r = [q | k | v | z | b | a] (q, k: n_k heads of
// dk; v, z: n_v heads of dv; b, a: n_v):
//   conv:   c[r, ch] = silu(sum_j w[ch, j] * in(r, K-1-j)[ch]) for the q | k | v channels, where in(r, 0) is row r's
//           own input and in(r, n) its n-th predecessor: the row n before it (a chain) or its ancestor n levels up
//           (a token tree), and past the forward's first row the committed window conv_state (oldest first).
//   (q and k heads are then L2-normalised in place by rmsnorm.wgsl's `heads`, q also scaled by 1/sqrt(dk).)
//   delta:  per value head h (its key head h / (n_v / n_k)), with S the dk x dv state before row r:
//           g = -exp(A_log[h]) * softplus(a + dt_bias[h]);  beta = sigmoid(b)
//           S = exp(g) * S;  S += k (beta * (v - S^T k))^T;  o = S^T q
//           out[r, h] = norm_w * rmsnorm(o) * silu(z)   (the gated RMSNorm over the head's dv values)
//           A tree row's S is the committed state advanced through its ancestors, then itself.
//   commit_state: S advanced through the kept rows (rows 0 .. kept-1, or order[0 .. kept-1] when `ordered`) and
//           written back; commit_conv: conv_state = the last K-1 inputs of (conv_state, kept rows).
//
// Bindings: 0 params (uniform Params), 1 mix (read, [rows, mix_stride]), 2 conv_w (read, [channels, K]),
//           3 conv_state (read_write, [K-1, channels]), 4 conv_rows (read_write, [rows, channels]),
//           5 gates (read, [n_v] -exp(A_log), [n_v] dt_bias, [dv] norm weight), 6 state (read_write,
//           [n_v, dk, dv]), 7 out (read_write, [rows, n_v * dv]), 8 order (read, [kept]) / tree (read, the token
//           tree's (depth, ancestor mask) per row, ops/tree.py).
//           conv: 1, 2, 3, 4, 8 (tree); delta: 1, 4, 5, 6, 7, 8 (tree); commit_state: 1, 4, 5, 6, 8 (order);
//           commit_conv: 1, 3, 8 (order). State and conv_state are only read by conv and delta.
// Params: rows (forward rows; commits: kept rows), tree (1: rows are a token tree), ordered (commits: 1 reads
//         order), channels (2 * n_k * dk + n_v * dv), mix_stride, taps (K), n_k, n_v, dk, dv, eps (gated norm),
//         row0 (conv and delta: the forward's rows are rows row0 .. of mix and out, as one sequence's segment of a
//         batched forward; conv_rows, the tree layout and the commits count from the segment's first row).
// Dispatch: conv (ceil(channels / 64), rows); delta and commit_state (n_v); commit_conv (ceil(channels / 64)).
// Limits: dk <= MAX_DK (a private state column per invocation), dv <= WG, taps <= MAX_TAPS.

const WG: u32 = 128u;
const MAX_DK: u32 = 128u;

struct Params {
  rows: u32,
  tree: u32,
  ordered: u32,
  channels: u32,
  mix_stride: u32,
  taps: u32,
  n_k: u32,
  n_v: u32,
  dk: u32,
  dv: u32,
  eps: f32,
  row0: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> mix: array<f32>;
@group(0) @binding(2) var<storage, read> conv_w: array<f32>;
@group(0) @binding(3) var<storage, read_write> conv_state: array<f32>;
@group(0) @binding(4) var<storage, read_write> conv_rows: array<f32>;
@group(0) @binding(5) var<storage, read> gates: array<f32>;
@group(0) @binding(6) var<storage, read_write> state: array<f32>;
@group(0) @binding(7) var<storage, read_write> out: array<f32>;
@group(0) @binding(8) var<storage, read> order: array<u32>;

// Shared by the invocations of a value head: the row's normalised key (0 .. dk) and query (MAX_DK ..).
var<workgroup> kq: array<f32, 256>;
var<workgroup> partial: array<f32, WG>;
// This invocation's column of the state (its value column of one value head): S[0 .. dk, col].
var<private> s: array<f32, MAX_DK>;

// exp() only sees -|x|, so it cannot overflow (as in swiglu.wgsl).
fn sigmoid(x: f32) -> f32 {
  let a = abs(x);
  let e = select(0.0, exp(-a), a < 87.0);
  return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}

fn silu(x: f32) -> f32 {
  return x * sigmoid(x);
}

// torch's softplus: x itself above its threshold of 20.
fn softplus(x: f32) -> f32 {
  return select(log(1.0 + exp(x)), x, x > 20.0);
}

// The row of tree row r's ancestor at `depth` (< r's depth): its (depth + 1)-th ancestor bit, counting up.
fn tree_ancestor(r: u32, depth: u32) -> u32 {
  let mask = order[2u * r + 1u];
  var seen = 0u;
  var found = 0u;
  for (var j = 0u; j < r; j++) {
    if (((mask >> j) & 1u) == 1u) {
      if (seen == depth) {
        found = j;
      }
      seen++;
    }
  }
  return found;
}

@compute @workgroup_size(64)
fn conv(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(workgroup_id) wid: vec3<u32>) {
  let ch = gid.x;
  let r = wid.y;
  if (ch >= params.channels) {
    return;
  }
  let window = params.taps - 1u;
  let depth = select(r, order[2u * r], params.tree == 1u);
  var acc = 0.0;
  for (var j = 0u; j < params.taps; j++) {
    let back = window - j;
    var v: f32;
    if (back == 0u) {
      v = mix[(params.row0 + r) * params.mix_stride + ch];
    } else if (back <= depth) {
      let row = select(r - back, tree_ancestor(r, depth - back), params.tree == 1u);
      v = mix[(params.row0 + row) * params.mix_stride + ch];
    } else {
      v = conv_state[(window - (back - depth)) * params.channels + ch];
    }
    acc += conv_w[ch * params.taps + j] * v;
  }
  conv_rows[r * params.channels + ch] = silu(acc);
}

// Row `row`'s normalised key and query of key head kh into kq (every invocation calls it: it holds a barrier).
fn load_kq(lid: u32, row: u32, kh: u32) {
  let base = row * params.channels + kh * params.dk;
  let k_base = base + params.n_k * params.dk;
  for (var i = lid; i < MAX_DK; i += WG) {
    kq[i] = select(0.0, conv_rows[k_base + i], i < params.dk);
    kq[MAX_DK + i] = select(0.0, conv_rows[base + i], i < params.dk);
  }
  workgroupBarrier();
}

// s (one value column of S) advanced by row `row` of value head h, with its key already in kq.
fn advance(row: u32, h: u32, col: u32) {
  let mix_row = (params.row0 + row) * params.mix_stride + params.channels + params.n_v * params.dv;
  let g = gates[h] * softplus(mix[mix_row + params.n_v + h] + gates[params.n_v + h]);
  let decay = exp(g);
  let beta = sigmoid(mix[mix_row + h]);
  var recalled = 0.0;
  for (var i = 0u; i < params.dk; i++) {
    s[i] *= decay;
    recalled += s[i] * kq[i];
  }
  let v = conv_rows[row * params.channels + 2u * params.n_k * params.dk + h * params.dv + col];
  let correction = (v - recalled) * beta;
  for (var i = 0u; i < params.dk; i++) {
    s[i] += kq[i] * correction;
  }
}

fn load_column(h: u32, col: u32) {
  for (var i = 0u; i < params.dk; i++) {
    s[i] = state[(h * params.dk + i) * params.dv + col];
  }
}

@compute @workgroup_size(128)
fn delta(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let h = wid.x;
  let kh = h / (params.n_v / params.n_k);
  let in_head = lid < params.dv;
  let col = min(lid, params.dv - 1u);
  load_column(h, col);
  for (var r = 0u; r < params.rows; r++) {
    if (params.tree == 1u) {
      // The committed state through r's ancestors; r itself follows below, as a chain row.
      load_column(h, col);
      let mask = order[2u * r + 1u];
      for (var j = 0u; j < r; j++) {
        if (((mask >> j) & 1u) == 1u) {
          load_kq(lid, j, kh);
          advance(j, h, col);
          workgroupBarrier();
        }
      }
    }
    load_kq(lid, r, kh);
    advance(r, h, col);
    var o = 0.0;
    for (var i = 0u; i < params.dk; i++) {
      o += s[i] * kq[MAX_DK + i];
    }
    partial[lid] = select(0.0, o * o, in_head);
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride >>= 1u) {
      if (lid < stride) {
        partial[lid] += partial[lid + stride];
      }
      workgroupBarrier();
    }
    let inv_rms = inverseSqrt(partial[0] / f32(params.dv) + params.eps);
    if (in_head) {
      let z = mix[(params.row0 + r) * params.mix_stride + params.channels + h * params.dv + col];
      let normed = gates[2u * params.n_v + col] * (o * inv_rms);
      out[((params.row0 + r) * params.n_v + h) * params.dv + col] = normed * silu(z);
    }
    workgroupBarrier();
  }
}

fn kept_row(j: u32) -> u32 {
  return select(j, order[j], params.ordered == 1u);
}

@compute @workgroup_size(128)
fn commit_state(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
  let h = wid.x;
  let kh = h / (params.n_v / params.n_k);
  let col = min(lid, params.dv - 1u);
  load_column(h, col);
  for (var j = 0u; j < params.rows; j++) {
    let row = kept_row(j);
    load_kq(lid, row, kh);
    advance(row, h, col);
    workgroupBarrier();
  }
  if (lid < params.dv) {
    for (var i = 0u; i < params.dk; i++) {
      state[(h * params.dk + i) * params.dv + col] = s[i];
    }
  }
}

@compute @workgroup_size(64)
fn commit_conv(@builtin(global_invocation_id) gid: vec3<u32>) {
  let ch = gid.x;
  if (ch >= params.channels) {
    return;
  }
  let window = params.taps - 1u;
  // Ascending slots: slot i reads slot i + kept (>= i) before any later slot is written.
  for (var i = 0u; i < window; i++) {
    let source = i + params.rows;
    var v: f32;
    if (source < window) {
      v = conv_state[source * params.channels + ch];
    } else {
      v = mix[kept_row(source - window) * params.mix_stride + ch];
    }
    conv_state[i * params.channels + ch] = v;
  }
}
