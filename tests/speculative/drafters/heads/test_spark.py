"""Spark, the block drafter, on a tiny model: the GPU block against a numpy reference of its math (random
weights), the trainer end to end in seconds, exactness greedy and sampled, the confidence head's cut, and
refusals of heads made for another model or broken files."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from speculative.conftest import (
    HEAD_TARGETS,
    TARGET,
    check_drafts_follow_their_reported_rows,
    compile_requests,
    held_in_prompt,
    matmul_pipelines,
    replay_accepted,
)
from support.decode import reference_decode
from support.trained_heads import BLOCK, DRAFT_VOCAB, RANK

from doppler_py.api import load
from doppler_py.errors import ModelFormatError, VocabularyMismatchError
from doppler_py.rng import Mulberry32
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import SpeculativeEngine
from doppler_py.speculative.contract import StepContext
from doppler_py.speculative.drafters.heads.files import made_for
from doppler_py.speculative.drafters.heads.spark import SparkDrafter, load_spark

GREEDY = SamplingParams()


def write_random_head(folder, target, rng) -> dict[str, np.ndarray]:
    """A spark folder with random weights (large enough that every term matters); returns its tensors."""
    from safetensors.numpy import save_file

    h, n = target.config.hidden_size, DRAFT_VOCAB
    tensors = {
        "resblock.weight": rng.normal(0, 0.2, (BLOCK, h, h)),
        "resblock.bias": rng.normal(0, 0.2, (BLOCK, h)),
        "lm_head.weight": rng.normal(0, 0.3, (n, h)),
        "prev.embed": rng.normal(0, 1.0, (n + 1, RANK)),
        "prev.proj": rng.normal(0, 1.0, (n, RANK)),
        "confidence.weight": rng.normal(0, 0.2, (BLOCK, h)),
        "confidence.bias": rng.normal(0, 0.5, BLOCK),
    }
    tensors = {name: t.astype(np.float32) for name, t in tensors.items()}
    tensors["draft_to_target"] = rng.permutation(target.config.vocab_size)[:n].astype(np.int64)
    folder.mkdir()
    save_file(tensors, str(folder / "spark.safetensors"))
    meta = {"kind": "spark", "block": BLOCK, "rank": RANK, "target": made_for(target.config, None), "draft_vocab": n}
    (folder / "spark.json").write_text(json.dumps(meta))
    return tensors


def reference_block(t: dict[str, np.ndarray], feature, norm_weight, eps: float, prevs: list[int], vocab: int):
    """numpy, float64: each position's logits over the draft vocabulary given the token before it (`prevs`),
    and the confidences c_i."""
    f = feature.astype(np.float64)
    h = f / np.sqrt(np.mean(f * f) + eps) * norm_weight
    n = t["draft_to_target"].size
    slots = np.full(vocab, n)
    slots[t["draft_to_target"]] = np.arange(n)
    rows = []
    for i, prev in enumerate(prevs):
        gate = t["resblock.weight"][i] @ h + t["resblock.bias"][i]
        y = h + gate / (1 + np.exp(-gate))
        rows.append(t["lm_head.weight"] @ y + t["prev.proj"] @ t["prev.embed"][slots[prev]])
    confidence = 1 / (1 + np.exp(-(t["confidence.weight"] @ h + t["confidence.bias"])))
    return rows, confidence


@pytest.mark.parametrize("k", [1, 2, 3, 8])
def test_the_gpu_block_drafts_what_the_reference_math_gives(models, tmp_path, rng, k):
    target = models["target"]
    tensors = write_random_head(tmp_path / "spark", target, rng)
    head = load_spark(tmp_path / "spark", target)
    drafter = SparkDrafter(target, head)
    prompt = [3, 17, 5, 9, 22, 40, 11]
    cache = target.new_cache(32)
    try:
        target.forward(prompt[:-1], cache, 0, logits="none")
        h = target.config.hidden_size
        feature = target.x.numpy().reshape(-1, h)[len(prompt) - 2]
        ctx = StepContext(list(prompt), target, cache, GREEDY, Mulberry32(0), 64, hidden_rows=len(prompt) - 1)
        proposal = drafter.propose(ctx, k)
        depth = min(k, BLOCK)
        assert proposal.count == depth and proposal.on_gpu
        drafts = proposal.tokens.numpy()[:depth].tolist()
    finally:
        drafter.close()
        head.close()
        target.release_cache(cache)
    norm = target.weights.norm.numpy().reshape(-1)[:h]
    # The reference follows the GPU's own drafts as each next position's previous token, and accepts a pick
    # within float rounding of the best.
    rows, confidence = reference_block(
        tensors, feature, norm, target.config.rms_norm_eps, [prompt[-1], *drafts[:-1]], target.config.vocab_size
    )
    for i, row in enumerate(rows):
        slot = int(np.flatnonzero(tensors["draft_to_target"] == drafts[i])[0])
        assert row[slot] >= row.max() - 1e-4 * max(1.0, abs(row.max())), f"position {i}"
    np.testing.assert_allclose(proposal.values, np.cumprod(confidence[:depth]), rtol=1e-4)


torch = pytest.importorskip("torch")  # the trainer's optional dependency (installed in CI)

from doppler_py.training.data import load_target, target_features  # noqa: E402
from doppler_py.training.spark import import_block, prev_slots  # noqa: E402


@pytest.fixture(scope="module")
def family_blocks(trained_head, head_targets):
    """family → (its tiny target, a spark block trained on it and loaded there), each loaded on first use."""
    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            target = head_targets(family)
            loaded[family] = (target, load_spark(trained_head("spark", family), target))
        return loaded[family]

    yield get
    for _, block in loaded.values():
        block.close()


@pytest.fixture(scope="module")
def block(family_blocks):
    return family_blocks("llama")[1]


def torch_accepted(block_dir, target_folder, tokens: list[int], prompt_len: int, k: int) -> int:
    """Drafts accepted when the trainer's torch block drafts (greedy, k pinned, all verified) over a known
    greedy output: position i's previous token is the draft before it, as on the GPU."""
    hf, _ = load_target(target_folder)
    ref, draft_ids = import_block(block_dir)
    n = draft_ids.size
    slot = {int(t): s for s, t in enumerate(draft_ids)}
    with torch.no_grad():
        h = hf.model.norm(target_features(hf, [tokens])[0][0])

    def drafts(committed: int, count: int) -> list[int]:  # from the row that produced tokens[committed - 1]
        out, prev = [], tokens[committed - 1]
        for i in range(min(count, BLOCK)):
            slots = torch.full((BLOCK, h.shape[0]), n, dtype=torch.long)
            slots[i, committed - 2] = slot.get(prev, n)
            with torch.no_grad():
                logits, _ = ref(h, slots)
            prev = int(draft_ids[int(logits[i, committed - 2].argmax())])
            out.append(prev)
        return out

    return replay_accepted(drafts, tokens, prompt_len, k)


