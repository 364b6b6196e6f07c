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
// A job without steps only compiles its pipelines (that is how shaders are validated). What a job does on the
// device is in run_job.mjs, which the browser page runs too.
// Result: {"id": 1, "ok": bool, "errors": [{"stage", "message"}], "warnings": [...], "buffers": {"b0": "<b64>"},
//          "ms": elapsed}.
//
// Adapters: "null" is Dawn's null backend (Tint validates everything, shader-f16 included; outputs are
// garbage); "vulkan" is whatever Vulkan driver VK_ICD_FILENAMES selects (Chrome's SwiftShader in the lane).
// Devices get the WebGPU DEFAULT limits (none raised), so a kernel a browser rejects is rejected here.

import { createInterface } from 'node:readline';
import { create, globals } from 'webgpu';
import { PipelineCache, buildPipelines, describeAdapter, reportedLimits, runSteps } from './run_job.mjs';

Object.assign(globalThis, globals);

const WANTED_FEATURES = ['shader-f16', 'subgroups'];
const base64 = {
  decode: (text) => Buffer.from(text, 'base64'),
  encode: (arrayBuffer) => Buffer.from(arrayBuffer).toString('base64'),
};

class Backend {
  constructor(name, options) {
    this.name = name;
    this.options = options;
    this.device = null;
    this.info = null;
    this.cache = null;
  }

  async open() {
    // Keep the GPU object referenced: if it is garbage-collected, Dawn's instance goes with it (a crash).
    this.gpu ??= create(this.options);
    const adapter = await this.gpu.requestAdapter();
    if (!adapter) return null;
    const features = WANTED_FEATURES.filter((f) => adapter.features.has(f));
    // No requiredLimits: the device gets the WebGPU defaults, as a page that asks for nothing does.
    this.device = await adapter.requestDevice({ requiredFeatures: features });
    this.cache = new PipelineCache(this.device);
    this.uncaptured = [];
    this.device.addEventListener('uncapturederror', (event) => this.uncaptured.push(event.error.message));
    this.device.lost.then((lost) => {
      if (lost.reason !== 'destroyed') process.stderr.write(`dawn ${this.name} device lost: ${lost.message}\n`);
      this.device = null;
    });
    this.info = {
      ...describeAdapter(adapter),
      features: [...this.device.features].filter((f) => WANTED_FEATURES.includes(f)),
      limits: reportedLimits(this.device),
    };
    return this.info;
  }

  async ready() {
    if (!this.device && !(await this.open())) throw new Error(`no ${this.name} adapter`);
    return this.device;
  }
}

const backends = {
  null: new Backend('null', ['backend=null']),
  vulkan: new Backend('vulkan', ['backend=vulkan']),
};

async function runJob(job) {
  const started = performance.now();
  const errors = [];
  const warnings = [];
  const backend = backends[job.adapter];
  if (!backend) throw new Error(`unknown adapter ${JSON.stringify(job.adapter)}`);
  const device = await backend.ready();
  backend.uncaptured.length = 0;

  const pipelines = await buildPipelines(backend.cache, job, errors, warnings);
  let buffers = {};
  if (errors.length === 0 && (job.steps ?? []).length > 0) {
    buffers = await runSteps(device, job, pipelines, base64, errors);
    for (const message of backend.uncaptured) errors.push({ stage: 'device', message });
  }
  const ok = errors.length === 0;
  return { id: job.id, ok, errors, warnings, buffers: ok ? buffers : {}, ms: performance.now() - started };
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
