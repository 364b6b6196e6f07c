"""EAGLE on a tiny model: the training tool end to end in seconds, then the head drafting on the GPU.

Exactness holds whatever the head proposes; these tests check that the GPU drafter runs the head exactly as
the trainer's torch module does (the same drafts, so the same number accepted), and that heads made for
another model are refused.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
from speculative.conftest import (
    HEAD_TARGETS,
    TARGET,
    check_drafts_follow_their_reported_rows,
    check_two_token_joint,
    compile_requests,
    held_in_prompt,
    matmul_pipelines,
    proposal_paths,
    replay_accepted,
)
from support.decode import reference_decode
from support.trained_heads import FUSED_LAYERS, head_for_a_larger_vocabulary

from doppler_py.api import load
from doppler_py.errors import GenerationOptionError, ModelFormatError, VocabularyMismatchError
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import SpeculativeEngine
from doppler_py.speculative.drafters.heads.eagle import EagleDrafter, load_head
from doppler_py.speculative.policy.confidence import ConfidenceCalibration
from doppler_py.testing.penalty_reference import penalize

torch = pytest.importorskip("torch")  # the trainer's optional dependency (installed in CI)

from doppler_py.training.data import (  # noqa: E402
    load_target,
    target_features,
)
from doppler_py.training.eagle import import_head, torch_drafts  # noqa: E402

GREEDY = SamplingParams()
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 11, 4]


KINDS = ("eagle-1", "eagle-3")  # a head without fused layers, and one with (`fused_dir`)


@pytest.fixture(scope="module")
def heads(trained_head, head_targets):
    """(kind, family="llama") → (head folder, the head loaded on that family's tiny target), each made on first
    use."""
    loaded: dict = {}

    def get(kind: str, family: str = "llama"):
        if (kind, family) not in loaded:
            folder = trained_head(kind, family)
            loaded[kind, family] = (folder, load_head(folder, head_targets(family)))
        return loaded[kind, family]

    yield get
    for _, head in loaded.values():
        head.close()


@pytest.fixture(scope="module")
def head(heads):
    return heads("eagle-1")[1]


def torch_accepted(
    head_dir, target_folder, tokens: list[int], prompt_len: int, k: int, params: SamplingParams = GREEDY
) -> int:
    """Drafts accepted when the trainer's torch head drafts (greedy, k pinned) over a known greedy output; under
    penalties each of its rows is spread over the target vocabulary and penalised by the host reference."""
    hf, _ = load_target(target_folder)
    ref, stats, draft_ids = import_head(head_dir, hf.config)
    features, _, taps = target_features(hf, [tokens], taps=stats.tap_layers)[0]
    embed = hf.get_input_embeddings().weight.detach()

    def penalised(row, context: list[int]):
        spread = np.full(hf.config.vocab_size, -np.inf, np.float32)
        spread[draft_ids] = row.numpy()
        return torch.from_numpy(penalize(spread, context, prompt_len, params)[draft_ids])

    def drafts(committed: int, n: int) -> list[int]:
        adjust = penalised if params.penalized else None
        return torch_drafts(ref, stats, draft_ids, embed, features, tokens, committed, n, taps, adjust)

    return replay_accepted(drafts, tokens, prompt_len, k)


@pytest.mark.parametrize(
    ("family", "kind", "case", "k"),
    [("llama", "eagle-1", "0", 1), ("llama", "eagle-1", "1", 3), ("llama", "eagle-1", "2", 8),
     ("llama", "eagle-1", "long", 2), ("llama", "eagle-3", "1", 3), ("llama", "eagle-3", "long", 8),
     ("qwen3_5", "eagle-1", "long", 3), ("qwen3_5", "eagle-3", "long", 8), ("gemma4", "eagle-1", "1", 3),
     ("gemma4", "eagle-3", "2", 3)],
)  # fmt: skip
def test_greedy_eagle_equals_plain_greedy_and_drafts_as_the_trainer_does(
    head_targets, heads, tiny_folder, family, kind, case, k
):
    """On Qwen 3.5 the features of the rows a step kept follow a recurrent state rolled back past the rejected
    ones; on Gemma 4 they pass per-layer inputs and KV-shared layers: both as in the trainer's torch target."""
    target = head_targets(family)
    folder, head = heads(kind, family)
    prompt = held_in_prompt(folder.parent / "work", case)
    engine = SpeculativeEngine(target, EagleDrafter(target, head))
    result = engine.generate(prompt, 40, GREEDY, k=k)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    expected = torch_accepted(folder, tiny_folder(HEAD_TARGETS[family]), prompt + result.tokens, len(prompt), k)
    assert expected > 0  # the trained head is right sometimes, so this compares something
    assert abs(result.stats.accepted - expected) <= 1, (expected, result.stats.as_dict())  # 1: a near-tie


@pytest.mark.parametrize(("kind", "k"), [("eagle-1", 3), ("eagle-3", 8)])
def test_greedy_eagle_under_penalties_drafts_as_the_trainer_does_with_penalised_rows(
    head_targets, heads, tiny_folder, kind, k
):
    """A head's row for draft i is changed as the target's row i will be (the committed tokens and drafts 0..i-1
    counted): the GPU drafter accepts what the torch head accepts when its rows are penalised so, and not what it
    accepts unpenalised. A bias lifts one draft-vocabulary token until its frequency penalty outweighs it, so
    which drafts match turns on the counts along each chain."""
    target = head_targets("llama")
    folder, head = heads(kind, "llama")
    lifted = int(head.draft_to_target[1])
    params = SamplingParams(frequency_penalty=2.0, presence_penalty=0.5, logit_bias={lifted: 9.0})
    prompt = held_in_prompt(folder.parent / "work", "long")
    engine = SpeculativeEngine(target, EagleDrafter(target, head))
    result = engine.generate(prompt, 40, params, k=k)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, params)
    answer, hf_folder = prompt + result.tokens, tiny_folder(HEAD_TARGETS["llama"])
    expected = torch_accepted(folder, hf_folder, answer, len(prompt), k, params)
    unpenalised = torch_accepted(folder, hf_folder, answer, len(prompt), k)
    assert abs(expected - unpenalised) > 1, (expected, unpenalised)  # the penalties change the head's drafts here
    assert abs(result.stats.accepted - expected) <= 1, (expected, unpenalised, result.stats.as_dict())


