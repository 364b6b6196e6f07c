"""Concurrent generations whose steps share forwards (`speculative.batch`), on the tiny target: each generation's
tokens equal its solo run (greedy and seeded sampling, every drafter of the registry, chains and token trees, several
drafters in one batch, ragged prompts and lengths), whenever it joined the batch; a generation that fails leaves the
others unharmed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from speculative.conftest import JOINT_TRIALS, exact_two_token_joint
from support.distribution import assert_samples_follow
from support.tiny_specs import TARGET

from doppler_py.model.prefix_cache import PrefixCache
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import engine as engine_module
from doppler_py.speculative.batch import StepBatch, plan_forwards
from doppler_py.speculative.contract import Drafter
from doppler_py.speculative.drafters.prompt_lookup import PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats

# Ragged: prompts of different lengths (one longer than a prefill chunk of the 32-row model), answers of different
# lengths, some repetitive enough for prompt lookup to draft.
PROMPTS = [
    [5, 9, 11],
    [(7 * i + 3) % 45 + 3 for i in range(40)],
    [4, 8, 15, 16, 23, 42, 4, 8, 15, 16],
    [30, 31, 32, 33, 30, 31, 32],
]
MAX_TOKENS = [14, 9, 20, 12]
GREEDY_PARAMS = SamplingParams()
PARAMS = {
    "greedy": GREEDY_PARAMS,
    "sampled": SamplingParams(temperature=1.1, top_k=12, seed=5),
}


# Drafters by name as the batch tests make them: a registry drafter, "-tree" for its token trees.
DrafterMaker = Callable[[str], Drafter | None]


def engine_for(target, drafter: str, batch: StepBatch | None = None, make: DrafterMaker | None = None):
    """A speculative engine drafting with `drafter` ("none", "prompt-lookup", or another name `make` knows)."""
    if make is None:
        made = PromptLookupDrafter() if drafter == "prompt-lookup" else None
    else:
        made = make(drafter)
    return SpeculativeEngine(target, made, batch=batch)


def params_for(name: str, i: int) -> SamplingParams:
    base = PARAMS[name]
    return base if base.greedy else SamplingParams(temperature=base.temperature, top_k=base.top_k, seed=base.seed + i)


def solo_runs(
    target,
    drafter: str | Sequence[str],
    params: str,
    make: DrafterMaker | None = None,
    drafts: list[tuple[int, int]] | None = None,
    prompts: Sequence[Sequence[int]] = PROMPTS,
) -> list[list[int]]:
    """Each prompt's tokens alone, with `drafter` (or drafters[i] for prompt i); `drafts` gets each generation's
    (drafted, accepted); `prompts`: four prompts."""
    names = [drafter] * len(prompts) if isinstance(drafter, str) else list(drafter)
    outputs = []
    for i, (prompt, n) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        engine = engine_for(target, names[i], make=make)
        try:
            result = engine.generate(prompt, n, params_for(params, i), k=3)
        finally:
            engine.close()
        outputs.append(result.tokens)
        if drafts is not None:
            drafts.append((result.stats.drafted, result.stats.accepted))
    return outputs


def start_all(run, count: int) -> list[threading.Thread]:
    """`run(i)` for i < count, each on a daemon thread of its own, started."""
    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads


def join_all(threads: list[threading.Thread], timeout_s: float) -> None:
    for thread in threads:
        thread.join(timeout_s)


def batched_runs(
    target,
    drafter: str | Sequence[str],
    params: str,
    *,
    staggered: bool,
    make: DrafterMaker | None = None,
    drafts: list[tuple[int, int]] | None = None,
    prompts: Sequence[Sequence[int]] = PROMPTS,
) -> tuple[list[list[int]], StepBatch]:
    """Every prompt on its own thread and engine (drafting with `drafter`, or drafters[i]), sharing one batch.
    `staggered`: each generation starts once the one before it has 3 tokens, so later ones join a running batch.
    `drafts` gets each generation's (drafted, accepted); `prompts`: four prompts."""
    names = [drafter] * len(prompts) if isinstance(drafter, str) else list(drafter)
    batch = StepBatch(target)
    engines = [engine_for(target, name, batch, make) for name in names]
    outputs: list[list[int]] = [[] for _ in prompts]
    stats = [SpecStats() for _ in prompts]
    errors: list[BaseException] = []
    started = [threading.Event() for _ in prompts]

    def run(i: int) -> None:
        try:
            if staggered and i:
                started[i - 1].wait(30)
            steps = engines[i].iter_generate(prompts[i], MAX_TOKENS[i], params_for(params, i), stats=stats[i], k=3)
            for new in steps:
                outputs[i].extend(new)
                if len(outputs[i]) >= 3:
                    started[i].set()
        except BaseException as exc:
            errors.append(exc)
        finally:
            started[i].set()

    # The generations must meet: none may run its answer out alone while another compiles its prompt's pipelines
    # (`compile_generation`, outside the batch), nor in a few submits of plain steps before the next one joins
    # (lone runs: `test_a_generation_alone_in_a_batch_runs_plain_steps_as_without_it`).
    for prompt in prompts:
        target.compile_generation(len(prompt) - 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "BATCH_TARGET_S", 0.0)
        join_all(start_all(run, len(prompts)), 120)
    for engine in engines:
        engine.close()
    batch.close()
    assert not errors, errors
    if drafts is not None:
        drafts.extend((one.drafted, one.accepted) for one in stats)
    return outputs, batch


