"""GPU memory is given back: on close() and context exit, after loading a second model, after a cancelled stream,
after a failed load, and across many generations.

Two measures. `buffer_use()` is wgpu-py's own count of live GPUBuffer objects and their bytes
(`wgpu.diagnostics.object_counts`) after a full garbage collection: it returns to its baseline only if nothing
still holds a buffer. `BufferLedger` watches the device while an engine lives and lists the buffers created
since it started that are neither destroyed nor collected: the memory `close()` must hand back at once, while
the caller still holds the engine object.
"""

from __future__ import annotations

import gc
import json
import shutil
import threading
import weakref
from pathlib import Path

import pytest
from reliability.helpers import GOOD_PROMPT, BufferUse, buffer_use, report
from wgpu.backends.wgpu_native import GPUBuffer, GPUDevice

import doppler_py
from doppler_py.errors import DeviceLimitError, DopplerError, VocabularyMismatchError
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.step import MAX_PLAIN_STEPS
from doppler_py.testing.tiny import TINY_SPECS, TinySpec, write_tiny_model

MODES = [None, "prompt-lookup", "layer-skip"]


class BufferLedger:
    """Buffers created on any device while active, until destroyed or collected."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.held: dict[int, tuple[weakref.ref, int, str]] = {}
        create, destroy = GPUDevice.create_buffer, GPUBuffer.destroy

        def create_buffer(device, *args, **kwargs):
            buffer = create(device, *args, **kwargs)
            key = id(buffer)
            self.held[key] = (weakref.ref(buffer, lambda _: self.held.pop(key, None)), buffer.size, buffer.label)
            return buffer

        def destroy_buffer(buffer):
            self.held.pop(id(buffer), None)
            destroy(buffer)

        monkeypatch.setattr(GPUDevice, "create_buffer", create_buffer)
        monkeypatch.setattr(GPUBuffer, "destroy", destroy_buffer)

    def holding(self) -> list[str]:
        gc.collect()
        return sorted(f"{label or '?'} ({size} B)" for _, size, label in self.held.values())


@pytest.fixture
def ledger(monkeypatch, gpu):
    gpu.wait_idle()  # the device's own 4-byte sync buffer exists before the ledger starts
    return BufferLedger(monkeypatch)


def load(folder: Path, gpu, **options):
    """The tiny model, ready to speculate from the first token, without the prefix cache: it keeps earlier
    sequences' K/V on purpose, within its own budget (tests/speculative/test_prefix_cache.py), which would read
    as growth here."""
    defaults = {"warmup": "now", "kv_cache_mb": 0}
    return doppler_py.load(folder, weights="f32", gpu=gpu, max_seq=None, progress=False, **{**defaults, **options})


@pytest.fixture(autouse=True)
def full_plain_batches(monkeypatch):
    """Plain batches as large as allowed whatever the machine's speed: memory is flat once the largest batch
    has run (its per-step uniform copies are made once per batch size and kept), and it must run first."""
    monkeypatch.setattr(
        SpeculativeEngine, "_batch_size", lambda self, remaining, first: 1 if first else min(remaining, MAX_PLAIN_STEPS)
    )


def exercise(engine, tokens: int = 8, *, full_batches: bool = False) -> None:
    """Every mode once. `full_batches`: plain decoding also reaches its largest batch, whose per-step uniform
    copies are then made (they are made once per batch size and kept, so memory is flat only after that)."""
    for mode in MODES:
        engine.generate(GOOD_PROMPT, max_tokens=tokens, speculative=mode, k=3 if mode else None)
    if full_batches:
        engine.generate(GOOD_PROMPT, max_tokens=2 + MAX_PLAIN_STEPS, speculative=None)


def test_close_destroys_every_buffer_the_engine_made(tiny_dir, gpu, ledger, request):
    baseline = buffer_use()
    engine = load(tiny_dir, gpu, kv_cache_mb=8)  # the prefix cache's entries are the engine's too
    exercise(engine)
    loaded = buffer_use()
    assert ledger.holding() and len(engine.prefix_cache) > 0  # the ledger sees the engine's buffers
    engine.close()
    assert ledger.holding() == []
    engine.close()  # closing twice is harmless
    del engine
    after = buffer_use()
    assert after == baseline
    report(
        request.config,
        f"GPU buffers (tiny model): before load {fmt(baseline)}, loaded {fmt(loaded)}, after close {fmt(after)}",
    )


def test_context_exit_closes_the_engine(tiny_dir, gpu, ledger):
    with load(tiny_dir, gpu) as engine:
        engine.generate(GOOD_PROMPT, max_tokens=4)
    assert engine.closed
    assert ledger.holding() == []


def test_a_closed_engine_refuses_to_generate(tiny_dir, gpu):
    engine = load(tiny_dir, gpu)
    stream = engine.stream(GOOD_PROMPT, max_tokens=20)
    next(stream)
    engine.close()
    with pytest.raises(DopplerError, match="closed during this generation; load the model again"):
        list(stream)  # a stream that outlives its engine stops with an error, not inside wgpu
    with pytest.raises(DopplerError, match="is closed; load the model again"):
        engine.generate(GOOD_PROMPT, max_tokens=4)


def test_loading_a_second_model_leaks_nothing(tiny_dir, gpu, tmp_path):
    other = write_tiny_model(tmp_path / "other", TinySpec(vocab_size=128, num_hidden_layers=3, seed=5))
    baseline = buffer_use()
    first = load(tiny_dir, gpu)
    first.generate(GOOD_PROMPT, max_tokens=8)
    with_first = buffer_use()
    for _ in range(2):
        with load(other, gpu) as second:
            second.generate(GOOD_PROMPT, max_tokens=8, speculative="prompt-lookup")
        del second
        assert buffer_use() == with_first
    first.close()
    del first
    assert buffer_use() == baseline


def test_cancelling_a_stream_mid_generation_leaks_nothing(tiny_dir, gpu):
    engine = load(tiny_dir, gpu)
    try:
        exercise(engine, full_batches=True)  # every speculative engine exists and is calibrated
        warm = buffer_use()
        for mode in MODES * 2:
            stream = engine.stream(GOOD_PROMPT, max_tokens=60, speculative=mode, k=3 if mode else None)
            next(stream)
            next(stream)
            stream.close()
            assert buffer_use() == warm, mode
        abandoned = engine.stream(GOOD_PROMPT, max_tokens=60, speculative="layer-skip", k=3)
        next(abandoned)
        del abandoned  # dropped without close(): the generator's cleanup still runs
        assert buffer_use() == warm
        assert engine.generate(GOOD_PROMPT, max_tokens=8).tokens  # and the engine still works
    finally:
        engine.close()


def test_memory_stays_flat_across_many_generations(tiny_dir, gpu):
    engine = load(tiny_dir, gpu)
    try:
        exercise(engine, full_batches=True)
        warm, groups = buffer_use(), engine.model.registry.cache_sizes["bind_groups"]
        for _ in range(5):
            exercise(engine, tokens=12)
        assert buffer_use() == warm
        assert engine.model.registry.cache_sizes["bind_groups"] == groups
    finally:
        engine.close()


def test_cancelling_one_of_two_batched_streams_leaks_nothing_and_leaves_the_other_unchanged(tiny_dir, gpu):
    """With `parallel`, a stream closed mid-batch frees its KV blocks at once, round after round: GPU memory stays
    flat, and the stream beside it answers as it does alone."""
    engine = load(tiny_dir, gpu, parallel=2)
    try:
        alone = {mode: engine.generate(GOOD_PROMPT, max_tokens=24, speculative=mode, k=3).text for mode in MODES}

        def answer(mode: str | None, answers: list[str]) -> None:
            answers.append("".join(engine.stream(GOOD_PROMPT, max_tokens=24, speculative=mode, k=3)))

        warm = None
        for round_ in range(3):
            for mode in MODES:
                answers: list[str] = []
                beside = threading.Thread(target=answer, args=(mode, answers))
                beside.start()
                cancelled = engine.stream(GOOD_PROMPT + " again", max_tokens=60, speculative=mode, k=3)
                next(cancelled)
                next(cancelled)
                cancelled.close()
                beside.join(60)
                assert answers == [alone[mode]], mode
                assert engine.batch.arena.used_blocks == 0 and not engine.batch.arena.slabs
            if round_ == 0:
                warm = buffer_use()  # every pipeline, plain batch size and engine of the pool exists now
            else:
                assert buffer_use() == warm, round_
    finally:
        engine.close()


def test_penalised_generations_free_their_counts_and_bind_groups(tiny_dir, gpu):
    """A generation's penalties (`StepContext.penalties`: its entries buffer, its bound kernels) go at its end,
    completed or cancelled, however long its answer grew them."""
    penalties = {"frequency_penalty": 0.5, "repetition_penalty": 1.2, "logit_bias": {"5": 2}, "min_p": 0.1}
    engine = load(tiny_dir, gpu)
    try:
        exercise(engine, full_batches=True)

        def generations(check: bool = True) -> None:
            for mode in MODES:
                engine.generate(GOOD_PROMPT, max_tokens=40, speculative=mode, temperature=0.8, seed=1, **penalties)
                stream = engine.stream(GOOD_PROMPT, max_tokens=40, speculative=mode, **penalties)
                next(stream)
                stream.close()
                assert not check or buffer_use() == warm, mode

        # Once to compile the penalty pipelines and make, per mode's step, the uniform copies of each plain step of
        # a submit that these generations reach (kept for reuse: they are bounded by the steps per submit).
        generations(check=False)
        warm, groups = buffer_use(), engine.model.registry.cache_sizes["bind_groups"]
        generations()
        assert engine.model.registry.cache_sizes["bind_groups"] == groups
    finally:
        engine.close()


def test_a_failed_load_leaves_nothing_behind(tiny_dir, gpu, tmp_path):
    too_long = Path(shutil.copytree(tiny_dir, tmp_path / "too-long"))
    config = json.loads((too_long / "config.json").read_text())
    (too_long / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 100_000_000}))
    wide_draft = write_tiny_model(tmp_path / "wide", TinySpec(vocab_size=4000, num_hidden_layers=1))
    baseline = buffer_use()
    for source, options, error in (
        (too_long, {}, DeviceLimitError),  # fails after the weights are on the GPU
        (tiny_dir, {"draft": wide_draft}, VocabularyMismatchError),  # fails before any upload
    ):
        with pytest.raises(error):
            load(source, gpu, **options)
        assert buffer_use() == baseline, error.__name__


def test_a_kv_cache_gives_its_memory_back(tiny_dir, gpu, ledger):
    engine = load(tiny_dir, gpu)
    try:
        model = engine.model
        before = set(ledger.holding())
        cache = model.new_cache(64)
        model.forward(engine.encode_prompt(GOOD_PROMPT), cache)
        assert len(set(ledger.holding()) - before) >= 2 * model.num_layers
        model.release_cache(cache)
        assert set(ledger.holding()) == before
    finally:
        engine.close()


# --- helpers ------------------------------------------------------------------------------------------------------


def fmt(use: BufferUse) -> str:
    return f"{use.count} / {use.nbytes:,} B"


def test_a_gemma4_engine_destroys_every_buffer_it_made(gpu, ledger, tmp_path):
    """Gemma 4's own buffers (per-layer inputs, caches of two shapes, their compaction ops) go with the rest."""
    folder = write_tiny_model(tmp_path / "gemma4", TINY_SPECS["gemma4"])
    baseline = buffer_use()
    engine = load(folder, gpu, kv_cache_mb=8)
    exercise(engine)
    assert ledger.holding()
    engine.close()
    assert ledger.holding() == []
    del engine
    assert buffer_use() == baseline
