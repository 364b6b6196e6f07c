"""Tokenizer: encoding parity with transformers (and with llama.cpp's pre-tokenizer rules), chat templates, streaming
detokenisation."""

from __future__ import annotations

import json
import os

import gguf
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers
from tokenizers.pre_tokenizers import ByteLevel

from doppler_py.errors import GenerationOptionError, ModelFormatError, UnsupportedModelError
from doppler_py.model.gguf import read_gguf, tokenizer_files
from doppler_py.tokenizer import StreamDecoder, Tokenizer

real_model = pytest.mark.realmodel

TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing   ",
    "tabs\tand\nnew\n\n\nlines\r\nend",
    "naïve café — résumé, Ångström, Straße",
    "日本語のテキストと한국어 그리고 中文",
    "emoji 👍🏽 🎉 family 👨‍👩‍👧 flag 🇫🇷",
    "def square(x):\n    return x ** 2  # comment\n\n\nclass A:\n\tpass\n",
    "numbers 1234567 3.14159 0x1F -42 1e-5 2024-06-01",
    "I'm you're they'll we'd it's HE'S",
    "\u00a0non-breaking\u2003em space\u200bzero width",
    "a" * 40 + " " + "ab" * 20,
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "math: ∑ᵢ xᵢ² ≤ ∞, ∀ε>0 ∃δ",
    "   \n\t  \r\n  ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Say hi 👋"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again, in 日本語."},
    ],
]


# --- SmolLM2's tokenizer, built from its GGUF metadata ---------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(smollm2_gguf, tmp_path_factory):
    folder = tmp_path_factory.mktemp("smollm2-tokenizer")
    tokenizer_json, tokenizer_config = tokenizer_files(read_gguf(smollm2_gguf))
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return Tokenizer.from_dir(folder)


@pytest.fixture(scope="module")
def transformers_tokenizer(smollm2_gguf):
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def chat_texts(tokenizer: Tokenizer) -> list[str]:
    return [tokenizer.apply_chat_template(c, add_generation_prompt=g) for c in CONVERSATIONS for g in (True, False)]


@real_model
@pytest.mark.slow
def test_smollm2_tokenises_like_transformers_gguf_tokenizer(smollm2, transformers_tokenizer):
    for text in TEXTS + chat_texts(smollm2):
        assert smollm2.encode(text) == transformers_tokenizer(text)["input_ids"], text


@real_model
@pytest.mark.slow
def test_smollm2_tokenizer_files_load_in_transformers(smollm2, transformers_tokenizer):
    transformers = pytest.importorskip("transformers")
    from_folder = transformers.AutoTokenizer.from_pretrained(smollm2.source)
    for text in TEXTS + chat_texts(smollm2):
        assert from_folder(text)["input_ids"] == transformers_tokenizer(text)["input_ids"], text
    assert from_folder.chat_template == transformers_tokenizer.chat_template
    assert (from_folder.bos_token, from_folder.eos_token) == ("<|im_start|>", "<|im_end|>")


@real_model
@pytest.mark.slow
def test_smollm2_chat_template_renders_like_transformers(smollm2, transformers_tokenizer):
    for conversation in CONVERSATIONS:
        for generation_prompt in (True, False):
            ours = smollm2.apply_chat_template(conversation, add_generation_prompt=generation_prompt)
            theirs = transformers_tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=generation_prompt
            )
            assert ours == theirs


