"""Structured output through the step on the tiny target (its character tokenizer, 35 of its 48 ids): every
verified row masked by the grammar, refused drafts cut, forced tokens drafted by the step. Greedy output equals
a host reference that masks each row itself, for every proposal shape (plain, host chain, GPU chain with draft
logits, host trees, lookahead's fixed trees); sampled output follows the target's joint distribution
renormalised over the allowed tokens (a GPU-sampled chain and a deterministic tree)."""

from __future__ import annotations

import re
import threading

import pytest
from speculative.conftest import TARGET, check_two_token_joint
from support.decode import reference_decode

from doppler_py.constraints.grammar import regex_constraint
from doppler_py.constraints.matcher import GrammarMatcher
from doppler_py.constraints.tokenizer_bridge import ll_tokenizer
from doppler_py.sampling import SamplingParams
from doppler_py.speculative.batch import StepBatch
from doppler_py.speculative.contract import NoOpHooks, Proposal, StepContext
from doppler_py.speculative.drafters.draft_model import DraftModelDrafter
from doppler_py.speculative.drafters.lookahead import LookaheadDrafter
from doppler_py.speculative.drafters.prompt_lookup import PromptLookupDrafter
from doppler_py.speculative.engine import SpeculativeEngine
from doppler_py.speculative.stats import SpecStats
from doppler_py.tokenizer import Tokenizer

GREEDY = SamplingParams()
# "ab" is forced at the start (drafted by the step), then a choice the model makes, then an end.
PATTERN = r"ab(c|d)[a-e ]{2,14}!"
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tiny_folder):
    return Tokenizer.from_dir(tiny_folder(TARGET))


def matcher_for(tokenizer, pattern: str = PATTERN) -> GrammarMatcher:
    ll = ll_tokenizer(tokenizer)
    return GrammarMatcher(ll, regex_constraint(pattern, tokenizer=ll), TARGET.vocab_size)


def prompt_ids(tokenizer) -> list[int]:
    return tokenizer.encode("abcab dab! abd ec!", add_special_tokens=False)  # repeats for lookup to find


