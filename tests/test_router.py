"""The A3M-shaped router (`doppler_py.router`): every method, on a tiny model (no heads: eagle, medusa and spark
are unavailable there) and on SmolLM2 with its shipped heads (all four types available)."""

from __future__ import annotations

import pytest

from doppler_py.errors import GenerationOptionError
from doppler_py.router import (
    DRAFT_TYPES,
    SpeculationResult,
    SpeculativeDecoding,
    SpeculativeDecodingWrapper,
    parameter_count,
)
from doppler_py.speculative.policy.draft_length import CostModel
from doppler_py.testing.tiny import TinySpec

PROMPT = "abcabdabcab"


@pytest.fixture(scope="module")
def tiny_engine(tiny_folder):
    from doppler_py.api import load

    with load(
        tiny_folder(TinySpec(num_hidden_layers=2, seed=5)), weights="f32", progress=False, warmup="now"
    ) as engine:
        yield engine


def plain_tokens(engine, prompt, n: int) -> list[int]:
    return engine.generate(prompt, max_tokens=n, speculative=None, chat=False).tokens


def test_only_the_types_this_model_can_draft_with_are_offered(tiny_engine):
    router = SpeculativeDecoding(tiny_engine)
    assert [t for t in DRAFT_TYPES if router.get_draft_model(t) is not None] == ["lookahead"]
    record = router.get_draft_model("lookahead")
    spec = tiny_engine.speculative_engine("lookahead")
    assert record.mode == "lookahead" and record.supported_windows == tuple(range(1, spec.capacity + 1))
    assert record.measured_windows and all(w in record.supported_windows for w in record.measured_windows)
    assert all(seconds > 0 for seconds in record.measured_windows.values())
    assert router.supports_speculative_decoding() and router.supports_speculative_decoding("lookahead")
    assert not router.supports_speculative_decoding("eagle") and not router.supports_speculative_decoding("spark")
    with pytest.raises(GenerationOptionError, match="draft type must be one of"):
        router.get_draft_model("n-gram")


def test_the_decision_follows_measured_costs_and_acceptance(tiny_engine):
    router = SpeculativeDecoding(tiny_engine, draft_model_type="eagle")
    assert not router.should_use() and not router.should_use(force_enable=True)  # no eagle head here
    assert router.get_recommended_window() == 0
    router.update_config(draft_model_type="lookahead")
    policy = tiny_engine.speculative_engine("lookahead").policy
    saved = (policy.costs, policy.fixed, policy.k, policy.tokens_per_step)
    try:
        policy.fixed, policy.k = True, 16
        policy.costs = CostModel(verify={1: 1.0, 17: 6.0})  # CPU-like: 17 rows cost 6 plain steps
        policy.tokens_per_step = 2.0
        assert not router.should_use() and router.get_recommended_window() == 0
        assert router.should_use(force_enable=True) and not router.should_use(force_enable=False)
        policy.costs = CostModel(verify={1: 1.0, 17: 1.3})  # GPU-like
        assert router.should_use() and router.get_recommended_window() == 16
        router.update_config(enabled=False)
        assert not router.should_use() and router.should_use(force_enable=True)
    finally:
        policy.costs, policy.fixed, policy.k, policy.tokens_per_step = saved


def test_a_window_is_recommended_only_for_the_loaded_model(tiny_engine):
    router = SpeculativeDecoding(tiny_engine, draft_model_type="lookahead")
    size = parameter_count(tiny_engine.model.config)
    assert router.get_recommended_window(size) == router.get_recommended_window()
    with pytest.raises(GenerationOptionError, match="not the loaded model's"):
        router.get_recommended_window(7_000_000_000)


def test_parameter_count_matches_smollm2s_published_size():
    from doppler_py.model.config import ModelConfig

    smollm2 = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 49152,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "tie_word_embeddings": True,
    }
    assert parameter_count(ModelConfig.from_dict(smollm2)) == pytest.approx(134_515_008, rel=1e-3)


def test_a_draft_by_hand_is_verified_once_and_continues_like_plain_decoding(tiny_engine):
    router = SpeculativeDecoding(tiny_engine, draft_model_type="lookahead", speculation_window=16)
    ids = tiny_engine.encode_prompt(PROMPT)
    plain = plain_tokens(tiny_engine, PROMPT, 17)
    draft = router.generate_draft(ids)
    assert draft.window == 16 and 0 < len(draft.tokens) <= 16 and draft.parents is not None
    verified = router.verify_draft(draft)
    assert verified.drafted == len(draft.tokens)
    assert verified.tokens == plain[: verified.accepted + 1]
    with pytest.raises(GenerationOptionError, match="verified or replaced"):
        router.verify_draft(draft)
    older = router.generate_draft(PROMPT, window=3)
    newer = router.generate_draft(PROMPT, window=3)
    with pytest.raises(GenerationOptionError, match="verified or replaced"):
        router.verify_draft(older)
    assert router.verify_draft(newer).tokens[0] == plain[0]
    router.update_config(draft_model_type="spark")
    with pytest.raises(GenerationOptionError, match="not usable"):
        router.generate_draft(PROMPT)


