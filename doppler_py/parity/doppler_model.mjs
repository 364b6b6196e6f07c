// Runs a whole model in the JS original (doppler-gpu) under Node and writes its greedy steps' logits.
//
//   node doppler_model.mjs PACKAGE_DIR RDRR_DIR JOB.json OUT.json
//
// PACKAGE_DIR is the unpacked doppler-gpu package, RDRR_DIR a folder its converter wrote. The job is
// {"ids": [prompt token ids], "steps": N}. The prompt goes in as token ids (no chat template, no tokenizer),
// through the package's public handle: `advanced.prefillWithLogits` for the prompt, then
// `advanced.decodeStepLogits` once per generated token. Each step's token is chosen by the package's own
// sampling functions as its generator calls them (`applyRepetitionPenalty`, then `sample`), at temperature 0
// and repetition penalty 1 (its default penalty is 1.1, which would change greedy tokens).
//
// OUT gets {"tokens": [N ids], "logits": [N base64 float32 rows], "adapter": {...}}: row i is the logits the
// i-th token was chosen from. Each phase (import, load, prefill, every decode step) is printed to stderr as it
// ends, `doppler-gpu phase NAME SECONDS` (wall time), so that a run stopped at its time limit still tells the
// Python side where its time went (a real model's forward takes a minute on SwiftShader).
//
// WebGPU comes from the module named by DOPPLER_NODE_WEBGPU_MODULE (the npm package `webgpu`, i.e. Dawn),
// which the package's own Node bootstrap reads.

import { readFileSync, writeFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

import { exitOnUncaught, loadModel, phaseClock } from './node_driver.mjs';

const [packageDir, rdrrDir, jobPath, outPath] = process.argv.slice(2);
if (!outPath) {
  console.error('usage: node doppler_model.mjs PACKAGE_DIR RDRR_DIR JOB.json OUT.json');
  process.exit(2);
}
const job = JSON.parse(readFileSync(jobPath, 'utf8'));
const endPhase = phaseClock();
const { applyRepetitionPenalty, sample } = await import(
  pathToFileURL(`${packageDir}/src/inference/pipelines/text/sampling.js`).href
);
endPhase('import');

const GREEDY = { temperature: 0 };
const NO_PENALTY = 1.0;

exitOnUncaught();
const model = await loadModel(packageDir, rdrrDir);
endPhase('load');
try {
  const ids = [...job.ids];
  const tokens = [];
  const rows = [];
  let logits = (await model.advanced.prefillWithLogits('', { inputIds: ids, useChatTemplate: false })).logits;
  endPhase('prefill');
  for (let step = 0; step < job.steps; step++) {
    const row = Float32Array.from(logits);
    rows.push(Buffer.from(row.buffer).toString('base64'));
    const scratch = Float32Array.from(row);  // sample() masks in place
    applyRepetitionPenalty(scratch, ids, NO_PENALTY);
    const token = sample(scratch, GREEDY);
    tokens.push(token);
    ids.push(token);
    if (step + 1 < job.steps) {
      logits = (await model.advanced.decodeStepLogits(ids)).logits;
      endPhase(`decode${step + 1}`);
    }
  }
  writeFileSync(outPath, JSON.stringify({ tokens, logits: rows, adapter: model.deviceInfo ?? null }));
} finally {
  await model.unload();
}