@pytest.mark.parametrize(
    ("family", "kind", "case", "k"),
    [("llama", "eagle-1", "1", 4), ("llama", "eagle-1", "long", 8), ("llama", "eagle-3", "long", 8),
     ("qwen3_5", "eagle-3", "long", 8), ("gemma4", "eagle-3", "long", 8)],
)  # fmt: skip
def test_greedy_eagle_trees_equal_plain_greedy(head_targets, heads, family, kind, case, k):
    """EAGLE-2's dynamic tree; after each tree step the head drafts on from the accepted path's features (and a
    fused head's tapped layers), moved into place by the engine (on Qwen 3.5, with the recurrent states' rows)."""
    target = head_targets(family)
    folder, head = heads(kind, family)
    prompt = held_in_prompt(folder.parent / "work", case)
    drafter = EagleDrafter(target, head)
    drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    result = engine.generate(prompt, 40, GREEDY, k=k)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    assert result.stats.tree_steps > 0 and result.stats.accepted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_eagle_2_trees_score_every_path_with_the_heads_own_probabilities(models, heads, head_dir, tiny_folder, kind):
    """Each node's value is its path's probability under the trainer's torch head (each token's softmax after
    the committed pairs and the head's own features down the path): the head's tree forward gives every row
    its ancestors' features, positions and keys, and no one else's."""
    target = models["target"]
    folder, head = heads(kind)
    prompt = held_in_prompt(head_dir.parent / "work", "long")
    drafter = EagleDrafter(target, head)
    drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    ctx = engine.open_context(prompt, 32, GREEDY, k=16)
    try:
        proposal = drafter.propose(ctx, 16)
    finally:
        engine.close_context(ctx)
        engine.close()
    paths = proposal_paths(proposal)
    assert proposal.count == 16 and proposal.parents is not None and max(map(len, paths)) >= 3
    hf, _ = load_target(tiny_folder(TARGET))
    ref, stats, draft_ids = import_head(folder, hf.config)
    features, _, taps = target_features(hf, [prompt], taps=stats.tap_layers)[0]
    features, tapped = stats.features(features), stats.tapped(taps)
    embed = hf.get_input_embeddings().weight.detach()
    draft_index = {int(t): i for i, t in enumerate(draft_ids)}
    m = len(prompt) - 1
    for path, log_value in paths.items():
        feats, ids, expected = features[:m], list(prompt[1:]), 0.0
        t = None if tapped is None else tapped[:m]
        with torch.no_grad():
            for token in path:
                pred, logits = ref(embed[torch.tensor(ids)][None], feats[None], None if t is None else t[None])
                expected += float(torch.log_softmax(logits[0, -1].double(), -1)[draft_index[token]])
                feats, ids = torch.cat([feats, pred[0, -1:]]), [*ids, token]
                t = None if t is None else torch.cat([t, t.new_zeros(1, t.shape[1])])  # a draft reads no taps
        assert log_value == pytest.approx(expected, abs=2e-3), path


