"""Embeddings (`Engine.embed`, `doppler_py.embeddings`) against sentence-transformers on tiny random models that the
tests lay out as sentence-transformers keeps them (tests/support/embedding_models.py).

Tolerances: f32 weights, max |ours − theirs| ≤ 1e-5 over unit vectors (seen: ~3e-7); f16 weights against the same
model computed in float32 with its weights rounded to f16, ≤ 1e-4. Bad input is a `GenerationOptionError` naming
the field. The EmbeddingGemma-shaped Gemma 3 (bidirectional attention, sliding layers, mean pooling, Dense layers) is
held to the same f32 tolerance, and the same forwards run causally must miss it by 100 times that.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.embedding_models import (
    QUERY_PROMPT,
    QWEN3,
    embedding_gemma_folder,
    qwen3_embedding_folder,
    saved_by_sentence_transformers,
)

from doppler_py.api import load
from doppler_py.embeddings import Embedder, EmbeddingHead, EmbeddingResult, input_groups, plan_forwards
from doppler_py.errors import GenerationOptionError, UnsupportedModelError
from doppler_py.testing.tiny import write_tiny_model

st = pytest.importorskip("sentence_transformers")
torch = pytest.importorskip("torch")

F32_TOLERANCE = 1e-5
F16_TOLERANCE = 1e-4
# One character (2 tokens with the appended <|endoftext|>), a few words, and one longer than a forward's 64 rows.
TEXTS = ["a", "hello world", "the quick brown fox jumps over the lazy dog, " * 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return qwen3_embedding_folder(tmp_path_factory.mktemp("qwen3-embedding"))


@pytest.fixture(scope="module")
def engine(folder):
    with load(folder, weights="f32", progress=False) as engine:
        yield engine


@pytest.fixture(scope="module")
def reference(folder):
    return st.SentenceTransformer(str(folder), device="cpu")


def test_the_tokenizer_appends_end_of_text_as_qwen3_embeddings_does(engine, reference):
    ids = engine.tokenizer.encode("hello")
    assert ids[-1] == engine.tokenizer.token_to_id("<|endoftext|>")
    assert reference.tokenizer("hello")["input_ids"] == ids


def test_last_token_embeddings_equal_sentence_transformers(engine, reference):
    ours = np.asarray(engine.embed(TEXTS))
    theirs = reference.encode(TEXTS)
    assert ours.shape == theirs.shape == (3, QWEN3.hidden_size)
    np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-6)
    assert np.abs(ours - theirs).max() <= F32_TOLERANCE


def test_a_named_prompt_is_prepended_as_sentence_transformers_does(engine, reference):
    ours = np.asarray(engine.embed(TEXTS[:2], prompt_name="query"))
    theirs = reference.encode(TEXTS[:2], prompt_name="query")
    assert np.abs(ours - theirs).max() <= F32_TOLERANCE
    plain = np.asarray(engine.embed([QUERY_PROMPT + t for t in TEXTS[:2]]))
    np.testing.assert_array_equal(ours, plain)
    assert np.abs(ours - np.asarray(engine.embed(TEXTS[:2]))).max() > 0.01  # the prompt changes the vector


def test_inputs_batched_together_equal_each_alone(engine):
    together = np.asarray(engine.embed(TEXTS * 4))  # 12 inputs, 2 long ones split across forwards
    alone = np.asarray([engine.embed(text)[0] for text in TEXTS])
    np.testing.assert_allclose(together, np.tile(alone, (4, 1)), rtol=0, atol=1e-6)


def test_a_one_token_input_is_its_final_normed_hidden_state(engine, reference):
    hf = reference[0].auto_model
    for tokens in ([5], [7, 9, 11]):
        with torch.no_grad():
            hidden = hf(input_ids=torch.tensor([tokens])).last_hidden_state[0, -1].numpy()
        ours = np.asarray(engine.embed(tokens, normalize=False)[0])  # one token list (not a list of inputs)
        assert np.abs(ours - hidden).max() <= F32_TOLERANCE * max(1.0, np.abs(hidden).max())
        unit = np.asarray(engine.embed([tokens])[0])
        np.testing.assert_allclose(unit, hidden / np.linalg.norm(hidden), atol=F32_TOLERANCE)


def test_matryoshka_dimensions_truncate_then_renormalise(engine, reference):
    full = reference.encode(TEXTS[:2])
    ours = np.asarray(engine.embed(TEXTS[:2], dimensions=16))
    expected = full[:, :16] / np.linalg.norm(full[:, :16], axis=1, keepdims=True)
    assert ours.shape == (2, 16)
    assert np.abs(ours - expected).max() <= F32_TOLERANCE


def test_base64_is_the_vectors_little_endian_float32_bytes(engine):
    result = engine.embeddings(TEXTS[:2])
    import base64

    decoded = [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in result.encoded("base64")]
    np.testing.assert_array_equal(np.stack(decoded), result.vectors)
    assert result.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in TEXTS[:2])


def test_f16_weights_equal_sentence_transformers_over_the_f16_rounded_model(folder, tmp_path):
    rounded = qwen3_embedding_folder(tmp_path / "rounded", f16_rounded=True)
    theirs = st.SentenceTransformer(str(rounded), device="cpu").encode(TEXTS)
    with load(folder, weights="f16", progress=False) as engine:
        ours = np.asarray(engine.embed(TEXTS))
    assert np.abs(ours - theirs).max() <= F16_TOLERANCE


def test_mean_pooling_and_dense_layers_saved_by_sentence_transformers_equal_it(folder, tmp_path):
    saved = saved_by_sentence_transformers(folder, tmp_path / "mean-dense", "mean", dense=(48, 32))
    theirs = st.SentenceTransformer(str(saved), device="cpu").encode(TEXTS)
    with load(saved, weights="f32", progress=False) as engine:
        assert engine.embedder.head.pooling == "mean" and len(engine.embedder.head.dense) == 2
        ours = np.asarray(engine.embed(TEXTS))
    assert ours.shape == theirs.shape == (3, 32)
    assert np.abs(ours - theirs).max() <= F32_TOLERANCE


def test_first_token_pooling_saved_by_sentence_transformers_equals_it(folder, tmp_path):
    saved = saved_by_sentence_transformers(folder, tmp_path / "cls", "cls")
    theirs = st.SentenceTransformer(str(saved), device="cpu").encode(TEXTS)
    with load(saved, weights="f32", progress=False) as engine:
        ours = np.asarray(engine.embed(TEXTS))
    assert np.abs(ours - theirs).max() <= F32_TOLERANCE


@pytest.mark.parametrize(
    ("call", "field", "says"),
    [
        (lambda e: e.embed([]), "input", "empty"),
        (lambda e: e.embed(""), "input", "empty string"),
        (lambda e: e.embed(["ok", ""]), "input", r"input\[1\] is an empty string"),
        (lambda e: e.embed([[]]), "input", "empty token list"),
        (lambda e: e.embed("x" * 250), "input", "past the context of 200"),
        (lambda e: e.embed([[1, 2, QWEN3.vocab_size]]), "input", "outside the vocabulary"),
        (lambda e: e.embed([[1, -1]]), "input", "outside the vocabulary"),
        (lambda e: e.embed([1.5]), "input", "must be"),
        (lambda e: e.embed("hi", dimensions=0), "dimensions", "1..64"),
        (lambda e: e.embed("hi", dimensions=65), "dimensions", "1..64"),
        (lambda e: e.embed("hi", dimensions=True), "dimensions", "1..64"),
        (lambda e: e.embed("hi", prompt_name="passage"), "prompt_name", "'query', 'document'"),
        (lambda e: e.embed([[3, 4]], prompt_name="query"), "prompt_name", "as given"),
        (lambda e: e.embeddings("hi").encoded("float16"), "encoding_format", "float, base64"),
    ],
)
def test_bad_input_is_refused_naming_the_field(engine, call, field, says):
    with pytest.raises(GenerationOptionError, match=says) as raised:
        call(engine)
    assert raised.value.option == field


def test_a_plain_language_model_keeps_its_full_width(engine):
    """Without sentence-transformers files: last-token pooling, normalised, and no Matryoshka truncation."""
    plain = Embedder(engine.model, engine.tokenizer, EmbeddingHead())
    try:
        result = plain.embed(["hello world"])
        np.testing.assert_array_equal(result.vectors, engine.embeddings("hello world").vectors)
        with pytest.raises(GenerationOptionError, match="not an embedding model") as raised:
            plain.embed("hi", dimensions=8)
        assert raised.value.option == "dimensions"
    finally:
        plain.close()


def test_bidirectional_attention_on_another_architecture_is_refused(tmp_path):
    folder = write_tiny_model(tmp_path / "bidirectional", QWEN3)
    config = json.loads((folder / "config.json").read_text())
    for asks in ({"use_bidirectional_attention": True}, {"is_causal": False}):
        (folder / "config.json").write_text(json.dumps(config | asks))
        with (
            load(folder, weights="f32", progress=False) as engine,
            pytest.raises(UnsupportedModelError, match="gemma3_text models only"),
        ):
            engine.embed("hi")


def test_embedding_result_encodes_floats_as_lists(engine):
    result: EmbeddingResult = engine.embeddings(["hi", "there"])
    floats = result.encoded("float")
    assert len(floats) == 2 and all(isinstance(x, float) for x in floats[0])


def test_the_embed_command_prints_openais_shape(folder, engine, capsys):
    from doppler_py.cli import main

    args = ["embed", "hello world", "a", "--model", str(folder), "--weights", "f32", "--no-progress"]
    assert main([*args, "--dimensions", "8", "--prompt-name", "query"]) == 0
    printed = json.loads(capsys.readouterr().out)
    vectors = np.asarray([d["embedding"] for d in printed["data"]], np.float32)
    expected = engine.embeddings(["hello world", "a"], dimensions=8, prompt_name="query")
    np.testing.assert_array_equal(vectors, expected.vectors)
    assert printed["usage"]["prompt_tokens"] == expected.prompt_tokens
    assert main([*args, "--dimensions", "99"]) == 2
    assert "dimensions must be a whole number in 1..64" in capsys.readouterr().err


def test_forwards_are_planned_full_with_each_inputs_chunks_in_order():
    plan = plan_forwards([3, 70, 2, 64], 64)
    assert all(sum(rows for _, _, rows in forward) <= 64 for forward in plan)
    for n, length in enumerate([3, 70, 2, 64]):
        chunks = [(start, rows) for forward in plan for m, start, rows in forward if m == n]
        assert [start for start, _ in chunks] == list(np.cumsum([0] + [rows for _, rows in chunks])[:-1])
        assert sum(rows for _, rows in chunks) == length
    assert plan[0] == [(0, 0, 3), (1, 0, 61)]


def _head_folder(tmp_path, pooling: dict, modules: list[str] = ("Transformer", "Pooling", "Normalize")):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize", "WeightedLayerPooling": "x"}
    listed = [{"path": paths[m], "type": f"sentence_transformers.models.{m}"} for m in modules]
    (tmp_path / "modules.json").write_text(json.dumps(listed))
    (tmp_path / "1_Pooling").mkdir(exist_ok=True)
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tmp_path


def test_the_head_reads_either_pooling_format_and_refuses_what_it_cannot_do(tmp_path):
    old = EmbeddingHead.from_folder(_head_folder(tmp_path, {"pooling_mode_mean_tokens": True}), 64)
    assert (old.pooling, old.normalize, old.declared) == ("mean", True, True)
    new = EmbeddingHead.from_folder(_head_folder(tmp_path, {"pooling_mode": "cls", "include_prompt": False}), 64)
    assert (new.pooling, new.include_prompt) == ("cls", False)
    with pytest.raises(UnsupportedModelError, match="'max' is not supported"):
        EmbeddingHead.from_folder(_head_folder(tmp_path, {"pooling_mode": "max"}), 64)
    with pytest.raises(UnsupportedModelError, match="one mode"):
        EmbeddingHead.from_folder(
            _head_folder(tmp_path, {"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": True}), 64
        )
    with pytest.raises(UnsupportedModelError, match="WeightedLayerPooling"):
        EmbeddingHead.from_folder(
            _head_folder(tmp_path, {"pooling_mode": "mean"}, ["Transformer", "WeightedLayerPooling", "Pooling"]), 64
        )


def test_mean_pooling_that_leaves_the_prompt_out_is_refused_with_a_prompt(engine):
    head = EmbeddingHead(pooling="mean", include_prompt=False, prompts={"query": "q: "}, declared=True)
    embedder = Embedder(engine.model, engine.tokenizer, head)
    try:
        assert embedder.embed("hello").vectors.shape == (1, QWEN3.hidden_size)  # without a prompt it is the mean
        with pytest.raises(UnsupportedModelError, match="include_prompt"):
            embedder.embed("hello", prompt_name="query")
    finally:
        embedder.close()


def test_inputs_are_grouped_so_that_their_caches_stay_bounded():
    assert input_groups([2] * 130, 64) == [list(range(64)), list(range(64, 128)), [128, 129]]  # 64 a forward
    assert input_groups([5] * 60, 64) == [list(range(51)), list(range(51, 60))]  # 255 tokens, then the rest
    assert input_groups([200, 100, 300, 10], 64) == [[0], [1], [2], [3]]  # 256 tokens at most, one long alone
    assert input_groups([100, 100, 50, 10], 64) == [[0, 1, 2], [3]]


# -- EmbeddingGemma-style: Gemma 3 with use_bidirectional_attention, mean pooling, Dense layers ------------------
# One text shorter than the sliding layers' window (keys less than 3 positions away either way), two longer.
GEMMA_TEXTS = ["hi", "hello world", "the quick brown fox jumps over the lazy dog"]


def test_bidirectional_gemma3_embeddings_equal_sentence_transformers(tmp_path, monkeypatch):
    """f32, the module's tolerance (≤ 1e-5 over unit vectors). Mutation check: the same forwards with causal
    attention are far off, so the comparison tells the two apart."""
    saved = embedding_gemma_folder(tmp_path / "embedding-gemma")
    reference = st.SentenceTransformer(str(saved), device="cpu")
    assert reference[0].auto_model.config.use_bidirectional_attention
    theirs = reference.encode(GEMMA_TEXTS)
    with load(saved, weights="f32", progress=False) as engine:
        embedder = engine.embedder
        assert embedder.bidirectional and embedder.head.pooling == "mean" and len(embedder.head.dense) == 2
        ours = np.asarray(engine.embed(GEMMA_TEXTS))
        assert ours.shape == theirs.shape == (3, 48)
        assert np.abs(ours - theirs).max() <= F32_TOLERANCE
        # Batched whole (several inputs per forward, none split across forwards) equals each alone.
        together = np.asarray(engine.embed(GEMMA_TEXTS * 3))
        np.testing.assert_allclose(together, np.tile(ours, (3, 1)), rtol=0, atol=1e-6)
        # Inputs up to a forward's rows and past it (run layer by layer, `Transformer.run_bidirectional`), alone
        # and beside short ones, up to the model's context (its max_position_embeddings, 256); past it refused.
        rows = engine.model.max_rows
        assert rows == 64 and embedder.max_length == 256
        # Varied characters (a token each): an input of one repeated token attends alike to any of its keys.
        pangrams = "the quick brown fox jumps over the lazy dog while five boxing wizards jump quickly " * 2
        long_texts = [pangrams[:n] for n in (1, rows - 1, rows, rows + 1, 150)]
        assert [i.size for i in embedder.token_lists(long_texts)] == [1, 63, 64, 65, 150]
        long_ours = np.asarray(engine.embed([*long_texts, *GEMMA_TEXTS]))
        assert np.abs(long_ours - reference.encode([*long_texts, *GEMMA_TEXTS])).max() <= F32_TOLERANCE
        with pytest.raises(GenerationOptionError, match="past the context of 256") as raised:
            engine.embed("x" * 257)
        assert raised.value.option == "input"
        monkeypatch.setattr(embedder, "bidirectional", False)
        causal = np.asarray(engine.embed(GEMMA_TEXTS[1:]))
    assert np.abs(causal - theirs[1:]).max() > 100 * F32_TOLERANCE


def test_whole_inputs_are_planned_into_forwards_with_room_for_them():
    plan = plan_forwards([3, 60, 2, 64, 5], 64, whole=True)
    assert plan == [[(0, 0, 3), (1, 0, 60)], [(2, 0, 2), (4, 0, 5)], [(3, 0, 64)]]
    with pytest.raises(ValueError, match="whole"):
        plan_forwards([65], 64, whole=True)
