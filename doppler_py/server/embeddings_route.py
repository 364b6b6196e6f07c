"""OpenAI's `POST /v1/embeddings` over the server's engine (`Engine.embeddings`): `input` a string, a list of strings,
a token list or a list of token lists; `dimensions` (Matryoshka truncation, embedding models only); `encoding_format`
"float" or "base64" (each vector's little-endian float32 bytes); `prompt_name` (ours: one of the model's named
prompts, e.g. "query"). Every input runs in the request's forwards, several side by side; the GPU is shared with
the generations' loop between its steps. The request is admitted as a generation is (`GenerationQueue.call`: 429
when the server is full). Refusals are 400s naming the field."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from doppler_py.embeddings import check_encoding_format
from doppler_py.server.disconnect import _DISCONNECTED
from doppler_py.server.errors import RequestError, _engine_error
from doppler_py.server.parsing import _field

if TYPE_CHECKING:
    from doppler_py.server.app import OpenAIServer


async def embeddings(server: OpenAIServer, request: Request) -> Response:
    body = await server._read_json(request)
    server._check_model(_field(body, "model", (str,), "a string"))
    if body.get("input") is None:
        raise RequestError(400, "'input' is required: a string, a list of strings or token lists", param="input")
    dimensions = _field(body, "dimensions", (int,), "a whole number")
    prompt_name = _field(body, "prompt_name", (str,), "the name of one of the model's prompts")
    encoding_format = body.get("encoding_format") or "float"
    _field(body, "user", (str,), "a string")  # accepted, as OpenAI's, and not used
    try:
        check_encoding_format(encoding_format)
    except Exception as exc:
        raise _engine_error(exc) from None
    run = partial(server.engine.embeddings, body["input"], dimensions=dimensions, prompt_name=prompt_name)
    result = await server.queue.call(request, run)  # admitted beside the generations (429 when full)
    if result is _DISCONNECTED:
        return Response(status_code=499)
    data = [
        {"object": "embedding", "index": i, "embedding": vector}
        for i, vector in enumerate(result.encoded(encoding_format))
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return JSONResponse({"object": "list", "data": data, "model": server.model_id, "usage": usage})
