"""Time the JS original's decode kernels (doppler-gpu@0.5.1) next to ours: same device, same run, same inputs.

    python tools/bench_vs_doppler.py [--json out.json] [--rounds 5] [--target-ms 150] [--only lm_head ...]

SmolLM2-135M shapes: LM head 49152 x 576 and MLP up 1536 x 576 at one token, per weight format; softmax and
sampling over the 49152-token vocabulary; attention decode over 512 cached positions and a 128-token prefill.
Their kernels are the ones their JS wrappers pick on this device under WebGPU default limits (f32 weights:
`matmul_f32`, even at M = 1; f16: `gemv_subgroup_multicol`; Q4_K: `q4_fused_multicol`), plus the alternatives
named in the table, set up as those wrappers set them up (tests/parity/doppler_kernels.py). Q4: theirs is their
Q4_K layout, ours q4_0 and q4_1 (ggml blocks); the same random matrix is quantised into each.

Each sample records n copies of one side's dispatches into one command buffer, submits once and waits once
(per-dispatch overhead on lavapipe is ~45 us, so n is chosen per side to make a sample last about --target-ms),
and divides by n. Ours and theirs take turns within every round (the order flips each round) and the table
reports medians over the rounds; `err` is each side's max abs error against its own float64 reference (for
samplers: 0 when the token is the reference's), checked once after warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from doppler_py.gpu.device import default_gpu
from doppler_py.gpu.kernels import KernelRegistry
from doppler_py.gpu.tensor import Tensor
from doppler_py.gpu.weights import Weight, dequantize_blocks, quantize_blocks
from doppler_py.ops.attention import Attention
from doppler_py.ops.linear import Linear
from doppler_py.ops.sampling import Sampler
from doppler_py.ops.softmax import Softmax
from doppler_py.parity.npm import fetch_package
from doppler_py.sampling import SamplingParams
from doppler_py.testing import references
from doppler_py.testing.sampling_reference import sample_reference

# The runner of the JS original's shaders is test-lane code (tests/parity), shared with this tool.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from parity import doppler_kernels as dop

HIDDEN, MLP, VOCAB = 576, 1536, 49152
HEADS = {"n_heads": 9, "n_kv_heads": 3, "head_dim": 64}
TOP_K, TEMPERATURE, U = 40, 0.7, 0.37
DECODE_CONTEXT, PREFILL_ROWS = 512, 128
MAX_COPIES = 2000
Q4K_VARIANTS = ("q4_fused_multicol", "q4_fused_gemv")  # what it picks at M = 1, and its "optimised" GEMV


@dataclass
class Side:
    kernel: str
    record: Callable[[int], Callable[[], None]]  # record(n): n copies recorded; returns the submit
    error: Callable[[], float]


@dataclass
class Case:
    group: str
    name: str
    ours: Side
    theirs: list[Side]


class Bench:
    def __init__(self):
        self.gpu = default_gpu(browser_limits=True)
        self.registry = KernelRegistry(self.gpu)
        self.doppler = dop.DopplerKernels(self.gpu, fetch_package())
        self.rng = np.random.default_rng(0)

    def tensor(self, array: np.ndarray, dtype: str | None = None) -> Tensor:
        return Tensor.from_numpy(self.gpu, np.ascontiguousarray(array), dtype)

    def ours(self, kernel: str, op, args: tuple, error: Callable[[], float]) -> Side:
        def record(n: int) -> Callable[[], None]:
            rec = self.registry.recorder()
            for _ in range(n):
                op.record(rec, *args)
            return rec.submit

        return Side(kernel, record, error)

    def theirs(self, kernel: str, dispatches: list[dop.Dispatch], error: Callable[[], float]) -> Side:
        def record(n: int) -> Callable[[], None]:
            encoder = self.gpu.device.create_command_encoder()
            dop.record(encoder, dispatches * n)
            commands = encoder.finish()
            return lambda: self.gpu.queue.submit([commands])

        return Side(kernel, record, error)

    def copies_for(self, side: Side, target_s: float) -> int:
        """Copies per submit for a sample of about target_s: grown 4x at a time until a sample lasts half the
        target (a spell of contention during one short try cannot leave the submit's own cost dominating),
        then scaled."""
        n = 1
        while True:
            elapsed = self.seconds(side, n) * n
            if elapsed >= target_s / 2 or n >= MAX_COPIES:
                return max(1, min(MAX_COPIES, round(n * target_s / elapsed)))
            n *= 4

    def seconds(self, side: Side, n: int) -> float:
        submit = side.record(n)
        start = time.perf_counter()
        submit()
        self.gpu.wait_idle()
        return (time.perf_counter() - start) / n


def max_error(out: Tensor, expected: np.ndarray) -> Callable[[], float]:
    return lambda: float(np.abs(out.numpy().reshape(expected.shape) - expected).max())


def linear_cases(b: Bench, group: str, n: int, k: int) -> list[Case]:
    x = b.rng.standard_normal((1, k)).astype(np.float32)
    w = (b.rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    x_t = b.tensor(x)
    x64 = x.astype(np.float64)

    def ours(fmt: str) -> Side:
        out = Tensor.empty(b.gpu, (1, n))
        op = Linear(b.registry, Weight.from_numpy(b.gpu, w, fmt, name=f"{n}x{k}"), x_t, out, max_rows=1)
        wq = dequantize_blocks(quantize_blocks(w, fmt), fmt, (n, k)).astype(np.float64)
        return b.ours(f"Linear {fmt}", op, (1,), max_error(out, x64 @ wq.T))

    def theirs(variant: str, weights: np.ndarray, reference: np.ndarray) -> Side:
        out = Tensor.empty(b.gpu, (1, n))
        dispatch = dop.matmul(b.doppler, variant, x_t, b.tensor(weights), out, 1, n, k)
        return b.theirs(variant, [dispatch], max_error(out, x64 @ reference.T))

    w16 = w.astype(np.float16)
    q4k = dop.quantize_q4k(w)
    q4k_words, q4k_ref = q4k.reshape(-1).view(np.uint32), dop.dequantize_q4k(q4k, k)
    theirs_q4 = [theirs(v, q4k_words, q4k_ref) for v in Q4K_VARIANTS]  # timed once, listed under q4_0 and q4_1
    return [
        Case(group, f"{n}x{k} f32", ours("f32"), [theirs("f32", w, w.astype(np.float64))]),
        Case(
            group,
            f"{n}x{k} f16",
            ours("f16"),
            [theirs(v, w16, w16.astype(np.float64)) for v in ("gemv_subgroup_multicol", "gemv")],
        ),
        *(Case(group, f"{n}x{k} {fmt} | Q4_K", ours(fmt), theirs_q4) for fmt in ("q4_0", "q4_1")),
    ]


def lm_head(b: Bench) -> list[Case]:
    return linear_cases(b, "lm_head", VOCAB, HIDDEN)


def mlp(b: Bench) -> list[Case]:
    return linear_cases(b, "mlp_up", MLP, HIDDEN)


def softmax(b: Bench) -> list[Case]:
    x = (b.rng.standard_normal((1, VOCAB)) * 3).astype(np.float32)
    expected = references.softmax(x, TEMPERATURE)
    x_t = b.tensor(x)
    ours_out, theirs_out = Tensor.empty(b.gpu, (1, VOCAB)), Tensor.empty(b.gpu, (1, VOCAB))
    op = Softmax(b.registry, x_t, ours_out, cols=VOCAB, max_rows=1)
    variant = dop.reduce_variant(VOCAB, b.gpu.has_subgroups)
    dispatch = dop.softmax(b.doppler, variant, x_t, theirs_out, 1, VOCAB, TEMPERATURE)
    return [
        Case(
            "softmax",
            f"1x{VOCAB}",
            b.ours("Softmax", op, (1, TEMPERATURE), max_error(ours_out, expected)),
            [b.theirs(f"softmax {variant}", [dispatch], max_error(theirs_out, expected))],
        )
    ]


def sampling(b: Bench) -> list[Case]:
    x = b.rng.standard_normal(VOCAB).astype(np.float32)
    x_t = b.tensor(x)

    def ours(temperature: float, top_k: int) -> Side:
        out = Tensor.empty(b.gpu, 1, "u32")
        op = Sampler(b.registry, x_t, b.tensor(np.float32([U])), out, vocab=VOCAB, max_rows=1)
        expected = sample_reference(x, U, SamplingParams(temperature=temperature, top_k=top_k))
        return b.ours("Sampler", op, (1, temperature, top_k), lambda: float(out.numpy()[0] != expected))

    greedy_bufs, top_k_bufs = dop.SampleBuffers.create(b.gpu), dop.SampleBuffers.create(b.gpu)
    argmax = dop.argmax(b.doppler, x_t, VOCAB, greedy_bufs)
    top_k = dop.sample_top_k(b.doppler, x_t, VOCAB, TOP_K, TEMPERATURE, U, top_k_bufs)
    # Its top-k is approximate (one candidate per 256-token block): its error here is the pick's agreement with
    # the EXACT top-k distribution sampled its way (descending logits, first cdf >= u).
    exact = np.argsort(-x.astype(np.float64), kind="stable")[:TOP_K]
    s = (x[exact] / np.float32(TEMPERATURE)).astype(np.float64)
    cdf = np.cumsum(np.exp(s - s.max()))
    exact_pick = int(exact[np.searchsorted(cdf / cdf[-1], U)])
    return [
        Case(
            "sampling",
            f"argmax {VOCAB}",
            ours(0.0, 0),
            [b.theirs("sample single_pass", argmax, lambda: float(greedy_bufs.out.numpy()[0] != int(np.argmax(x))))],
        ),
        Case(
            "sampling",
            f"top-{TOP_K} T={TEMPERATURE} {VOCAB}",
            ours(TEMPERATURE, TOP_K),
            [b.theirs("sample top-k 3 phases", top_k, lambda: float(top_k_bufs.out.numpy()[0] != exact_pick))],
        ),
    ]


def attention(b: Bench) -> list[Case]:
    n_heads, n_kv, head_dim = HEADS["n_heads"], HEADS["n_kv_heads"], HEADS["head_dim"]
    k = b.rng.standard_normal((DECODE_CONTEXT, n_kv, head_dim)).astype(np.float32)
    v = b.rng.standard_normal((DECODE_CONTEXT, n_kv, head_dim)).astype(np.float32)
    k_t, v_t = b.tensor(k), b.tensor(v)
    cases = []
    for name, rows, start_pos, variants in (
        (f"decode, {DECODE_CONTEXT} positions", 1, DECODE_CONTEXT - 1, ("decode_subgroup", "decode")),
        (f"prefill {PREFILL_ROWS} tokens", PREFILL_ROWS, 0, ("prefill_small",)),
    ):
        q = b.rng.standard_normal((rows, n_heads * head_dim)).astype(np.float32)
        expected = references.attention(q, k, v, start_pos)
        q_t = b.tensor(q)
        ours_out = Tensor.empty(b.gpu, (rows, n_heads * head_dim))
        op = Attention(b.registry, q_t, k_t, v_t, ours_out, max_seq=DECODE_CONTEXT, max_rows=rows, **HEADS)
        theirs = []
        for variant in variants:
            out = Tensor.empty(b.gpu, (rows, n_heads * head_dim))
            dispatch = dop.attention(b.doppler, variant, q_t, k_t, v_t, out, rows=rows, start_pos=start_pos, **HEADS)
            theirs.append(b.theirs(f"attention {variant}", [dispatch], max_error(out, expected)))
        cases.append(
            Case("attention", name, b.ours("Attention", op, (rows, start_pos), max_error(ours_out, expected)), theirs)
        )
    return cases


CASES: dict[str, Callable[[Bench], list[Case]]] = {
    "lm_head": lm_head,
    "mlp": mlp,
    "softmax": softmax,
    "sampling": sampling,
    "attention": attention,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", nargs="*", choices=sorted(CASES), help="case groups to run (default: all)")
    parser.add_argument("--rounds", type=int, default=5, help="samples per kernel (median reported), at least 5")
    parser.add_argument("--target-ms", type=float, default=150.0, help="about how long one sample lasts")
    args = parser.parse_args(argv)
    rounds = max(5, args.rounds)

    bench = Bench()
    print(f"adapter: {bench.gpu.name} ({bench.gpu.backend}), {os.cpu_count()} CPUs, WebGPU default limits")
    cases = [case for group in (args.only or CASES) for case in CASES[group](bench)]
    sides = list({id(side): side for case in cases for side in (case.ours, *case.theirs)}.values())
    copies, errors = {}, {}
    for side in sides:  # warm-up (first submits pay for lazy driver work) and error check
        bench.seconds(side, 1)
        errors[id(side)] = side.error()
        copies[id(side)] = bench.copies_for(side, args.target_ms / 1e3)
    samples: dict[int, list[float]] = {id(side): [] for side in sides}
    load = [os.getloadavg()[0]]
    for r in range(rounds):  # ours and theirs of a case measured back to back, the order flipping each round
        for side in sides if r % 2 == 0 else reversed(sides):
            samples[id(side)].append(bench.seconds(side, copies[id(side)]))
        load.append(os.getloadavg()[0])

    rows = []
    print(f"{'case':34s} {'side':6s} {'kernel':28s} {'ms':>9s} {'theirs/ours':>11s} {'err':>9s} {'n':>4s}")
    for case in cases:
        ours_ms = statistics.median(samples[id(case.ours)]) * 1e3
        for label, side in (("ours", case.ours), *(("theirs", s) for s in case.theirs)):
            ms = statistics.median(samples[id(side)]) * 1e3
            row = {
                "group": case.group,
                "case": case.name,
                "side": label,
                "kernel": side.kernel,
                "ms": ms,
                "ratio_theirs_over_ours": ms / ours_ms,
                "error": errors[id(side)],
                "copies_per_submit": copies[id(side)],
                "ms_all": [t * 1e3 for t in samples[id(side)]],
            }
            rows.append(row)
            ratio = f"{row['ratio_theirs_over_ours']:11.2f}" if label == "theirs" else " " * 11
            print(
                f"{case.group + ' ' + case.name:34s} {label:6s} {side.kernel:28s} {ms:9.3f} {ratio} "
                f"{row['error']:9.2g} {row['copies_per_submit']:4d}"
            )
    print(f"1-minute load average during the rounds: {min(load):.1f} .. {max(load):.1f} ({os.cpu_count()} CPUs)")
    if args.json:
        summary = {"adapter": bench.gpu.summary(), "cpus": os.cpu_count(), "rounds": rounds, "load_average": load}
        with open(args.json, "w") as f:
            json.dump({**summary, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
