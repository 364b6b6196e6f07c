"""Serving figures on SmolLM2-135M, in three parts (`--parts chat,concurrency` by default; `choices` when named).

    python tools/bench_serve.py --json serve.json --png serve.png

chat: an 8-turn chat's time to first token per turn, with the prefix cache and without it, side by side in one
run (the two alternate, their order swapped from repeat to repeat; `--repeats`, default 2). Each turn sends the
whole conversation so far (as a server receives it): with the prefix cache, a turn prefills only its new
messages; without it, everything again. Time to first token is from the call to the first streamed piece, which
includes the prefill and the first step. Greedy, so both runs produce the same answers (checked).

concurrency: C clients at once against two OpenAI servers in the same run, each its own engine and uvicorn thread:
one-at-a-time (`parallel=1`, a queue long enough that nothing is refused) and batched (`parallel=max(--clients)`:
concurrent generations' steps share one forward, `speculative.batch`). For each C in `--clients`, C threads each
stream `--requests` chat completions back to back through the `openai` client (a fixed number of requests per client
rather than a time budget: every cell does the same work, and each prompt's answer can be compared across servers).
Prompts: `bench_speculative.PROMPTS`' open-ended group (`--groups`), client i's request j takes prompt (i + j·C) mod
n, so the clients start on different prompts. Per cell: aggregate completion tokens/s (all tokens over the cell's
wall time, which ends when its last request does), time to first token (request sent → first content delta),
inter-token latency (gaps between content deltas) and time per output token after the first (a request's last delta
minus its first, over its tokens − 1) at p50/p95, and the batched server's mean steps per forward (the JSON also
has its forwards whose attention ran once for several generations and its prompt rows prefilled beside their
steps). The one-at-a-time engine decodes several plain tokens per GPU submit (about 0.2 s of them,
`speculative.engine.BATCH_TARGET_S`) and streams them as one delta; the batched one does so only for a generation that
runs alone, else a delta per step: compare their per-token latency by TPOT, not ITL. Each C runs both servers in turn,
in an order that alternates from C to C and from repeat to repeat (`--repeats`, default 1); the table has medians over
repeats, the ratios (batched / one-at-a-time) are medians of each repeat's paired ratio. Before the timings, each server
answers one request per client for every C (each batch row count compiles its pipelines on first use). Both servers run
without the prefix cache by default (`--kv-cache-mb 0`): the prompts repeat here, as distinct users' prompts would not,
so every request prefills its whole prompt. With `--distinct` every request is its own (its question tagged "Request
<repeat>.<C>.<client>.<request>: ", the same tags on both servers) and both servers keep the server's default prefix
cache (256 MB): what distinct users share, the chat template's system prompt (24 of SmolLM2's ~43 prompt tokens here),
is prefilled once per server, as in a deployment.
choices: `n` = CHOICES sampled choices of one request (seeds s .. s + CHOICES - 1) against the same seeds as CHOICES
requests one after another, on one batched server (`parallel` = CHOICES, the default prefix cache), for a short prompt
(the open-ended group's first) and a long one (~570 tokens of meeting notes); and for the long prompt, the `n`
request again with the prefix cache off, so each choice prefills the prompt itself. Per cell: the request(s)' wall
time, median over `--repeats` (default 2; the order alternates from repeat to repeat); every way must give the same
answers (checked).

Greedy, with the same `speculative` request option on both (`--speculative`, default "none"); `--batched-speculative
MODE` adds a third way, the batched server's requests with MODE (e.g. `auto`: each generation drafts with its own
drafter inside the batch), with its ratio to the batched server's requests without it. Every prompt's answers must be
the same every way (checked). The clients run
in a process of their own (the servers and engines share this one), on the same machine's cores.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import math
import multiprocessing
import statistics
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

QUESTIONS = [
    "I'm planning a small vegetable garden. What should I plant first?",
    "How often should I water tomatoes?",
    "What about pests? Anything natural I can use?",
    "Can I grow herbs in the same bed?",
    "Which herbs are easiest for a beginner?",
    "How much sun do they need?",
    "Should I use compost or fertiliser?",
    "Thanks! Can you summarise the plan in three steps?",
]
SERVERS = ("one-at-a-time", "batched")
GOAL_CLIENTS, GOAL_THROUGHPUT, GOAL_TTFT = 4, 2.5, 1.0  # issue 50: batched ≥ 2.5× tok/s, p95 TTFT no worse
# Issue 62: batched with speculation (`--batched-speculative auto`) against one-at-a-time and batched without it.
GOAL_SPECULATIVE_VS_ONE, GOAL_SPECULATIVE_VS_BATCHED = 3.0, 1.25


def concurrency_ways(args) -> list[tuple[str, str, str]]:
    """(label, server, speculative) of each way the concurrency part runs: both servers with `--speculative`, and the
    batched server's requests again with `--batched-speculative` where that differs."""
    ways = [(server, server, args.speculative) for server in SERVERS]
    extra = args.batched_speculative
    if extra is not None and extra != args.speculative:
        ways.append((f"batched {extra}", "batched", extra))
    return ways


