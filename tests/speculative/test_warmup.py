"""Getting ready to speculate without holding up the first token: pipelines compiled in a background thread
(`doppler_py.speculative.readiness.warmup`), drafts limited to the row counts already compiled, the calibration between
two steps, and the on-disk cost cache (`doppler_py.speculative.readiness.cost_cache`)."""

from __future__ import annotations

import json
import os
import threading

import pytest
from support.decode import reference_decode

import doppler_py
from doppler_py.ops.linear import row_tile
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.policy.draft_length import DraftLengthPolicy
from doppler_py.speculative.readiness.cost_cache import cost_key, load_costs, save_costs
from doppler_py.speculative.readiness.state import Stage
from doppler_py.testing.tiny import TinySpec

GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]
MODEL = TinySpec(num_hidden_layers=2, seed=5)  # with a tokenizer, for `doppler_py.load`


def draft_engine(models) -> SpeculativeEngine:
    return SpeculativeEngine(models["target"], DraftModelDrafter(models["draft"], 48))


def test_background_warmup_streams_plain_tokens_then_speculates(models):
    """The first generation's first step is plain and starts the compile thread; once it is done, the next step
    calibrates every row count (the costs go to `on_calibrated`) and speculation is on. Greedy output never
    changes."""
    plain = reference_decode(models["target"], PROMPT, 24, GREEDY)
    engine = draft_engine(models)
    calibrated = []
    engine.readiness.on_calibrated = calibrated.append
    engine.prepare(background=True)
    try:
        first = engine.generate(PROMPT, 24, GREEDY)
        assert first.tokens == plain and first.stats.plain_steps >= 1
        if engine.readiness.warmup is not None:
            assert engine.readiness.warmup.done.wait(timeout=300), "the pipelines never finished compiling"
        second = engine.generate(PROMPT, 24, GREEDY)
    finally:
        engine.close()
    assert second.tokens == plain and second.stats.drafted > 0
    assert first.stats.warmup_steps >= 1 and second.stats.warmup_steps == 0
    assert engine.policy.limit is None and engine.readiness.usable_rows == max(engine.verify_rows())
    assert len(calibrated) == 1 and sorted(calibrated[0]) == engine.verify_rows()
    assert all(seconds > 0 for seconds in calibrated[0].values())
    # Calibrating compiled each row count's own row tile: no step runs the small ones a CPU adapter falls back on.
    target = models["target"]
    for linear in target.linears():
        for rows in engine.verify_rows():
            assert rows > linear.max_rows or linear.tile(rows) == row_tile(rows, linear.tiled_gemm), (linear, rows)


def test_a_seeded_sampled_generation_waits_for_the_warmup(models):
    """Which steps speculate decides which random numbers each token uses: with a seed the tokens must not
    depend on how long compiling took, so a background engine gives what a ready one gives."""
    params = SamplingParams(temperature=1.0, top_k=8, seed=7)
    ready = draft_engine(models)
    ready.prepare(costs={1: 1.0, 5: 2.0})
    warming = draft_engine(models)
    warming.prepare(costs={1: 1.0, 5: 2.0}, background=True)
    try:
        assert warming.generate(PROMPT, 20, params).tokens == ready.generate(PROMPT, 20, params).tokens
    finally:
        ready.close()
        warming.close()


def test_closing_while_compiling_stops_the_thread(models, monkeypatch):
    """Each row count's compile is held until the test lets it go, so the thread is surely still compiling when
    the engine closes: closing must stop it after the row count in hand, not let it compile the rest."""
    started, release = threading.Semaphore(0), threading.Event()
    compiled = []
    calibrate = SpeculativeEngine.calibrate

    def held(self, rows, *args, **kwargs):
        if threading.current_thread().name == "doppler-warmup":
            if not compiled:  # the first row count waits (a thread never asked to stop goes on after 10 s)
                started.release()
                release.wait(timeout=10)
            compiled.append(rows)
        return calibrate(self, rows, *args, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "calibrate", held)
    engine = draft_engine(models)
    engine.prepare(costs={1: 1.0, 2: 1.5}, background=True)
    engine.generate(PROMPT, 3, GREEDY)  # the first token is out: the thread starts
    warmup = engine.readiness.warmup
    assert warmup is not None and started.acquire(timeout=60), "the compile thread never started"
    assert warmup._thread.is_alive()
    # The row count in hand is let go only once closing has asked the thread to stop, so without that request
    # it would go on to the next row count.
    ask_to_stop = warmup._cancel.set
    monkeypatch.setattr(warmup._cancel, "set", lambda: (ask_to_stop(), release.set()))
    engine.close()
    assert not warmup._thread.is_alive()
    assert engine.readiness.warmup is None
    assert len(compiled) == 1 < len(engine.verify_rows())


