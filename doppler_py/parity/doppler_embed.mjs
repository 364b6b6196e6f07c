// Embeds token-id inputs with the JS original (doppler-gpu) under Node and writes its vectors.
//
//   node doppler_embed.mjs PACKAGE_DIR RDRR_DIR JOB.json OUT.json
//
// PACKAGE_DIR is the unpacked doppler-gpu package, RDRR_DIR a folder its converter wrote for an embedding model
// (modelType "embedding"; pooling, Dense projections and Normalize as its converter read them from the folder's
// sentence-transformers files). The job is {"inputs": [[token ids], ...]}: each input goes in as token ids (no
// tokenizer, no chat template) through the package's public handle, `embed(prompt, {inputIds})`, one input at a
// time as its own `embedBatch` does.
//
// OUT gets {"vectors": [base64 float32 rows], "modes": [the pooling each input used], "adapter": {...}}. Each
// phase (import, load, embed) is printed to stderr as it ends, `doppler-gpu phase NAME SECONDS` (wall time), the
// lines the Python side reads (doppler_model._run).
//
// WebGPU comes from the module named by DOPPLER_NODE_WEBGPU_MODULE (the npm package `webgpu`, i.e. Dawn),
// which the package's own Node bootstrap reads.

import { readFileSync, writeFileSync } from 'node:fs';

import { exitOnUncaught, loadModel, phaseClock } from './node_driver.mjs';

const [packageDir, rdrrDir, jobPath, outPath] = process.argv.slice(2);
if (!outPath) {
  console.error('usage: node doppler_embed.mjs PACKAGE_DIR RDRR_DIR JOB.json OUT.json');
  process.exit(2);
}
const job = JSON.parse(readFileSync(jobPath, 'utf8'));
const endPhase = phaseClock();
endPhase('import');

exitOnUncaught();
const model = await loadModel(packageDir, rdrrDir);
endPhase('load');
try {
  const vectors = [];
  const modes = [];
  for (const ids of job.inputs) {
    const result = await model.embed('', { inputIds: ids, useChatTemplate: false });
    vectors.push(Buffer.from(Float32Array.from(result.embedding).buffer).toString('base64'));
    modes.push(result.embeddingMode ?? null);
  }
  endPhase('embed');
  writeFileSync(outPath, JSON.stringify({ vectors, modes, adapter: model.deviceInfo ?? null }));
} finally {
  await model.unload();
}