# --- chat: time to first token with and without the prefix cache --------------------------------------------------
def chat(engine, *, cached: bool, max_tokens: int) -> list[dict]:
    """One conversation of len(QUESTIONS) turns; per turn its time to first token, prompt and cached tokens."""
    engine.prefix_cache.clear()
    budget = engine.prefix_cache.budget_bytes
    if not cached:
        engine.prefix_cache.budget_bytes = 0
    messages, turns = [], []
    try:
        for question in QUESTIONS:
            messages.append({"role": "user", "content": question})
            start = time.perf_counter()
            first = None
            for _ in engine.stream(messages, max_tokens=max_tokens, speculative=None):
                first = first if first is not None else time.perf_counter() - start
            result = engine.last_result
            messages.append({"role": "assistant", "content": result.text})
            turns.append(
                {
                    "ttft_s": first,
                    "prompt_tokens": result.prompt_tokens,
                    "cached_tokens": result.cached_tokens,
                    "text": result.text,
                }
            )
    finally:
        engine.prefix_cache.budget_bytes = budget
        engine.prefix_cache.clear()
    return turns


def chat_part(args) -> dict | None:
    """The chat part's runs, printed; None when the cached and uncached answers differ."""
    import doppler_py
    from doppler_py.ops.linear import compile_rows

    repeats = 2 if args.repeats is None else args.repeats
    engine = doppler_py.load(args.model, weights=args.weights, progress=False, warmup="now")
    # Every prefill chunk's row count has pipelines of its own: compiled now, outside the timings of either mode.
    compile_rows(engine.model.linears())
    chat(engine, cached=False, max_tokens=4)
    runs: dict[str, list[list[dict]]] = {"cached": [], "uncached": []}
    for repeat in range(repeats):
        for mode in ("cached", "uncached") if repeat % 2 == 0 else ("uncached", "cached"):
            runs[mode].append(chat(engine, cached=mode == "cached", max_tokens=args.max_tokens))
            print(f"repeat {repeat} {mode}: " + " ".join(f"{t['ttft_s']:.2f}" for t in runs[mode][-1]), file=sys.stderr)
    engine.close()
    for cached, uncached in zip(runs["cached"], runs["uncached"], strict=True):
        if [t["text"] for t in cached] != [t["text"] for t in uncached]:
            print("the cached and uncached answers differ", file=sys.stderr)
            return None
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'ttft cached s':>14} {'ttft uncached s':>16} {'ratio':>6}")
    table = []
    for turn in range(len(QUESTIONS)):
        with_cache = statistics.median(run[turn]["ttft_s"] for run in runs["cached"])
        without = statistics.median(run[turn]["ttft_s"] for run in runs["uncached"])
        prompt, hit = runs["cached"][0][turn]["prompt_tokens"], runs["cached"][0][turn]["cached_tokens"]
        table.append({"turn": turn + 1, "prompt_tokens": prompt, "cached_tokens": hit, "ttft_cached_s": with_cache})
        table[-1] |= {"ttft_uncached_s": without}
        print(f"{turn + 1:>4} {prompt:>7} {hit:>7} {with_cache:>14.3f} {without:>16.3f} {without / with_cache:>6.2f}")
    last_over_first = {
        mode: table[-1][f"ttft_{mode}_s"] / table[0][f"ttft_{mode}_s"] for mode in ("cached", "uncached")
    }
    print(
        f"turn 8 / turn 1 time to first token: cached {last_over_first['cached']:.2f}, uncached "
        f"{last_over_first['uncached']:.2f}"
    )
    return {"turns": table, "last_over_first": last_over_first, "runs": runs}