@pytest.mark.parametrize(
    ("family", "case", "k"),
    [("llama", "0", 1), ("llama", "1", 2), ("llama", "2", 8), ("llama", "long", 3), ("qwen3_5", "long", 3),
     ("gemma4", "long", 3)],
)  # fmt: skip
def test_greedy_spark_equals_plain_greedy_and_drafts_as_the_trainer_does(
    family_blocks, trained_head, tiny_folder, family, case, k
):
    target, block = family_blocks(family)
    block_dir = trained_head("spark", family)
    prompt = held_in_prompt(block_dir.parent / "work", case)
    engine = SpeculativeEngine(target, SparkDrafter(target, block))
    result = engine.generate(prompt, 40, GREEDY, k=k)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    assert result.stats.drafted > 0 and max(len(result.stats.acceptance_by_position), 1) <= BLOCK
    expected = torch_accepted(block_dir, tiny_folder(HEAD_TARGETS[family]), prompt + result.tokens, len(prompt), k)
    assert expected > 0  # the trained block is right sometimes, so this compares something
    assert abs(result.stats.accepted - expected) <= 1, (expected, result.stats.as_dict())  # 1: a near-tie


def test_the_compile_hook_covers_every_matmul_of_the_block_drafter(models, block, monkeypatch):
    """The engine's warm-up runs `compile`: the head's f16 matmuls compiled mid-generation without it."""
    drafter = SparkDrafter(models["target"], block)
    assert matmul_pipelines(drafter) <= compile_requests(drafter, monkeypatch)


