"""OpenAI's response shapes: a request's answer and its streamed chunks (`_Format`), `usage`, the `doppler`
extension object, log-probabilities as JSON, and a server-sent event (`_sse`)."""

from __future__ import annotations

import json
import time
import uuid
from collections import Counter
from typing import Any

from doppler_py.api import GenerationResult
from doppler_py.ops.logprobs import TokenLogprob
from doppler_py.tool_calls import Delta


def usage(results: list[GenerationResult]) -> dict[str, Any]:
    """OpenAI's usage of a request's choices: the prompt once (with the tokens whose K/V choice 0 took from the
    prefix cache as its cached ones), every choice's completion tokens."""
    prompt = results[0]
    completion = sum(len(result.tokens) for result in results)
    return {
        "prompt_tokens": prompt.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": prompt.cached_tokens},
    }


def doppler_stats(result: GenerationResult) -> dict[str, Any]:
    """The extension object: what speculation did and what it saved."""
    return {
        "speculative": result.speculative,
        "drafted": result.drafted,
        "accepted": result.accepted,
        "acceptance_rate": round(result.acceptance_rate, 4),
        "mean_accepted_per_step": round(result.mean_accepted_per_step, 3),
        "tokens_per_s": round(result.tokens_per_s, 2),
        "elapsed_s": round(result.elapsed_s, 4),
        "time_saved_s": None if result.time_saved_s is None else round(result.time_saved_s, 4),
        "time_saved_s_err": None if result.time_saved_s_err is None else round(result.time_saved_s_err, 4),
    }


def _json_logprob(value: float) -> float:
    return value if value != float("-inf") else -9999.0  # JSON has no -inf; OpenAI sends -9999.0


class _Format:
    """OpenAI's response and chunk objects for one request."""

    def __init__(self, chat: bool, model: str, token_text):
        self.chat = chat
        self.model = model
        self.token_text = token_text  # token id -> its text
        # Completions' logprobs, per choice: where the next token's text starts (chunks continue it).
        self.text_offsets: Counter[int] = Counter()
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _object(self, kind: str, choices: list[dict], **extra: Any) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices} | extra

    def logprobs(self, entries: list[TokenLogprob] | None, index: int = 0) -> dict | None:
        """OpenAI's logprobs object of a choice: chat's {"content": [...]}, completions' parallel lists."""
        if entries is None:
            return None
        if self.chat:

            def item(token: int, logprob: float) -> dict:
                text = self.token_text(token)
                return {"token": text, "logprob": _json_logprob(logprob), "bytes": list(text.encode())}

            content = [item(e.token, e.logprob) | {"top_logprobs": [item(*t) for t in e.top]} for e in entries]
            return {"content": content, "refusal": None}
        texts = [self.token_text(e.token) for e in entries]
        offsets = []
        for text in texts:
            offsets.append(self.text_offsets[index])
            self.text_offsets[index] += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [_json_logprob(e.logprob) for e in entries],
            "top_logprobs": [{self.token_text(t): _json_logprob(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets,
        }

    def _choice(
        self, text: str | None, finish_reason: str | None, *, streaming: bool, logprobs=None, index: int = 0
    ) -> dict:
        logprobs = self.logprobs(logprobs, index)
        if not self.chat:
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        if streaming:
            delta = {"content": text} if text is not None else {}
            return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def response(self, results: list[GenerationResult]) -> dict:
        """The whole answer: results[i] is choice i's."""
        kind = "chat.completion" if self.chat else "text_completion"
        choices = []
        for index, result in enumerate(results):
            # An answer that called tools has no content: its text is the calls as written (`tool_calls` module).
            text = None if result.tool_calls else result.text
            choice = self._choice(text, result.finish_reason, streaming=False, logprobs=result.logprobs, index=index)
            if result.tool_calls:
                choice["message"]["tool_calls"] = result.tool_calls
            if len(results) > 1:
                choice["doppler"] = doppler_stats(result)
            choices.append(choice)
        return self._object(kind, choices, usage=usage(results), doppler=doppler_stats(results[0]))

    def delta_chunks(self, deltas: list[Delta], logprobs: list[TokenLogprob] | None, index: int = 0) -> list[dict]:
        """Chunks for a parsed piece of a tool-calling answer: content, a call's start, pieces of arguments
        (OpenAI's streaming shape); the piece's log-probs ride on the first (or an empty delta when none)."""
        chunks = []
        for i, delta in enumerate(deltas or [None]):
            choice = self._choice(None, None, streaming=True, logprobs=logprobs if i == 0 else None, index=index)
            if delta is None and choice["logprobs"] is None:
                return []
            if delta is not None and delta.kind == "content":
                choice["delta"] = {"content": delta.text}
            elif delta is not None:
                function = {"name": delta.name, "arguments": ""} if delta.kind == "call" else {"arguments": delta.text}
                head = {"id": delta.id, "type": "function"} if delta.kind == "call" else {}
                choice["delta"] = {"tool_calls": [{"index": delta.index} | head | {"function": function}]}
            chunks.append(self._object(self._chunk_kind, [choice]))
        return chunks

    @property
    def _chunk_kind(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def opening_chunks(self, choices: int = 1) -> list[dict]:
        if not self.chat:
            return []
        return [
            self._object(
                self._chunk_kind,
                [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}],
            )
            for i in range(choices)
        ]

    def piece_chunk(self, text: str, logprobs: list[TokenLogprob] | None = None, index: int = 0) -> dict:
        return self._object(
            self._chunk_kind, [self._choice(text, None, streaming=True, logprobs=logprobs, index=index)]
        )

    def finish_chunk(self, result: GenerationResult, index: int = 0, logprobs_sent: int = 0, **figures: Any) -> dict:
        """A choice's finish chunk (with the log-probs of tokens no piece carried, e.g. end of sequence)."""
        rest = None if result.logprobs is None else result.logprobs[logprobs_sent:]
        finish = self._choice(None, result.finish_reason, streaming=True, logprobs=rest, index=index)
        return self._object(self._chunk_kind, [finish], **figures)

    def usage_chunk(self, results: list[GenerationResult]) -> dict:
        """What OpenAI clients asking for usage expect last: a chunk with no choices."""
        return self._object(self._chunk_kind, [], usage=usage(results), doppler=doppler_stats(results[0]))


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"
