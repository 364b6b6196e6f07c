"""Text ↔ token ids for a model folder: `tokenizer.json` through the `tokenizers` package, the chat template
from `tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2 the way transformers renders
it, and streaming detokenisation that never emits half of a multi-byte character.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from doppler_py.errors import GenerationOptionError, ModelFormatError, UnsupportedModelError

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_REPLACEMENT_CHARACTER = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelFormatError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(data, dict):
        raise ModelFormatError(f"{path}: expected a JSON object")
    return data


def _optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.exists() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json writes a special token as a string or as an AddedToken object.
    return value.get("content") if isinstance(value, dict) else value


def _id_list(value: Any) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.exists():
        return jinja_file.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template


class Tokenizer:
    """A model's tokenizer. Build it with `Tokenizer.from_dir(folder)`."""

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: dict[str, str | None],
        eos_token_ids: Sequence[int],
        chat_template: str | None,
        source: str,
    ):
        self.backend = backend  # a tokenizers.Tokenizer
        self.special_tokens = special_tokens
        self.eos_token_ids = tuple(eos_token_ids)
        self.chat_template = chat_template
        self.source = source

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        folder = Path(folder)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.exists():
            raise ModelFormatError(f"{tokenizer_file}: not found")
        try:
            backend = Backend.from_file(str(tokenizer_file))
        except Exception as exc:  # the tokenizers package raises plain Exception on malformed files
            raise ModelFormatError(f"{tokenizer_file}: cannot be read ({exc})") from None
        config = _optional_json(folder / "tokenizer_config.json")
        special = {key: _token_text(config.get(key)) for key in _SPECIAL_TOKEN_KEYS}

        # End of generation: the tokenizer's eos token, then what generation_config.json and config.json add.
        eos_ids: list[int] = []
        eos_id = backend.token_to_id(special["eos_token"]) if special["eos_token"] else None
        candidates = [eos_id] if eos_id is not None else []
        for name in ("generation_config.json", "config.json"):
            candidates += _id_list(_optional_json(folder / name).get("eos_token_id"))
        for token_id in candidates:
            if token_id not in eos_ids:
                eos_ids.append(token_id)
        return cls(
            backend,
            special_tokens=special,
            eos_token_ids=eos_ids,
            chat_template=_chat_template(folder, config),
            source=str(folder),
        )

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        bos = self.special_tokens["bos_token"]
        return self.backend.token_to_id(bos) if bos else None

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` adds what the tokenizer's post-processor adds (e.g. BOS)."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for a conversation, rendered like transformers' `apply_chat_template(tokenize=False)`.

        `extra` is passed to the template as more variables (e.g. `tools`). Templates that call
        `raise_exception` (roles out of order, ...) raise GenerationOptionError with their message.
        """
        import jinja2

        if self.chat_template is None:
            raise UnsupportedModelError(
                f"{self.source}: the model has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja)",
                advice="encode a plain prompt instead",
            )
        variables = {key: value for key, value in self.special_tokens.items() if value is not None}
        variables |= extra
        variables |= {"messages": list(messages), "add_generation_prompt": add_generation_prompt}
        try:
            return self._compiled_template.render(variables)
        except _TemplateRaised as exc:
            raise GenerationOptionError(f"chat template refused the messages: {exc}") from None
        except jinja2.TemplateError as exc:
            raise ModelFormatError(f"{self.source}: the chat template failed to render ({exc})") from None

    @cached_property
    def _compiled_template(self) -> Any:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as exc:
            raise ModelFormatError(f"{self.source}: the chat template does not parse ({exc})") from None

    def stream_decoder(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens=skip_special_tokens)


class _TemplateRaised(Exception):
    """A chat template called raise_exception()."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
    # jinja2's own tojson escapes HTML characters; chat templates expect plain JSON, as in transformers.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class StreamDecoder:
    """Turns token ids, one at a time, into text pieces whose concatenation is `decode(all ids)`.

    A piece is released only when the text decoded so far does not end in U+FFFD: a token may carry part of a
    multi-byte character (an emoji is often split over several byte-level tokens), and its bytes are held back
    until the character is complete. `flush()` releases whatever is held (as U+FFFD if it never completed).
    Decoding a short window of recent tokens, not just the new one, keeps context-dependent decoders right
    (e.g. the leading space a SentencePiece decoder drops only at the start of text).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self._window_start = 0  # the window starts with the last released piece's tokens
        self._released_end = 0  # tokens before this index have been released

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        released = self._decode(self.ids[self._window_start : self._released_end])
        text = self._decode(self.ids[self._window_start :])
        if len(text) <= len(released) or text.endswith(_REPLACEMENT_CHARACTER):
            return ""
        self._window_start, self._released_end = self._released_end, len(self.ids)
        return text[len(released) :]

    def flush(self) -> str:
        """Release held-back text at the end of a stream."""
        released = self._decode(self.ids[self._window_start : self._released_end])
        text = self._decode(self.ids[self._window_start :])
        self._window_start = self._released_end = len(self.ids)
        return text[len(released) :]
