"""Whole-model parity: our engine, HF transformers and the JS original (doppler-gpu) on the same HF folder.

Each engine decodes greedily from the same prompt ids, all in float32: ours step by step through our GPU KV
cache (argmax, lowest id on ties), the JS original through its own pipeline and sampling (see
`doppler_model.run_greedy`), and HF by one teacher-forced forward over the prompt and OUR tokens. Step i's
logits are the ones the i-th generated token is chosen from. Two engines' step i are compared only while
both decoded the same tokens before it (the contexts are then identical); the first step whose chosen tokens
differ is the pair's first divergence.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from doppler_py.parity import doppler_model

ENGINES = ("ours", "hf", "doppler")
PAIRS = (("ours", "hf"), ("doppler", "hf"), ("ours", "doppler"))
DEFAULT_ATOL = 1e-4  # float32 engines on the tiny models agree to a few 1e-6 (docs/parity-findings.md)


@dataclass(frozen=True)
class EngineRun:
    """Greedy steps of one engine: `tokens[i]` chosen from `logits[i]`, decoded along `path` (the tokens its
    step i was conditioned on are path[:i])."""

    tokens: list[int]
    logits: np.ndarray
    path: list[int]


@dataclass(frozen=True)
class PairResult:
    pair: tuple[str, str]
    deltas: list[float]  # max |Δlogit| per comparable step
    first_divergence: int | None  # first step whose chosen tokens differ; None: none among comparable steps

    @property
    def max_delta(self) -> float:
        return max(self.deltas, default=0.0)


@dataclass
class ParityReport:
    model: str
    prompt_ids: list[int]
    steps: int
    runs: dict[str, EngineRun]
    pairs: list[PairResult] = field(default_factory=list)
    missing: dict[str, str] = field(default_factory=dict)  # engine -> why it did not run
    # phase -> wall seconds: "ours", "hf", "doppler convert" and the Node driver's phases ("doppler load", ...)
    timings: dict[str, float] = field(default_factory=dict)
    dawn_driver: str | None = None  # the Vulkan driver doppler-gpu ran on (doppler_model.DawnDriver.name)

    def record(self) -> dict:
        """Tokens and per-step deltas as plain JSON values."""
        return {
            "model": self.model,
            "prompt_ids": self.prompt_ids,
            "tokens": {name: run.tokens for name, run in self.runs.items()},
            "pairs": {
                "-".join(p.pair): {"deltas": p.deltas, "first_divergence": p.first_divergence} for p in self.pairs
            },
            "missing": self.missing,
            "timings": self.timings,
            "dawn_driver": self.dawn_driver,
        }

    def agrees(self, atol: float) -> bool:
        return not self.missing and all(p.first_divergence is None and p.max_delta <= atol for p in self.pairs)


def our_greedy(folder: Path, prompt_ids: list[int], steps: int, precision: str = "f32") -> EngineRun:
    """Our engine's greedy steps with the weights loaded in `precision` (see loader.load_weights)."""
    from doppler_py.gpu.device import default_gpu
    from doppler_py.gpu.kernels import KernelRegistry
    from doppler_py.model.loader import load_weights
    from doppler_py.model.transformer import Transformer

    gpu = default_gpu()
    registry = KernelRegistry(gpu)
    weights = load_weights(folder, gpu, precision)
    model = Transformer(weights, registry, max_positions=len(prompt_ids) + steps)
    try:
        cache = model.new_cache(len(prompt_ids) + steps)
        logits = model.forward(prompt_ids, cache, 0, logits="last")
        rows, tokens = [], []
        for step in range(steps):
            rows.append(np.asarray(logits, np.float32).reshape(-1))
            tokens.append(int(np.argmax(rows[-1])))
            if step + 1 < steps:
                logits = model.forward([tokens[-1]], cache, len(prompt_ids) + step, logits="last")
        model.release_cache(cache)
        return EngineRun(tokens, np.stack(rows), tokens)
    finally:
        model.close()
        weights.destroy()
        registry.close()


def hf_along(folder: Path, prompt_ids: list[int], path: list[int]) -> EngineRun:
    """HF's logits for every step of `path` (teacher-forced), and the tokens HF would choose at each."""
    from doppler_py.testing.reference import hf_logits

    full = hf_logits(folder, prompt_ids + path[:-1])[len(prompt_ids) - 1 :]
    return EngineRun([int(t) for t in full.argmax(axis=1)], full.astype(np.float32), path)


def compare_pair(a: EngineRun, b: EngineRun, pair: tuple[str, str]) -> PairResult:
    deltas: list[float] = []
    first = None
    for step in range(min(len(a.tokens), len(b.tokens))):
        if a.path[:step] != b.path[:step]:
            break  # different contexts from here on: nothing left to compare
        deltas.append(float(np.abs(a.logits[step].astype(np.float64) - b.logits[step]).max()))
        if first is None and a.tokens[step] != b.tokens[step]:
            first = step
    return PairResult(pair, deltas, first)


