// matmul: out[t, n] = sum_k x[t, k] * W[n, k] (+ bias[n]) for t < rows, with W in f32, f16, q4_0, q4_1 or q8_0,
// dequantised in registers. `accumulate` adds the result into out (folds a residual add into the projection).
// With RMS_NORM the register kernels first normalise x like rmsnorm.wgsl, x[t, k] / rms(x[t]) * norm_weight[k],
// which saves the norm's own dispatch: the gain scales x as it is loaded and 1 / rms, summed from the same
// loads, scales each dot product at the end. With GLU, x is a gated MLP's [gate | up] output (rows of 2k) and
// the product's input is act(gate) * up, computed as x is loaded (swiglu.wgsl's formula, which this folds into
// the down projection, saving its dispatch and the round trip of the activations through memory).
// One invocation owns COLS consecutive weight rows and ROWS consecutive x rows, so every weight it loads is
// used for all ROWS rows (T=1 decode: ROWS=1; speculative verification: ROWS up to 8, more via grid y).
//
// Bindings:
//   0 params  (uniform Params)
//   1 x       (read)        f32 [rows, k] as vec4 ([rows, 2k] with GLU)
//   2 weights (read)        one part of W (rows n_offset .. n_offset + n), layout by FORMAT, see below
//   3 scales  (read)        packed f16 block scales (block formats; a 4-byte dummy otherwise)
//   4 bias    (read)        f32 [n_total] (a 4-byte dummy unless has_bias)
//   5 out     (read_write)  f32 [rows, n_total]
//   6 norm_weight (read)    f32 [k] RMSNorm gain (register kernels; a 16-byte dummy unless RMS_NORM)
// Params: rows (valid x rows), k (multiple of 32), n (weight rows in this part), n_offset (output column of
//   the part's first row), n_total (row length of out and bias), has_bias (0/1: add bias), accumulate (0/1:
//   out += result), eps (RMS_NORM's epsilon). The two flags are uniforms, not overrides: they cost nothing at
//   run time and would otherwise triple the pipelines to compile (0.2-0.7 s each on lavapipe).
// Overrides: FORMAT (0 f32, 1 f16, 2 q4_0, 3 q4_1, 4 q8_0), ROWS (1..8), COLS (4 or 8), WORKGROUP_SIZE,
//   SUBGROUP_MIN (main_subgroups: the smallest subgroup size the pipeline can run with, 4 unless the host
//   measured more; 8 or more drops the second x load that subgroups of 4 need), SIMD_LANES (how many
//   invocations a CPU adapter runs as the lanes of one vector loop; 1 on GPUs; see first_col), RMS_NORM
//   (register kernels: normalise x first), GLU (register kernels: 0: x as is; 1: silu(gate) * up;
//   2: gelu_tanh(gate) * up; not with RMS_NORM).
// Weight layouts, per block b of 32 weights along k; blocks are ordered by (group of 8 rows, block column,
// row in group): b = ((row / 8) * k / 32 + block) * 8 + row % 8, so an invocation's 8 rows are contiguous.
//   f32   weights[b * 8 + i] = W[row, 32 block + 4 i .. + 3] (bit patterns of the f32 values)
//   f16   weights[b * 4 + i] = 8 halves W[row, 32 block + 8 i .. + 7], two per u32, low half first
//   q4_0  weights[b] = the block's 16 ggml quant bytes: byte j holds weight j (low nibble) and j + 16 (high);
//         scales[b / 2] holds d of block b in its low half when b is even, high half when odd; w = (q - 8) d
//   q4_1  weights[b] as q4_0; scales[b] = d | m << 16 (f16 each); w = q d + m
//   q8_0  weights[2 b], weights[2 b + 1] = the block's 32 int8 quants; scales as q4_0; w = q d
// Entry points and dispatch:
//   main_subgroups  register kernel; lanes share each x block through subgroupBroadcast (needs subgroups,
//                   any subgroup size >= SUBGROUP_MIN). (ceil(n / (COLS * WORKGROUP_SIZE)), ceil(rows / ROWS), 1)
//                   workgroups of WORKGROUP_SIZE.
//   main            the same without subgroups: every invocation loads x itself. Same dispatch.
//   gemm_tiled      prefill GEMM through 12 KiB of workgroup memory (see below; uses only the FORMAT
//                   override, no RMS_NORM or GLU). (ceil(n / 64), ceil(rows / 32), 1) workgroups of 8 x 8.

