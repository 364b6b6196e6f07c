"""Qwen 3.5 (Gated DeltaNet layers between gated attention layers) on a tiny random model: greedy decoding against HF,
and speculation over a recurrent state, which rejected drafts must not move (ops/linear_attention.py).

The logits themselves are checked against HF in test_forward_vs_hf.py (every TINY_SPECS model), the kernels against
numpy in tests/kernels/test_linear_attention.py. Here: whole generations, every kind of rollback a step makes
(a chain cut at each length, a tree's side path, plain steps sharing a submit), the sampled output's distribution,
and what a hybrid model refuses.
"""

from __future__ import annotations

import pytest
from model.test_forward_vs_hf import hf_greedy
from speculative.conftest import check_two_token_joint
from support.decode import reference_decode

from doppler_py.errors import CapacityError, UnsupportedModelError
from doppler_py.ops.linear_attention import RecurrentState
from doppler_py.sampling import SamplingParams
from doppler_py.speculative import DraftModelDrafter, LayerSkipDrafter, PromptLookupDrafter
from doppler_py.speculative.contract import NO_PROPOSAL, NoOpHooks, Proposal
from doppler_py.speculative.drafters.lookahead import LookaheadDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.testing.tiny import TINY_SPECS, draft_spec

NAME = "qwen3_5-hybrid"
GREEDY = SamplingParams(temperature=0.0)
PROMPT = [3, 17, 5, 9, 3, 17, 5, 22, 40, 3, 17, 5, 9, 1, 30, 3, 17]
NEW = 40


@pytest.fixture(scope="module")
def hybrid(tiny_model, named_folder):
    return tiny_model(named_folder(NAME), "f32", max_rows=32)


@pytest.fixture(scope="module")
def plain(hybrid):
    return reference_decode(hybrid, PROMPT, NEW, GREEDY)


def test_greedy_tokens_match_transformers_for_64_tokens(hybrid, named_folder, reference):
    assert reference_decode(hybrid, PROMPT, 64, GREEDY) == hf_greedy(named_folder(NAME), PROMPT, 64)


class CutChainOracle(NoOpHooks):
    """Proposes the greedy answer with the draft at `cut` wrong, `cut` cycling through 0..k, so the steps keep
    every number of rows from 1 (the root alone) to k + 1."""

    name = "cut-chain-oracle"

    def __init__(self, answer: list[int], prompt_len: int, vocab: int):
        self.answer, self.prompt_len, self.vocab, self.steps = answer, prompt_len, vocab, 0
        self.accepted: set[int] = set()

    def propose(self, ctx, k):
        done = len(ctx.tokens) - self.prompt_len
        ids = list(self.answer[done : done + k])
        if not ids:
            return NO_PROPOSAL
        cut = self.steps % (k + 1)
        self.steps += 1
        if cut < len(ids):
            ids[cut] = (ids[cut] + 1) % self.vocab
        return Proposal(len(ids), ids)

    def commit(self, ctx, accepted):
        self.accepted.add(accepted)


def test_a_chain_cut_at_every_length_rolls_the_state_back(hybrid, plain):
    drafter = CutChainOracle(plain, len(PROMPT), hybrid.config.vocab_size)
    engine = SpeculativeEngine(hybrid, drafter)
    try:
        result = engine.generate(PROMPT, NEW, GREEDY, k=4)
    finally:
        engine.close()
    assert result.tokens == plain
    assert drafter.accepted >= {0, 1, 2, 3, 4}


@pytest.mark.parametrize(
    "drafter, k",
    [
        ("prompt-lookup", 4),
        ("prompt-lookup", None),  # the policy's k: plain steps share submits, each committing the one before
        ("prompt-lookup-tree", 6),
        ("lookahead", None),
        ("draft-model", 4),
        ("draft-tree", 6),
        ("layer-skip", 4),  # drafts on the target's own states, which come back before the verification
        ("self-draft", 4),  # a hybrid draft model: its states come back after drafting, its accepted tokens re-fed
    ],
)
def test_greedy_speculative_equals_plain_greedy(hybrid, plain, tiny_model, drafter, k):
    draft = tiny_model(draft_spec(hybrid.config.vocab_size, 3), max_rows=32)
    make = {
        "prompt-lookup": lambda: PromptLookupDrafter(),
        "prompt-lookup-tree": lambda: PromptLookupDrafter(branches=4),
        "lookahead": lambda: LookaheadDrafter(hybrid),
        "draft-model": lambda: DraftModelDrafter(draft, hybrid.config.vocab_size),
        "draft-tree": lambda: DraftModelDrafter(draft, hybrid.config.vocab_size, branches=2),
        "layer-skip": lambda: LayerSkipDrafter(hybrid, 2),
        "self-draft": lambda: DraftModelDrafter(hybrid, hybrid.config.vocab_size),
    }
    engine = SpeculativeEngine(hybrid, make[drafter]())
    try:
        result = engine.generate(PROMPT, NEW, GREEDY, k=k)
    finally:
        engine.close()
    assert result.tokens == plain
    assert result.stats.steps > 0, "nothing was ever drafted"
    if drafter == "self-draft":  # drafts from states that came back exactly are the target's own tokens
        assert result.stats.accepted == result.stats.drafted