@real_model
def test_smollm2_special_tokens(smollm2):
    assert smollm2.eos_token_ids == (2,) and smollm2.bos_token_id == 1 and smollm2.vocab_size == 49152
    ids = smollm2.encode("<|im_start|>assistant<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and smollm2.decode(ids[1:-1]) == "assistant"
    assert smollm2.encode("hi") == smollm2.encode("hi", add_special_tokens=False)  # SmolLM2 adds no BOS
    assert smollm2.decode([1, 2], skip_special_tokens=True) == ""


@real_model
def test_smollm2_decode_gives_back_the_text(smollm2):
    for text in TEXTS:
        assert smollm2.decode(smollm2.encode(text)) == text


@real_model
def test_smollm2_streams_an_emoji_split_over_tokens_whole(smollm2):
    text = "Good 👍🏽 job 🎉!"
    ids = smollm2.encode(text)
    assert any("\ufffd" in smollm2.decode([i]) for i in ids)  # some token carries part of a character
    stream = smollm2.stream_decoder()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert "" in pieces  # bytes were held back at least once


@real_model
@pytest.mark.parametrize("skip_special_tokens", [False, True])
def test_smollm2_stream_pieces_concatenate_to_decode_for_any_ids(smollm2, rng, skip_special_tokens):
    # Random ids include lone continuation bytes and specials: text must still match decode() exactly.
    for _ in range(20):
        ids = rng.integers(0, smollm2.vocab_size, size=int(rng.integers(1, 40))).tolist()
        stream = smollm2.stream_decoder(skip_special_tokens=skip_special_tokens)
        text = "".join(stream.push(i) for i in ids) + stream.flush()
        assert text == smollm2.decode(ids, skip_special_tokens=skip_special_tokens)


# --- llama.cpp's pre-tokenizer names, on a tiny vocabulary that merges digits -----------------------------------

ALPHABET = sorted(ByteLevel.alphabet())
MERGES = ["1 2", "12 3", "Ġ 1", "Ġ1 2", "4 5", "45 6", "' s", "Ġ t", "h e", "Ġt he", "Ċ Ċ", "Ġ Ġ", "e s", "' S"]
TINY_TOKENS = ["<|endoftext|>", *ALPHABET, *(m.replace(" ", "") for m in MERGES)]
SPLIT_TEXTS = [
    "the 123456 1234567 year's 12 x12\n\n\nhe's  456 the<|endoftext|>",
    "HE'S IT'S 3.14159 \t\n  \n x  y",
    "ünïcödé 日本 👍 12😀3",
]


def write_vocab_gguf(path, pre: str):
    writer = gguf.GGUFWriter(str(path), "llama")
    # llama.cpp reads these even for a vocabulary-only load.
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(32)
    writer.add_head_count(1)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(TINY_TOKENS)
    writer.add_token_merges(MERGES)
    writer.add_token_types([3] + [1] * (len(TINY_TOKENS) - 1))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_smollm_pre_tokenizer_splits_every_digit_and_otherwise_splits_like_gpt2(tmp_path):
    """llama.cpp's "smollm" split is GPT-2's regex after every digit is cut from its neighbours (transformers has
    no such name, so the spec itself is the reference): with merges that join digits, no token holds two digits,
    the text comes back whole, and text without digits splits as "gpt-2" does."""

    def tokenizer(pre: str) -> Backend:
        return Backend.from_str(tokenizer_files(read_gguf(write_vocab_gguf(tmp_path / f"{pre}.gguf", pre)))[0])

    smollm, gpt2 = tokenizer("smollm"), tokenizer("gpt-2")
    digits = set("0123456789")
    assert any(len(digits & set(token)) > 1 for text in SPLIT_TEXTS for token in gpt2.encode(text).tokens)
    for text in SPLIT_TEXTS:
        encoding = smollm.encode(text)
        assert all(len([c for c in token if c in digits]) <= 1 for token in encoding.tokens), text
        assert smollm.decode(encoding.ids, skip_special_tokens=False) == text
        no_digits = "".join(c for c in text if c not in digits)
        assert smollm.encode(no_digits).ids == gpt2.encode(no_digits).ids, text


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])  # transformers has no "smollm" split
def test_pre_tokenizer_names_split_like_transformers(tmp_path, pre):
    transformers = pytest.importorskip("transformers")
    path = write_vocab_gguf(tmp_path / f"{pre}.gguf", pre)
    ours = Backend.from_str(tokenizer_files(read_gguf(path))[0])
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in SPLIT_TEXTS:
        assert ours.encode(text).ids == theirs(text)["input_ids"], text


@pytest.mark.parametrize("pre", [None, "mystery"])
def test_unknown_or_missing_pre_tokenizer_is_refused(tmp_path, pre):
    path = write_vocab_gguf(tmp_path / "v.gguf", pre or "")
    if pre is None:  # GGUFWriter cannot leave the key out; blank its value's name instead
        data = path.read_bytes().replace(b"tokenizer.ggml.pre", b"tokenizer.ggml.xxx")
        path.write_bytes(data)
    with pytest.raises(UnsupportedModelError, match=r"tokenizer\.ggml\.pre"):
        tokenizer_files(read_gguf(path))


# --- templates and streaming on a byte-per-token tokenizer ------------------------------------------------------


def byte_tokenizer_folder(folder, config: dict | None = None, **files: str):
    """A tokenizer whose tokens are single bytes (so any multi-byte character spans several tokens)."""
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(ALPHABET)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    defaults = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps({**defaults, **(config or {})}))
    for name, text in files.items():
        (folder / name.replace("_json", ".json").replace("_jinja", ".jinja")).write_text(text)
    return Tokenizer.from_dir(folder)


