"""`POST /v1/rerank` (also `/rerank`), in the shape llama.cpp's server and Jina/Cohere-style clients use: `query`,
`documents` (strings), `top_n`, `return_documents`, and `instruction` (ours: the task line of Qwen3-Reranker's
prompt) in; `results` of `index` and `relevance_score`, highest first, out (`Engine.rerank`). The request is admitted
as a generation is (`GenerationQueue.call`: 429 when the server is full)."""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from doppler_py.server.disconnect import _DISCONNECTED
from doppler_py.server.errors import RequestError
from doppler_py.server.parsing import _field

if TYPE_CHECKING:
    from doppler_py.server.app import OpenAIServer


async def rerank(server: OpenAIServer, request: Request) -> Response:
    body = await server._read_json(request)
    server._check_model(_field(body, "model", (str,), "a string"))
    query = _field(body, "query", (str,), "a string")
    documents = _field(body, "documents", (list,), "a list of strings")
    if query is None or documents is None:
        missing = "query" if query is None else "documents"
        raise RequestError(400, f"'{missing}' is required", param=missing)
    top_n = _field(body, "top_n", (int,), "a whole number")
    instruction = _field(body, "instruction", (str,), "a string")
    return_documents = _field(body, "return_documents", (bool,), "true or false")
    run = partial(server.engine.rerank_with_usage, query, documents, instruction=instruction, top_n=top_n)
    answer = await server.queue.call(request, run)  # admitted beside the generations (429 when full)
    if answer is _DISCONNECTED:
        return Response(status_code=499)
    ranked, tokens = answer
    results = []
    for result in ranked:
        entry = {"index": result.index, "relevance_score": result.relevance_score}
        if return_documents:
            entry["document"] = {"text": documents[result.index]}
        results.append(entry)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return JSONResponse({"object": "list", "model": server.model_id, "results": results, "usage": usage})
