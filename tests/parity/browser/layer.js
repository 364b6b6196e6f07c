// Runs one captured submit of doppler-py (the Dawn worker's job format, see tests/parity/dawn/worker.mjs) with
// this browser's WebGPU, through the same run_job.mjs as the worker, and POSTs the buffers it wrote to /result:
//   {ok, errors: [string], adapter: {...}, limits: {...}, features: [...], buffers: {id: base64}, ms}
// The device asks only for the features the WGSL enables; no limit is raised, so a kernel that needs more
// than the WebGPU defaults fails here as it would on any page.

import { PipelineCache, buildPipelines, describeAdapter, reportedLimits, runSteps } from './run_job.mjs';

const ENABLES = { subgroups: /^\s*enable\s+subgroups\s*;/m, 'shader-f16': /^\s*enable\s+f16\s*;/m };

const base64 = {
  decode(text) {
    const binary = atob(text);
    const bytes = new Uint8Array(binary.length);
    for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
    return bytes;
  },
  encode(arrayBuffer) {
    const bytes = new Uint8Array(arrayBuffer);
    let binary = '';
    for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
    return btoa(binary);
  },
};

// As the Python client prints the worker's errors: "[stage] pipeline: message".
const describeError = (e) => `[${e.stage}] ${e.pipeline ? `${e.pipeline}: ` : ''}${e.message}`;

async function openDevice(job, report) {
  if (!navigator.gpu) throw new Error('navigator.gpu is missing: WebGPU is off in this browser');
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new Error('requestAdapter() returned null: no WebGPU adapter');
  const sources = Object.values(job.modules);
  const needed = Object.keys(ENABLES).filter((f) => sources.some((s) => ENABLES[f].test(s)));
  const missing = needed.filter((f) => !adapter.features.has(f));
  if (missing.length) throw new Error(`the WGSL enables ${missing} but the adapter lacks it`);
  const device = await adapter.requestDevice({ requiredFeatures: needed });
  report.adapter = describeAdapter(adapter);
  report.features = [...device.features];
  report.limits = reportedLimits(device);
  return device;
}

async function run(job, report) {
  const device = await openDevice(job, report);
  const errors = [];
  device.addEventListener('uncapturederror', (event) => errors.push({ stage: 'device', message: event.error.message }));
  const pipelines = await buildPipelines(new PipelineCache(device), job, errors, []);
  if (errors.length === 0) {
    const started = performance.now();
    report.buffers = await runSteps(device, job, pipelines, base64, errors);
    report.ms = performance.now() - started;
  }
  report.errors.push(...errors.map(describeError));
}

async function main() {
  const report = { ok: false, errors: [], buffers: {} };
  try {
    const response = await fetch('/job.json');
    await run(await response.json(), report);
  } catch (error) {
    report.errors.push(String(error?.stack ?? error));
  }
  report.ok = report.errors.length === 0;
  const headers = { 'Content-Type': 'application/json' };
  await fetch('/result', { method: 'POST', headers, body: JSON.stringify(report) });
}

main();
