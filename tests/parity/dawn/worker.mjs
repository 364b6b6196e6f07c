// Dawn/Tint worker for doppler-py's parity lane: runs our WGSL under dawn.node (npm `webgpu`).
//
// Protocol: one JSON job per line on stdin, one JSON result per line on stdout, in order. The first line
// written is a hello: {"hello": true, "adapters": {"null": {...} | null, "vulkan": {...} | null}}.
//
// Job:
//   {"id": 1, "adapter": "null" | "vulkan",
//    "modules":   {"m0": "<wgsl>"},
//    "pipelines": {"p0": {"module": "m0", "entry": "main", "constants": {"TILE": 16},
//                         "layout": [{"binding": 0, "type": "uniform" | "storage" | "read-only-storage"}]}},
//    "buffers":   {"b0": {"size": 1024, "data": "<base64, optional>"}},
//    "steps": [{"dispatch": "p0", "workgroups": [x, y, z],
//               "bind": [{"binding": 1, "buffer": "b0", "offset": 0, "size": 40}],
//               "uniform": {"binding": 0, "data": "<base64>"}},
//              {"copy": {"src": "b0", "src_offset": 0, "dst": "b1", "dst_offset": 0, "size": 40}}],
//    "read": ["b0"]}
// A job without steps only compiles its pipelines (that is how shaders are validated).
// Result: {"id": 1, "ok": bool, "errors": [{"stage", "message"}], "warnings": [...], "buffers": {"b0": "<b64>"},
//          "ms": elapsed}.
//
// Adapters: "null" is Dawn's null backend (Tint validates everything, shader-f16 included; outputs are
// garbage); "vulkan" is whatever Vulkan driver VK_ICD_FILENAMES selects (Chrome's SwiftShader in the lane).
// Devices get the WebGPU DEFAULT limits (none raised), so a kernel a browser rejects is rejected here.

import { createInterface } from 'node:readline';
import { create, globals } from 'webgpu';

Object.assign(globalThis, globals);

const WANTED_FEATURES = ['shader-f16', 'subgroups'];
const REPORTED_LIMITS = [
  'maxStorageBuffersPerShaderStage',
  'maxComputeWorkgroupStorageSize',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupsPerDimension',
  'maxStorageBufferBindingSize',
  'maxBufferSize',
];

class Backend {
  constructor(name, options) {
    this.name = name;
    this.options = options;
    this.device = null;
    this.info = null;
    this.modules = new Map(); // WGSL source -> {module, messages}
    this.pipelines = new Map(); // pipeline spec key -> GPUComputePipeline
  }

  async open() {
    // Keep the GPU object referenced: if it is garbage-collected, Dawn's instance goes with it (a crash).
    this.gpu ??= create(this.options);
    const adapter = await this.gpu.requestAdapter();
    if (!adapter) return null;
    const features = WANTED_FEATURES.filter((f) => adapter.features.has(f));
    // No requiredLimits: the device gets the WebGPU defaults, as a page that asks for nothing does.
    this.device = await adapter.requestDevice({ requiredFeatures: features });
    this.modules.clear();
    this.pipelines.clear();
    this.uncaptured = [];
    this.device.addEventListener('uncapturederror', (event) => this.uncaptured.push(event.error.message));
    this.device.lost.then((lost) => {
      if (lost.reason !== 'destroyed') process.stderr.write(`dawn ${this.name} device lost: ${lost.message}\n`);
      this.device = null;
    });
    const limits = Object.fromEntries(REPORTED_LIMITS.map((k) => [k, this.device.limits[k]]));
    this.info = {
      vendor: adapter.info.vendor,
      architecture: adapter.info.architecture,
      device: adapter.info.device,
      description: adapter.info.description,
      features: [...this.device.features].filter((f) => WANTED_FEATURES.includes(f)),
      limits,
    };
    return this.info;
  }

  async ready() {
    if (!this.device && !(await this.open())) throw new Error(`no ${this.name} adapter`);
    return this.device;
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

const backends = {
  null: new Backend('null', ['backend=null']),
  vulkan: new Backend('vulkan', ['backend=vulkan']),
};

const decode = (b64) => Buffer.from(b64, 'base64');
const encode = (arrayBuffer) => Buffer.from(arrayBuffer).toString('base64');
const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);

async function runJob(job) {
  const started = performance.now();
  const errors = [];
  const warnings = [];
  const backend = backends[job.adapter];
  if (!backend) throw new Error(`unknown adapter ${JSON.stringify(job.adapter)}`);
  const device = await backend.ready();
  backend.uncaptured.length = 0;

  const pipelines = {};
  for (const [name, spec] of Object.entries(job.pipelines ?? {})) {
    const source = job.modules[spec.module];
    const compiled = await backend.pipeline(spec, source, errors, warnings);
    if (!compiled) errors.forEach((e) => (e.pipeline ??= name));
    pipelines[name] = compiled;
  }
  const steps = job.steps ?? [];
  const done = (extra) => ({ id: job.id, ok: errors.length === 0, errors, warnings, ...extra });
  if (errors.length || steps.length === 0) return done({ buffers: {}, ms: performance.now() - started });

  const scratch = [];
  const track = (buffer) => (scratch.push(buffer), buffer);
  try {
    const buffers = {};
    const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
    for (const [id, spec] of Object.entries(job.buffers ?? {})) {
      buffers[id] = track(createBuffer(device, align4(spec.size), usage, spec.data ? decode(spec.data) : null));
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
      encodeSteps(device, encoder, steps, pipelines, buffers, track);
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

    const out = {};
    if (errors.length === 0) {
      for (const [id, buffer] of Object.entries(staging)) {
        await buffer.mapAsync(GPUMapMode.READ);
        out[id] = encode(buffer.getMappedRange().slice(0, job.buffers[id].size));
        buffer.unmap();
      }
    }
    for (const message of backend.uncaptured) errors.push({ stage: 'device', message });
    return done({ buffers: errors.length ? {} : out, ms: performance.now() - started });
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
function encodeSteps(device, encoder, steps, pipelines, buffers, track) {
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
      const bytes = decode(step.uniform.data);
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

async function main() {
  const adapters = {};
  for (const [name, backend] of Object.entries(backends)) {
    try {
      adapters[name] = await backend.open();
    } catch (error) {
      adapters[name] = null;
      process.stderr.write(`dawn ${name} adapter failed: ${error.message}\n`);
    }
  }
  process.stdout.write(JSON.stringify({ hello: true, adapters }) + '\n');

  // Jobs run one at a time, in arrival order; a job that throws answers with its error instead of a result.
  let queue = Promise.resolve();
  const lines = createInterface({ input: process.stdin, crlfDelay: Infinity });
  lines.on('line', (line) => {
    if (!line.trim()) return;
    queue = queue.then(async () => {
      let job = { id: null };
      let result;
      try {
        job = JSON.parse(line);
        result = await runJob(job);
      } catch (error) {
        result = { id: job.id, ok: false, errors: [{ stage: 'worker', message: String(error?.stack ?? error) }] };
      }
      process.stdout.write(JSON.stringify(result) + '\n');
    });
  });
  // dawn.node keeps handles alive; leave explicitly once the last job has answered.
  lines.on('close', () => queue.then(() => process.exit(0)));
}

main();
