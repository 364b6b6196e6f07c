"""Heads trained on the tiny target once per session (EAGLE, EAGLE-3 fused, Medusa, spark), for the drafter tests
and the trainer tests alike. Needs torch (the trainer's optional dependency): each fixture skips without it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from doppler_py.training.data import TrainOptions
from support.tiny_specs import CORPUS_OPTIONS, TARGET

BLOCK, RANK, DRAFT_VOCAB = 3, 32, 40  # the spark block's shape


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory, tiny_folder):
    """A function copying the session's training data for TARGET into a new work folder (returned)."""
    pytest.importorskip("torch")
    from doppler_py.training.data import prepare

    made = tmp_path_factory.mktemp("corpus") / "work"
    prepare(tiny_folder(TARGET), made, TrainOptions(**CORPUS_OPTIONS), say=lambda _: None)

    def copy(work):
        shutil.copytree(made, work)
        return work

    return copy


EAGLE_OPTIONS = TrainOptions(
    **CORPUS_OPTIONS,
    draft_vocab=40,
    steps=160,
    save_every=80,
)


FUSED_LAYERS = (0, 2)  # EAGLE-3 fusion on the tiny target's 4 layers: these beside the last


@pytest.fixture(scope="session")
def head_dir(tmp_path_factory, tiny_folder, tiny_corpus):
    from doppler_py.training.eagle import train

    out = tmp_path_factory.mktemp("eagle")
    tiny_corpus(out / "work")
    card = train(tiny_folder(TARGET), out / "head", out / "work", EAGLE_OPTIONS, say=lambda _: None)
    assert card["steps"] == EAGLE_OPTIONS.steps and card["sequences"] == 18
    return out / "head"


@pytest.fixture(scope="session")
def fused_dir(tmp_path_factory, tiny_folder, head_dir):
    """An EAGLE-3-style head, trained on the same answers; their cached features lack the taps, so the features
    stage runs again."""
    from doppler_py.training.eagle import train

    out = tmp_path_factory.mktemp("eagle3")
    shutil.copytree(head_dir.parent / "work", out / "work")
    (out / "work" / "eagle.pt").unlink()
    said: list[str] = []
    options = TrainOptions(**{**EAGLE_OPTIONS.__dict__, "feature_taps": FUSED_LAYERS})
    card = train(tiny_folder(TARGET), out / "head", out / "work", options, say=said.append)
    assert "features: reused from features.pt" not in said and list(card["options"]["feature_taps"]) == [0, 2]
    assert json.loads((out / "head" / "eagle.json").read_text())["feature_taps"] == list(FUSED_LAYERS)
    return out / "head"


MEDUSA_OPTIONS = TrainOptions(**CORPUS_OPTIONS, draft_vocab=40, steps=150, save_every=75, medusa_heads=3)


@pytest.fixture(scope="session")
def heads_dir(tmp_path_factory, tiny_folder, tiny_corpus):
    from doppler_py.training.medusa import train

    out = tmp_path_factory.mktemp("medusa")
    tiny_corpus(out / "work")
    card = train(tiny_folder(TARGET), out / "heads", out / "work", MEDUSA_OPTIONS, say=lambda _: None)
    assert card["kind"] == "medusa" and card["steps"] == MEDUSA_OPTIONS.steps
    # A random tiny target is hard to foresee two tokens ahead: better than chance (1/40) is what is asked.
    assert len(card["validation_top1_by_head"]) == 3 and card["held_in_top1_by_head"][0] > 1.5 / 40
    return out / "heads"


SPARK_OPTIONS = TrainOptions(
    **CORPUS_OPTIONS,
    draft_vocab=DRAFT_VOCAB,
    steps=150,
    save_every=75,
    spark_block=BLOCK,
    spark_rank=RANK,
    holdout=0.25,  # several held-out sequences: the confidence head is calibrated on them
)


@pytest.fixture(scope="session")
def block_dir(tmp_path_factory, tiny_folder, tiny_corpus):
    from doppler_py.training.spark import train

    out = tmp_path_factory.mktemp("spark")
    tiny_corpus(out / "work")
    card = train(tiny_folder(TARGET), out / "block", out / "work", SPARK_OPTIONS, say=lambda _: None)
    assert card["kind"] == "spark" and card["steps"] == SPARK_OPTIONS.steps
    assert len(card["validation_top1_by_position"]) == BLOCK and card["held_in_top1_by_position"][0] > 1.5 / 40
    assert all(0 < c < 1 for c in card["held_in_confidence_by_position"])
    return out / "block"


def head_for_a_larger_vocabulary(head_dir, tmp_path) -> tuple[Path, dict]:
    """A copy of `head_dir` whose eagle.json names a target vocabulary one token larger, and that metadata."""
    wrong = tmp_path / "wrong"
    shutil.copytree(head_dir, wrong)
    meta = json.loads((wrong / "eagle.json").read_text())
    meta["target"]["vocab_size"] += 1
    (wrong / "eagle.json").write_text(json.dumps(meta))
    return wrong, meta