def test_drafts_stay_within_the_compiled_row_counts():
    policy = DraftLengthPolicy(capacity=8)
    policy.reset()
    policy.limit = 2
    assert all(policy.next_k(100) <= 2 for _ in range(10))
    policy.reset(k=6)  # a pinned k too, until its pipelines exist
    assert policy.next_k(100) == 2
    policy.limit = None
    assert policy.next_k(100) == 6


# --- the on-disk cost cache -------------------------------------------------------------------------------------
@pytest.fixture
def cost_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DOPPLER_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "verify-costs"


def test_costs_are_kept_per_device_model_and_precision(gpu, tiny_folder, cost_dir):
    folder = tiny_folder(MODEL)
    key = cost_key(gpu, folder, "f32", max_rows=32, capacity=8)
    assert load_costs(key) is None
    save_costs(key, {1: 0.01, 5: 0.03})
    assert load_costs(key) == {1: 0.01, 5: 0.03}
    assert load_costs(cost_key(gpu, folder, "f16", max_rows=32, capacity=8)) is None
    assert load_costs(cost_key(gpu, folder, "f32", max_rows=32, capacity=4)) is None
    (path,) = cost_dir.iterdir()
    path.write_text("{not json")
    assert load_costs(key) is None
    path.write_text(json.dumps({"key": key, "verify": {"1": -1.0}}))
    assert load_costs(key) is None


def test_a_cache_that_cannot_be_written_costs_a_warning_not_the_generation(gpu, tiny_folder, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("DOPPLER_CACHE", str(blocked))  # a file where the cache folder should be
    with pytest.warns(RuntimeWarning, match="could not be cached"):
        assert not save_costs(cost_key(gpu, tiny_folder(MODEL), "f32", max_rows=32, capacity=8), {1: 0.01})


def test_changed_model_files_invalidate_the_costs(gpu, tiny_folder, cost_dir, tmp_path):
    import shutil

    folder = shutil.copytree(tiny_folder(MODEL), tmp_path / "model")
    save_costs(cost_key(gpu, folder, "f32", max_rows=32, capacity=8), {1: 0.01})
    weights = folder / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000))
    assert load_costs(cost_key(gpu, folder, "f32", max_rows=32, capacity=8)) is None


def test_a_second_engine_for_the_same_model_skips_the_calibration(gpu, tiny_folder, cost_dir, monkeypatch):
    """The second engine measures nothing; with warmup="now" it still runs every step size once (storing no
    cost), so that none compiles during a generation."""
    measured, compiled = [], []
    calibrate = SpeculativeEngine.calibrate

    def spy(self, *args, store=True, **kwargs):
        (measured if store else compiled).append(args)
        return calibrate(self, *args, store=store, **kwargs)

    monkeypatch.setattr(SpeculativeEngine, "calibrate", spy)
    folder = tiny_folder(MODEL)
    for expected in ((1, 0), (1, 1)):
        with doppler_py.load(folder, "f32", gpu=gpu, max_seq=128, progress=False, warmup="now") as engine:
            engine.generate("hello", max_tokens=4, speculative="prompt-lookup")
        assert (len(measured), len(compiled)) == expected
    (path,) = cost_dir.iterdir()
    assert sorted(json.loads(path.read_text())["verify"], key=int) == [str(r) for r in range(1, 10)]


def test_the_api_says_on_stderr_when_a_mode_compiles_and_measures_before_its_first_token(
    gpu, tiny_folder, cost_dir, capsys
):
    folder = tiny_folder(MODEL)
    for warmup, said in (
        ("now", "compile and time its verification pipelines"),
        ("background", "in the background"),
        ("auto", "once the tokens to come can repay it"),
    ):
        with doppler_py.load(folder, "f32", gpu=gpu, max_seq=128, progress=True, warmup=warmup) as engine:
            engine.generate("hello", max_tokens=2, speculative="prompt-lookup")
        err = capsys.readouterr().err
        assert said in err and "once per process" in err, err
        assert ("ready in" in err) == (warmup == "now")
    with doppler_py.load(folder, "f32", gpu=gpu, max_seq=128, progress=False) as engine:
        engine.generate("hello", max_tokens=2, speculative="prompt-lookup")
    assert capsys.readouterr().err == ""