enable subgroups;

struct Params {
  rows: u32,
  k: u32,
  n: u32,
  n_offset: u32,
  n_total: u32,
  has_bias: u32,
  accumulate: u32,
  eps: f32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> weights: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> scales: array<u32>;
@group(0) @binding(4) var<storage, read> bias: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
@group(0) @binding(6) var<storage, read> norm_weight: array<vec4<f32>>;

const F32: u32 = 0u;
const F16: u32 = 1u;
const Q4_0: u32 = 2u;
const Q4_1: u32 = 3u;
const Q8_0: u32 = 4u;

override FORMAT: u32 = F32;
override ROWS: u32 = 1u;
override COLS: u32 = 8u;
override WORKGROUP_SIZE: u32 = 64u;
override SUBGROUP_MIN: u32 = 4u;
override SIMD_LANES: u32 = 1u;
override RMS_NORM: bool = false;
override GLU: u32 = 0u;

const MAX_ROWS: u32 = 8u;
const MAX_SPREAD: u32 = 16u;

// The current block of x (32 values per row) and its per-row sum (for the q4 formats' offset terms; zero
// and unused otherwise).
var<private> xs: array<array<vec4<f32>, 8>, MAX_ROWS>;
var<private> xsum: array<f32, MAX_ROWS>;
// RMS_NORM: the gain's current block and each x row's running sum of squares (of x before the gain).
var<private> gain: array<vec4<f32>, 8>;
var<private> squares: array<f32, MAX_ROWS>;
// acc_lo[t][c], acc_hi[t][c]: the sums for x row t and this invocation's weight rows c and 4 + c.
var<private> acc_lo: array<vec4<f32>, MAX_ROWS>;
var<private> acc_hi: array<vec4<f32>, MAX_ROWS>;

// First x row of this invocation's tile, clamped so loads stay in bounds; rows past params.rows are
// computed on duplicated data and never stored.
fn x_row_base(t0: u32, t: u32) -> u32 {
  let row_vec4s = select(params.k / 4u, params.k / 2u, GLU != 0u);
  return min(t0 + t, params.rows - 1u) * row_vec4s;
}

// sigmoid(v) per component as swiglu.wgsl computes it: exp() only sees -|v| > -87 (no overflow, and below
// that the subnormal result is taken as 0).
fn sigmoid4(v: vec4<f32>) -> vec4<f32> {
  let a = abs(v);
  let e = select(vec4<f32>(0.0), exp(-a), a < vec4<f32>(87.0));
  return select(e / (1.0 + e), 1.0 / (1.0 + e), v >= vec4<f32>(0.0));
}

// vec4 i of x as the product's input: x itself, or with GLU act(gate) * up (up sits k values after gate).
fn x_at(i: u32) -> vec4<f32> {
  if (GLU == 0u) {
    return x[i];
  }
  let g = x[i];
  let u = x[i + params.k / 4u];
  var z = g;
  if (GLU == 2u) {
    z = 1.5957691216057308 * (g + 0.044715 * g * g * g);  // 2 * sqrt(2 / pi) * (...)
  }
  return g * sigmoid4(z) * u;
}

fn load_x_block(t0: u32, block: u32) {
  if (RMS_NORM) {
    for (var i = 0u; i < 8u; i++) {
      gain[i] = norm_weight[block * 8u + i];
    }
  }
  for (var t = 0u; t < ROWS; t++) {
    let base = x_row_base(t0, t) + block * 8u;
    for (var i = 0u; i < 8u; i++) {
      xs[t][i] = x_at(base + i);
    }
  }
}

// Lane l of each subgroup loads vec4 l % 8 of a block (8 vec4s from `base`) and every lane reads all 8 by
// broadcast, which costs far less than 8 loads per lane. Subgroups of 4 (the smallest WebGPU allows) also
// load vec4s 4..7 into `hi`; on wider subgroups that load is masked off and `hi` unused. A CPU adapter runs a
// masked-off load lane by lane all the same, so when the host knows subgroups have at least 8 lanes
// (SUBGROUP_MIN) the condition is a constant and the load is gone (a 5-row LM-head call: 3% faster on
// lavapipe). `from_x` picks x or the norm gain: a portable function cannot take a storage buffer pointer.
fn shared_block(from_x: bool, base: u32, lane: u32, subgroup_size: u32) -> array<vec4<f32>, 8> {
  let narrow = SUBGROUP_MIN < 8u && subgroup_size < 8u;
  var lo: vec4<f32>;
  var hi = vec4<f32>(0.0);
  if (from_x) {
    lo = x_at(base + (lane & 7u));
    if (narrow) {
      hi = x_at(base + 4u + (lane & 3u));
    }
  } else {
    lo = norm_weight[base + (lane & 7u)];
    if (narrow) {
      hi = norm_weight[base + 4u + (lane & 3u)];
    }
  }
  return array<vec4<f32>, 8>(
    subgroupBroadcast(lo, 0u),
    subgroupBroadcast(lo, 1u),
    subgroupBroadcast(lo, 2u),
    subgroupBroadcast(lo, 3u),
    select(subgroupBroadcast(lo, 4u), subgroupBroadcast(hi, 0u), narrow),
    select(subgroupBroadcast(lo, 5u), subgroupBroadcast(hi, 1u), narrow),
    select(subgroupBroadcast(lo, 6u), subgroupBroadcast(hi, 2u), narrow),
    select(subgroupBroadcast(lo, 7u), subgroupBroadcast(hi, 3u), narrow),
  );
}

fn load_x_block_subgroup(t0: u32, block: u32, lane: u32, subgroup_size: u32) {
  if (RMS_NORM) {
    gain = shared_block(false, block * 8u, lane, subgroup_size);
  }
  for (var t = 0u; t < ROWS; t++) {
    xs[t] = shared_block(true, x_row_base(t0, t) + block * 8u, lane, subgroup_size);
  }
}

// RMS_NORM: adds row t's block of squares to its sum, then applies the gain to the block.
fn normalize_row(t: u32) {
  var s = vec4<f32>(0.0);
  for (var i = 0u; i < 8u; i++) {
    s = fma(xs[t][i], xs[t][i], s);
    xs[t][i] *= gain[i];
  }
  squares[t] += horizontal(s);
}

// Rows spelled out with constant indices, like store_tile: as a loop lavapipe indexed xs lane by lane, which
// made a 5-row call 4.5x slower.
fn normalize_x_block() {
  if (RMS_NORM) {
    normalize_row(0u);
    if (ROWS > 1u) { normalize_row(1u); }
    if (ROWS > 2u) { normalize_row(2u); }
    if (ROWS > 3u) { normalize_row(3u); }
    if (ROWS > 4u) { normalize_row(4u); }
    if (ROWS > 5u) { normalize_row(5u); }
    if (ROWS > 6u) { normalize_row(6u); }
    if (ROWS > 7u) { normalize_row(7u); }
  }
}

fn sum_x_block() {
  if (FORMAT == Q4_0 || FORMAT == Q4_1) {
    for (var t = 0u; t < ROWS; t++) {
      let s = xs[t][0] + xs[t][1] + xs[t][2] + xs[t][3] + xs[t][4] + xs[t][5] + xs[t][6] + xs[t][7];
      xsum[t] = s.x + s.y + s.z + s.w;
    }
  }
}

fn half4(a: u32, b: u32) -> vec4<f32> {
  return vec4<f32>(unpack2x16float(a), unpack2x16float(b));
}

fn nibbles(word: u32, shift: u32) -> vec4<f32> {
  return vec4<f32>((vec4<u32>(word) >> vec4<u32>(shift, shift + 8u, shift + 16u, shift + 24u)) & vec4<u32>(15u));
}

fn int8s(word: u32) -> vec4<f32> {
  return vec4<f32>((vec4<i32>(bitcast<i32>(word)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// Block b's 32 stored values as f32 (vec4 i = weights 4i..4i+3 of the block): the weights themselves for
// f32/f16, the quants q for the block formats; weight = q * d + m with (d, m) from block_scale_offset.
fn block_values(b: u32) -> array<vec4<f32>, 8> {
  var w: array<vec4<f32>, 8>;
  if (FORMAT == F32) {
    for (var i = 0u; i < 8u; i++) {
      w[i] = bitcast<vec4<f32>>(weights[b * 8u + i]);
    }
  } else if (FORMAT == F16) {
    for (var i = 0u; i < 4u; i++) {
      let q = weights[b * 4u + i];
      w[2u * i] = half4(q.x, q.y);
      w[2u * i + 1u] = half4(q.z, q.w);
    }
  } else if (FORMAT == Q4_0 || FORMAT == Q4_1) {
    // Quant byte j holds weights j and j + 16: word i's low nibbles are weights 4i..4i+3, high ones 16+4i...
    let q = weights[b];
    for (var i = 0u; i < 4u; i++) {
      w[i] = nibbles(q[i], 0u);
      w[4u + i] = nibbles(q[i], 4u);
    }
  } else {
    let qa = weights[2u * b];
    let qb = weights[2u * b + 1u];
    for (var i = 0u; i < 4u; i++) {
      w[i] = int8s(qa[i]);
      w[4u + i] = int8s(qb[i]);
    }
  }
  return w;
}

// (d, m) of block b: weight = q * d + m ((1, 0) for f32/f16, (d, -8 d) for q4_0).
fn block_scale_offset(b: u32) -> vec2<f32> {
  if (FORMAT == Q4_1) {
    return unpack2x16float(scales[b]);
  }
  if (FORMAT == Q4_0 || FORMAT == Q8_0) {
    let pair = unpack2x16float(scales[b >> 1u]);
    let d = select(pair.x, pair.y, (b & 1u) == 1u);
    return vec2<f32>(d, select(0.0, -8.0 * d, FORMAT == Q4_0));
  }
  return vec2<f32>(1.0, 0.0);
}

// The 32 weights of block b as f32, for the tiled GEMM's workgroup tile.
fn dequantize_block(b: u32) -> array<vec4<f32>, 8> {
  var w = block_values(b);
  let dm = block_scale_offset(b);
  for (var i = 0u; i < 8u; i++) {
    w[i] = w[i] * dm.x + dm.y;
  }
  return w;
}

// sums[t] += w * (vec4 i of row t's x block), one fma per lane and component; callers pass a literal i so
// every index is a constant.
fn add_products(sums: ptr<function, array<vec4<f32>, MAX_ROWS>>, w: vec4<f32>, i: u32) {
  for (var t = 0u; t < ROWS; t++) {
    (*sums)[t] = fma(w, xs[t][i], (*sums)[t]);
  }
}

fn horizontal(v: vec4<f32>) -> f32 {
  return (v.x + v.y) + (v.z + v.w);
}

// Index of (row, block) in the weights' block order: groups of 8 rows, block columns, rows within the group.
fn block_index(row: u32, block: u32) -> u32 {
  return ((row / 8u) * (params.k / 32u) + block) * 8u + row % 8u;
}

// Dot products of one weight row's block with the current x block, for every x row of the tile. The block
// formats sum q * x and scale once per block: d * sum(q x) + m * sum(x).
fn block_dots(row: u32, block: u32) -> array<f32, MAX_ROWS> {
  let b = block_index(row, block);
  let w = block_values(b);
  var sums: array<vec4<f32>, MAX_ROWS>;
  add_products(&sums, w[0], 0u);
  add_products(&sums, w[1], 1u);
  add_products(&sums, w[2], 2u);
  add_products(&sums, w[3], 3u);
  add_products(&sums, w[4], 4u);
  add_products(&sums, w[5], 5u);
  add_products(&sums, w[6], 6u);
  add_products(&sums, w[7], 7u);
  let dm = block_scale_offset(b);
  var dots: array<f32, MAX_ROWS>;
  for (var t = 0u; t < ROWS; t++) {
    // Spelled out per format: the compiler may not drop a multiplication by a constant 1 or 0 itself.
    if (FORMAT == Q4_0 || FORMAT == Q4_1) {
      dots[t] = dm.x * horizontal(sums[t]) + dm.y * xsum[t];
    } else if (FORMAT == Q8_0) {
      dots[t] = dm.x * horizontal(sums[t]);
    } else {
      dots[t] = horizontal(sums[t]);
    }
  }
  return dots;
}

// Columns are spelled out (not a loop) so the accumulators stay in registers on every compiler.
fn accumulate_block(col0: u32, block: u32) {
  let last = params.n - 1u;
  let d0 = block_dots(min(col0, last), block);
  let d1 = block_dots(min(col0 + 1u, last), block);
  let d2 = block_dots(min(col0 + 2u, last), block);
  let d3 = block_dots(min(col0 + 3u, last), block);
  for (var t = 0u; t < ROWS; t++) {
    acc_lo[t] += vec4<f32>(d0[t], d1[t], d2[t], d3[t]);
  }
  if (COLS == 8u) {
    let d4 = block_dots(min(col0 + 4u, last), block);
    let d5 = block_dots(min(col0 + 5u, last), block);
    let d6 = block_dots(min(col0 + 6u, last), block);
    let d7 = block_dots(min(col0 + 7u, last), block);
    for (var t = 0u; t < ROWS; t++) {
      acc_hi[t] += vec4<f32>(d4[t], d5[t], d6[t], d7[t]);
    }
  }
}

fn store_one(t: u32, col: u32, value: f32) {
  if (t < params.rows && col < params.n) {
    let n = params.n_offset + col;
    let i = t * params.n_total + n;
    var v = value;
    if (params.has_bias != 0u) {
      v += bias[n];
    }
    if (params.accumulate != 0u) {
      v += out[i];
    }
    out[i] = v;
  }
}

fn store_row(t0: u32, t: u32, col0: u32) {
  if (RMS_NORM) {
    let scale = inverseSqrt(squares[t] / f32(params.k) + params.eps);
    acc_lo[t] *= scale;
    acc_hi[t] *= scale;
  }
  for (var c = 0u; c < 4u; c++) {
    store_one(t0 + t, col0 + c, acc_lo[t][c]);
    if (COLS == 8u) {
      store_one(t0 + t, col0 + 4u + c, acc_hi[t][c]);
    }
  }
}

// Rows spelled out with constant indices: as a loop over t (too large for Mesa to unroll) lavapipe indexes
// the accumulators lane by lane, which cost 7% of a 5-row LM-head call.
fn store_tile(t0: u32, col0: u32) {
  store_row(t0, 0u, col0);
  if (ROWS > 1u) { store_row(t0, 1u, col0); }
  if (ROWS > 2u) { store_row(t0, 2u, col0); }
  if (ROWS > 3u) { store_row(t0, 3u, col0); }
  if (ROWS > 4u) { store_row(t0, 4u, col0); }
  if (ROWS > 5u) { store_row(t0, 5u, col0); }
  if (ROWS > 6u) { store_row(t0, 6u, col0); }
  if (ROWS > 7u) { store_row(t0, 7u, col0); }
}

// First weight row of invocation i's COLS rows. On a CPU adapter the SIMD_LANES invocations of one vector
// loop load their rows lane after lane, and lanes that stream neighbouring row groups (9 KB apart in the
// f16 LM head) made lavapipe's decode GEMV 1.2-1.4x slower than lanes four or more groups apart. So each
// chunk of SIMD_LANES * spread invocations is transposed: lane j of the chunk's s-th vector loop takes group
// j * spread + s. Groups past the last whole chunk keep their own index; with SIMD_LANES = 1 (GPUs) every
// invocation does.
fn first_col(i: u32) -> u32 {
  var group = i;
  if (SIMD_LANES > 1u) {
    let groups = (params.n + COLS - 1u) / COLS;
    let spread = clamp(groups / SIMD_LANES, 1u, MAX_SPREAD);
    let chunk = SIMD_LANES * spread;
    if (i < groups / chunk * chunk) {
      let j = i % chunk;
      group = i - j + (j % SIMD_LANES) * spread + j / SIMD_LANES;
    }
  }
  return group * COLS;
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let col0 = first_col(gid.x);
  let t0 = gid.y * ROWS;
  for (var block = 0u; block < params.k / 32u; block++) {
    load_x_block(t0, block);
    normalize_x_block();
    sum_x_block();
    accumulate_block(col0, block);
  }
  store_tile(t0, col0);
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn main_subgroups(@builtin(global_invocation_id) gid: vec3<u32>,
                  @builtin(subgroup_invocation_id) lane: u32,
                  @builtin(subgroup_size) subgroup_size: u32) {
  let col0 = first_col(gid.x);
  let t0 = gid.y * ROWS;
  for (var block = 0u; block < params.k / 32u; block++) {
    load_x_block_subgroup(t0, block, lane, subgroup_size);
    normalize_x_block();
    sum_x_block();
    accumulate_block(col0, block);
  }
  store_tile(t0, col0);
}

// Tiled GEMM for prefill: a workgroup of 8 x 8 computes a 32 (x rows) x 64 (weight rows) tile; per block of 32
// along k it stages the x tile and the dequantised weight tile in workgroup memory (12 KiB), then each
// invocation accumulates 4 x rows x 8 weight rows from them.
const TILE_ROWS: u32 = 32u;
const TILE_COLS: u32 = 64u;
var<workgroup> tile_x: array<vec4<f32>, 256>;  // [TILE_ROWS][8]
var<workgroup> tile_w: array<vec4<f32>, 512>;  // [TILE_COLS][8]

@compute @workgroup_size(8, 8)
fn gemm_tiled(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
              @builtin(local_invocation_index) li: u32) {
  let t0 = wid.y * TILE_ROWS;
  let tile_col0 = wid.x * TILE_COLS;
  for (var block = 0u; block < params.k / 32u; block++) {
    for (var j = 0u; j < 4u; j++) {
      let idx = li + 64u * j;
      tile_x[idx] = x[x_row_base(t0, idx / 8u) + block * 8u + idx % 8u];
    }
    let w = dequantize_block(block_index(min(tile_col0 + li, params.n - 1u), block));
    for (var i = 0u; i < 8u; i++) {
      tile_w[li * 8u + i] = w[i];
    }
    workgroupBarrier();
    for (var i = 0u; i < 8u; i++) {
      let w0 = (lid.x * 8u) * 8u + i;
      let b0 = tile_w[w0];
      let b1 = tile_w[w0 + 8u];
      let b2 = tile_w[w0 + 16u];
      let b3 = tile_w[w0 + 24u];
      let b4 = tile_w[w0 + 32u];
      let b5 = tile_w[w0 + 40u];
      let b6 = tile_w[w0 + 48u];
      let b7 = tile_w[w0 + 56u];
      for (var r = 0u; r < 4u; r++) {
        let a = tile_x[(lid.y * 4u + r) * 8u + i];
        acc_lo[r] += vec4<f32>(dot(a, b0), dot(a, b1), dot(a, b2), dot(a, b3));
        acc_hi[r] += vec4<f32>(dot(a, b4), dot(a, b5), dot(a, b6), dot(a, b7));
      }
    }
    workgroupBarrier();
  }
  let col0 = tile_col0 + lid.x * 8u;
  for (var r = 0u; r < 4u; r++) {
    for (var c = 0u; c < 4u; c++) {
      store_one(t0 + lid.y * 4u + r, col0 + c, acc_lo[r][c]);
      store_one(t0 + lid.y * 4u + r, col0 + 4u + c, acc_hi[r][c]);
    }
  }
}
