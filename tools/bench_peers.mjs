// The JS original (doppler-gpu) as one peer of tools/bench_peers.py: loads a model once, then times greedy
// generations asked for on stdin, one JSON job per line.
//
//   node tools/bench_peers.mjs PACKAGE_DIR RDRR_DIR
//
// PACKAGE_DIR is the unpacked doppler-gpu package, RDRR_DIR a folder its converter wrote (doppler_py.parity
// .doppler_model.convert). WebGPU comes from the module named by DOPPLER_NODE_WEBGPU_MODULE (Dawn), which the
// package's Node bootstrap reads; doppler_model.node_environment() sets it and the Vulkan driver.
//
// The model goes through the package's public handle, as the parity lane's doppler_model.mjs drives it: the prompt
// as token ids through `advanced.prefillWithLogits`, then `advanced.decodeStepLogits` once per further token, each
// token the argmax of its logits (greedy; no end-of-sequence stop, so every peer generates the same count).
//
// Protocol (stdout; the package may print lines of its own, so ours start with "BENCH "):
//   after loading:  BENCH {"load_s": s, "adapter": {...}}
//   per job line {"ids": [...], "new_tokens": N}:
//                   BENCH {"first_token_s": s, "decode_s": s, "first_count": 1, "tokens": [...], "max_rss_bytes": n}
// first_token_s runs from the prefill's call to the first token's id; decode_s from there to the last token's id.

import { performance } from 'node:perf_hooks';
import { createInterface } from 'node:readline';

import { exitOnUncaught, loadModel } from '../doppler_py/parity/node_driver.mjs';

const [packageDir, rdrrDir] = process.argv.slice(2);
if (!rdrrDir) {
  console.error('usage: node bench_peers.mjs PACKAGE_DIR RDRR_DIR');
  process.exit(2);
}

function reply(record) {
  process.stdout.write(`BENCH ${JSON.stringify(record)}\n`);
}

function argmax(logits) {
  let best = 0;
  for (let i = 1; i < logits.length; i++) {
    if (logits[i] > logits[best]) best = i;
  }
  return best;
}

exitOnUncaught((message) => reply({ error: message }));

const loadStart = performance.now();
const model = await loadModel(packageDir, rdrrDir);
reply({ load_s: (performance.now() - loadStart) / 1000, adapter: model.deviceInfo ?? null });

const lines = createInterface({ input: process.stdin });
for await (const line of lines) {
  if (!line.trim()) continue;
  const job = JSON.parse(line);
  model.resetGenerationState();
  const ids = [...job.ids];
  const start = performance.now();
  let logits = (await model.advanced.prefillWithLogits('', { inputIds: ids, useChatTemplate: false })).logits;
  const tokens = [argmax(logits)];
  const first = performance.now();
  ids.push(tokens[0]);
  while (tokens.length < job.new_tokens) {
    logits = (await model.advanced.decodeStepLogits(ids)).logits;
    const token = argmax(logits);
    tokens.push(token);
    ids.push(token);
  }
  const end = performance.now();
  reply({
    first_token_s: (first - start) / 1000,
    decode_s: (end - first) / 1000,
    first_count: 1,
    tokens,
    max_rss_bytes: process.resourceUsage().maxRSS * 1024,
  });
}
await model.unload();
