"""Reranking (`Engine.rerank`, `doppler_py.rerank`) against HF transformers following Qwen3-Reranker's card: the
probability of "yes" over "no" at the last position of the card's prompt, on a tiny random Qwen3 whose tokenizer has
"yes" and "no" tokens. Tolerance: |ours − theirs| ≤ 1e-5 per score (f32)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from doppler_py.api import load
from doppler_py.errors import GenerationOptionError, UnsupportedModelError
from doppler_py.rerank import PREFIX, SUFFIX, common_prefix
from doppler_py.testing.tiny import TinySpec, write_tiny_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

SPEC = TinySpec(arch="qwen3", num_attention_heads=4, num_key_value_heads=2, explicit_head_dim=32, seed=23)
QUERY = "where do rivers go?"
DOCUMENTS = ["rivers flow to the sea.", "bread is baked.", "a", "the sea takes the rivers, " * 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from tokenizers import Tokenizer

    folder = write_tiny_model(tmp_path_factory.mktemp("reranker"), SPEC)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.add_tokens(["yes", "no"])  # ids 99 and 100, inside the 128-token vocabulary
    tokenizer.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(config | {"tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


@pytest.fixture(scope="module")
def engine(folder):
    with load(folder, weights="f32", progress=False) as engine:
        yield engine


def card_scores(folder, query: str, documents: list[str], instruction: str) -> list[float]:
    """The card's recipe, in transformers: prefix + tokenizer(pair) + suffix, last position's [no, yes] softmax."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    prefix, suffix = tok.encode(PREFIX, add_special_tokens=False), tok.encode(SUFFIX, add_special_tokens=False)
    yes, no = tok.convert_tokens_to_ids("yes"), tok.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        pair = f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
        ids = prefix + tok(pair)["input_ids"] + suffix
        with torch.no_grad():
            last = model(input_ids=torch.tensor([ids])).logits[0, -1]
        scores.append(torch.log_softmax(torch.stack([last[no], last[yes]]), dim=0)[1].exp().item())
    return scores


def test_scores_equal_the_cards_recipe_in_transformers_highest_first(engine, folder):
    instruction = "Given a web search query, retrieve relevant passages that answer the query"
    theirs = card_scores(folder, QUERY, DOCUMENTS, instruction)
    results = engine.rerank(QUERY, DOCUMENTS)
    assert sorted(r.index for r in results) == list(range(len(DOCUMENTS)))
    assert [r.relevance_score for r in results] == sorted((r.relevance_score for r in results), reverse=True)
    ours = {r.index: r.relevance_score for r in results}
    np.testing.assert_allclose([ours[n] for n in range(len(DOCUMENTS))], theirs, rtol=0, atol=1e-5)
    custom = card_scores(folder, QUERY, DOCUMENTS[:2], "judge it")
    mine = {r.index: r.relevance_score for r in engine.rerank(QUERY, DOCUMENTS[:2], instruction="judge it")}
    np.testing.assert_allclose([mine[0], mine[1]], custom, rtol=0, atol=1e-5)


def test_batched_scores_equal_one_forward_per_document(engine):
    """The shared prefix run once, the documents' own rows side by side (one document's rows across forwards: 150
    tokens of its own against a forward's 64 rows), each score from its last row: equal to a forward per document
    within the module's tolerance, in the request's order."""
    documents = [*DOCUMENTS, "the sea takes the rivers, and then the rain. " * 4, "doc 7", "doc 8"]
    ours = {r.index: r.relevance_score for r in engine.rerank(QUERY, documents)}
    pairs = engine._reranker.token_ids(QUERY, documents)
    theirs = engine._reranker.scores_one_by_one(pairs)
    np.testing.assert_allclose([ours[n] for n in range(len(documents))], theirs, rtol=0, atol=1e-5)
    shared = common_prefix(pairs)
    assert shared > len(engine._reranker.prefix) and max(len(ids) - shared for ids in pairs) > engine.model.max_rows


def test_the_common_prefix_leaves_every_pair_its_last_token():
    assert common_prefix([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 9]]) == 2
    assert common_prefix([[1, 2, 3], [1, 2, 3, 4]]) == 2
    assert common_prefix([[7], [7]]) == 0
    assert common_prefix([[1, 2], [3, 2]]) == 0


def test_top_n_keeps_the_best(engine):
    everything = engine.rerank(QUERY, DOCUMENTS)
    assert engine.rerank(QUERY, DOCUMENTS, top_n=2) == everything[:2]


@pytest.mark.parametrize(
    ("args", "kwargs", "field"),
    [
        (("", DOCUMENTS), {}, "query"),
        ((QUERY, []), {}, "documents"),
        ((QUERY, "one document"), {}, "documents"),
        ((QUERY, ["fine", ""]), {}, "documents"),
        ((QUERY, ["x" * 2100]), {}, "documents"),  # past the context (load's max_seq, 2048)
        ((QUERY, DOCUMENTS), {"top_n": 0}, "top_n"),
    ],
)
def test_bad_input_is_refused_naming_the_field(engine, args, kwargs, field):
    with pytest.raises(GenerationOptionError) as raised:
        engine.rerank(*args, **kwargs)
    assert raised.value.option == field


def test_a_model_without_yes_and_no_tokens_is_refused(tmp_path):
    plain = write_tiny_model(tmp_path / "plain", SPEC)
    with (
        load(plain, weights="f32", progress=False) as engine,
        pytest.raises(UnsupportedModelError, match="'yes' and 'no'"),
    ):
        engine.rerank(QUERY, DOCUMENTS)


def test_the_rerank_endpoint_answers_in_llama_cpps_shape(engine):
    import httpx

    from doppler_py.server import OpenAIServer, ServerConfig, serving_in_background

    with serving_in_background(OpenAIServer(engine, ServerConfig(model_id="tiny-rerank")).app) as url:
        body = {"model": "tiny-rerank", "query": QUERY, "documents": DOCUMENTS, "top_n": 3, "return_documents": True}
        answer = httpx.post(f"{url}/v1/rerank", json=body, timeout=60).json()
        expected = engine.rerank(QUERY, DOCUMENTS, top_n=3)
        assert [(r["index"], r["relevance_score"]) for r in answer["results"]] == [
            (r.index, r.relevance_score) for r in expected
        ]
        assert [r["document"]["text"] for r in answer["results"]] == [DOCUMENTS[r.index] for r in expected]
        assert answer["usage"]["prompt_tokens"] == engine.rerank_with_usage(QUERY, DOCUMENTS)[1]
        plain = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS[:2]}, timeout=60).json()
        assert len(plain["results"]) == 2 and "document" not in plain["results"][0]
        for bad, param in (({"documents": DOCUMENTS}, "query"), ({"query": QUERY, "documents": []}, "documents")):
            refused = httpx.post(f"{url}/v1/rerank", json=bad, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == param