def test_a_tree_steps_compaction_moves_the_tapped_layers_rows_with_the_final_ones(models, heads):
    """After a tree step the accepted path's rows move into place in target.x and in every tapped layer's buffer
    alike (a fused head reads both for the same positions)."""
    import numpy as np

    target = models["target"]
    engine = SpeculativeEngine(target, EagleDrafter(target, heads("eagle-3")[1]))
    buffers = target.feature_buffers
    assert len(buffers) == 1 + len(FUSED_LAYERS)
    h = target.config.hidden_size
    rows = np.arange(8 * h, dtype=np.float32).reshape(8, h)
    for b, buffer in enumerate(buffers):
        buffer.view((8, h)).write(rows + 1000 * b)
    rec = target.registry.recorder()
    engine.steps.move_feature_rows(rec, [(3, 1), (5, 2)])
    rec.submit()
    for b, buffer in enumerate(buffers):
        got = buffer.view((8, h)).numpy()
        expected = (rows + 1000 * b)[[0, 3, 5, 3, 4, 5, 6, 7]]
        np.testing.assert_array_equal(got, expected)
    engine.close()


@pytest.mark.parametrize("kind", KINDS)
def test_plain_steps_batched_while_speculation_pauses_keep_every_feature_for_the_head(models, heads, head_dir, kind):
    """While the policy pauses speculation, its plain steps go several to a submit; the head must still get
    every verified row's feature (and tapped layers' outputs), so it drafts exactly as when they go one per
    submit."""
    target = models["target"]
    head = heads(kind)[1]
    prompt = held_in_prompt(head_dir.parent / "work", "long")
    runs = {}
    for batched in (True, False):
        engine = SpeculativeEngine(target, EagleDrafter(target, head))
        observe = engine.policy.observe
        batches = []

        def pause_after_each_step(drafted, accepted, observe=observe, policy=engine.policy):
            observe(drafted, accepted)
            policy.pause_steps = 5

        engine.policy.observe = pause_after_each_step

        def counted(ctx, k, step=engine.steps.step, batches=batches, plain_steps=1, **options):
            if plain_steps > 1:
                batches.append(plain_steps)
            return step(ctx, k, plain_steps=plain_steps, **options)

        engine.steps.step = counted
        if not batched:
            engine._paused_batch = lambda remaining: 1
        result = engine.generate(prompt, 40, GREEDY, k=3)
        engine.close()
        runs[batched] = (result.tokens, result.stats.drafted, result.stats.accepted, batches)
    assert runs[True][0] == runs[False][0] == reference_decode(target, prompt, 40, GREEDY)
    assert runs[True][1:3] == runs[False][1:3] and runs[True][2] > 0  # the same drafts, the same acceptance
    assert max(runs[True][3]) > 1 and not runs[False][3]


def test_adaptive_greedy_eagle_ends_chains_by_confidence_and_equals_plain_greedy(models, heads, head_dir):
    """Unpinned, the engine prices steps, so the head reads back its confidence in each draft and ends its chain
    at the first that does not pay; the engine verifies the best leading run. The text never changes."""
    target = models["target"]
    head = heads("eagle-1")[1]
    prompt = held_in_prompt(head_dir.parent / "work", "long")
    drafter = EagleDrafter(target, head)
    engine = SpeculativeEngine(target, drafter)
    # Costs as a GPU's (each row adds 5% of a plain step, a draft 1%), held fixed: not the test machine's timing.
    engine.policy.costs.verify.update({rows: 1.0 + 0.05 * (rows - 1) for rows in range(1, 10)})
    engine.policy.costs.draft_per_token = 0.01
    engine._price = lambda outcome, times: None
    proposals = []
    propose = drafter.propose
    drafter.propose = lambda ctx, k: proposals.append(propose(ctx, k)) or proposals[-1]
    result = engine.generate(prompt, 40, GREEDY)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    assert proposals and all(p.values is not None and len(p.values) == p.count for p in proposals)
    for p in proposals:
        assert all(1 >= a >= b > 0 for a, b in zip(p.values, p.values[1:], strict=False))  # values fall along a chain
    assert drafter.calibration.trials.sum() > ConfidenceCalibration().trials.sum()  # verified drafts were read
    assert result.stats.accepted > 0 and len({p.count for p in proposals}) > 1, result.stats.k_history