def plot_chat(axes, table: list[dict]) -> None:
    turns = [row["turn"] for row in table]
    for mode in ("cached", "uncached"):
        axes.plot(
            turns,
            [row[f"ttft_{mode}_s"] for row in table],
            marker="o",
            label=f"prefix cache {'on' if mode == 'cached' else 'off'}",
        )
    axes.set_xlabel("chat turn")
    axes.set_ylabel("time to first token (s)")
    axes.legend()


# --- concurrency: C clients against a one-at-a-time and a batched server -------------------------------------------
def load_prompts(groups: list[str]) -> list[tuple[str, str, list[dict]]]:
    """(group, name, messages) of bench_speculative's prompts in `groups`, in its order."""
    path = Path(__file__).resolve().parent / "bench_speculative.py"
    spec = importlib.util.spec_from_file_location("bench_speculative", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(group, name, messages) for name, (group, messages) in module.PROMPTS.items() if group in groups]


def one_request(client, model: str, prompt: tuple[str, str, list[dict]], *, max_tokens: int, speculative: str):
    """Stream one greedy chat completion; its timings (from the request's start), tokens and text."""
    group, name, messages = prompt
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        stream=True,
        max_tokens=max_tokens,
        temperature=0,
        stream_options={"include_usage": True},
        extra_body={"speculative": speculative},
    )
    arrivals, pieces, tokens = [], [], None
    for chunk in stream:
        for choice in chunk.choices:
            if choice.delta.content:  # the opening chunk's empty content is not a token
                arrivals.append(time.perf_counter())
                pieces.append(choice.delta.content)
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    end = time.perf_counter()
    return {
        "group": group,
        "prompt": name,
        "start_s": start,
        "ttft_s": arrivals[0] - start if arrivals else None,
        "itl_s": [b - a for a, b in itertools.pairwise(arrivals)],
        # Time per output token after the first: what a client waits per token on average, bursts or not.
        "tpot_s": (arrivals[-1] - arrivals[0]) / (tokens - 1) if arrivals and tokens and tokens > 1 else None,
        "latency_s": end - start,
        "tokens": tokens,
        "text": "".join(pieces),
    }


def run_cell(pool, url: str, model: str, prompts: list, **cell) -> tuple[list[dict], float]:
    """`run_clients` in the clients' own process (`pool`, one worker): their Python work (the openai client, SSE
    parsing) would otherwise take turns with the server's for one interpreter lock, as no real client does."""
    return pool.submit(run_clients, url, model, prompts, **cell).result()


def tagged(prompt: tuple[str, str, list[dict]], tag: str) -> tuple[str, str, list[dict]]:
    """`prompt` as a distinct user sends it: its last message starts with "Request <tag>: ", so what it shares with
    other requests is what distinct users' requests share, the chat template and its system prompt; its name
    carries the tag, so its answers are compared only with the same request's on the other server."""
    group, name, messages = prompt
    *earlier, last = messages
    return group, f"{name} #{tag}", [*earlier, last | {"content": f"Request {tag}: {last['content']}"}]


def run_clients(
    url: str,
    model: str,
    prompts: list,
    *,
    clients: int,
    requests: int,
    max_tokens: int,
    speculative: str,
    distinct: str | None = None,
) -> tuple[list[dict], float]:
    """`clients` threads, each streaming `requests` requests back to back, started together; the cell's requests
    (each with its client's index) and its wall time (first start to last end). `distinct`: each request is
    `tagged` "<distinct>.<client>.<request>"."""
    import openai

    # max_retries=0: a refused request (429) fails the run instead of being retried behind the timings' back.
    sessions = [openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600) for _ in range(clients)]
    go = threading.Barrier(clients + 1)

    def client_loop(i: int) -> list[dict]:
        go.wait()
        done = []
        for j in range(requests):
            prompt = prompts[(i + j * clients) % len(prompts)]
            if distinct is not None:
                prompt = tagged(prompt, f"{distinct}.{i}.{j}")
            done.append(one_request(sessions[i], model, prompt, max_tokens=max_tokens, speculative=speculative))
            done[-1]["client"] = i
        return done

    with ThreadPoolExecutor(clients) as pool:
        futures = [pool.submit(client_loop, i) for i in range(clients)]
        go.wait()
        start = time.perf_counter()
        done = [row for future in futures for row in future.result()]
        wall = time.perf_counter() - start
    for session in sessions:
        session.close()
    for row in done:
        row["start_s"] -= start
    return done, wall


