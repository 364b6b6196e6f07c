"""The EAGLE trainer on the tiny target: its stages, resuming and continuing, cached features, the hold-out, and
the evaluation tool against the drafts the trainer's torch module makes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.tiny_specs import TARGET
from support.trained_heads import EAGLE_OPTIONS as OPTIONS
from support.trained_heads import FUSED_LAYERS, head_for_a_larger_vocabulary

from doppler_py.errors import GenerationOptionError, ModelFormatError, VocabularyMismatchError
from doppler_py.sampling import SamplingParams

torch = pytest.importorskip("torch")  # the trainer's optional dependency (installed in CI)

from doppler_py.training.data import (  # noqa: E402
    TrainOptions,
    cached_features,
    load_target,
    save_features,
    split,
    target_features,
)
from doppler_py.training.eagle import import_head, train, unrolled  # noqa: E402

GREEDY = SamplingParams()
KINDS = ("eagle-1", "eagle-3")


def test_training_resumes_from_its_stages(head_dir, tiny_folder, tmp_path):
    """A second run over the same work folder regenerates nothing, records no stage time, and picks up the
    checkpoint."""
    work = head_dir.parent / "work"
    lines = {name: (work / name).read_text() for name in ("prompts.jsonl", "answers.jsonl", "stage_times.json")}
    said: list[str] = []
    card = train(tiny_folder(TARGET), tmp_path / "again", work, OPTIONS, say=said.append)
    assert {name: (work / name).read_text() for name in lines} == lines
    assert f"train: resumed at step {OPTIONS.steps}" in said and "features: reused from features.pt" in said
    assert card["held_in_top1"] > 0.15  # chance is 1/40
    assert card["validation_sequences"] == 1 and 0 <= card["validation_top1"] <= 1
    chains = card["validation_chains"]  # chains of k from every greedy answer position held out
    depth = chains["accepted_by_depth"]
    assert chains["k"] == len(depth) and chains["anchors"] > 0 and depth == sorted(depth, reverse=True)
    assert chains["tokens_per_forward"] == pytest.approx(1 + sum(depth), abs=1e-3)


@pytest.mark.parametrize("kind", KINDS)
def test_training_time_test_drafts_as_the_head_does_after_a_verification(request, head_dir, tiny_folder, kind):
    """The trainer's unrolled steps: row a of step j is exactly the head's j-th draft from anchor a, run one
    draft at a time over the true pairs up to a and its own outputs after (the GPU drafter's KV cache)."""
    hf, _ = load_target(tiny_folder(TARGET))
    folder = request.getfixturevalue("head_dir" if kind == "eagle-1" else "fused_dir")
    head, stats, _ = import_head(folder, hf.config)
    record = json.loads((head_dir.parent / "work" / "answers.jsonl").read_text().splitlines()[0])
    ids = torch.tensor(record["prompt_ids"] + record["answer_ids"])
    features, _, taps = target_features(hf, [ids.tolist()], taps=stats.tap_layers)[0]
    emb, s = hf.get_input_embeddings().weight.detach()[ids[1:]], stats.features(features[:-1])
    tapped = None if taps is None else stats.tapped(taps)[:-1]
    n, steps = emb.shape[0], 4

    def run(tokens, feats, a: int):  # a drafted position reads no taps: zeros
        if tapped is None:
            return head(tokens[None], feats[None])
        t = torch.cat([tapped[: a + 1], tapped.new_zeros(len(feats) - a - 1, tapped.shape[1])])
        return head(tokens[None], feats[None], t[None])

    with torch.no_grad():
        rows = unrolled(head, emb, s, steps, tapped)
        assert [out.shape[0] for out, _ in rows] == [n - j for j in range(steps)]
        for a in (0, 3, n // 2, n - steps):
            feats, tokens = s[: a + 1], emb[: a + 1]
            out, logits = run(tokens, feats, a)
            for j in range(steps):
                assert torch.allclose(rows[j][0][a], out[0, -1], atol=1e-4, rtol=1e-4)
                assert torch.allclose(rows[j][1][a], logits[0, -1], atol=1e-4, rtol=1e-4)
                if j + 1 < steps:
                    feats, tokens = torch.cat([feats, out[0, -1:]]), torch.cat([tokens, emb[a + j + 1 : a + j + 2]])
                    out, logits = run(tokens, feats, a)


def test_use_prompts_trains_on_the_first_prompts_and_answers_no_more(head_dir, tiny_folder, tmp_path):
    """`use_prompts` (a long answers stage spread over sessions): only the first N prompts are answered and
    trained on; the answers already made for later prompts stay in the file for later runs."""
    work = tmp_path / "work"
    shutil.copytree(head_dir.parent / "work", work)
    (work / "eagle.pt").unlink()
    answers = (work / "answers.jsonl").read_text()
    options = TrainOptions(**{**OPTIONS.__dict__, "use_prompts": 10, "steps": 2})
    card = train(tiny_folder(TARGET), tmp_path / "head", work, options, say=lambda _: None)
    assert card["prompts"] == card["sequences"] == 10 and card["validation_sequences"] == 1
    assert (work / "answers.jsonl").read_text() == answers


def continue_head(head_dir, tiny_folder, tmp_path, out: str, **changes) -> dict:
    """Train on a copy of `head_dir`'s work folder with `changes` to OPTIONS (e.g. init_from)."""
    work = tmp_path / "work"
    if not work.exists():
        shutil.copytree(head_dir.parent / "work", work)
    options = TrainOptions(**{**OPTIONS.__dict__, **changes})
    return train(tiny_folder(TARGET), tmp_path / out, work, options, say=lambda _: None)


def test_training_continues_a_head_folder_with_its_vocabulary_and_statistics(head_dir, tiny_folder, tmp_path):
    """`init_from`: the head starts where the folder's head stopped (0 steps give its very tensors back), keeps
    its draft vocabulary and feature statistics, and trains on from there (a few small steps move its weights a
    little; a fresh head's are elsewhere entirely)."""
    from safetensors.numpy import load_file

    same = continue_head(head_dir, tiny_folder, tmp_path, "same", init_from=str(head_dir), steps=0)
    for name in ("model.safetensors", "eagle.safetensors"):
        assert (tmp_path / "same" / name).read_bytes() == (head_dir / name).read_bytes()
    assert same["continued_from"]["head"] == str(head_dir) and same["continued_from"]["steps"] == OPTIONS.steps
    continue_head(head_dir, tiny_folder, tmp_path, "on", init_from=str(head_dir), steps=3, lr=1e-4)
    assert (tmp_path / "work" / f"eagle-from-{head_dir.name}.pt").is_file()
    (tmp_path / "work" / "eagle.pt").unlink()  # else the fresh run resumes the folder's own finished checkpoint
    continue_head(head_dir, tiny_folder, tmp_path, "fresh", steps=3)

    def moved(folder) -> float:
        """The largest change of any weight of `folder`'s head against the head it continued."""
        a, b = load_file(str(head_dir / "model.safetensors")), load_file(str(folder / "model.safetensors"))
        return max(float(abs(a[k].astype("f4") - b[k].astype("f4")).max()) for k in a)

    assert 0 < moved(tmp_path / "on") < 0.01 < moved(tmp_path / "fresh")
    _, stats, ids = import_head(tmp_path / "on", load_target(tiny_folder(TARGET))[0].config)
    _, stats0, ids0 = import_head(head_dir, load_target(tiny_folder(TARGET))[0].config)
    assert ids.tolist() == ids0.tolist() and torch.equal(stats.mean, stats0.mean) and torch.equal(stats.std, stats0.std)


def test_continuing_refuses_another_targets_head_or_a_moved_hold_out(head_dir, tiny_folder, tmp_path):
    wrong, _ = head_for_a_larger_vocabulary(head_dir, tmp_path)
    with pytest.raises(VocabularyMismatchError, match="vocabulary of 49 "):
        continue_head(head_dir, tiny_folder, tmp_path, "a", init_from=str(wrong), steps=0)
    with pytest.raises(GenerationOptionError, match=r"hold-out 0.05, this run holds out 0.1"):
        continue_head(head_dir, tiny_folder, tmp_path, "b", init_from=str(head_dir), steps=0, holdout=0.1)
    with pytest.raises(GenerationOptionError, match="fuses layers \\[\\]"):
        continue_head(head_dir, tiny_folder, tmp_path, "c", init_from=str(head_dir), steps=0, feature_taps=(0,))
    (wrong / "training_card.json").unlink()
    with pytest.raises(ModelFormatError, match=r"training_card\.json"):
        continue_head(head_dir, tiny_folder, tmp_path, "d", init_from=str(wrong), steps=0)


def test_features_are_cached_per_sequence_so_appended_prompts_are_computed_alone(tmp_path):
    sequences = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    data = [(torch.full((len(s), 2), float(i)), torch.tensor(s), None) for i, s in enumerate(sequences)]
    save_features(data, sequences, tmp_path / "features.pt", "m")
    found = cached_features([[4, 5], [10, 11], *sequences], tmp_path / "features.pt", "m")
    assert found[1] is None and [f[0, 0].item() for f, _, _ in (found[0], *found[2:])] == [1.0, 0.0, 1.0, 2.0]
    assert all(f is None for f in cached_features(sequences, tmp_path / "features.pt", "another model"))
    assert all(f is None for f in cached_features(sequences, tmp_path / "missing.pt", "m"))
    # Taps asked for and not stored: every sequence is computed again; stored for other layers: the same.
    assert all(f is None for f in cached_features(sequences, tmp_path / "features.pt", "m", taps=(1,)))
    tapped = [(f, a, torch.full((len(a), 1, 2), 7.0)) for f, a, _ in data]
    save_features(tapped, sequences, tmp_path / "features.pt", "m", taps=(1,))
    found = cached_features(sequences, tmp_path / "features.pt", "m", taps=(1,))
    assert [t[0, 0, 0].item() for _, _, t in found] == [7.0] * 3
    assert all(f is None for f in cached_features(sequences, tmp_path / "features.pt", "m", taps=(2,)))


def test_held_out_sequences_stay_held_out_as_prompts_are_appended():
    train, valid = split(100, 0.05)
    assert valid == [19, 39, 59, 79, 99] and sorted(train + valid) == list(range(100))
    assert set(valid) <= set(split(180, 0.05)[1]) and split(10, 0.05) == (list(range(9)), [9])
    assert split(1, 0.05) == ([0], [])


def test_features_in_padded_batches_equal_one_sequence_at_a_time(tiny_folder):
    """The features stage batches sequences of similar length (right-padded); each sequence's features and
    argmax must be those of running it alone (to float rounding: a batched matmul sums in another order),
    whatever the lengths and batch budget."""
    hf, _ = load_target(tiny_folder(TARGET))
    gen = torch.Generator().manual_seed(3)
    lengths = [1, 2, 7, 7, 13, 31, 40, 5, 29]
    sequences = [torch.randint(hf.config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    alone = target_features(hf, sequences, batch_tokens=1, taps=FUSED_LAYERS)
    for (_, _, taps), sequence in zip(alone, sequences, strict=True):  # a tap: HF's hidden_states[layer + 1]
        with torch.no_grad():
            states = hf(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        for t, layer in enumerate(FUSED_LAYERS):
            torch.testing.assert_close(taps[:, t].float(), states[layer + 1][0], atol=2e-3, rtol=2e-3)
    for budget in (41, 100, 10_000):
        batched = target_features(hf, sequences, batch_tokens=budget)
        for (f, a, _), (f1, _, _), n in zip(batched, alone, lengths, strict=True):
            assert f.shape[0] == a.shape[0] == n
            torch.testing.assert_close(f, f1, atol=1e-4, rtol=1e-4)
        same = torch.cat([a == a1 for (_, a, _), (_, a1, _) in zip(batched, alone, strict=True)])
        assert int((~same).sum()) <= 1  # a near-tie may flip under rounding; a padding leak would flip many


def test_eval_head_counts_every_answer_token_once_and_matches_the_trainers_drafts(head_dir, tiny_folder):
    """tools/eval_head.py's simulation: each verifying forward adds its accepted drafts + 1 token, chains of at
    most k, and over a held-in answer the head is right sometimes (so the tool measures something)."""
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "tools"))
    from eval_head import simulate

    hf, _ = load_target(tiny_folder(TARGET))
    head, stats, draft_ids = import_head(head_dir, hf.config)
    record = json.loads((head_dir.parent / "work" / "answers.jsonl").read_text().splitlines()[1])
    tokens, start = record["prompt_ids"] + record["answer_ids"], len(record["prompt_ids"])
    features = target_features(hf, [tokens])[0][0]
    embed = hf.get_input_embeddings().weight.detach()
    accepted = simulate(head, stats, draft_ids, embed, features, tokens, start, 3)
    assert sum(a + 1 for a in accepted) == len(tokens) - start and max(accepted) <= 3 and sum(accepted) > 0