def test_an_answer_that_crosses_the_compile_gate_switches_to_speculation_and_stays_exact(models, heads, head_dir):
    """`auto`'s pair on an engine that weighs its compile (`warmup="auto"` on a CPU adapter): the answer begins
    plainly, the gate opens mid-answer (here after three weighings), the compile starts (waited for here until its
    first row counts are done, so the switch comes at a known step), and the drafter joins the answer under way:
    the head from the last step's rows. It drafts from there on, and greedy output is plain decoding's."""
    from doppler_py.speculative import PromptLookupDrafter
    from doppler_py.speculative.drafters.best_of import BestOfDrafter

    target = models["target"]
    prompt = held_in_prompt(head_dir.parent / "work", "long")
    pair = BestOfDrafter(PromptLookupDrafter(), EagleDrafter(target, heads("eagle-1")[1]))
    engine = SpeculativeEngine(target, pair, capacity=2)  # row tiles 1, 2 and 4: less to compile
    weighed = []

    def pays(target, rows, *, tokens, plain_token_s, speedup, drafter):
        weighed.append((tuple(rows), plain_token_s))
        return len(weighed) > 3, 30.0, 0.5

    def first_rows_compiled(rows, start_warmup=engine.start_warmup):
        warmup = start_warmup(rows)
        while warmup.compiled_rows < 2 and not warmup.done.wait(0.01):
            pass
        return warmup

    engine.readiness.compile_pays = pays
    engine.start_warmup = first_rows_compiled
    # Costs as a GPU's (each row adds 5% of a plain step), held fixed: not the test machine's timing; plain steps
    # are still timed, for the weighing.
    engine.prepare(costs={rows: 1.0 + 0.05 * (rows - 1) for rows in engine.verify_rows()}, background=True, weigh=True)
    engine._price = lambda outcome, times: engine._observe_plain(times.total_s) if not outcome.drafted else None
    try:
        result = engine.generate(prompt, 40, GREEDY)
    finally:
        engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, GREEDY)
    stats = result.stats
    assert weighed[0][1] is None and all(t for _, t in weighed[1:])
    # The one-draft row counts open after three weighings; the rest, weighed once they are done, opens at once.
    assert [rows for rows, _ in weighed][:4] == [(1, 2)] * 4 and [rows for rows, _ in weighed][4:] in ([], [(1, 2, 3)])
    assert 0 < stats.joined_at < 40 and stats.warmup_steps == stats.joined_at and stats.drafted > 0


def test_drafts_that_cannot_pay_become_plain_steps(models, heads, head_dir):
    """Where verifying a second row costs ten plain steps, no chain is worth its first draft: every step is cut
    to a plain one, and the head still consumes every row."""
    target = models["target"]
    head = heads("eagle-1")[1]
    prompt = held_in_prompt(head_dir.parent / "work", "long")
    drafter = EagleDrafter(target, head)
    engine = SpeculativeEngine(target, drafter)
    engine.policy.costs.verify.update({1: 0.001, 2: 10.0})
    observed = []
    observe = drafter.calibration.observe
    drafter.calibration.observe = lambda confidences, hits: (
        observed.append(len(confidences)) or observe(confidences, hits)
    )
    result = engine.generate(prompt, 30, GREEDY)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 30, GREEDY)
    assert result.stats.steps == 0 and result.stats.plain_steps == 30
    assert observed == [1] * 29  # every step but the last (nothing drafts past the budget) made its first draft


@pytest.mark.slow
def test_chains_ended_by_confidence_keep_the_target_joint_distribution(models, head):
    """The stopping rule reads only the head's own drafts, so sampled output stays exact. (A seeded generation
    never gates, so its tokens do not depend on timing; this drafter is told to gate anyway.)"""

    class Gated(EagleDrafter):
        def propose(self, ctx, k):
            ctx.worth_drafting = lambda values: values[-1] >= 0.3
            return super().propose(ctx, k)

    check_two_token_joint(models["target"], Gated(models["target"], head), new_tokens=4, k=3)