def percentile(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def cell_figures(done: list[dict], wall: float) -> dict:
    tokens = sum(row["tokens"] for row in done)
    ttfts = [row["ttft_s"] for row in done if row["ttft_s"] is not None]
    gaps = [gap for row in done for gap in row["itl_s"]]
    tpots = [row["tpot_s"] for row in done if row["tpot_s"] is not None]
    return {
        "requests": len(done),
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p95_s": percentile(gaps, 95),
        "tpot_p50_s": percentile(tpots, 50),
        "tpot_p95_s": percentile(tpots, 95),
    }


def batch_counts(batch) -> dict[str, int]:
    """The batched server's running counts: forwards whose attention ran once for several generations, prompt rows
    prefilled beside generations' steps (`speculative.batch.StepBatch`)."""
    if batch is None:
        return {"shared_attention_forwards": 0, "prefill_rows_beside_steps": 0}
    return {
        "shared_attention_forwards": batch.paged_forwards,
        "prefill_rows_beside_steps": batch.prefill_rows_beside_steps,
    }


def mean_rows(sizes: Counter) -> float | None:
    """Mean steps per batched forward of a Counter of steps per forward (None: no forward)."""
    forwards = sum(sizes.values())
    return sum(size * n for size, n in sizes.items()) / forwards if forwards else None


def median_or_none(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return None if numerator is None or not denominator else numerator / denominator


def shown(value: float | None, scale: float = 1, digits: int = 0) -> str:
    """`value` × `scale` for the table ("-": none, e.g. no content delta came)."""
    return "-" if value is None else f"{scale * value:.{digits}f}"


def concurrency_part(args) -> dict | None:
    """The concurrency part's cells, printed; None when the two servers' answers to a prompt differ."""
    import openai

    import doppler_py
    from doppler_py.ops.linear import compile_rows
    from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background

    clients = sorted(set(args.clients))
    repeats = 1 if args.repeats is None else args.repeats
    prompts = load_prompts(args.groups)
    if not prompts:
        raise SystemExit(f"no prompts in groups {args.groups}")
    print(
        f"concurrency prompts: {', '.join(f'{group}/{name}' for group, name, _ in prompts)}; speculative "
        f"{args.speculative!r}, {args.requests} requests per client, max_tokens {args.max_tokens}",
        file=sys.stderr,
    )
    cell = dict(requests=args.requests, max_tokens=args.max_tokens)
    ways = concurrency_ways(args)
    labels = [label for label, _, _ in ways]
    # Every client's request may wait in the one-at-a-time server's queue: none is refused.
    config = ServerConfig(queue_size=max(clients))
    parallel = {"one-at-a-time": 1, "batched": max(clients)}
    runs: dict[str, dict[int, list[dict]]] = {label: {c: [] for c in clients} for label in labels}
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")))
        engines, urls, models = {}, {}, {}
        for server in SERVERS:  # one after the other: each loads, compiles and warms up alone
            engine = doppler_py.load(
                args.model,
                weights=args.weights,
                progress=False,
                warmup="now",
                parallel=parallel[server],
                kv_cache_mb=args.kv_cache_mb,
            )
            stack.callback(engine.close)  # after its server has stopped (the stack unwinds in reverse)
            compile_rows(engine.model.linears())  # every prefill chunk's row count, outside the timings
            engines[server], urls[server] = (
                engine,
                stack.enter_context(serving_in_background(OpenAIServer(engine, config).app)),
            )
            with openai.OpenAI(base_url=f"{urls[server]}/v1", api_key="x") as client:
                models[server] = client.models.list().data[0].id
        for _, server, speculative in ways:
            for c in clients:  # each batch row count's pipelines compile on first use: one request per client
                warm = cell | {"requests": 1, "speculative": speculative}
                warm["distinct"] = "warm-up" if args.distinct else None
                run_cell(pool, urls[server], models[server], prompts, clients=c, **warm)
        for repeat in range(repeats):
            for index, c in enumerate(clients):
                order = ways if (repeat + index) % 2 == 0 else ways[::-1]
                for label, server, speculative in order:
                    batch = engines[server].batch
                    before = Counter(batch.sizes) if batch is not None else Counter()
                    counts = batch_counts(batch)
                    # The same tags on every way (each server has its own prefix cache), new ones for every cell.
                    distinct = {"distinct": f"{repeat}.{c}" if args.distinct else None, "speculative": speculative}
                    done, wall = run_cell(pool, urls[server], models[server], prompts, clients=c, **cell | distinct)
                    sizes = (batch.sizes - before) if batch is not None else Counter()
                    counted = {key: value - counts[key] for key, value in batch_counts(batch).items()}
                    figures = cell_figures(done, wall) | {"mean_rows": mean_rows(sizes), "batch_sizes": dict(sizes)}
                    figures |= counted
                    runs[label][c].append(figures | {"done": done})
                    print(
                        f"repeat {repeat} clients {c} {label}: {figures['tok_s']:.1f} tok/s, "
                        f"TTFT p95 {shown(figures['ttft_p95_s'], digits=2)} s",
                        file=sys.stderr,
                    )
    answers: dict[str, set[str]] = {}
    for label in labels:
        for c in clients:
            for figures in runs[label][c]:
                for row in figures["done"]:
                    answers.setdefault(row["prompt"], set()).add(row["text"])
    differing = sorted(name for name, texts in answers.items() if len(texts) > 1)
    if differing:
        print(f"greedy answers differ between requests or ways for: {', '.join(differing)}", file=sys.stderr)
        return None
    table = []
    keys = ("tok_s", "ttft_p50_s", "ttft_p95_s", "itl_p50_s", "itl_p95_s", "tpot_p50_s", "tpot_p95_s", "mean_rows")
    for c in clients:
        for label, server, _ in ways:
            row = {"clients": c, "server": label, "parallel": parallel[server]}
            row |= {key: median_or_none([run[key] for run in runs[label][c]]) for key in keys}
            row["requests"] = sum(run["requests"] for run in runs[label][c])
            if server == "batched":  # against one-at-a-time, paired repeat by repeat
                pairs = list(zip(runs["one-at-a-time"][c], runs[label][c], strict=True))
                row["tok_s_ratio"] = median_or_none([ratio(b["tok_s"], o["tok_s"]) for o, b in pairs])
                row["ttft_p95_ratio"] = median_or_none([ratio(b["ttft_p95_s"], o["ttft_p95_s"]) for o, b in pairs])
            if label not in SERVERS:  # and against the batched server's requests without it
                pairs = list(zip(runs["batched"][c], runs[label][c], strict=True))
                row["tok_s_vs_batched"] = median_or_none([ratio(s["tok_s"], b["tok_s"]) for b, s in pairs])
            table.append(row)
    print(
        f"{'C':>3} {'way':<18} {'tok/s':>7} {'TTFT p50':>9} {'p95 ms':>7} {'ITL p50':>8} {'p95 ms':>7} "
        f"{'TPOT p50':>9} {'p95 ms':>7} {'rows/fwd':>8} {'req':>4} {'tok/s ×':>8} {'TTFT95 ×':>9} {'× batched':>9}"
    )
    for row in table:
        ratios = ""
        if "tok_s_ratio" in row:
            ratios = f"{shown(row['tok_s_ratio'], digits=2):>8} {shown(row['ttft_p95_ratio'], digits=2):>9}"
        if "tok_s_vs_batched" in row:
            ratios += f" {shown(row['tok_s_vs_batched'], digits=2):>9}"
        latencies = [shown(row[key], 1000) for key in keys[1:-1]]  # milliseconds
        print(
            f"{row['clients']:>3} {row['server']:<18} {shown(row['tok_s'], digits=1):>7} {latencies[0]:>9} "
            f"{latencies[1]:>7} {latencies[2]:>8} {latencies[3]:>7} {latencies[4]:>9} {latencies[5]:>7} "
            f"{shown(row['mean_rows'], digits=2):>8} {row['requests']:>4} {ratios}"
        )
    goal = next((row for row in table if row["clients"] == GOAL_CLIENTS and row["server"] == "batched"), None)
    if goal is None:
        print(f"{GOAL_CLIENTS} clients: not run (the goal is stated for {GOAL_CLIENTS})")
    else:
        print(
            f"{GOAL_CLIENTS} clients: batched {shown(goal['tok_s_ratio'], digits=2)}× one-at-a-time aggregate tok/s "
            f"(goal ≥ {GOAL_THROUGHPUT}), p95 TTFT ratio {shown(goal['ttft_p95_ratio'], digits=2)} "
            f"(goal ≤ {GOAL_TTFT:g})"
        )
    for row in table:
        if row["clients"] == GOAL_CLIENTS and "tok_s_vs_batched" in row:
            print(
                f"{GOAL_CLIENTS} clients: {row['server']} {shown(row['tok_s_ratio'], digits=2)}× one-at-a-time "
                f"(goal ≥ {GOAL_SPECULATIVE_VS_ONE}), {shown(row['tok_s_vs_batched'], digits=2)}× batched "
                f"{args.speculative} (goal ≥ {GOAL_SPECULATIVE_VS_BATCHED})"
            )
    keys = ("requests", "max_tokens", "speculative", "batched_speculative", "kv_cache_mb", "distinct")
    settings = {key: getattr(args, key) for key in keys}
    settings |= {"repeats": repeats, "clients": clients, "prompts": [f"{g}/{n}" for g, n, _ in prompts]}
    return {"settings": settings, "table": table, "runs": {s: {str(c): r for c, r in runs[s].items()} for s in runs}}


def plot_concurrency(throughput, latency, table: list[dict]) -> None:
    clients = sorted({row["clients"] for row in table})
    for server in dict.fromkeys(row["server"] for row in table):
        rows = [row for row in table if row["server"] == server]
        throughput.plot(clients, [row["tok_s"] for row in rows], marker="o", label=server)
        p95 = [math.nan if row["ttft_p95_s"] is None else row["ttft_p95_s"] for row in rows]
        latency.plot(clients, p95, marker="o", label=server)
    for axes, label in ((throughput, "aggregate completion tok/s"), (latency, "time to first token p95 (s)")):
        axes.set_xlabel("concurrent clients")
        axes.set_ylabel(label)
        axes.set_xscale("log", base=2)
        axes.set_xticks(clients, [str(c) for c in clients])
        axes.legend()


# --- choices: n choices in one request against n requests ------------------------------------------------------------
CHOICES = 4
NOTES = " ".join(
    f"Paragraph {i}: the committee reviewed budget line {i * 7} and asked for a revised estimate by Friday."
    for i in range(24)
)
CHOICE_WAYS = ("n in one request", "n requests in turn", "n in one request, no prefix cache")


def choices_part(args) -> dict | None:
    """The choices part's cells, printed; None when the ways' answers differ."""
    import httpx

    import doppler_py
    from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background

    repeats = 2 if args.repeats is None else args.repeats
    prompts = {
        "short": load_prompts(["open-ended"])[0][2],
        "long": [{"role": "user", "content": NOTES + "\n\nSummarise the notes above in one sentence."}],
    }
    engine = doppler_py.load(args.model, weights=args.weights, progress=False, warmup="now", parallel=CHOICES)
    budget = engine.prefix_cache.budget_bytes
    base = {"max_tokens": args.max_tokens, "temperature": 0.8, "speculative": args.speculative}
    table, answers = [], {}
    with serving_in_background(OpenAIServer(engine, ServerConfig()).app) as url, httpx.Client(timeout=900) as client:

        def post(messages: list[dict], seed: int, n: int) -> tuple[list[str], int]:
            body = client.post(f"{url}/v1/chat/completions", json=base | {"messages": messages, "seed": seed, "n": n})
            body.raise_for_status()
            reply = body.json()
            return [choice["message"]["content"] for choice in reply["choices"]], reply["usage"]["completion_tokens"]

        post(prompts["short"], 1, CHOICES)  # compiles the batch's row counts outside the timings
        for name, messages in prompts.items():
            ways = CHOICE_WAYS if name == "long" else CHOICE_WAYS[:2]
            walls: dict[str, list[float]] = {way: [] for way in ways}
            for repeat in range(repeats):
                seed = 1000 * (repeat + 1)
                for way in ways if repeat % 2 == 0 else reversed(ways):
                    engine.prefix_cache.clear()
                    engine.prefix_cache.budget_bytes = 0 if way.endswith("no prefix cache") else budget
                    start = time.perf_counter()
                    if way == "n requests in turn":
                        replies = [post(messages, seed + i, 1) for i in range(CHOICES)]
                        texts, tokens = [r[0][0] for r in replies], sum(r[1] for r in replies)
                    else:
                        texts, tokens = post(messages, seed, CHOICES)
                    walls[way].append(time.perf_counter() - start)
                    answers.setdefault((name, repeat), texts)
                    if answers[(name, repeat)] != texts:
                        print(f"{name} prompt, repeat {repeat}: {way} answered differently", file=sys.stderr)
                        return None
                    print(f"{name} repeat {repeat} {way}: {walls[way][-1]:.2f} s, {tokens} tokens", file=sys.stderr)
            one = statistics.median(walls[CHOICE_WAYS[0]])
            for way in ways:
                wall = statistics.median(walls[way])
                table.append({"prompt": name, "way": way, "wall_s": wall, "over_n_in_one": wall / one})
    engine.prefix_cache.budget_bytes = budget
    engine.close()
    print(f"{'prompt':>6} {'way':<36} {'wall s':>7} {'× n in one':>10}")
    for row in table:
        print(f"{row['prompt']:>6} {row['way']:<36} {row['wall_s']:>7.2f} {row['over_n_in_one']:>10.2f}")
    return {"settings": {"choices": CHOICES, "repeats": repeats, "max_tokens": args.max_tokens}, "table": table}


def integers(text: str) -> list[int]:
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive integers, got {text!r}")
    return values


def names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--parts", type=names, default=["chat", "concurrency"], help="chat,concurrency (default), choices"
    )
    parser.add_argument("--model", default=None, help="a known model name or an HF folder (default: SmolLM2-135M)")
    parser.add_argument("--weights", default="keep")
    parser.add_argument("--repeats", type=int, help="default: 2 for the chat part, 1 for the concurrency part")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--clients", type=integers, default=[1, 2, 4, 8], help="concurrent clients (default 1,2,4,8)")
    parser.add_argument("--requests", type=int, default=3, help="requests per client in each cell (default 3)")
    parser.add_argument("--groups", type=names, default=["open-ended"], help="bench_speculative prompt groups")
    parser.add_argument("--speculative", default="none", choices=("none", "prompt-lookup", "auto"))
    parser.add_argument(
        "--batched-speculative",
        default=None,
        help="the concurrency part also runs the batched server's requests with this speculative mode (e.g. auto)",
    )
    parser.add_argument(
        "--kv-cache-mb", type=int, default=None, help="the concurrency servers' prefix cache (0; 256 with --distinct)"
    )
    parser.add_argument(
        "--distinct",
        action="store_true",
        help="every concurrency request its own (a tagged question), as distinct users send: with the prefix cache on, "
        "only the chat template's system prompt is shared",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    if args.kv_cache_mb is None:
        from doppler_py.defaults import KV_CACHE_MB

        args.kv_cache_mb = KV_CACHE_MB if args.distinct else 0
    unknown = set(args.parts) - {"chat", "concurrency", "choices"}
    if unknown:
        parser.error(f"unknown parts: {', '.join(sorted(unknown))}")
    if args.model is None:
        from doppler_py.model.catalog import DEFAULT_MODEL

        args.model = DEFAULT_MODEL

    results: dict = {}
    if "chat" in args.parts:
        chat_results = chat_part(args)
        if chat_results is None:
            return 1
        results |= chat_results  # at the top level, as before the concurrency part
    if "concurrency" in args.parts:
        results["concurrency"] = concurrency_part(args)
        if results["concurrency"] is None:
            return 1
    if "choices" in args.parts:
        results["choices"] = choices_part(args)
        if results["choices"] is None:
            return 1
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    panels = ("chat" in args.parts) + 2 * ("concurrency" in args.parts)  # the choices part has a table only
    if args.png and panels:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 3.5), squeeze=False)
        axes = list(axes[0])
        if "chat" in args.parts:
            plot_chat(axes.pop(0), results["turns"])
        if "concurrency" in args.parts:
            plot_concurrency(axes[0], axes[1], results["concurrency"]["table"])
        figure.tight_layout()
        figure.savefig(args.png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
