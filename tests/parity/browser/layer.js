// Runs one captured submit of doppler-py (the Dawn worker's job format, see tests/parity/dawn/worker.mjs)
// with this browser's WebGPU, and POSTs the buffers it wrote to /result:
//   {ok, errors: [string], adapter: {...}, limits: {...}, features: [...], buffers: {id: base64}, ms}
// The device asks only for the features the WGSL enables; no limit is raised, so a kernel that needs more
// than the WebGPU defaults fails here as it would on any page.

const REPORTED_LIMITS = [
  'maxStorageBuffersPerShaderStage',
  'maxComputeWorkgroupStorageSize',
  'maxComputeInvocationsPerWorkgroup',
  'maxComputeWorkgroupsPerDimension',
  'maxStorageBufferBindingSize',
  'maxBufferSize',
];
const ENABLES = { subgroups: /^\s*enable\s+subgroups\s*;/m, 'shader-f16': /^\s*enable\s+f16\s*;/m };

const align4 = (n) => Math.max(4, Math.ceil(n / 4) * 4);

function decode(b64) {
  const text = atob(b64);
  const bytes = new Uint8Array(text.length);
  for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
  return bytes;
}

function encode(arrayBuffer) {
  const bytes = new Uint8Array(arrayBuffer);
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

function createBuffer(device, size, usage, data) {
  const buffer = device.createBuffer({ size, usage, mappedAtCreation: data !== null });
  if (data !== null) {
    new Uint8Array(buffer.getMappedRange()).set(data);
    buffer.unmap();
  }
  return buffer;
}

async function openDevice(job, report) {
  if (!navigator.gpu) throw new Error('navigator.gpu is missing: WebGPU is off in this browser');
  const adapter = await navigator.gpu.requestAdapter();
  if (!adapter) throw new Error('requestAdapter() returned null: no WebGPU adapter');
  const sources = Object.values(job.modules);
  const needed = Object.keys(ENABLES).filter((f) => sources.some((s) => ENABLES[f].test(s)));
  const missing = needed.filter((f) => !adapter.features.has(f));
  if (missing.length) throw new Error(`the WGSL enables ${missing} but the adapter lacks it`);
  const device = await adapter.requestDevice({ requiredFeatures: needed });
  const { vendor, architecture, device: name, description } = adapter.info;
  report.adapter = { vendor, architecture, device: name, description };
  report.features = [...device.features];
  report.limits = Object.fromEntries(REPORTED_LIMITS.map((k) => [k, device.limits[k]]));
  return device;
}

async function compileModule(device, name, code, errors) {
  device.pushErrorScope('validation');
  const module = device.createShaderModule({ label: name, code });
  const info = await module.getCompilationInfo();
  const scopeError = await device.popErrorScope();
  for (const m of info.messages) {
    if (m.type === 'error') errors.push(`${name}.wgsl:${m.lineNum}:${m.linePos}: ${m.message}`);
  }
  if (scopeError) errors.push(`${name}.wgsl: ${scopeError.message}`);
  return module;
}

// Explicit layouts, as the kernel registry builds them (a pipeline's group holds only what its entry uses).
async function createPipelines(device, job, errors) {
  const modules = {};
  for (const [name, code] of Object.entries(job.modules)) {
    modules[name] = await compileModule(device, name, code, errors);
  }
  const pipelines = {};
  for (const [label, spec] of Object.entries(job.pipelines)) {
    const bindGroupLayout = device.createBindGroupLayout({
      label,
      entries: spec.layout.map((b) => ({
        binding: b.binding,
        visibility: GPUShaderStage.COMPUTE,
        buffer: { type: b.type },
      })),
    });
    try {
      const pipeline = await device.createComputePipelineAsync({
        label,
        layout: device.createPipelineLayout({ bindGroupLayouts: [bindGroupLayout] }),
        compute: { module: modules[spec.module], entryPoint: spec.entry, constants: spec.constants ?? {} },
      });
      pipelines[label] = { pipeline, bindGroupLayout };
    } catch (error) {
      errors.push(`pipeline ${label}: ${error.message}`);
    }
  }
  return pipelines;
}

// Every step in one command encoder: consecutive dispatches share a compute pass, a copy ends it.
function encodeSteps(device, encoder, job, pipelines, buffers) {
  let pass = null;
  for (const step of job.steps) {
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
      const uniform = createBuffer(device, align4(bytes.length), GPUBufferUsage.UNIFORM, bytes);
      entries.push({ binding: step.uniform.binding, resource: { buffer: uniform, offset: 0, size: bytes.length } });
    }
    pass ??= encoder.beginComputePass();
    pass.setPipeline(pipeline);
    pass.setBindGroup(0, device.createBindGroup({ layout: bindGroupLayout, entries }));
    pass.dispatchWorkgroups(...step.workgroups);
  }
  pass?.end();
}

async function run(job, report) {
  const device = await openDevice(job, report);
  const errors = report.errors;
  device.addEventListener('uncapturederror', (event) => errors.push(`uncaptured: ${event.error.message}`));
  const pipelines = await createPipelines(device, job, errors);
  if (errors.length) return;

  const started = performance.now();
  const usage = GPUBufferUsage.STORAGE | GPUBufferUsage.COPY_SRC | GPUBufferUsage.COPY_DST;
  const buffers = {};
  for (const [id, spec] of Object.entries(job.buffers)) {
    buffers[id] = createBuffer(device, align4(spec.size), usage, spec.data ? decode(spec.data) : null);
  }
  const staging = {};
  for (const id of job.read) {
    const size = align4(job.buffers[id].size);
    staging[id] = device.createBuffer({ size, usage: GPUBufferUsage.MAP_READ | GPUBufferUsage.COPY_DST });
  }
  device.pushErrorScope('validation');
  const encoder = device.createCommandEncoder();
  encodeSteps(device, encoder, job, pipelines, buffers);
  for (const [id, buffer] of Object.entries(staging)) {
    encoder.copyBufferToBuffer(buffers[id], 0, buffer, 0, buffer.size);
  }
  device.queue.submit([encoder.finish()]);
  const scopeError = await device.popErrorScope();
  if (scopeError) errors.push(`dispatch: ${scopeError.message}`);
  if (errors.length) return;
  for (const [id, buffer] of Object.entries(staging)) {
    await buffer.mapAsync(GPUMapMode.READ);
    report.buffers[id] = encode(buffer.getMappedRange().slice(0, job.buffers[id].size));
    buffer.unmap();
  }
  report.ms = performance.now() - started;
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