@pytest.mark.parametrize("staggered", [False, True], ids=["together", "joining"])
@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_each_batched_generation_equals_its_solo_run(models, drafter, params, staggered):
    target = models["target"]
    outputs, batch = batched_runs(target, drafter, params, staggered=staggered)
    assert outputs == solo_runs(target, drafter, params)
    shared = sum(count for size, count in batch.sizes.items() if size > 1)
    assert shared > 0, batch.sizes  # the steps did share forwards
    assert batch.paged_forwards > 0  # ... and attention dispatches, their caches in one arena slab
    if staggered:  # later prompts were prefilled in the running generations' forwards
        assert batch.prefill_rows_beside_steps > 0
    assert batch.members == 0
    assert not batch.arena.slabs  # every cache gave its blocks back


@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
def test_a_generation_alone_in_a_batch_runs_plain_steps_as_without_it(models, params):
    """The only member of a batch takes its plain steps several per submit, as without the batch; beside another
    generation, one step per shared forward; alone again once it left, several again. Both answers equal their solo
    runs (the seeded stream draws one number per plain step, however many share a submit)."""
    target = models["target"]
    batch = StepBatch(target)
    engines = [engine_for(target, "none", batch) for _ in range(2)]
    prompts, lengths = [PROMPTS[0], PROMPTS[2]], [60, 6]
    joined: list[list[int]] = []
    chunks: list[tuple[int, bool]] = []  # (tokens, whether the other generation had ended before they came)

    def join() -> None:
        joined.append(engines[1].generate(prompts[1], lengths[1], params_for(params, 1)).tokens)

    other = threading.Thread(target=join, daemon=True)
    out: list[int] = []
    for new in engines[0].iter_generate(prompts[0], lengths[0], params_for(params, 0), stats=SpecStats()):
        out.extend(new)
        chunks.append((len(new), bool(joined)))
        if len(new) > 1 and not other.is_alive() and not joined:  # several steps alone: now the other one joins
            other.start()
            while batch.members < 2 and other.is_alive():
                time.sleep(0.005)
    other.join(60)
    for engine in engines:
        engine.close()
    batch.close()
    solo = engine_for(target, "none")
    assert out == solo.generate(prompts[0], lengths[0], params_for(params, 0)).tokens
    assert joined == [solo.generate(prompts[1], lengths[1], params_for(params, 1)).tokens]
    solo.close()
    assert batch.sizes[2] > 0, batch.sizes  # beside the other, the steps shared forwards
    assert any(n > 1 and not ended for n, ended in chunks), chunks  # several per submit before it joined
    assert any(n > 1 and ended for n, ended in chunks), chunks  # ... and after it left
    assert batch.members == 0 and not batch.arena.slabs