def test_the_compile_is_weighed_before_it_starts_and_again_with_each_answer(models, monkeypatch):
    """`prepare(background=True, weigh=True)`: an answer the compile cannot pay for runs plainly without the drafter
    (never started, so no upkeep) and no compile thread; the next answer weighs it again, counting the tokens
    generated before; once it pays, the drafter runs and the thread starts."""
    weighed = []

    def pays(target, rows, *, tokens, plain_token_s, speedup, drafter):
        weighed.append((tokens, plain_token_s is not None))
        return tokens > 12, 30.0, 0.5

    plain = reference_decode(models["target"], PROMPT, 12, GREEDY)
    engine = draft_engine(models)
    engine.readiness.compile_pays = pays
    started = []
    start = engine.drafter.start
    monkeypatch.setattr(engine.drafter, "start", lambda ctx: (started.append(len(ctx.tokens)), start(ctx)))
    engine.prepare(background=True, weigh=True)
    try:
        first = engine.generate(PROMPT, 12, GREEDY)
        assert engine.readiness.warmup is None and engine.readiness.stage is Stage.WEIGHING and not started
        assert first.tokens == plain and first.stats.drafted == 0 and first.stats.warmup_steps == 12
        assert (first.stats.compile_cost_s, first.stats.compile_gain_s) == (30.0, 0.5)
        assert first.stats.drafter == engine.drafter.name
        second = engine.generate(PROMPT, 12, GREEDY)
        assert second.tokens == plain and started == [len(PROMPT)]
        assert engine.readiness.warmup is not None or engine.readiness.usable_rows > 1  # started (maybe done already)
    finally:
        engine.close()
    # Before each answer until it pays, and before each step of an answer that began plainly once its plain tokens
    # are timed: the tokens left of the answer plus those generated before (and on a CPU adapter the next stage's
    # compile, weighed once the first is done, over the tokens left).
    opened = weighed.index((24, True))
    assert weighed[0] == (12, False) and opened > 1 and all(timed and 0 < t < 12 for t, timed in weighed[1:opened])
    assert [t for t, _ in weighed[1:opened]] == sorted((t for t, _ in weighed[1:opened]), reverse=True)
    assert all(timed and 12 < t <= 24 for t, timed in weighed[opened + 1 :])


def test_the_compile_pays_by_its_pipelines_and_the_tokens_to_come(models, monkeypatch):
    from doppler_py.speculative.readiness import compile_gate

    target = models["target"]
    monkeypatch.setattr(compile_gate, "missing_pipelines", lambda target, rows, drafter: [("matmul", "main", ())] * 10)
    monkeypatch.setattr(compile_gate, "compile_estimate_s", lambda cache, keys: 1.0 * len(keys))
    # 10 pipelines × 1 s against tokens × 0.1 s × (1 - 1/2)
    assert compile_gate.compile_pays(target, [1, 2], tokens=100, plain_token_s=0.1, speedup=2.0) == (False, 10.0, 5.0)
    assert compile_gate.compile_pays(target, [1, 2], tokens=300, plain_token_s=0.1, speedup=2.0)[0]
    # No speedup measured yet: the prior; a predicted slowdown saves nothing.
    assert compile_gate.compile_pays(target, [1], tokens=1000, plain_token_s=0.1, speedup=None)[2] > 0
    assert compile_gate.compile_pays(target, [1], tokens=10**6, plain_token_s=0.1, speedup=0.9)[0] is False
    monkeypatch.setattr(type(target.gpu), "on_cpu", property(lambda gpu: False))  # a GPU: compiling runs beside it
    assert compile_gate.compile_pays(target, [1, 2], tokens=1, plain_token_s=0.1, speedup=1.0)[0]


