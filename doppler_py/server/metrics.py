"""What /health and /metrics report: the KV budget's use, and the server's counters and gauges in Prometheus' text
format."""

from __future__ import annotations

from doppler_py.api import Engine
from doppler_py.model.kv_arena import BLOCK
from doppler_py.server.jobs import GenerationQueue


def kv_status(engine: Engine) -> dict[str, float]:
    """The KV budget's use (`--kv-budget-mb`), in MiB; nothing without a budget."""
    budget = engine.kv_budget
    if budget is None:
        return {}
    return {
        "kv_budget_mb": budget.limit / 2**20,
        "kv_reserved_mb": round(budget.reserved / 2**20, 3),
        "kv_waiting": budget.waiting,
    }


def prometheus_text(queue: GenerationQueue, engine: Engine) -> str:
    """The server's counters and gauges in Prometheus' text format."""
    status, totals, cache = queue.status(), queue.totals, engine.prefix_cache
    lines = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP doppler_{name} {help_text}", f"# TYPE doppler_{name} {kind}"])
        lines.extend(f"doppler_{name}{labels} {value:g}" for labels, value in samples)

    outcomes = ("completed", "cancelled", "refused", "failed", "rejected")
    metric("requests_total", "counter", "Requests by outcome.", [(f'{{outcome="{o}"}}', status[o]) for o in outcomes])
    for name, help_text in (
        ("prompt_tokens", "Prompt tokens of completed generations."),
        ("cached_prompt_tokens", "Prompt tokens whose K/V came from the prefix cache."),
        ("completion_tokens", "Generated tokens."),
        ("drafted_tokens", "Draft tokens verified."),
        ("accepted_tokens", "Draft tokens accepted."),
        ("forced_tokens", "Draft tokens a grammar forced."),
    ):
        metric(f"{name}_total", "counter", help_text, [("", totals[name])])
    metric("running", "gauge", "Generations running (their steps batched).", [("", status["running"])])
    metric("parallel", "gauge", "Generations that may run at once.", [("", status["parallel"])])
    if engine.parallel > 1:
        sizes = engine.batch.sizes
        samples = [(f'{{le="{le}"}}', sum(n for size, n in sizes.items() if size <= le)) for le in (1, 2, 4, 8, 16)]
        samples += [('{le="+Inf"}', sum(sizes.values()))]
        metric("batch_steps", "histogram", "Batched forwards by the generations' steps they held.", [])
        lines.extend(f"doppler_batch_steps_bucket{labels} {value:g}" for labels, value in samples)
        lines.append(f"doppler_batch_steps_sum {sum(size * n for size, n in sizes.items()):g}")
        lines.append(f"doppler_batch_steps_count {sum(sizes.values()):g}")
        metric(
            "batch_shared_attention_total",
            "counter",
            "Batched forwards whose attention ran once per layer for all their generations.",
            [("", engine.batch.paged_forwards)],
        )
        metric(
            "batch_prefill_rows_total",
            "counter",
            "Prompt rows prefilled in the forwards of running generations' steps.",
            [("", engine.batch.prefill_rows_beside_steps)],
        )
        arena = engine.batch.arena
        metric(
            "kv_arena_bytes",
            "gauge",
            "GPU memory of the slabs the batched generations' KV caches sit in.",
            [("", arena.nbytes)],
        )
        metric(
            "kv_arena_blocks",
            "gauge",
            f"KV blocks of {BLOCK} positions the running generations hold.",
            [("", arena.used_blocks)],
        )
    metric("waiting", "gauge", "Generations waiting in the queue.", [("", status["waiting"])])
    budget = engine.kv_budget
    if budget is not None:
        metric("kv_budget_bytes", "gauge", "KV memory the running generations may take.", [("", budget.limit)])
        metric("kv_reserved_bytes", "gauge", "KV memory the running generations hold.", [("", budget.reserved)])
        metric("kv_waiting", "gauge", "Generations waiting for KV memory.", [("", budget.waiting)])
        metric("kv_waited_total", "counter", "Generations that waited for KV memory.", [("", budget.waited)])
    metric("queue_size", "gauge", "Waiting generations allowed before 429.", [("", status["queue_size"])])
    metric("prefix_cache_bytes", "gauge", "GPU memory held by the prefix cache.", [("", cache.nbytes)])
    metric("prefix_cache_entries", "gauge", "Sequences held by the prefix cache.", [("", len(cache))])
    metric("prefix_cache_lookups_total", "counter", "Prompts looked up in the prefix cache.", [("", cache.lookups)])
    metric("prefix_cache_hits_total", "counter", "Prompts that took a prefix from the cache.", [("", cache.hits)])
    return "\n".join(lines) + "\n"
