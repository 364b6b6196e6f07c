// stream_read: how fast this adapter streams a buffer in (tools/bench_bandwidth.py, doppler_py/bandwidth.py).
// Every invocation reads its share of src with one of the load types the matmuls use (f32 / vec4<f32> for x and
// the norm gains, u32 / vec4<u32> for packed weights and block scales), sums what it read so that no load can be
// dropped, and each workgroup writes the sum of its invocations' sums:
//   partial[w] = sum of src[i] for w * span <= i < min((w + 1) * span, n), span = WORKGROUP_SIZE * per_invocation
// (f32 entry points: float sums, vec4 components added at the end; u32 entry points: sums modulo 2^32).
//
// Bindings (an entry point binds params, the src of its load type and the out of its sum type):
//   0 params   (uniform Params)
//   1 src_f32  (read)        array<f32>         read_f32
//   2 src_vec4 (read)        array<vec4<f32>>   read_vec4_f32
//   3 src_u32  (read)        array<u32>         read_u32
//   4 src_vec4u (read)       array<vec4<u32>>   read_vec4_u32
//   5 sums     (read_write)  f32 [workgroups]   the f32 entry points' partials
//   6 words    (read_write)  u32 [workgroups]   the u32 entry points' partials
// Params: n (elements of the load type in src), per_invocation (elements one invocation reads, at most).
// Overrides: WORKGROUP_SIZE (1..256), PATTERN (how a workgroup's span is shared out):
//   0 contiguous   invocation t reads the per_invocation elements from (w * WORKGROUP_SIZE + t) * per_invocation:
//                  each invocation one stream of its own (how the register matmuls read a group of 8 rows);
//   1 interleaved  invocation t reads elements w * span + t + j * WORKGROUP_SIZE, j < per_invocation: neighbouring
//                  invocations read neighbouring elements (the layout a GPU coalesces).
//   UNROLL (1 or 4): loads per loop iteration, into that many independent sums (the register matmuls load a
//   group's 8 rows per iteration); with 4 the last count % 4 elements are read one by one. The partials differ
//   only in float rounding.
// Dispatch: (ceil(n / span), 1, 1) workgroups of WORKGROUP_SIZE; the host raises per_invocation until that is at
// most 65535. Elements past n are never read (invocations whose share starts past n read nothing).