def test_two_token_joint_distribution_matches_the_target(hybrid, tiny_model):
    draft = tiny_model(draft_spec(hybrid.config.vocab_size, 3), max_rows=32)
    check_two_token_joint(hybrid, DraftModelDrafter(draft, hybrid.config.vocab_size))


def test_the_joint_test_fails_when_rejected_rows_stay_in_the_state(hybrid, tiny_model, monkeypatch):
    """The mutation the joint test must catch: every verified row committed, rejected ones included."""
    draft = tiny_model(draft_spec(hybrid.config.vocab_size, 3), max_rows=32)
    rows_kept = RecurrentState.rows_kept

    def keep_every_row(self, start_pos):
        rows_kept(self, start_pos)
        return self.pending[1] if self.pending is not None else 0

    monkeypatch.setattr(RecurrentState, "rows_kept", keep_every_row)
    with pytest.raises(AssertionError):
        check_two_token_joint(hybrid, DraftModelDrafter(draft, hybrid.config.vocab_size))


def test_a_forward_behind_the_committed_state_is_refused(hybrid):
    cache = hybrid.new_cache(32)
    try:
        hybrid.forward(PROMPT[:8], cache, 0, logits="none")
        hybrid.forward(PROMPT[8:10], cache, 8, logits="none")  # keeps all 8 rows of the first forward
        cache.truncate(4)
        with pytest.raises(CapacityError, match="keeps no history"):
            hybrid.forward(PROMPT[4:6], cache, 4)
        with pytest.raises(UnsupportedModelError, match="hybrid"):
            cache.fork()
    finally:
        hybrid.release_cache(cache)


def test_the_tiny_model_is_a_hybrid():
    spec = TINY_SPECS[NAME]
    assert "linear_attention" in spec.hybrid_pattern and "full_attention" in spec.hybrid_pattern


def test_the_language_model_of_an_image_text_checkpoint_loads_as_the_text_model(
    hybrid, named_folder, tmp_path, tiny_model
):
    """Qwen 3.5's released checkpoints are image-text models: the text_config and the weights under
    model.language_model. load as the text model; the vision tower's weights are left alone."""
    import json

    from safetensors.numpy import load_file, save_file

    folder = named_folder(NAME)
    text = json.loads((folder / "config.json").read_text())
    config = {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": {**text, "model_type": "qwen3_5_text"},
        "vision_config": {"depth": 1},
        "tie_word_embeddings": False,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    weights = {
        (name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name): value
        for name, value in load_file(folder / "model.safetensors").items()
    }
    weights["model.visual.patch_embed.proj.weight"] = weights["lm_head.weight"][:4]
    save_file(weights, str(tmp_path / "model.safetensors"))
    image_text = tiny_model(tmp_path, "f32", max_rows=32)
    assert image_text.config.weights_prefix == "model.language_model."
    assert reference_decode(image_text, PROMPT, 16, GREEDY) == reference_decode(hybrid, PROMPT, 16, GREEDY)


def test_a_chats_next_turn_takes_the_whole_last_sequence_and_a_part_of_it_nothing(hybrid):
    """A recurrent state exists only at its sequence's end: an entry is hit by a prompt extending all of it (with
    the state copied), never by a shorter shared prefix. Output with the hit equals output without."""
    from doppler_py.model.prefix_cache import PrefixCache

    engine = SpeculativeEngine(hybrid, PromptLookupDrafter())
    engine.prefix_cache = PrefixCache(hybrid, 64 << 20)
    try:
        first = engine.generate(PROMPT, 12, GREEDY).tokens
        next_turn = PROMPT + first + [5, 9, 3]
        result = engine.generate(next_turn, 12, GREEDY)
        assert result.stats.cached_tokens == len(PROMPT) + len(first) - 1
        assert result.tokens == reference_decode(hybrid, next_turn, 12, GREEDY)
        other = PROMPT + first[:4] + [7, 7, 7]  # shares 21 tokens with the entries, all of neither
        result = engine.generate(other, 8, GREEDY)
        assert result.stats.cached_tokens == 0
        assert result.tokens == reference_decode(hybrid, other, 8, GREEDY)
    finally:
        engine.prefix_cache.clear()
        engine.close()