def test_prev_slots_are_the_target_choices_before_each_position():
    from types import SimpleNamespace

    corpus = SimpleNamespace(draft_ids=[7, 3, 9], to_draft=torch.full((12,), -100, dtype=torch.long))
    corpus.to_draft[torch.tensor([7, 3, 9])] = torch.tensor([0, 1, 2])
    slots = prev_slots(corpus, torch.tensor([3, 9, 5, 7]), 2)
    assert slots.tolist() == [[1, 2, 3, 0], [2, 3, 0, 3]]  # 5 is outside the draft vocabulary: slot 3


def test_unpinned_the_confidence_head_decides_how_much_is_verified(models, block, block_dir, monkeypatch):
    import doppler_py.speculative.policy.draft_length as policy_module

    asked = []
    monkeypatch.setattr(policy_module, "tree_budget", lambda values, costs, least=1: asked.append(list(values)) or 1)
    target = models["target"]
    engine = SpeculativeEngine(target, SparkDrafter(target, block))
    engine.policy.costs.verify.update({1: 1.0e-3, 17: 1.0e-3})
    prompt = held_in_prompt(block_dir.parent / "work", "long")
    adaptive = engine.generate(prompt, 30, GREEDY)
    pinned = engine.generate(prompt, 30, GREEDY, k=3)
    engine.close()
    assert adaptive.tokens == pinned.tokens == reference_decode(target, prompt, 30, GREEDY)
    assert asked and all(np.all(np.diff(values) <= 0) and 0 < values[0] < 1 for values in asked)
    assert len(adaptive.stats.acceptance_by_position) == 1  # every step verified the one draft asked for
    assert pinned.stats.drafted > pinned.stats.steps  # pinned: the whole block


def test_sampled_drafts_follow_the_rows_they_report(models, block, monkeypatch):
    drafter = SparkDrafter(models["target"], block)
    assert check_drafts_follow_their_reported_rows(models["target"], drafter, monkeypatch)["sampled"] > 0


def test_the_api_runs_a_spark_head_and_refuses_broken_ones(block_dir, models, tiny_folder, tmp_path):
    prompt = [{"role": "user", "content": "tell me about rivers"}]
    with load(tiny_folder(TARGET), weights="f32", draft_head=block_dir, progress=False, warmup="now") as engine:
        assert sorted(engine.heads) == ["spark"]
        plain = engine.generate(prompt, max_tokens=30)
        spark = engine.generate(prompt, max_tokens=30, speculative="spark", k=3)
        assert engine.generate(prompt, max_tokens=30, speculative="auto").speculative == "spark+prompt-lookup"
    assert spark.tokens == plain.tokens and spark.speculative == "spark" and spark.drafted > 0
    wrong = tmp_path / "wrong"
    shutil.copytree(block_dir, wrong)
    meta = json.loads((wrong / "spark.json").read_text())
    meta["target"]["vocab_size"] += 1
    (wrong / "spark.json").write_text(json.dumps(meta))
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 49 "):
        load_spark(wrong, models["target"])
    meta["target"]["vocab_size"] -= 1
    for field, value, match in (("rank", 48, "multiple of 32"), ("block", 0, "positive integer")):
        (wrong / "spark.json").write_text(json.dumps(meta | {field: value}))
        with pytest.raises(ModelFormatError, match=match):
            load_spark(wrong, models["target"])
    (wrong / "spark.json").write_text(json.dumps(meta | {"rank": 64}))
    with pytest.raises(ModelFormatError, match=r"prev\.embed must have shape"):
        load_spark(wrong, models["target"])
    (wrong / "spark.json").write_text(json.dumps(meta))
    data = (wrong / "spark.safetensors").read_bytes()
    (wrong / "spark.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"spark\.safetensors"):
        load_spark(wrong, models["target"])
