// Runs the JS original's SpeculativeDecoder on deterministic mock models and prints what it did.
//
//   node driver.mjs <path to doppler-gpu's src/inference/speculative.js>  < job.json  > results.jsonl
//
// The job (written by tests/parity/test_speculative_js.py) lists cases, RNG seeds and math arguments; the
// driver answers one JSON line per case, one for the RNG streams and one for Math.exp/Math.log. Everything
// runs in this one process. speculative.js imports nothing, so it loads in Node as it is: no stubs needed.
//
// The mock models are integer hashes of the context, so their logits (multiples of 1/8, |x| <= 32) are exact
// in float32 and computed identically by the Python twin in test_speculative_js.py. Keep the two in step.

import { readFileSync } from 'node:fs';
import { pathToFileURL } from 'node:url';

function mix32(x) {
  x = (x ^ (x >>> 16)) >>> 0;
  x = Math.imul(x, 0x7feb352d) >>> 0;
  x = (x ^ (x >>> 15)) >>> 0;
  x = Math.imul(x, 0x846ca68b) >>> 0;
  return (x ^ (x >>> 16)) >>> 0;
}

function contextHash(ids, salt) {
  let h = salt >>> 0;
  for (const id of ids) h = mix32((h + Math.imul(id + 1, 0x9e3779b9)) >>> 0);
  return h;
}

// The hash of token i under context hash h.
function tokenHash(h, i) {
  return mix32((h ^ Math.imul(i + 1, 0x85ebca6b)) >>> 0);
}

class MockCache {
  constructor(n, cloned, counter) {
    this.n = n;
    this.cloned = cloned;
    this.counter = counter;
  }
  clone() {
    this.counter.clones++;
    return new MockCache(this.n, true, this.counter);
  }
}

// logits = sum over components of ((tokenHash mod spread) - spread/2) / 8, then the mask (-Infinity) and
// the poison (+Infinity at one position, which turns every log-prob into NaN).
function mockLogits(spec, ids, vocab) {
  const values = new Array(vocab).fill(0);
  for (const [salt, spread] of spec.components) {
    const h = contextHash(ids, salt);
    for (let i = 0; i < vocab; i++) values[i] += ((tokenHash(h, i) % spread) - spread / 2) / 8;
  }
  if (spec.mask) {
    const [salt, every] = spec.mask;
    const h = contextHash(ids, salt);
    for (let i = 0; i < vocab; i++) if (tokenHash(h, i) % every === 0) values[i] = -Infinity;
  }
  if (spec.poison) {
    const [salt, every] = spec.poison;
    const h = contextHash(ids, salt);
    if (h % every === 0) values[(h >>> 8) % vocab] = Infinity;
  }
  switch (spec.format) {
    case 'vector':
      return Float32Array.from(values);
    case 'list':
      return values;
    case 'rows':
      return [new Float32Array(vocab).fill(7), Float32Array.from(values)];
    case 'f64':
      return Float64Array.from(values);
    default:
      throw new Error(`unknown logits format ${spec.format}`);
  }
}

function mockModel(tag, spec, vocab, calls) {
  return {
    forward(ids, kvCache) {
      calls.push([tag, ids.length, kvCache ? kvCache.n : -1, kvCache ? kvCache.cloned : false]);
      const result = { logits: mockLogits(spec, ids, vocab) };
      if (spec.returns_cache && kvCache) result.newKVCache = new MockCache(ids.length, false, kvCache.counter);
      return result;
    },
  };
}

// An order-sensitive checksum of a Float32Array's bits (every NaN counted as the canonical quiet NaN).
function arrayDigest(values) {
  const bits = new Uint32Array(values.buffer, values.byteOffset, values.length);
  let sum = values.length >>> 0;
  for (let i = 0; i < values.length; i++) {
    const word = Number.isNaN(values[i]) ? 0x7fc00000 : bits[i];
    sum = (sum + (Math.imul((word ^ Math.imul(i + 1, 0x27d4eb2f)) >>> 0, 0x9e3779b1) >>> 0)) >>> 0;
  }
  return sum;
}

function newDecoder(SpeculativeDecoder, numDraftTokens, temperature, randomSeed) {
  return new SpeculativeDecoder({
    numDraftTokens,
    maxRejectionRetries: 3,
    enableTreeDraft: false,
    temperature,
    randomSeed,
  });
}

async function runCase(SpeculativeDecoder, job) {
  const decoder = newDecoder(SpeculativeDecoder, job.k, job.temperature, job.seed);
  let draws = 0;
  const draw = decoder.random;
  decoder.random = () => {
    draws++;
    return draw();
  };
  let digest = 0;
  const logSoftmax = decoder.logSoftmax.bind(decoder);
  decoder.logSoftmax = (logits) => {
    const out = logSoftmax(logits);
    digest = mix32((digest ^ arrayDigest(out)) >>> 0);
    return out;
  };
  const calls = [];
  const counter = { clones: 0 };
  decoder.setMainModel(mockModel('main', job.main, job.vocab, calls));
  decoder.setDraftModel(mockModel('draft', job.draft, job.vocab, calls));

  let context = [...job.prompt];
  const steps = [];
  for (let s = 0; s < job.steps; s++) {
    calls.length = 0;
    draws = 0;
    digest = 0;
    counter.clones = 0;
    const mainCache = job.caches ? new MockCache(context.length, false, counter) : null;
    const draftCache = job.caches ? new MockCache(context.length, false, counter) : null;
    const result = await decoder.step(context, mainCache, draftCache);
    steps.push({
      new_tokens: result.newTokens,
      accept_rate: result.acceptRate,
      same_main_cache: result.mainKVCache === mainCache,
      calls: calls.map((call) => [...call]),
      clones: counter.clones,
      draws,
      digest,
      stats: statsOf(decoder.getStats()),
    });
    context = [...context, ...result.newTokens];
  }
  decoder.resetStats();
  return { kind: 'case', name: job.name, steps, stats_after_reset: statsOf(decoder.getStats()) };
}

function statsOf(stats) {
  return {
    total_drafted: stats.totalDrafted,
    total_accepted: stats.totalAccepted,
    total_rejected: stats.totalRejected,
    average_accept_rate: stats.averageAcceptRate,
    speedup: stats.speedup,
  };
}

function rngStreams(SpeculativeDecoder, seeds, count) {
  return seeds.map((seed) => {
    const decoder = newDecoder(SpeculativeDecoder, 1, 1, seed);
    const values = [];
    for (let i = 0; i < count; i++) values.push(decoder.random() * 4294967296);
    return { seed, values };
  });
}

function mapFloat64(base64, fn) {
  const bytes = Buffer.from(base64, 'base64');
  const args = new Float64Array(bytes.buffer, bytes.byteOffset, bytes.length / 8);
  const out = new Float64Array(args.length);
  for (let i = 0; i < args.length; i++) out[i] = fn(args[i]);
  return Buffer.from(out.buffer).toString('base64');
}

const [, , modulePath] = process.argv;
const { SpeculativeDecoder } = await import(pathToFileURL(modulePath).href);
const job = JSON.parse(readFileSync(0, 'utf8'));
for (const spec of job.cases) {
  process.stdout.write(JSON.stringify(await runCase(SpeculativeDecoder, spec)) + '\n');
}
const streams = rngStreams(SpeculativeDecoder, job.rng_seeds, job.rng_draws);
process.stdout.write(JSON.stringify({ kind: 'rng', streams }) + '\n');
const math = { kind: 'math', exp: mapFloat64(job.math.exp, Math.exp), log: mapFloat64(job.math.log, Math.log) };
process.stdout.write(JSON.stringify(math) + '\n');
