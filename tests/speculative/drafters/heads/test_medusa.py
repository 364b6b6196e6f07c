"""Medusa on a tiny model: the trainer end to end in seconds, then the heads drafting on the GPU.

Exactness holds whatever the heads propose; these tests check that the GPU drafter runs the heads exactly as
the trainer's torch module does (the same drafts, so the same number accepted), and that heads made for
another model, or broken files, are refused with typed errors.
"""

from __future__ import annotations

import json
import shutil

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

from doppler_py.api import load
from doppler_py.errors import ModelFormatError, VocabularyMismatchError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import SpeculativeEngine
from doppler_py.speculative.drafters.heads.medusa import MedusaDrafter, load_medusa

torch = pytest.importorskip("torch")  # the trainer's optional dependency (installed in CI)

from doppler_py.training.data import TrainOptions, load_target, target_features  # noqa: E402
from doppler_py.training.medusa import import_heads  # noqa: E402

GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def family_heads(trained_head, head_targets):
    """family → (its tiny target, Medusa heads trained on it and loaded there), each loaded on first use."""
    loaded: dict = {}

    def get(family: str):
        if family not in loaded:
            target = head_targets(family)
            loaded[family] = (target, load_medusa(trained_head("medusa", family), target))
        return loaded[family]

    yield get
    for _, heads in loaded.values():
        heads.close()


@pytest.fixture(scope="module")
def heads(family_heads):
    return family_heads("llama")[1]


def torch_accepted(heads_dir, target_folder, tokens: list[int], prompt_len: int, k: int) -> int:
    """Drafts accepted when the trainer's torch heads draft (greedy, k pinned) over a known greedy output."""
    hf, _ = load_target(target_folder)
    ref, draft_ids = import_heads(heads_dir)
    with torch.no_grad():
        logits = ref(hf.model.norm(target_features(hf, [tokens])[0][0]))  # [K, T, N]

    def drafts(committed: int, n: int) -> list[int]:  # from the row that produced tokens[committed - 1]
        n = min(n, logits.shape[0])
        return [int(draft_ids[int(logits[j, committed - 2].argmax())]) for j in range(n)]

    return replay_accepted(drafts, tokens, prompt_len, k)


@pytest.mark.parametrize(
    ("family", "case", "k"),
    [("llama", "0", 1), ("llama", "1", 2), ("llama", "2", 8), ("llama", "long", 3), ("qwen3_5", "long", 3),
     ("gemma4", "long", 3)],
)  # fmt: skip
def test_greedy_medusa_equals_plain_greedy_and_drafts_as_the_trainer_does(
    family_heads, trained_head, tiny_folder, family, case, k
):
    target, heads = family_heads(family)
    heads_dir = trained_head("medusa", family)
    prompt = held_in_prompt(heads_dir.parent / "work", case)
    engine = SpeculativeEngine(target, MedusaDrafter(target, heads))
    result = engine.generate(prompt, 40, GREEDY, k=k)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    assert result.stats.drafted > 0 and max(len(result.stats.acceptance_by_position), 1) <= 3  # k capped at K
    expected = torch_accepted(heads_dir, tiny_folder(HEAD_TARGETS[family]), prompt + result.tokens, len(prompt), k)
    assert expected > 0  # the trained heads are right sometimes, so this compares something
    assert abs(result.stats.accepted - expected) <= 1, (expected, result.stats.as_dict())  # 1: a near-tie


@pytest.mark.parametrize(("family", "k"), [("llama", 2), ("llama", 5), ("llama", 8), ("qwen3_5", 5), ("gemma4", 5)])
def test_greedy_medusa_trees_equal_plain_greedy(family_heads, trained_head, family, k):
    """Each head's best tokens, by the acceptance measured per head and rank: the same tokens as plain decoding,
    through trees (a budget of 2 already branches: the tiny heads' second token beats two heads' first)."""
    target, heads = family_heads(family)
    heads_dir = trained_head("medusa", family)
    drafter = MedusaDrafter(target, heads)
    drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    for case in ("0", "long"):
        prompt = held_in_prompt(heads_dir.parent / "work", case)
        result = engine.generate(prompt, 40, GREEDY, k=k)
        assert result.tokens == reference_decode(target, prompt, 40, GREEDY), case
        assert result.stats.tree_steps > 0 and drafter.branching.acceptance.seen[0] > 0
    engine.close()


