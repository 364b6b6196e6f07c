// swiglu: out[t, j] = act(gate_up[t, j]) * gate_up[t, ffn_dim + j] — the gated MLP activation applied to the
// output of ONE matmul over the concatenated [gate; up] weights. act is
//   ACTIVATION 0: silu(x) = x * sigmoid(x) (LLaMA's SwiGLU),
//   ACTIVATION 1: gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))) = x * sigmoid(2 sqrt(2 / pi)
//                 (x + 0.044715 x^3)) (Gemma's GeGLU, torch's gelu(approximate="tanh")).
// Entry point `sigmoid_gate` (Qwen 3.5's gated attention): out[t, j] *= sigmoid(gate_up[t, j]) in place, with
// gate_up the gate's rows [rows, ffn_dim] and out the attention's output.
// per_layer_gate: out[t, j] = act(out[t, j]) * gate_up[t * up_stride + up_offset + j], in place: Gemma 4's
// per-layer input step, act(per_layer_input_gate(x)) * per_layer_input, with the gate projection in out and
// gate_up holding every layer's per-layer inputs [rows, n_layers * ffn_dim] (up_offset = layer * ffn_dim).
// Bindings: 0 params (uniform Params), 1 gate_up (read, [rows, 2 * ffn_dim]; sigmoid_gate: [rows, ffn_dim];
//           per_layer_gate: [rows, up_stride]), 2 out (read_write, [rows, ffn_dim]).
// Params: ffn_dim = MLP width (sigmoid_gate: the row width; per_layer_gate: the per-layer input width);
//         per_layer_gate only: up_stride, up_offset.
// Overrides: ACTIVATION (0 silu, 1 gelu_tanh; main and per_layer_gate).
// Dispatch: (ceil(ffn_dim / 256), rows, 1) workgroups of 256; one invocation per output element.

struct Params {
  ffn_dim: u32,
  up_stride: u32,
  up_offset: u32,
}

@group(0) @binding(0) var<uniform> params: Params;
@group(0) @binding(1) var<storage, read> gate_up: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

// exp() only ever sees -|x| in (-87, 0]: it cannot overflow (x / (1 + exp(-x)) meets inf at x = -1e4, and WGSL
// leaves infinities implementation-defined) and WGSL's error bound for exp, 3 + 2|x| ulp, stays small. Below
// -87, exp(-|x|) would be subnormal; it is taken as exactly 0.
override ACTIVATION: u32 = 0u;

fn sigmoid(x: f32) -> f32 {
  let a = abs(x);
  let e = select(0.0, exp(-a), a < 87.0);
  return select(e / (1.0 + e), 1.0 / (1.0 + e), x >= 0.0);
}

fn act(g: f32) -> f32 {
  var z = g;
  if (ACTIVATION == 1u) {
    z = 1.5957691216057308 * (g + 0.044715 * g * g * g);  // 2 * sqrt(2 / pi) * (...)
  }
  return g * sigmoid(z);
}

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x;
  if (j >= params.ffn_dim) {
    return;
  }
  let g = gate_up[gid.y * 2u * params.ffn_dim + j];
  let u = gate_up[gid.y * 2u * params.ffn_dim + params.ffn_dim + j];
  out[gid.y * params.ffn_dim + j] = act(g) * u;
}

@compute @workgroup_size(256)
fn per_layer_gate(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x;
  if (j >= params.ffn_dim) {
    return;
  }
  let at = gid.y * params.ffn_dim + j;
  out[at] = act(out[at]) * gate_up[gid.y * params.up_stride + params.up_offset + j];
}

@compute @workgroup_size(256)
fn sigmoid_gate(@builtin(global_invocation_id) gid: vec3<u32>) {
  let j = gid.x;
  if (j >= params.ffn_dim) {
    return;
  }
  let i = gid.y * params.ffn_dim + j;
  out[i] = out[i] * sigmoid(gate_up[i]);
}
