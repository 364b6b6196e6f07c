"""Forwards played from tapes (Transformer.record_forward, Recorder.play_tape): a forward of up to 16 rows is
recorded once per (cache, rows, logits, layers, phase, attention grid) and played again with only the attention
positions set, through the compiled dispatch loop or the Python one. Played forwards must give bit-identical
logits to forwards recorded op by op (the wgpu-py public-API path never plays tapes), through key changes (rows,
logits, layer skip, attention grid as the context grows), rollbacks, sliding windows and several forwards in one
submit."""

from __future__ import annotations

import numpy as np
import pytest

from doppler_py.errors import InternalError
from doppler_py.gpu.kernels import Recorder
from doppler_py.testing.tiny import TINY_SPECS

PROMPT = [5, 9, 14, 3, 7, 21, 2, 11]


def run_script(model, registry, monkeypatch, *, tapes: bool) -> tuple[list[np.ndarray], int]:
    """A decoding session's forwards: prefill, decode steps past several attention-grid changes, 5-row
    verifications with "all" logits, rollbacks, layer-skip forwards. Returns every logits array and the number
    of forwards played from tapes."""
    monkeypatch.setattr(registry, "native_dispatch", tapes)
    plays = []
    monkeypatch.setattr(Recorder, "play_tape", lambda rec, tape, play=Recorder.play_tape: plays.append(play(rec, tape)))
    cache = model.new_cache(96)
    outputs = [model.forward(PROMPT, cache)]
    rng = np.random.default_rng(3)
    for step in range(60):
        pos = cache.length
        if step % 7 == 3:
            outputs.append(model.forward(rng.integers(0, 60, 5).tolist(), cache, logits="all"))
            cache.truncate(pos + 2)  # two of four drafts accepted, say
        elif step % 11 == 5:
            outputs.append(model.forward([int(rng.integers(0, 60))], cache, num_layers=1))
            cache.truncate(pos)
        else:
            outputs.append(model.forward([int(rng.integers(0, 60))], cache))
    model.release_cache(cache)
    return outputs, len(plays)


@pytest.mark.parametrize("name", ["llama-tied-gqa", "gemma3-sliding", "qwen3-qknorm-gqa", "gemma4"])
def test_played_forwards_equal_forwards_recorded_op_by_op(
    tiny_model, tiny_folder, registry, monkeypatch, name, tape_loop
):
    model = tiny_model(tiny_folder(TINY_SPECS[name]), max_rows=16, max_positions=128)
    reference, plays = run_script(model, registry, monkeypatch, tapes=False)
    assert not model._tapes and plays == 0
    played, plays = run_script(model, registry, monkeypatch, tapes=True)
    assert plays > 40, "most of the 61 forwards are played from a tape"
    for i, (want, got) in enumerate(zip(reference, played, strict=True)):
        np.testing.assert_array_equal(got, want, err_msg=f"forward {i}")
    assert not model._tapes, "releasing the cache drops its tapes"


@pytest.fixture
def prompted(tiny_model, tiny_folder, registry):
    """The tiny LLaMA with PROMPT in a fresh cache (released afterwards); skipped where tapes never play."""
    if not registry.native_dispatch:
        pytest.skip("no native dispatch path here: forwards are never played from tapes")
    model = tiny_model(tiny_folder(TINY_SPECS["llama-tied-gqa"]), max_rows=16, max_positions=128)
    cache = model.new_cache(64)
    model.forward(PROMPT, cache)
    yield model, cache
    model.release_cache(cache)


def test_tapes_are_kept_per_call_shape_and_played(prompted, registry):
    model, cache = prompted
    per_layer = 5  # qkv, attention (RoPE and the cache write inside), o, gate_up, down
    for token in range(4):
        rec = registry.recorder()
        model.ids.view((1,)).write(model.check_ids([token]))
        model.record_forward(rec, 1, cache, cache.length)
        rec.submit()
        assert rec.dispatches == 2 + per_layer * model.num_layers
    decode_keys = [key for key in model._tapes if key[1] == 1]
    assert len(decode_keys) == 1, "four decode steps at positions 8..11 share one attention grid, one tape"


def test_two_played_forwards_at_different_positions_in_one_submit_are_refused(prompted, registry):
    """Without phases both would run with the second one's positions: the slot check catches it for tapes too."""
    model, cache = prompted
    model.forward([1], cache)  # captures the decode tape
    rec = registry.recorder()
    model.record_forward(rec, 1, cache, cache.length)
    with pytest.raises(InternalError, match="dispatched again in the same submit with different values"):
        model.record_forward(rec, 1, cache, cache.length)
    rec = registry.recorder()
    for phase in (1, 2, 3):  # in phases each forward has its own slots: fine (plain batches do this)
        rec.phase = phase
        model.record_forward(rec, 1, cache, cache.length)
    rec.submit()


def test_a_new_cache_never_plays_tapes_left_under_its_id(tiny_model, tiny_folder, registry):
    """A cache dropped without release_cache can leave tapes whose key holds its id; a new cache given the same
    id must not play them (they bind the old cache's buffers)."""
    model = tiny_model(tiny_folder(TINY_SPECS["llama-tied-gqa"]), max_rows=16, max_positions=128)
    cache = model.new_cache(64)
    stale = object()
    model._tapes[(id(cache), 1, "last", None, False, 0, ())] = stale  # as if left by a cache with this id
    fresh = model.new_cache(64)
    expected = model.forward(PROMPT, fresh)
    np.testing.assert_array_equal(model.forward(PROMPT, cache), expected)
    assert stale not in model._tapes.values()
    model.release_cache(cache)
    model.release_cache(fresh)
