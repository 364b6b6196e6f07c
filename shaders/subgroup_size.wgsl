// subgroup_size: sizes[i] = the subgroup size invocation i runs in. The host takes the smallest, once per
// device, to learn whether kernels may assume subgroups of at least 8 lanes (matmul's SUBGROUP_MIN) and,
// on CPU adapters, how many invocations share one vector loop (matmul's SIMD_LANES).
// Bindings: 0 sizes (read_write) u32 [64].
// Dispatch: (1, 1, 1) workgroups of 64.
// No non-subgroup entry point: the host runs this only on devices with subgroups.

enable subgroups;

@group(0) @binding(0) var<storage, read_write> sizes: array<u32>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32, @builtin(subgroup_size) size: u32) {
  sizes[i] = size;
}
