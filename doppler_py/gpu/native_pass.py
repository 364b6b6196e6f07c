"""wgpu-native's compute-pass functions called directly: the fast path `Recorder` records dispatches through."""

from __future__ import annotations


class _NativePassCalls:
    """wgpu-native's three compute-pass entry points, called without wgpu-py's per-call wrapper, and a step's
    encoder, pass and submit created and ended through wgpu-py's raising wrappers without its objects.

    A decode step records ~200 dispatches, and wgpu-py's wrapper (argument conversion, an error-capture
    stack push and pop around every C call) cost ~3.5 of the ~5 µs each dispatch took on the host. Errors in a
    pass are not lost: wgpu-core reports them when the pass ends or the encoder finishes, and those calls still
    go through wgpu-py, which raises them. Where the private module or handles are missing (another wgpu-py
    version or backend), `available` is False and the recorder uses the public API.
    """

    def __init__(self) -> None:
        try:
            from wgpu.backends.wgpu_native._api import GPUCommandEncoder, libf
            from wgpu.backends.wgpu_native._ffi import ffi, lib

            # A step's encoder, pass, command buffer and submit go through wgpu-py's error-raising wrappers
            # (`libf`) but skip its descriptor structs and the pass and command buffer objects (~0.1 ms a step
            # on a slow machine); none has a label.
            self.encoder_class = GPUCommandEncoder
            self.create_encoder = libf.wgpuDeviceCreateCommandEncoder
            self.encoder_descriptor = ffi.new("WGPUCommandEncoderDescriptor *")
            self.begin_pass = libf.wgpuCommandEncoderBeginComputePass
            self.end_pass = libf.wgpuComputePassEncoderEnd
            self.release_pass = lib.wgpuComputePassEncoderRelease
            self.pass_descriptor = ffi.new("WGPUComputePassDescriptor *")
            self.finish = libf.wgpuCommandEncoderFinish
            self.commands_descriptor = ffi.new("WGPUCommandBufferDescriptor *")
            self.submit = libf.wgpuQueueSubmit
            self.release_commands = lib.wgpuCommandBufferRelease
            self.set_pipeline = lib.wgpuComputePassEncoderSetPipeline
            self.set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
            self.dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
            self.null = ffi.NULL
            self._ffi = ffi
            # Addresses of the same three functions, for the compiled loop (dispatch_loop.py) to call.
            self.functions = tuple(
                self.address(ffi.addressof(lib, name))
                for name in (
                    "wgpuComputePassEncoderSetPipeline",
                    "wgpuComputePassEncoderSetBindGroup",
                    "wgpuComputePassEncoderDispatchWorkgroups",
                )
            )
            self.available = True
        except (ImportError, AttributeError):
            self.available = False

    def address(self, handle) -> int:
        return int(self._ffi.cast("uintptr_t", handle))

    def command_encoder(self, device):
        """A wgpu-py command encoder (copies, timestamps and tests use its methods) created without its
        descriptor struct."""
        return self.encoder_class("", self.create_encoder(device._internal, self.encoder_descriptor), device)

    def finish_and_submit(self, encoder, queue) -> None:
        commands = self.finish(encoder._internal, self.commands_descriptor)
        try:
            self.submit(queue._internal, 1, self._ffi.new("WGPUCommandBuffer[1]", [commands]))
        finally:
            self.release_commands(commands)


_NATIVE = _NativePassCalls()