def test_only_pipelines_not_compiled_yet_are_counted(gpu, tiny_folder, tmp_path):
    import shutil

    from doppler_py.gpu.kernels import SHADER_DIR, KernelRegistry
    from doppler_py.model.loader import load_weights
    from doppler_py.model.transformer import Transformer
    from doppler_py.speculative.readiness.compile_gate import missing_pipelines

    # A registry over a copy of the shaders has a pipeline cache of its own: nothing compiled yet.
    registry = KernelRegistry(gpu, shutil.copytree(SHADER_DIR, tmp_path / "shaders"))
    target = Transformer(load_weights(tiny_folder(MODEL), gpu, "f32"), registry, max_rows=8)
    try:
        distinct = {linear.pipeline_key(rows) for linear in target.linears() for rows in (2, 3)}
        assert len(missing_pipelines(target, [2, 3])) == len(distinct) < 2 * len(target.linears())  # shapes share
        for linear in target.linears():
            linear.compile(2)
        assert missing_pipelines(target, [2]) == []
        assert 0 < len(missing_pipelines(target, [2, 3])) < len(distinct)
        for linear in target.linears():
            linear.compile(3)
        assert missing_pipelines(target, [2, 3]) == []
        assert all(r.pipeline_s > 0 for r in registry.pipelines.records if r.key[0] == "matmul")  # the gate's basis
    finally:
        registry.close()
        target.close()
        target.weights.destroy()


def test_a_generations_first_matmul_pipelines_compile_at_once(models, monkeypatch):
    """Before its prefill a generation compiles the matmul pipelines of its prompt's chunks and of plain steps,
    several at once (a thread per core, `compile_at_once`); the generation then compiles none of them itself, and
    its tokens are those of plain decoding."""
    from doppler_py.gpu.kernels import PipelineCache
    from doppler_py.model import transformer
    from doppler_py.ops.linear import Linear

    target = models["target"]
    asked: list[tuple[set[int], bool]] = []
    monkeypatch.setattr(
        transformer,
        "compile_at_once",
        lambda calls, small_tiles: asked.append(({rows for _, rows in calls}, small_tiles)),
    )
    monkeypatch.setattr(target, "_generation_rows", set())
    monkeypatch.setattr(target, "_small_tile_prompt_rows", 0)
    target.compile_generation(40)  # a chunk of 32 rows, one of 8, then plain steps
    target.compile_generation(40)  # ... once
    # A short prompt gets the small row tiles; one of LONG_PROMPT_ROWS rows its own (compiled again for it).
    target.compile_generation(transformer.LONG_PROMPT_ROWS)
    assert asked == [({32, 8, 1}, True), ({32, 1}, False)]
    # Short prompts adding up past LONG_PROMPT_ROWS: the one that would pass it compiles its own tiles.
    asked.clear()
    monkeypatch.setattr(target, "_generation_rows", set())
    monkeypatch.setattr(target, "_small_tile_prompt_rows", 0)
    short = transformer.LONG_PROMPT_ROWS // 2 - 1
    for _ in range(3):
        target.compile_generation(short)
    assert [small for _, small in asked] == [True, False]  # the second prompt compiles nothing (small again)
    monkeypatch.undo()

    prompt = [5, 9, 11, 4]  # 3 prefill rows: small row tiles, quick to compile
    expected = reference_decode(target, prompt, 6, GREEDY)
    cache = target.registry.pipelines
    fresh = PipelineCache()  # the compiled pipelines but the matmuls'
    fresh.modules = cache.modules
    fresh.kernels = {key: kernel for key, kernel in cache.kernels.items() if key[0] != "matmul"}
    monkeypatch.setattr(target.registry, "pipelines", fresh)
    monkeypatch.setattr(target, "_generation_rows", set())
    monkeypatch.setattr(target, "_small_tile_prompt_rows", 0)  # a fresh process's first prompts
    threads: set[str] = set()
    compile_rows = Linear.compile

    def compile(linear: Linear, rows: int, *, small: bool = False) -> None:
        threads.add(threading.current_thread().name)
        compile_rows(linear, rows, small=small)

    monkeypatch.setattr(Linear, "compile", compile)
    compiled: list[int] = []  # matmul pipelines compiled when `compile_generation` returned
    compile_generation = target.compile_generation
    monkeypatch.setattr(
        target,
        "compile_generation",
        lambda rows: [compile_generation(rows), compiled.append(len(fresh.compile_s["matmul"]))],
    )
    engine = SpeculativeEngine(target, None)
    try:
        assert engine.generate(prompt, 6, GREEDY).tokens == expected
    finally:
        engine.close()
    layer = target.layers[0]
    for linear, rows in [(layer.qkv, 3), (layer.down, 3), (layer.o, 1), (target.lm_head_last, 1)]:
        assert target.registry.compiled(linear.pipeline_key(rows, small=True))  # a short prompt's (`row_tile`)
    assert compiled == [len(fresh.compile_s["matmul"])]  # the generation compiled no matmul itself
    if (os.cpu_count() or 1) > 1:  # several at once
        assert len(threads) >= 2, threads