def test_the_wrapper_generates_the_plain_text_and_reports_what_it_measured(tiny_engine):
    router = SpeculativeDecoding(tiny_engine, draft_model_type="lookahead", speculation_window=16)
    wrapper = SpeculativeDecodingWrapper(tiny_engine, router)
    plain = tiny_engine.generate(PROMPT, max_tokens=24, speculative=None, chat=False)
    text, result = wrapper.generate(PROMPT, 24, use_spec_dec=True, chat=False)
    assert text == plain.text and result.used and result.draft_tokens > 0
    assert 0 <= result.accepted_tokens <= result.draft_tokens
    assert result.acceptance_rate == pytest.approx(result.accepted_tokens / result.draft_tokens)
    text, off = wrapper.generate(PROMPT, 24, use_spec_dec=False, chat=False)
    assert text == plain.text and not off.used and off.draft_tokens == 0 and off.estimated_time_saved == 0.0
    assert router.calculate_speedup(off) == 1.0
    # A3M's way: the wrapper makes its router from a partial config; settings beside a router are refused.
    configured = SpeculativeDecodingWrapper(tiny_engine, draft_model_type="lookahead", enabled=False)
    assert configured.router.get_config()["draft_model_type"] == "lookahead" and not configured.router.config.enabled
    assert not configured.generate(PROMPT, 8, chat=False)[1].used
    for wrong in ({"router": router, "enabled": False}, {"window": 3}):
        with pytest.raises(GenerationOptionError, match=r"not both|unknown setting"):
            SpeculativeDecodingWrapper(tiny_engine, **wrong)
    # Measured: the plain cost per token needs live plain steps first (none yet here: None, not a guess).
    speedup = router.calculate_speedup(result)
    saved = result.estimated_time_saved
    assert (speedup is None) == (saved is None)


def test_speedup_is_spent_plus_saved_over_spent():
    from doppler_py.api import GenerationResult

    stats = {"plain_s": 1.0, "draft_s": 0.5, "verify_s": 2.5}
    generation = GenerationResult("", [], 1, "length", "lookahead", 10, 5, 0.5, 1.0, 1.0, 4.0, 2.0, stats=stats)
    router = SpeculativeDecoding.__new__(SpeculativeDecoding)
    assert router.calculate_speedup(SpeculationResult(True, 10, 5, 0.5, 2.0, generation)) == pytest.approx(1.5)
    generation.time_saved_s = None
    assert router.calculate_speedup(generation) is None


def test_settings_are_checked(tiny_engine):
    router = SpeculativeDecoding(tiny_engine)
    assert router.get_config() == {
        "enabled": True,
        "draft_model_type": "eagle",
        "speculation_window": None,
        "temperature": 0.0,
    }
    assert router.update_config(speculation_window=4, temperature=0.7)["speculation_window"] == 4
    for bad, match in (
        ({"window": 3}, "unknown setting"),
        ({"draft_model_type": "ngram"}, "draft_model_type must be one of"),
        ({"speculation_window": 0}, "speculation_window"),
        ({"temperature": -1.0}, "temperature"),
        ({"enabled": "yes"}, "enabled"),
    ):
        with pytest.raises(GenerationOptionError, match=match):
            router.update_config(**bad)
    assert router.get_config()["speculation_window"] == 4  # a refused change leaves the settings alone


@pytest.fixture(scope="module")
def smollm2(smollm2_engine):
    return smollm2_engine


@pytest.mark.realmodel
@pytest.mark.slow
@pytest.mark.parametrize("draft_type", DRAFT_TYPES)
def test_every_type_on_smollm2(smollm2, draft_type):
    prompt = [{"role": "user", "content": "Write two sentences about a lighthouse."}]
    router = SpeculativeDecoding(smollm2, draft_model_type=draft_type, speculation_window=4)
    record = router.get_draft_model()
    if draft_type != "lookahead" and draft_type not in smollm2.heads:  # a head kind not shipped for SmolLM2
        assert record is None and not router.should_use(force_enable=True)
        return
    assert record is not None and record.mode == draft_type and record.measured_windows
    assert 0 <= router.get_recommended_window() <= max(record.supported_windows)
    plain = smollm2.generate(prompt, max_tokens=12, speculative=None)
    verified = router.verify_draft(router.generate_draft(prompt))
    assert verified.tokens == plain.tokens[: verified.accepted + 1]
    text, result = SpeculativeDecodingWrapper(smollm2, router).generate(prompt, 12, use_spec_dec=True)
    assert text == plain.text and result.used and result.draft_tokens > 0


def test_resolve_mode_names_what_a_mode_runs_on_this_engine(tiny_engine):
    """What a benchmark labels its rows with: `auto` here (no head, no draft model) is prompt lookup."""
    assert tiny_engine.resolve_mode(None) == "none" and tiny_engine.resolve_mode("auto") == "prompt-lookup"
    assert tiny_engine.resolve_mode("lookahead") == "lookahead"
    with pytest.raises(GenerationOptionError, match="draft model"):
        tiny_engine.resolve_mode("draft-model")