DRAFTERS = {
    "none": lambda models: None,
    "prompt-lookup": lambda models: PromptLookupDrafter(min_ngram=1),
    "prompt-lookup-tree": lambda models: PromptLookupDrafter(min_ngram=1, branches=4),
    "draft-model": lambda models: DraftModelDrafter(models["draft"], TARGET.vocab_size),
    "lookahead": lambda models: LookaheadDrafter(models["target"]),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_constrained_output_equals_the_masked_reference(models, tokenizer, drafter):
    target, prompt = models["target"], prompt_ids(tokenizer)
    expected = reference_decode(target, prompt, 24, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine = SpeculativeEngine(target, DRAFTERS[drafter](models))
    result = engine.generate(prompt, 24, GREEDY, k=4, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine.close()
    assert result.tokens == expected
    text = tokenizer.decode([t for t in result.tokens if t != EOS])
    if result.tokens[-1] == EOS:
        assert re.fullmatch(PATTERN, text), text
    else:
        assert any(re.fullmatch(PATTERN, text + tail) for tail in ("a!", "!", "aa!"))  # a prefix of the language
    if drafter != "none":  # the forced "ab" came as drafts of the step's own, all accepted
        assert result.stats.forced_tokens >= 2 and result.stats.accepted >= result.stats.forced_tokens


def test_a_drafter_continues_the_forced_tokens_in_the_same_step(models, tokenizer):
    """Prompt lookup proposes nothing of its own here, only continuations of what the grammar forces (the prompt
    holds "ab" followed by text the model may write): those are verified behind the forced tokens in one step, and
    the output is still the reference's."""

    class ContinueOnly(PromptLookupDrafter):
        def propose(self, ctx: StepContext, k: int) -> Proposal:
            return Proposal(0)

    target, prompt = models["target"], prompt_ids(tokenizer)
    expected = reference_decode(target, prompt, 24, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine = SpeculativeEngine(target, ContinueOnly(min_ngram=1))
    result = engine.generate(prompt, 24, GREEDY, k=4, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine.close()
    assert result.tokens == expected
    assert result.stats.forced_tokens >= 2
    assert result.stats.drafted > result.stats.forced_tokens  # drafts behind the forced ones


def test_forced_tokens_after_a_continuation_join_the_same_step(models, tokenizer, monkeypatch):
    """ "ab" is forced, lookup continues it with "cab" (the prompt's), then the grammar forces "xy": one proposal
    holds all three runs, and the output is still the masked reference's."""
    pattern = r"ab(cab|dab)ee [a-e ]{2,8}!"
    target, prompt = models["target"], prompt_ids(tokenizer)
    expected = reference_decode(target, prompt, 20, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer, pattern))
    engine = SpeculativeEngine(target, PromptLookupDrafter(min_ngram=1))
    proposals = []
    make = engine._forced_proposal
    monkeypatch.setattr(engine, "_forced_proposal", lambda *args: proposals.append(make(*args)) or proposals[-1])
    result = engine.generate(prompt, 20, GREEDY, k=8, stop_ids=[EOS], grammar=matcher_for(tokenizer, pattern))
    engine.close()
    assert result.tokens == expected
    # The forced "ab", lookup's next letter(s) from the prompt, then what the grammar forces after them.
    assert re.match(r"ab(cab|dab)ee ", tokenizer.decode(list(proposals[0].tokens))), proposals[0]
    assert proposals[0].forced == len(tokenizer.encode("ab", add_special_tokens=False))


@pytest.fixture(scope="module")
def merging_tokenizer(tmp_path_factory):
    """The tiny target's characters plus one merge, "ab" (id 35 of its 48): a forced "a" may then open "ab", so
    llguidance does not force the token "a"; it is only the likely spelling of the forced byte."""
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as Backend

    from doppler_py.testing.tiny import SMALL_CHARSET, SPECIAL_TOKENS

    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *SMALL_CHARSET, "ab"])}
    backend = Backend(models.BPE(vocab=vocab, merges=[("a", "b")]))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    folder = tmp_path_factory.mktemp("merging-tokenizer")
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text('{"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}')
    return Tokenizer.from_dir(folder)


def test_the_rest_of_the_forced_bytes_is_drafted_as_its_likely_spelling(models, merging_tokenizer, monkeypatch):
    """Each word opens with a forced "a" that the model may write as "a" or inside "ab": the step drafts "a" (not
    forced, `Proposal.spelled`) with lookup's continuation behind it, and the output is still the masked reference's
    whichever spelling the model takes. Lookup proposes nothing of its own here, so every step it is told of was
    the grammar's: it must hear of none as its drafts accepted (a drafter with state would run ahead)."""

    class ContinueOnly(PromptLookupDrafter):
        def propose(self, ctx: StepContext, k: int) -> Proposal:
            return Proposal(0)

        def commit(self, ctx: StepContext, accepted: int) -> None:
            commits.append(accepted)

    commits: list[int] = []
    pattern = r"(a[bcd] ){3,5}!"
    tokenizer, target = merging_tokenizer, models["target"]
    prompt = tokenizer.encode("ab ac ad ac ab !", add_special_tokens=False)
    grammar = lambda: matcher_for(tokenizer, pattern)  # noqa: E731
    spelled_a = grammar()
    assert spelled_a.forced_tokens() == [] and spelled_a.forced_spelling() == tokenizer.encode("a")
    expected = reference_decode(target, prompt, 16, GREEDY, stop_ids=[EOS], grammar=grammar())
    engine = SpeculativeEngine(target, ContinueOnly(min_ngram=1))
    proposals = []
    make = engine._forced_proposal
    monkeypatch.setattr(engine, "_forced_proposal", lambda *args: proposals.append(make(*args)) or proposals[-1])
    result = engine.generate(prompt, 16, GREEDY, k=4, stop_ids=[EOS], grammar=grammar())
    engine.close()
    assert result.tokens == expected
    spellings = [p for p in proposals if p.forced == 0 and p.spelled >= 1]
    assert spellings and any(p.count > p.spelled for p in spellings)  # lookup continued a spelling in one step
    assert commits and set(commits) == {0}


def test_drafts_the_grammar_refuses_are_cut_before_verification(models, tokenizer):
    """A drafter that always proposes "z", which the grammar never allows: each proposal is cut to nothing (a plain
    step), so only the grammar's forced tokens are ever verified as drafts, and the output is the reference's."""
    z = tokenizer.encode("z", add_special_tokens=False)[0]

    class Refused(NoOpHooks):
        name = "refused"

        def propose(self, ctx: StepContext, k: int) -> Proposal:
            return Proposal(k, [z] * k)

    target, prompt = models["target"], prompt_ids(tokenizer)
    engine = SpeculativeEngine(target, Refused())
    result = engine.generate(prompt, 16, GREEDY, k=3, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine.close()
    assert result.tokens == reference_decode(target, prompt, 16, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    stats = result.stats
    assert stats.made > stats.drafted == stats.accepted == stats.forced_tokens >= 2


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["none", "draft-model", "prompt-lookup-tree"])
def test_sampled_constrained_output_keeps_the_renormalised_joint_distribution(models, tokenizer, drafter):
    """Plain steps, a GPU-sampled chain and a deterministic tree. Skipping the mask at drafted rows fails here: the
    matcher refuses the token such a row let through when the step commits it."""
    pattern = r"[a-h]{2}[a-z]*!"  # the first two tokens: 8 allowed of 48
    grammar = lambda: matcher_for(tokenizer, pattern)  # noqa: E731
    prompt = tuple(tokenizer.encode("abc abd ab", add_special_tokens=False))
    trees = check_two_token_joint(models["target"], DRAFTERS[drafter](models), prompt, new_tokens=4, grammar=grammar)
    assert (trees > 0) == (drafter == "prompt-lookup-tree")


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup", "prompt-lookup-tree", "draft-model"])
def test_greedy_constrained_output_with_penalties_equals_the_reference(models, tokenizer, drafter):
    """Penalties and a bias before the grammar's mask (a bias on an allowed token, a ban on another), on every
    shape: the reference penalises each row on the host, then masks it."""
    target, prompt = models["target"], prompt_ids(tokenizer)
    a, c = tokenizer.encode("a", add_special_tokens=False)[0], tokenizer.encode("c", add_special_tokens=False)[0]
    params = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3, logit_bias={a: 1.5, c: -100.0})
    expected = reference_decode(target, prompt, 24, params, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    assert expected != reference_decode(target, prompt, 24, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine = SpeculativeEngine(target, DRAFTERS[drafter](models))
    result = engine.generate(prompt, 24, params, k=4, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    engine.close()
    assert result.tokens == expected
    assert c not in result.tokens  # banned, so the grammar's "ab(c|d)" takes d


@pytest.mark.parametrize("drafter", ["none", "prompt-lookup"])
def test_in_one_batch_a_grammar_masks_only_its_own_sequences_rows(models, tokenizer, drafter):
    """A constrained generation and an unconstrained one on the same prompt, their steps in one forward
    (`StepBatch`): each equals its solo reference, so the grammar's masks touch only its own sequence's rows (the
    unconstrained answer writes what the grammar refuses, so a mask on its rows would change it)."""
    target, prompt = models["target"], prompt_ids(tokenizer)
    constrained = reference_decode(target, prompt, 20, GREEDY, stop_ids=[EOS], grammar=matcher_for(tokenizer))
    free = reference_decode(target, prompt, 20, GREEDY)
    assert not re.fullmatch(r"[a-e !]*", tokenizer.decode(free))  # what the grammar would never allow
    batch = StepBatch(target)
    engines = [SpeculativeEngine(target, DRAFTERS[drafter](models), batch=batch) for _ in range(2)]
    outputs: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    both_started = threading.Barrier(2, timeout=60)

    def run(i: int) -> None:
        grammar, stop = (matcher_for(tokenizer), [EOS]) if i == 0 else (None, [])
        try:
            steps = engines[i].iter_generate(prompt, 20, GREEDY, stats=SpecStats(), k=3, stop_ids=stop, grammar=grammar)
            for n, new in enumerate(steps):
                if n == 0:
                    both_started.wait()  # their next steps share forwards
                outputs[i] += new
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    for engine in engines:
        engine.close()
    shared = sum(n for size, n in batch.sizes.items() if size > 1)
    batch.close()
    assert not errors, errors
    assert outputs == [constrained, free]
    assert shared > 0  # their steps did share forwards