def run_parity(
    folder: Path,
    prompt_ids: list[int],
    steps: int,
    *,
    with_hf: bool = True,
    timeout: float | None = None,
    log: Callable[[str], None] | None = None,
) -> ParityReport:
    """Run the three engines on `folder` and compare every pair (HF is left out when transformers is missing
    or `with_hf` is False; the report says so).

    `timeout` limits doppler-gpu's conversion and, separately, its run (None: CONVERT_TIMEOUT_S and
    RUN_TIMEOUT_S); past it a DopplerTimeoutError names the limit and the phases that finished. `log` gets a
    line as each phase ends, as a real model's run takes minutes."""
    if not prompt_ids:
        raise doppler_model.DopplerParityError("the prompt is empty: parity needs at least one prompt token")
    if steps < 1:
        raise doppler_model.DopplerParityError(f"steps must be at least 1, got {steps}")
    if timeout is not None and not timeout > 0:
        raise doppler_model.DopplerParityError(f"the time limit must be positive, got {timeout} s")
    say = log or (lambda line: None)
    report = ParityReport(str(folder), list(prompt_ids), steps, {})
    start = time.perf_counter()
    report.runs["ours"] = our_greedy(folder, prompt_ids, steps)
    report.timings["ours"] = time.perf_counter() - start
    say(f"ours: {steps} steps in {report.timings['ours']:.1f} s")
    convert_limit = doppler_model.CONVERT_TIMEOUT_S if timeout is None else timeout
    run_limit = doppler_model.RUN_TIMEOUT_S if timeout is None else timeout
    with tempfile.TemporaryDirectory(prefix="doppler-rdrr-") as rdrr:
        start = time.perf_counter()
        converted = doppler_model.convert(folder, Path(rdrr), timeout=convert_limit)
        report.timings["doppler convert"] = time.perf_counter() - start
        say(f"doppler-gpu converter: {report.timings['doppler convert']:.1f} s")
        doppler = doppler_model.run_greedy(converted, prompt_ids, steps, timeout=run_limit, log=say)
    report.timings.update((f"doppler {name}", seconds) for name, seconds in doppler.phases)
    report.runs["doppler"] = EngineRun(doppler.tokens, doppler.logits, doppler.tokens)
    report.dawn_driver = doppler.driver
    if with_hf:
        start = time.perf_counter()
        try:
            report.runs["hf"] = hf_along(folder, prompt_ids, report.runs["ours"].tokens)
            report.timings["hf"] = time.perf_counter() - start
        except ImportError as exc:
            report.missing["hf"] = f"transformers/torch not installed ({exc.name})"
    else:
        report.missing["hf"] = "left out (--no-hf)"
    report.pairs = [
        compare_pair(report.runs[a], report.runs[b], (a, b)) for a, b in PAIRS if a in report.runs and b in report.runs
    ]
    return report


def format_report(report: ParityReport, atol: float = DEFAULT_ATOL) -> str:
    names = [name for name in ENGINES if name in report.runs]
    lines = [f"model: {report.model}", f"prompt ids ({len(report.prompt_ids)}): {report.prompt_ids}"]
    if report.dawn_driver is not None:
        lines.append(f"doppler-gpu ran on Dawn over {report.dawn_driver}")
    for engine, why in report.missing.items():
        lines.append(f"{engine}: not run: {why}")
    header = f"{'step':>4}  " + "  ".join(f"{n:>7}" for n in names)
    header += "".join(f"  {'|d| ' + a + '-' + b:>18}" for a, b in (p.pair for p in report.pairs))
    lines.append(header)
    for step in range(report.steps):
        row = f"{step:>4}  " + "  ".join(f"{report.runs[n].tokens[step]:>7}" for n in names)
        for pair in report.pairs:
            cell = f"{pair.deltas[step]:.2e}" if step < len(pair.deltas) else "-"
            mark = " *" if pair.first_divergence == step else ""
            row += f"  {cell + mark:>18}"
        lines.append(row)
    lines.append("(* = first divergence: the chosen tokens differ; '-' = contexts differ, not compared)")
    for pair in report.pairs:
        a, b = pair.pair
        where = "none" if pair.first_divergence is None else f"step {pair.first_divergence}"
        verdict = "ok" if pair.first_divergence is None and pair.max_delta <= atol else "DIFFERS"
        lines.append(
            f"{a} vs {b}: max |dlogit| {pair.max_delta:.2e} over {len(pair.deltas)} steps, "
            f"first divergence {where} -> {verdict} (atol {atol:g})"
        )
    if report.timings:
        lines.append("wall s: " + ", ".join(f"{name} {seconds:.1f}" for name, seconds in report.timings.items()))
    return "\n".join(lines)
