// The WebGPU side of a doppler-py replay job (format in worker.mjs's header), shared by the Dawn worker (Node,
// imported by worker.mjs) and the browser page (tests/parity/browser/layer.js, served by harness.py), so both
// lanes build shaders, explicit layouts, pipelines, buffers, dispatches and readbacks the same way.
//
// Plain WebGPU and ES only: the caller opens the device and passes in its base64 codec (Node's Buffer is far
// faster than atob/btoa on large readbacks; a page has no Buffer). Errors and warnings are {stage, message}
// objects, plus `pipeline` (its name in the job) on those that made a pipeline fail.

export const REPORTED_LIMITS = [
  'maxStorageBuffersPerShaderStage',
  'maxComputeWorkgroupStorageSize',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupsPerDimension',
  'maxStorageBufferBindingSize',
  'maxBufferSize',
];

export const reportedLimits = (device) => Object.fromEntries(REPORTED_LIMITS.map((k) => [k, device.limits[k]]));

export function describeAdapter(adapter) {
  const { vendor, architecture, device, description } = adapter.info;
  return { vendor, architecture, device, description };
}

const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);

// One device's shader modules (by WGSL source) and pipelines (by spec), so repeated jobs compile nothing twice.
export class PipelineCache {
  constructor(device) {
    this.device = device;
    this.modules = new Map(); // WGSL source -> {module, messages, failed, scopeError}
    this.pipelines = new Map(); // pipeline spec key -> {pipeline, bindGroupLayout}
  }

  async module(source, errors, warnings) {
    let entry = this.modules.get(source);
    if (!entry) {
      const device = this.device;
      device.pushErrorScope('validation');
      const module = device.createShaderModule({ code: source });
      const info = await module.getCompilationInfo();
      const scopeError = await device.popErrorScope();
      const messages = info.messages.map((m) => ({
        type: m.type,
        text: `${m.type} at line ${m.lineNum}:${m.linePos}: ${m.message}`,
      }));
      const failed = scopeError !== null || messages.some((m) => m.type === 'error');
      entry = { module, messages, failed, scopeError: scopeError?.message };
      this.modules.set(source, entry);
    }
    for (const m of entry.messages) (m.type === 'error' ? errors : warnings).push({ stage: 'compile', message: m.text });
    if (entry.failed && entry.scopeError && !entry.messages.some((m) => m.type === 'error')) {
      errors.push({ stage: 'compile', message: entry.scopeError });
    }
    return entry.failed ? null : entry.module;
  }

  // Explicit layouts, as the kernel registry builds them (a pipeline's group holds only what its entry uses).
  async pipeline(spec, source, errors, warnings) {
    const key = JSON.stringify([source, spec.entry, spec.constants ?? {}, spec.layout]);
    const cached = this.pipelines.get(key);
    if (cached) return cached;
    const module = await this.module(source, errors, warnings);
    if (!module) return null;
    const device = this.device;
    device.pushErrorScope('validation');
    const bindGroupLayout = device.createBindGroupLayout({
      entries: spec.layout.map((b) => ({
        binding: b.binding,
        visibility: GPUShaderStage.COMPUTE,
        buffer: { type: b.type },
      })),
    });
    const layout = device.createPipelineLayout({ bindGroupLayouts: [bindGroupLayout] });
    const layoutError = await device.popErrorScope();
    if (layoutError) {
      errors.push({ stage: 'layout', message: layoutError.message });
      return null;
    }
    try {
      const pipeline = await device.createComputePipelineAsync({
        layout,
        compute: { module, entryPoint: spec.entry, constants: spec.constants ?? {} },
      });
      const result = { pipeline, bindGroupLayout };
      this.pipelines.set(key, result);
      return result;
    } catch (error) {
      errors.push({ stage: 'pipeline', message: error.message });
      return null;
    }
  }
}