def test_an_unpinned_tree_verifies_the_node_budget_the_policy_chooses(models, heads, heads_dir, monkeypatch):
    """The engine cuts a best-first tree to `policy.tree_budget`'s leading nodes unless k is pinned."""
    import doppler_py.speculative.policy.draft_length as policy_module

    asked = []
    monkeypatch.setattr(policy_module, "tree_budget", lambda values, costs, least=1: asked.append(len(values)) or 2)
    target = models["target"]
    drafter = MedusaDrafter(target, heads)
    drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    engine.policy.costs.verify.update({1: 1.0e-3, 17: 1.0e-3})  # so that the first step drafts k = START_K
    prompt = held_in_prompt(heads_dir.parent / "work", "long")
    adaptive = engine.generate(prompt, 40, GREEDY)
    pinned = engine.generate(prompt, 40, GREEDY, k=6)
    engine.close()
    assert adaptive.tokens == pinned.tokens == reference_decode(target, prompt, 40, GREEDY)
    assert asked and max(asked) > 2 and len(adaptive.stats.acceptance_by_position) <= 2
    assert pinned.stats.drafted > 2 * pinned.stats.steps  # pinned: the whole budget, never asked


@pytest.mark.parametrize("tree", [False, True])
def test_sampled_drafts_follow_the_rows_they_report(models, heads, tree, monkeypatch):
    """Chains: each draft sampled from the row the verifier reads; trees: nodes that ignore the random stream."""
    drafter = MedusaDrafter(models["target"], heads)
    if tree:
        drafter.branches = drafter.tree_branches
    seen = check_drafts_follow_their_reported_rows(models["target"], drafter, monkeypatch)
    assert seen["sampled"] > 0 and (seen["trees"] > 0) == tree


def test_sampled_medusa_is_reproducible_by_seed(models, heads):
    target = models["target"]
    engine = SpeculativeEngine(target, MedusaDrafter(target, heads))
    prompt = [3, 17, 5, 9, 3, 17, 5, 22, 40, 11, 4]
    runs = [engine.generate(prompt, 20, SamplingParams(temperature=0.8, seed=s), k=3).tokens for s in (5, 5, 6)]
    engine.close()
    assert runs[0] == runs[1] != runs[2]


def test_the_api_loads_both_kinds_of_head_and_medusa_stays_exact(heads_dir, tiny_folder, tmp_path):
    pytest.importorskip("transformers")
    from doppler_py.training.eagle import train as train_eagle

    eagle_dir = tmp_path / "eagle"
    options = TrainOptions(seed_prompts=4, max_new_tokens=8, draft_vocab=40, steps=2)
    train_eagle(tiny_folder(TARGET), eagle_dir, heads_dir.parent / "work", options, say=lambda _: None)
    prompt = [{"role": "user", "content": "tell me about rivers"}]
    with load(
        tiny_folder(TARGET), weights="f32", draft_head=[heads_dir, eagle_dir], progress=False, warmup="now"
    ) as engine:
        assert sorted(engine.heads) == ["eagle", "medusa"]
        plain = engine.generate(prompt, max_tokens=30)
        medusa = engine.generate(prompt, max_tokens=30, speculative="medusa", k=2)
        medusa_tree = engine.generate(prompt, max_tokens=30, speculative="medusa", tree=True, k=4)
        assert engine.last_result.stats["tree_steps"] > 0
        auto = engine.generate(prompt, max_tokens=30, speculative="auto")
    assert medusa.tokens == plain.tokens == auto.tokens == medusa_tree.tokens
    assert medusa.speculative == "medusa" and medusa.drafted > 0
    assert auto.speculative == "eagle+prompt-lookup"  # EAGLE first when both are there


def test_the_compile_hook_covers_every_matmul_of_the_heads(models, heads, monkeypatch):
    """The engine's warm-up runs `compile`: the heads' f16 matmuls compiled mid-generation without it."""
    drafter = MedusaDrafter(models["target"], heads)
    assert matmul_pipelines(drafter) <= compile_requests(drafter, monkeypatch)


def test_heads_for_another_model_or_broken_files_are_refused(heads_dir, models, tiny_folder, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(heads_dir, wrong)
    meta = json.loads((wrong / "medusa.json").read_text())
    meta["target"]["vocab_size"] += 1
    (wrong / "medusa.json").write_text(json.dumps(meta))
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 49 "):
        load_medusa(wrong, models["target"])
    meta["target"]["vocab_size"] -= 1
    meta["heads"] = 5
    (wrong / "medusa.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFormatError, match=r"resblock\.weight has shape \(3, 64, 64\), expected \(5, 64, 64\)"):
        load_medusa(wrong, models["target"])
    meta["heads"] = 3
    (wrong / "medusa.json").write_text(json.dumps(meta))
    data = (wrong / "medusa.safetensors").read_bytes()
    (wrong / "medusa.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"medusa\.safetensors"):
        load_medusa(wrong, models["target"])
    (wrong / "medusa.json").unlink()
    with pytest.raises(ModelFormatError, match="not a draft head folder"):
        load(tiny_folder(TARGET), weights="f32", draft_head=wrong, progress=False)