struct Params {
  n: u32,
  per_invocation: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> src_f32: array<f32>;
@group(0) @binding(2) var<storage, read> src_vec4: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read> src_u32: array<u32>;
@group(0) @binding(4) var<storage, read> src_vec4u: array<vec4<u32>>;
@group(0) @binding(5) var<storage, read_write> sums: array<f32>;
@group(0) @binding(6) var<storage, read_write> words: array<u32>;

const CONTIGUOUS: u32 = 0u;
const INTERLEAVED: u32 = 1u;
const MAX_WORKGROUP: u32 = 256u;

override WORKGROUP_SIZE: u32 = 64u;
override PATTERN: u32 = CONTIGUOUS;
override UNROLL: u32 = 1u;

// Each invocation's sum; only entries below WORKGROUP_SIZE are written, and only those are read.
var<workgroup> partial_f32: array<f32, MAX_WORKGROUP>;
var<workgroup> partial_u32: array<u32, MAX_WORKGROUP>;

// The elements invocation t of workgroup w reads: `count` of them, the first at `first`, `step` apart.
struct Share {
  first: u32,
  count: u32,
  step: u32,
}

fn share(w: u32, t: u32) -> Share {
  let base = w * WORKGROUP_SIZE * params.per_invocation;
  var first = base + t;
  var step = WORKGROUP_SIZE;
  if (PATTERN == CONTIGUOUS) {
    first = base + t * params.per_invocation;
    step = 1u;
  }
  var count = 0u;
  if (first < params.n) {
    count = min(params.per_invocation, (params.n - first + step - 1u) / step);
  }
  return Share(first, count, step);
}

// Folds the live entries [0, WORKGROUP_SIZE) in halves: at each power of two s below WORKGROUP_SIZE, entries
// [s, 2s) are added into [0, s), so any workgroup size works. Every invocation calls these (barriers in uniform
// control flow); invocation 0 gets the workgroup's sum.
fn reduce_f32(t: u32, value: f32) -> f32 {
  partial_f32[t] = value;
  workgroupBarrier();
  for (var s = MAX_WORKGROUP / 2u; s > 0u; s >>= 1u) {
    if (s < WORKGROUP_SIZE) {
      if (t < s && t + s < WORKGROUP_SIZE) {
        partial_f32[t] += partial_f32[t + s];
      }
      workgroupBarrier();
    }
  }
  return partial_f32[0];
}

fn reduce_u32(t: u32, value: u32) -> u32 {
  partial_u32[t] = value;
  workgroupBarrier();
  for (var s = MAX_WORKGROUP / 2u; s > 0u; s >>= 1u) {
    if (s < WORKGROUP_SIZE) {
      if (t < s && t + s < WORKGROUP_SIZE) {
        partial_u32[t] += partial_u32[t + s];
      }
      workgroupBarrier();
    }
  }
  return partial_u32[0];
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn read_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let s = share(wid.x, t);
  var a0 = 0.0;
  var a1 = 0.0;
  var a2 = 0.0;
  var a3 = 0.0;
  var i = s.first;
  let quads = select(0u, s.count / 4u, UNROLL == 4u);
  for (var j = 0u; j < quads; j++) {
    a0 += src_f32[i];
    a1 += src_f32[i + s.step];
    a2 += src_f32[i + 2u * s.step];
    a3 += src_f32[i + 3u * s.step];
    i += 4u * s.step;
  }
  for (var j = 4u * quads; j < s.count; j++) {
    a0 += src_f32[i];
    i += s.step;
  }
  let acc = (a0 + a1) + (a2 + a3);
  let total = reduce_f32(t, acc);
  if (t == 0u) {
    sums[wid.x] = total;
  }
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn read_vec4_f32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let s = share(wid.x, t);
  var a0 = vec4<f32>(0.0);
  var a1 = vec4<f32>(0.0);
  var a2 = vec4<f32>(0.0);
  var a3 = vec4<f32>(0.0);
  var i = s.first;
  let quads = select(0u, s.count / 4u, UNROLL == 4u);
  for (var j = 0u; j < quads; j++) {
    a0 += src_vec4[i];
    a1 += src_vec4[i + s.step];
    a2 += src_vec4[i + 2u * s.step];
    a3 += src_vec4[i + 3u * s.step];
    i += 4u * s.step;
  }
  for (var j = 4u * quads; j < s.count; j++) {
    a0 += src_vec4[i];
    i += s.step;
  }
  let acc = (a0 + a1) + (a2 + a3);
  let total = reduce_f32(t, (acc.x + acc.y) + (acc.z + acc.w));
  if (t == 0u) {
    sums[wid.x] = total;
  }
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn read_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let s = share(wid.x, t);
  var a0 = 0u;
  var a1 = 0u;
  var a2 = 0u;
  var a3 = 0u;
  var i = s.first;
  let quads = select(0u, s.count / 4u, UNROLL == 4u);
  for (var j = 0u; j < quads; j++) {
    a0 += src_u32[i];
    a1 += src_u32[i + s.step];
    a2 += src_u32[i + 2u * s.step];
    a3 += src_u32[i + 3u * s.step];
    i += 4u * s.step;
  }
  for (var j = 4u * quads; j < s.count; j++) {
    a0 += src_u32[i];
    i += s.step;
  }
  let acc = (a0 + a1) + (a2 + a3);
  let total = reduce_u32(t, acc);
  if (t == 0u) {
    words[wid.x] = total;
  }
}

@compute @workgroup_size(WORKGROUP_SIZE)
fn read_vec4_u32(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) t: u32) {
  let s = share(wid.x, t);
  var a0 = vec4<u32>(0u);
  var a1 = vec4<u32>(0u);
  var a2 = vec4<u32>(0u);
  var a3 = vec4<u32>(0u);
  var i = s.first;
  let quads = select(0u, s.count / 4u, UNROLL == 4u);
  for (var j = 0u; j < quads; j++) {
    a0 += src_vec4u[i];
    a1 += src_vec4u[i + s.step];
    a2 += src_vec4u[i + 2u * s.step];
    a3 += src_vec4u[i + 3u * s.step];
    i += 4u * s.step;
  }
  for (var j = 4u * quads; j < s.count; j++) {
    a0 += src_vec4u[i];
    i += s.step;
  }
  let acc = (a0 + a1) + (a2 + a3);
  let total = reduce_u32(t, (acc.x + acc.y) + (acc.z + acc.w));
  if (t == 0u) {
    words[wid.x] = total;
  }
}