@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
@pytest.mark.parametrize("family", ["qwen3_5-hybrid", "gemma4"])
def test_other_families_batch_each_generation_as_its_solo_run(tiny_model, family, params):
    """Qwen 3.5: each segment's Gated DeltaNet rows read its own state and the rows kept are committed per
    sequence before the next batched forward, while its attention layers run once for all. Gemma 4: sliding and
    full layers of different head shapes, and KV-shared layers reading an earlier layer's blocks."""
    from doppler_py.testing.tiny import TINY_SPECS

    model = tiny_model(TINY_SPECS[family], max_rows=32)
    outputs, batch = batched_runs(model, "prompt-lookup", params, staggered=True)
    assert outputs == solo_runs(model, "prompt-lookup", params)
    assert sum(count for size, count in batch.sizes.items() if size > 1) > 0, batch.sizes
    assert batch.paged_forwards > 0


@pytest.mark.parametrize("family", ["llama", "qwen3_5-hybrid"])
def test_a_prompt_still_generating_in_the_batch_is_a_prefix_cache_hit_for_the_same_prompt(models, tiny_model, family):
    """A generation keeps its prompt's K/V in the prefix cache once prefilled, so a request with the same prompt
    (another choice of one request, a shared system prompt) that arrives while it still runs prefills only the
    prompt's last token; both answers equal their solo runs. Qwen 3.5: the entry also holds the recurrent states
    at the prompt's end."""
    from doppler_py.testing.tiny import TINY_SPECS

    target = models["target"] if family == "llama" else tiny_model(TINY_SPECS[family], max_rows=32)
    prompt, lengths = PROMPTS[1], (40, 12)
    batch = StepBatch(target)
    engines = [engine_for(target, "none", batch) for _ in lengths]
    for engine in engines:
        engine.prefix_cache = PrefixCache(target, 64 << 20) if engine is engines[0] else engines[0].prefix_cache
    first: list[int] = []
    running = threading.Event()

    def run_first() -> None:
        try:
            for new in engines[0].iter_generate(prompt, lengths[0], GREEDY_PARAMS, stats=SpecStats()):
                first.extend(new)
                if len(first) >= 3:
                    running.set()
        finally:
            running.set()

    target.compile_generation(len(prompt) - 1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine_module, "BATCH_TARGET_S", 0.0)  # one token per submit: the first is still running
        thread = start_all(lambda _: run_first(), 1)[0]
        assert running.wait(60)
        first_so_far = len(first)
        second = engines[1].generate(prompt, lengths[1], GREEDY_PARAMS)
        thread.join(60)
    for engine in engines:
        engine.close()
    engines[0].prefix_cache.clear()
    batch.close()
    assert first_so_far < lengths[0]
    assert second.stats.cached_tokens == len(prompt) - 1
    solo = engine_for(target, "none")
    try:
        assert first == solo.generate(prompt, lengths[0], GREEDY_PARAMS).tokens
    finally:
        solo.close()
    assert second.tokens == first[: lengths[1]]


