// What every Node driver of the JS original (doppler-gpu) does the same way: report an uncaught failure where
// the Python side reads it, time its phases, and load a converted model with the KV cache dtype its manifest
// names. Imported by doppler_model.mjs, doppler_embed.mjs and tools/bench_peers.mjs.

import { readFileSync } from 'node:fs';
import { performance } from 'node:perf_hooks';
import { pathToFileURL } from 'node:url';

// A failure's message is the last thing written (on stderr unless `report` writes it elsewhere), after its stack:
// a stack trace ends in frames, so the Python side reads the line `report` writes.
export function exitOnUncaught(report = (message) => console.error(`doppler-gpu failed: ${message}`)) {
  process.on('uncaughtException', (error) => {
    console.error(error?.stack ?? error);
    report(`${error?.message ?? error}`);
    process.exit(1);
  });
}

// endPhase(name) ends the phase that began at the previous call and prints `doppler-gpu phase NAME SECONDS` on
// stderr at once, so a run stopped at its time limit still tells where its time went. performance.now() counts
// from the process's start, so the first phase includes Node's start and the imports.
export function phaseClock() {
  let phaseStart = 0;
  return (name) => {
    const now = performance.now();
    console.error(`doppler-gpu phase ${name} ${((now - phaseStart) / 1000).toFixed(3)}`);
    phaseStart = now;
  };
}

// The package's `load` on a folder its converter wrote. The KV cache is allocated from the runtime config's
// session, whose default kvDtype is f16 (src/config/schema/kvcache.schema.js), not from the manifest's: on an
// adapter with shader-f16 an f32 model's attention steps would then meet an f16 cache, which its precision
// contract refuses (docs/parity-findings.md, finding 8). So the manifest's own kvDtype goes in as the runtime's.
export async function loadModel(packageDir, rdrrDir) {
  const { load } = await import(pathToFileURL(`${packageDir}/src/index.js`).href);
  const manifest = JSON.parse(readFileSync(`${rdrrDir}/manifest.json`, 'utf8'));
  const kvDtype = manifest.inference?.session?.kvcache?.kvDtype;
  const runtimeConfig = kvDtype ? { inference: { session: { kvcache: { kvDtype } } } } : undefined;
  return load({ url: pathToFileURL(rdrrDir).href }, { runtimeConfig });
}