def test_template_is_rendered_with_trimmed_blocks_and_special_tokens(tmp_path):
    template = """{{ bos_token }}
{% for m in messages %}
    {% if m.role == 'user' %}
U: {{ m.content }}
    {% else %}
A: {{ m.content }}{{ eos_token }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""
    tokenizer = byte_tokenizer_folder(tmp_path / "t", {"chat_template": template})
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    # Block-tag lines vanish (lstrip_blocks + trim_blocks); the newline after an expression stays.
    assert tokenizer.apply_chat_template(messages) == "<s>\nU: hi\nA: yo</s>\nA:"
    assert tokenizer.apply_chat_template(messages, add_generation_prompt=False) == "<s>\nU: hi\nA: yo</s>\n"


def test_template_tojson_keeps_unicode_and_markup_and_gets_extra_variables(tmp_path):
    template = "{{ tools | tojson }}|{{ messages[0] | tojson(indent=1) }}|{% for x in [1,2,3] %}{% break %}{% endfor %}"
    tokenizer = byte_tokenizer_folder(tmp_path / "t", {"chat_template": template})
    out = tokenizer.apply_chat_template([{"role": "user", "content": "<b>é</b>"}], tools=[{"name": "ä&b"}])
    assert out == '[{"name": "ä&b"}]|{\n "role": "user",\n "content": "<b>é</b>"\n}|'


@pytest.mark.slow
def test_templates_render_like_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    templates = [
        "{% for m in messages %}\n  {% if loop.first %}{{ bos_token }}{% endif %}\n{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}\n{% if add_generation_prompt %}assistant:{% endif %}",
        "{{ tools | tojson }}|{{ messages | tojson(indent=2) }}|{% for x in messages %}{% continue %}{% endfor %}",
    ]
    messages = [{"role": "user", "content": "<b>é</b> 👍"}, {"role": "assistant", "content": "yo"}]
    for index, template in enumerate(templates):
        folder = tmp_path / str(index)
        ours = byte_tokenizer_folder(folder, {"chat_template": template, "eos_token": "</s>"})
        theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
        for generation_prompt in (True, False):
            assert ours.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tools=[{"name": "ä&b"}]
            ) == theirs.apply_chat_template(
                messages, add_generation_prompt=generation_prompt, tools=[{"name": "ä&b"}], tokenize=False
            )


def test_template_raise_exception_is_a_generation_option_error(tmp_path):
    template = (
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversation must start with user') }}{% endif %}"
    )
    tokenizer = byte_tokenizer_folder(tmp_path / "t", {"chat_template": template})
    with pytest.raises(GenerationOptionError, match="must start with user"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_template_sources(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert byte_tokenizer_folder(tmp_path / "a", {"chat_template": named}).apply_chat_template([]) == "D"
    jinja_file = byte_tokenizer_folder(tmp_path / "b", {"chat_template": "config"}, chat_template_jinja="file")
    assert jinja_file.apply_chat_template([]) == "file"
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        byte_tokenizer_folder(tmp_path / "c").apply_chat_template([])
    with pytest.raises(ModelFormatError, match="does not parse"):
        byte_tokenizer_folder(tmp_path / "d", {"chat_template": "{% for %}"}).apply_chat_template([])


def test_eos_ids_gather_tokenizer_and_generation_config(tmp_path):
    tokenizer = byte_tokenizer_folder(
        tmp_path / "t", generation_config_json=json.dumps({"eos_token_id": [257, 5]}), config_json="{}"
    )
    assert tokenizer.eos_token_ids == (257, 5)
    assert tokenizer.bos_token_id == 256


def test_missing_or_broken_tokenizer_json_is_a_format_error(tmp_path):
    with pytest.raises(ModelFormatError, match=r"tokenizer\.json: not found"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelFormatError, match="cannot be read"):
        Tokenizer.from_dir(tmp_path)


def test_stream_holds_back_each_incomplete_character(tmp_path):
    tokenizer = byte_tokenizer_folder(tmp_path / "t")
    text = "a👍é日b"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode())  # one token per byte
    stream = StreamDecoder(tokenizer)
    pieces = [stream.push(i) for i in ids]
    assert pieces == ["a", "", "", "", "👍", "", "é", "", "", "日", "b"]
    assert stream.flush() == ""


def test_stream_flush_releases_an_unfinished_character(tmp_path):
    tokenizer = byte_tokenizer_folder(tmp_path / "t")
    ids = tokenizer.encode("x👍")[:-1]
    stream = StreamDecoder(tokenizer)
    assert "".join(stream.push(i) for i in ids) == "x"
    assert stream.flush() == tokenizer.decode(ids)[1:] == "\ufffd"


def test_stream_matches_decode_on_random_bytes(tmp_path, rng):
    tokenizer = byte_tokenizer_folder(tmp_path / "t")
    for _ in range(50):
        ids = rng.integers(0, 258, size=int(rng.integers(1, 30))).tolist()
        stream = StreamDecoder(tokenizer)
        assert "".join(stream.push(i) for i in ids) + stream.flush() == tokenizer.decode(ids)