def test_a_failing_generation_leaves_the_others_unharmed(models):
    target = models["target"]

    class Failing(PromptLookupDrafter):
        def propose(self, ctx, k):
            if len(ctx.tokens) > len(PROMPTS[0]) + 4:
                raise RuntimeError("drafter broke")
            return super().propose(ctx, k)

    batch = StepBatch(target)
    failing = SpeculativeEngine(target, Failing(), batch=batch)
    healthy = engine_for(target, "prompt-lookup", batch)
    results: dict[str, object] = {}

    def run(name: str, engine: SpeculativeEngine, i: int) -> None:
        try:
            results[name] = engine.generate(PROMPTS[i], MAX_TOKENS[i], params_for("greedy", i), k=3).tokens
        except RuntimeError as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=run, args=("failing", failing, 0)),
        threading.Thread(target=run, args=("healthy", healthy, 2)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    failing.close()
    healthy.close()
    batch.close()
    assert isinstance(results["failing"], RuntimeError)
    assert results["healthy"] == solo_runs(target, "prompt-lookup", "greedy")[2]
    assert batch.members == 0


@pytest.fixture(scope="module")
def make_drafter(models, trained_head):
    """name -> a new drafter on the tiny target: a registry name ("auto": EAGLE with prompt lookup), "eagle-3" (the
    fused head, which taps target layers), NAME-tree for its token trees, "none" for None. Heads load on first use
    and are shared by every drafter made from them, as `Engine`'s streams share theirs."""
    from doppler_py.speculative.drafters.best_of import BestOfDrafter
    from doppler_py.speculative.drafters.heads.eagle import load_head
    from doppler_py.speculative.drafters.heads.medusa import load_medusa
    from doppler_py.speculative.drafters.heads.spark import load_spark
    from doppler_py.speculative.registry import DRAFTERS, DraftSources

    target = models["target"]
    # Our name -> (the registry's, the trained head's kind); loaders by the registry's name.
    with_heads = {"eagle": ("eagle", "eagle-1"), "eagle-3": ("eagle", "eagle-3"), "medusa": ("medusa", "medusa")}
    with_heads["spark"] = ("spark", "spark")
    loaders = {"eagle": load_head, "medusa": load_medusa, "spark": load_spark}
    heads: dict[str, object] = {}

    def make(name: str) -> Drafter | None:
        base, tree = name.removesuffix("-tree"), name.endswith("-tree")
        if base == "none":
            return None
        if base == "auto":
            return BestOfDrafter(PromptLookupDrafter(), make("eagle"))
        kind, trained = with_heads.get(base, (base, None))
        if trained is not None and trained not in heads:
            heads[trained] = loaders[kind](trained_head(trained), target)
        loaded = {kind: heads[trained]} if trained is not None else {}
        drafter = DRAFTERS[kind].make(DraftSources(target, models["draft"], loaded))
        if tree:
            drafter.branches = drafter.tree_branches
        return drafter

    yield make
    for loaded in heads.values():
        loaded.close()


@pytest.fixture(scope="module")
def trained_prompts(trained_head) -> list[list[int]]:
    """Four prompts the heads were trained on (their corpus is the tiny target's own answers), where they draft
    well enough for acceptance to tell whether they drafted from the right state; the second is longer than a
    prefill chunk."""
    import json

    corpus = trained_head("eagle-1").parent / "work" / "answers.jsonl"
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    return [record["prompt_ids"] for record in records[:4]]


@pytest.fixture(scope="module")
def repeating_prompts(trained_head) -> list[list[int]]:
    """Four prompts whose answers repeat what the prompt holds (a trained prompt, the target's answer to it, the
    prompt again), where prompt lookup drafts what the target says."""
    import json

    corpus = trained_head("eagle-1").parent / "work" / "answers.jsonl"
    records = [json.loads(line) for line in corpus.read_text().splitlines()]
    return [record["prompt_ids"] + record["answer_ids"][:24] + record["prompt_ids"] for record in records[:4]]


# Every drafter of the registry, GPU drafting and feature reads included, chains and trees ("auto" is EAGLE beside
# prompt lookup; "eagle-3" taps target layers; lookahead verifies a tree every step).
EVERY_DRAFTER = [
    "auto",
    "eagle",
    "eagle-tree",
    "eagle-3",
    "medusa",
    "medusa-tree",
    "spark",
    "draft-model",
    "draft-model-tree",
    "layer-skip",
    "lookahead",
    "prompt-lookup-tree",
]


@pytest.mark.parametrize("drafter", EVERY_DRAFTER)
def test_every_drafter_drafts_inside_the_batch_and_each_generation_equals_its_solo_run(
    models, make_drafter, trained_prompts, repeating_prompts, drafter
):
    """Four generations drafting with one drafter kind, each its own drafter (shared heads), joining one after
    another: their GPU drafts read their own sequence's feature rows (kept from the shared forwards), their trees
    verify in the shared forwards, and each answer is its solo run's, drafts and all (the same drafts accepted:
    a drafter reading another sequence's rows or head state would draft otherwise, greedy output or not)."""
    target = models["target"]
    batched, solo = [], []
    # Lookup drafts from repetitions in the prompt, the heads from what they were trained on.
    prompts = repeating_prompts if drafter.startswith("prompt-lookup") else trained_prompts
    options = dict(make=make_drafter, prompts=prompts)
    outputs, batch = batched_runs(target, drafter, "greedy", staggered=True, drafts=batched, **options)
    assert outputs == solo_runs(target, drafter, "greedy", drafts=solo, **options)
    assert batched == solo
    assert sum(accepted for _, accepted in solo) > 0, solo  # the drafter did draft something worth taking
    assert sum(count for size, count in batch.sizes.items() if size > 1) > 0, batch.sizes
    assert batch.members == 0 and not batch.arena.slabs


@pytest.mark.parametrize("params", PARAMS, ids=PARAMS)
def test_generations_with_different_drafters_share_one_forward(models, make_drafter, trained_prompts, params):
    """EAGLE, prompt lookup, none and Medusa's trees in one batch: each answer equals its solo run, greedy and
    seeded sampling (whose tokens follow every draft's random draw: a sequence drafting from another's rows, or
    from a head state another left, would change them)."""
    target = models["target"]
    drafters = ["eagle", "prompt-lookup", "none", "medusa-tree"]
    options = dict(make=make_drafter, prompts=trained_prompts)
    outputs, batch = batched_runs(target, drafters, params, staggered=False, **options)
    assert outputs == solo_runs(target, drafters, params, **options)
    assert batch.sizes[len(drafters)] > 0, batch.sizes


def test_where_matmuls_change_kernel_past_16_rows_steps_share_forwards_only_within_them(tiny_model, monkeypatch):
    """GPUs run the tiled GEMM for calls over REGISTER_TILED_MAX_ROWS rows, whose sums round unlike the register
    kernel's; five k=4 prompt-lookup steps (up to 25 rows) must then go in forwards of at most 16 rows for each
    to equal its solo run. Lavapipe runs the same tiled GEMM when told to."""
    target = tiny_model(TARGET, max_rows=32, max_positions=200)  # its own instance: its matmuls are switched
    for linear in target.linears():
        monkeypatch.setattr(linear, "tiled_gemm", True)
    prompts = [*PROMPTS, [12, 13, 14, 12, 13, 14, 12]]
    solo = SpeculativeEngine(target, PromptLookupDrafter())
    expected = [solo.generate(prompt, 24, GREEDY_PARAMS, k=4).tokens for prompt in prompts]
    solo.close()
    batch = StepBatch(target)
    outputs: list[list[int] | None] = [None] * len(prompts)

    def run(i: int) -> None:
        engine = engine_for(target, "prompt-lookup", batch)
        outputs[i] = engine.generate(prompts[i], 24, GREEDY_PARAMS, k=4).tokens
        engine.close()

    join_all(start_all(run, len(prompts)), 120)
    batch.close()
    assert target.rows_alone == 16
    assert outputs == expected
    assert batch.sizes[len(prompts)] > 0, batch.sizes


def test_an_error_in_the_batchs_own_work_reaches_every_member_as_itself(models, monkeypatch):
    """Planning a batch's forwards fails (not any one step's work): each generation in that turn of the loop fails
    with that error, not an error of its own."""
    target = models["target"]
    broken = threading.Event()
    rows_alone = type(target).rows_alone

    def planning(self):
        if broken.is_set():
            raise RuntimeError("planning broke")
        return rows_alone.fget(self)

    monkeypatch.setattr(type(target), "rows_alone", property(planning))
    batch = StepBatch(target)
    engines = [engine_for(target, "none", batch) for _ in range(2)]
    errors: list[str] = []
    stepping = threading.Barrier(3)

    def run(i: int) -> None:
        try:
            # Long enough to be still running once the consumers met: the loop steps on while they wait.
            for n, _ in enumerate(engines[i].iter_generate(PROMPTS[i], 150, GREEDY_PARAMS, stats=SpecStats())):
                if n == 1:
                    stepping.wait(30)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")

    threads = start_all(run, 2)
    stepping.wait(60)  # both generations are stepping in one batch
    broken.set()
    join_all(threads, 60)
    for engine in engines:
        engine.close()
    batch.close()
    assert errors == ["RuntimeError: planning broke"] * 2
    assert not batch.arena.slabs


def test_a_generation_in_a_batch_prices_its_drafts_by_the_batchs_measured_forwards(models, monkeypatch):
    """An unpinned prompt-lookup generation beside others chooses k with `StepBatch.shared_costs`: its plain step
    is the shared forward's measured time and each extra row is priced once per member it delays (what the row
    costs alone, as its steps alone measured it then); alone again (after the batch), its policy prices with the
    device's own costs."""
    target = models["target"]
    batch = StepBatch(target)
    priced: list = []  # (the shared costs, what two extra rows cost in them and alone, then)
    shared_costs = batch.shared_costs

    def priced_with(alone):
        costs = shared_costs(alone)
        extra = costs.verify_cost(3) - costs.verify_cost(1) if costs is not None else None
        priced.append((costs, extra, alone.verify_cost(3) - alone.verify_cost(1)))
        return costs

    monkeypatch.setattr(batch, "shared_costs", priced_with)
    engines = [engine_for(target, "prompt-lookup", batch) for _ in PROMPTS]
    for engine in engines:
        for rows, seconds in {1: 0.040, 2: 0.044, 3: 0.052, 5: 0.074, 9: 0.170}.items():
            engine.policy.costs.observe_verify(rows, seconds)
        engine.policy.limit = 3  # the row counts the other tests compile
    outputs: list[list[int] | None] = [None] * len(PROMPTS)

    def run(i: int) -> None:
        outputs[i] = engines[i].generate(PROMPTS[i], MAX_TOKENS[i], GREEDY_PARAMS).tokens

    join_all(start_all(run, len(PROMPTS)), 120)
    batch.close()
    shared = [entry for entry in priced if entry[0] is not None]
    assert shared, priced  # once forwards were timed, members priced with the batch's costs
    assert all(costs.members >= 2 and costs.step_s > 0 for costs, _, _ in shared)
    assert all(extra == pytest.approx(costs.members * alone) for costs, extra, alone in shared)
    for engine in engines:
        assert engine.policy.shared is None  # alone again
        engine.close()
    expected = SpeculativeEngine(target, PromptLookupDrafter())
    assert outputs == [expected.generate(p, n, GREEDY_PARAMS).tokens for p, n in zip(PROMPTS, MAX_TOKENS, strict=True)]
    expected.close()


def test_sampled_generations_with_different_drafters_in_one_batch_each_follow_the_target(models, make_drafter):
    """An EAGLE head (drafts sampled on the GPU, verified by rejection sampling), prompt lookup (one-hot drafts) and no
    drafter, each sampling two-token answers over and over in one batch: each one's samples of (t1, t2) follow the
    target's exact joint p(t1) p(t2 | t1) (T = 1.5, top-6), as alone (`check_two_token_joint`)."""
    target = models["target"]
    prompt = [3, 17, 5, 9, 3, 17, 5]  # (17, 5) recurs: lookup drafts [9, 3]
    joint = exact_two_token_joint(target, prompt)
    drafters = ["eagle", "prompt-lookup", "none"]
    batch = StepBatch(target)
    engines = [engine_for(target, name, batch, make_drafter) for name in drafters]
    counts = [np.zeros_like(joint) for _ in drafters]
    drafted = [0] * len(drafters)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for trial in range(JOINT_TRIALS):
                # Three tokens: the first step may verify two drafts (a step never drafts past the last token asked).
                params = SamplingParams(temperature=1.5, top_k=6, seed=trial * len(drafters) + i)
                result = engines[i].generate(prompt, 3, params, k=2)
                counts[i][result.tokens[0], result.tokens[1]] += 1
                drafted[i] += result.stats.drafted
        except BaseException as exc:
            errors.append(exc)

    join_all(start_all(run, len(drafters)), 600)
    for engine in engines:
        engine.close()
    batch.close()
    assert not errors, errors
    assert drafted[0] > 0 and drafted[1] > 0, drafted  # both drafters drafted, so their drafts were verified
    assert sum(count for size, count in batch.sizes.items() if size > 1) > 0, batch.sizes
    for count in counts:
        assert_samples_follow(count, joint)


@pytest.mark.parametrize(
    ("steps", "prefills", "expected"),
    [
        # Steps in order, a forward holding at most 8 rows (logit rows here).
        ([(4, False), (3, False), (2, False)], [], [([0, 1], []), ([2], [])]),
        # One token tree per forward, chains beside it.
        ([(4, True), (2, True), (1, False)], [], [([0], []), ([1, 2], [])]),
        # A prompt's short last chunk rides beside the steps; with steps, a full chunk takes a forward of its own and
        # the rest of that prompt waits for the next turn.
        ([(2, False)], [5], [([0], [(0, 5)])]),
        ([(2, False)], [20], [([0], []), ([], [(0, 16)])]),
        # Without steps, prompts run whole, a chunk (16 rows) per forward.
        ([], [20, 3], [([], [(0, 16)]), ([], [(0, 4)]), ([], [(1, 3)])]),
    ],
    ids=["rows", "trees", "beside", "own-forward", "no-steps"],
)
def test_a_turn_of_the_loop_is_planned_as_its_forwards(steps, prefills, expected):
    assert plan_forwards(steps, prefills, max_rows=16, logit_rows=8, rows_alone=16) == expected


def test_a_generation_cancelled_mid_batch_frees_its_cache_and_leaves_the_others_unchanged(models):
    """Three generations in one loop; the consumer of one stops reading after two pieces and closes its stream: by the
    time the close returns, the loop has closed it (its KV blocks back in the arena), and the other two answer as
    alone."""
    target = models["target"]
    batch = StepBatch(target)
    engines = [engine_for(target, "prompt-lookup", batch) for _ in range(3)]
    prompts = [PROMPTS[0], PROMPTS[3]]
    outputs: dict[int, list[int]] = {}
    running = [threading.Event(), threading.Event()]

    def run(i: int) -> None:
        out: list[int] = []
        for new in engines[i].iter_generate(prompts[i], 200, GREEDY_PARAMS, stats=SpecStats(), k=3):
            out.extend(new)
            running[i].set()
        outputs[i] = out

    threads = start_all(run, 2)
    assert all(event.wait(60) for event in running)
    stream = engines[2].iter_generate(PROMPTS[2], 120, GREEDY_PARAMS, stats=SpecStats(), k=3)
    taken = [next(stream), next(stream)]
    before, members = batch.arena.used_blocks, batch.members
    stream.close()  # the consumer leaves mid-generation
    assert members == 3 and batch.arena.used_blocks < before  # it was beside the others; its blocks are back
    join_all(threads, 120)
    for engine in engines:
        engine.close()
    batch.close()
    solo = engine_for(target, "prompt-lookup")
    assert [outputs[0], outputs[1]] == [solo.generate(prompt, 200, GREEDY_PARAMS, k=3).tokens for prompt in prompts]
    solo.close()
    assert sum(len(new) for new in taken) >= 2 and batch.members == 0 and not batch.arena.slabs