@pytest.mark.slow
def test_sampled_eagle_over_a_recurrent_state_keeps_the_target_joint_distribution(head_targets, heads):
    """On Qwen 3.5 the head's GPU-sampled drafts are verified over a recurrent state that must forget the rows
    verification rejected, and the head drafts on from the kept rows' features: the joint is still the target's."""
    target = head_targets("qwen3_5")
    _, head = heads("eagle-1", "qwen3_5")
    check_two_token_joint(target, EagleDrafter(target, head), new_tokens=3, k=2)


def test_sampled_drafts_follow_the_rows_they_report(models, head, monkeypatch):
    drafter = EagleDrafter(models["target"], head)
    assert check_drafts_follow_their_reported_rows(models["target"], drafter, monkeypatch)["sampled"] > 0


@pytest.mark.parametrize("family", list(HEAD_TARGETS))
def test_sampled_eagle_is_reproducible_by_seed(head_targets, heads, family):
    target = head_targets(family)
    engine = SpeculativeEngine(target, EagleDrafter(target, heads("eagle-1", family)[1]))
    runs = [engine.generate(PROMPT, 20, SamplingParams(temperature=0.8, seed=s), k=3).tokens for s in (5, 5, 6)]
    engine.close()
    assert runs[0] == runs[1] != runs[2]


def test_a_head_for_another_model_is_refused(head_dir, models, tmp_path):
    wrong, meta = head_for_a_larger_vocabulary(head_dir, tmp_path)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 49 "):
        load_head(wrong, models["target"])
    meta["target"]["vocab_size"] -= 1
    meta["target"]["hidden_size"] = 128
    (wrong / "eagle.json").write_text(json.dumps(meta))
    with pytest.raises(ModelFormatError, match="hidden size 128,"):
        load_head(wrong, models["target"])
    (wrong / "eagle.json").unlink()
    with pytest.raises(ModelFormatError, match="not an EAGLE head"):
        load_head(wrong, models["target"])