// name -> {pipeline, bindGroupLayout} for every pipeline of the job (null where it failed, with its errors).
export async function buildPipelines(cache, job, errors, warnings) {
  const pipelines = {};
  for (const [name, spec] of Object.entries(job.pipelines ?? {})) {
    const compiled = await cache.pipeline(spec, job.modules[spec.module], errors, warnings);
    if (!compiled) errors.forEach((e) => (e.pipeline ??= name));
    pipelines[name] = compiled;
  }
  return pipelines;
}

// Uploads the job's buffers, records its steps in one command encoder, submits, and returns {id: base64} of the
// buffers it reads, or {} when anything went wrong (pushed to `errors`). Every buffer it makes is destroyed.
export async function runSteps(device, job, pipelines, base64, errors) {
  const scratch = [];
  const track = (buffer) => (scratch.push(buffer), buffer);
  try {
    const buffers = {};
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    for (const [id, spec] of Object.entries(job.buffers ?? {})) {
      const data = spec.data ? base64.decode(spec.data) : null;
      buffers[id] = track(createBuffer(device, align4(spec.size), usage, data));
    }
    const staging = {};
    for (const id of job.read ?? []) {
      const size = align4(job.buffers[id].size);
      staging[id] = track(device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST }));
    }

    // Scopes are always popped, even when encoding throws, so the next job starts with a clean stack.
    for (const scope of ['validation', 'out-of-memory', 'internal']) device.pushErrorScope(scope);
    let thrown = null;
    try {
      const encoder = device.createCommandEncoder();
      encodeSteps(device, encoder, job.steps ?? [], pipelines, buffers, base64, track);
      for (const [id, buffer] of Object.entries(staging)) {
        encoder.copyBufferToBuffer(buffers[id], 0, buffer, 0, buffer.size);
      }
      device.queue.submit([encoder.finish()]);
    } catch (error) {
      thrown = error;
    }
    const scopeErrors = await Promise.all([device.popErrorScope(), device.popErrorScope(), device.popErrorScope()]);
    for (const error of scopeErrors) if (error) errors.push({ stage: 'dispatch', message: error.message });
    if (thrown) errors.push({ stage: 'encode', message: String(thrown?.message ?? thrown) });
    if (errors.length) return {};

    const out = {};
    for (const [id, buffer] of Object.entries(staging)) {
      await buffer.mapAsync(GPUMapMode.READ);
      out[id] = base64.encode(buffer.getMappedRange().slice(0, job.buffers[id].size));
      buffer.unmap();
    }
    return out;
  } finally {
    for (const buffer of scratch) buffer.destroy();
  }
}

function createBuffer(device, size, usage, data) {
  const buffer = device.createBuffer({ size, usage, mappedAtCreation: data !== null });
  if (data !== null) {
    new Uint8Array(buffer.getMappedRange()).set(data);
    buffer.unmap();
  }
  return buffer;
}

// One compute pass for consecutive dispatches (each dispatch is its own synchronization scope, as in the
// Python Recorder); a copy ends the pass.
function encodeSteps(device, encoder, steps, pipelines, buffers, base64, track) {
  let pass = null;
  for (const step of steps) {
    if (step.copy) {
      pass?.end();
      pass = null;
      const c = step.copy;
      encoder.copyBufferToBuffer(buffers[c.src], c.src_offset, buffers[c.dst], c.dst_offset, c.size);
      continue;
    }
    const { pipeline, bindGroupLayout } = pipelines[step.dispatch];
    const entries = step.bind.map((b) => ({
      binding: b.binding,
      resource: { buffer: buffers[b.buffer], offset: b.offset, size: b.size },
    }));
    if (step.uniform) {
      const bytes = base64.decode(step.uniform.data);
      const uniform = track(createBuffer(device, align4(bytes.length), GPUBufferUsage.UNIFORM, bytes));
      entries.push({ binding: step.uniform.binding, resource: { buffer: uniform, offset: 0, size: bytes.length } });
    }
    pass ??= encoder.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, device.createBindGroup({ layout: bindGroupLayout, entries }));
    pass.dispatchWorkgroups(...step.workgroups);
  }
  pass?.end();
}