def test_a_fused_head_whose_layers_or_tensors_do_not_fit_is_refused(fused_dir, models, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(fused_dir, wrong)
    meta = json.loads((wrong / "eagle.json").read_text())
    for taps in ([0, 4], [1, 1], ["2"]):  # the tiny target has layers 0..3
        (wrong / "eagle.json").write_text(json.dumps(meta | {"feature_taps": taps}))
        with pytest.raises(ModelFormatError, match=r"eagle\.json: feature_taps"):
            load_head(wrong, models["target"])
    (wrong / "eagle.json").write_text(json.dumps(meta | {"feature_taps": [0, 1, 2]}))  # 3 taps, weights for 2
    with pytest.raises(ModelFormatError, match=r"eagle\.safetensors: tensor fc_taps\.weight has shape"):
        load_head(wrong, models["target"])


def test_a_truncated_head_file_names_the_file(head_dir, models, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(head_dir, broken)
    data = (broken / "eagle.safetensors").read_bytes()
    (broken / "eagle.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelFormatError, match=r"eagle\.safetensors"):
        load_head(broken, models["target"])


@pytest.mark.slow
def test_the_api_drafts_with_a_head_for_eagle_and_auto_and_stays_exact(head_dir, tiny_folder):
    prompt = [{"role": "user", "content": "tell me about rivers"}]
    with load(tiny_folder(TARGET), weights="f32", draft_head=head_dir, progress=False, warmup="now") as engine:
        plain = engine.generate(prompt, max_tokens=30)
        eagle = engine.generate(prompt, max_tokens=30, speculative="eagle", k=3)
        auto = engine.generate(prompt, max_tokens=30, speculative="auto")
    assert eagle.tokens == plain.tokens == auto.tokens
    assert eagle.speculative == "eagle" and eagle.drafted > 0
    assert auto.speculative == "eagle+prompt-lookup"


def test_the_compile_hook_covers_every_matmul_of_the_head(models, heads, monkeypatch):
    """The engine's warm-up runs `compile`: each of the head's matmuls (input projections, its layer, its LM head)
    that it missed and the target had not compiled would compile mid-generation, timed as a step's cost."""
    drafter = EagleDrafter(models["target"], heads("eagle-1")[1])
    assert matmul_pipelines(drafter, drafter.head.model.linears()) <= compile_requests(drafter, monkeypatch)


@pytest.mark.parametrize("kind", KINDS)
def test_a_head_for_a_block_quantised_target_runs_the_targets_own_pipelines(tiny_model, trained_head, kind):
    """A head loaded for a q4_1 target takes its format (`dense_format`): its layer, its LM head and its input
    projections (the fused layers' too) run matmul pipelines the target's own steps compile, so on a CPU adapter
    it adds none (issue 65: the f16 head's own pipelines were 16 of `auto`'s 26)."""
    target = tiny_model(TARGET, "q4_1", max_rows=32, max_positions=256)
    head = load_head(trained_head(kind, "llama"), target)
    drafter = EagleDrafter(target, head)
    try:
        rows = (1, 2, 4, 8)
        targets = {linear.pipeline_key(n) for linear in target.linears() for n in rows if n <= linear.max_rows}
        assert len(drafter.matmuls()) == 2 + len(head.tap_layers) + len(head.model.linears())
        assert {op.pipeline_key(n) for op in drafter.matmuls() for n in rows if n <= op.max_rows} <= targets
        assert head.model.weights.layers[0].down.format == "q4_1" == drafter.fc_feature.weight.format
    finally:
        drafter.close()
        head.close()


def test_auto_s_pair_declares_the_heads_taps_and_pipelines_and_chains_only(models, heads, monkeypatch):
    """What `auto` runs (`BestOfDrafter`: prompt lookup or the head, per step) declares for the whole: the fused
    head's target layers are tapped for it, its pipelines compile with the engine's, and it drafts chains."""
    from doppler_py.model.transformer import Transformer
    from doppler_py.speculative import PromptLookupDrafter
    from doppler_py.speculative.drafters.best_of import BestOfDrafter

    target = models["target"]
    head = heads("eagle-3")[1]
    untapped = Transformer(target.weights, target.registry, max_rows=target.max_rows, max_positions=64)
    pair = BestOfDrafter(PromptLookupDrafter(), EagleDrafter(untapped, head))
    assert pair.feature_taps == FUSED_LAYERS and not pair.gates_chains and pair.tree_branches == 1
    compiled = []
    monkeypatch.setattr(EagleDrafter, "compile", lambda drafter, max_rows=None: compiled.append(drafter))
    engine = SpeculativeEngine(untapped, pair)
    try:
        assert sorted(untapped.taps) == list(FUSED_LAYERS)
        engine.prepare(costs={1: 1.0, 2: 1.5})
        assert compiled == [pair.head]
    finally:
        engine.close()
        untapped.close()


def test_eagle_without_a_head_says_how_to_get_one(tiny_folder):
    with load(tiny_folder(TARGET), weights="f32", progress=False, warmup="now") as engine:
        assert engine.heads == {}  # no head is shipped for a tiny model
        with pytest.raises(GenerationOptionError, match="train-draft"):
            engine.generate("hi", max_tokens=4, speculative="eagle")
        assert engine.generate("hi", max_tokens=4, speculative="auto").speculative == "prompt-lookup"


def test_a_head_made_with_another_tokenizer_is_refused_at_load(head_dir, tiny_folder, tmp_path):
    wrong = tmp_path / "wrong"
    shutil.copytree(head_dir, wrong)
    meta = json.loads((wrong / "eagle.json").read_text())
    meta["target"]["tokenizer_sha256"] = "0" * 64
    (wrong / "eagle.json").write_text(json.dumps(meta))
    with pytest.raises(VocabularyMismatchError, match="another tokenizer"):
        load(tiny_folder(TARGET), weights="f32", draft_head=wrong, progress=False)


@pytest.mark.parametrize("tree", [False, True], ids=["chains", "trees"])
def test_greedy_eagle_with_penalties_equals_plain_decoding_with_host_penalties(head_targets, heads, tree):
    """Penalties and a bias on every row the head's chains or EAGLE-2 trees put before the target (each row with
    the drafts on its own path), against plain decoding that applies them on the host token by token."""
    target = head_targets("llama")
    folder, head = heads("eagle-1")
    prompt = held_in_prompt(folder.parent / "work", "1")
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.5, repeat_last_n=8, logit_bias={5: 0.5})
    drafter = EagleDrafter(target, head)
    if tree:
        drafter.branches = drafter.tree_branches
    engine = SpeculativeEngine(target, drafter)
    result = engine.generate(prompt, 40, params, k=4)
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 40, params)
    assert result.tokens != reference_decode(target, prompt, 40, GREEDY), "the penalties change nothing"
    assert result.stats.accepted > 0 and (result.stats.tree_steps > 0) == tree
