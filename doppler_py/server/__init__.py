"""An OpenAI-compatible HTTP server over one `Engine` (Starlette app, served by uvicorn).

    doppler-py serve --model smollm2-135m-instruct --port 8000
    curl http://127.0.0.1:8000/v1/chat/completions -d '{"messages": [{"role": "user", "content": "Hi"}]}'

Endpoints: GET /v1/models, GET /v1/models/{id}, POST /v1/completions, POST /v1/chat/completions (both with
`"stream": true` for server-sent events in OpenAI's chunk format, ending with `data: [DONE]`), GET /health and GET
/metrics (Prometheus text); and Anthropic's Messages API, POST /v1/messages (streamed as Anthropic's events) and POST
/v1/messages/count_tokens, answered in Anthropic's shapes, errors included (`messages_route`).
Every response carries `usage` and a `doppler` object with the speculation figures of the generation.

`stop` (a string or up to 4) ends the text before the first stop string, with finish_reason "stop"; streamed
text never shows it. Extra request fields: `top_k`, `seed`, `speculative` ("auto", "none" or a drafter's name from
`speculative.registry.DRAFTERS`), `k` (pinned draft length) and
`tree` (true, false or "auto": token trees of lookup, draft-model, EAGLE or Medusa drafts, `k` nodes each,
`GenerationOptions.tree`).
A request's options are one `doppler_py.options.GenerationOptions` (checked there, 400 naming the field), built
over the server's defaults: options a request leaves out take them (the `serve` command's flags); without
`max_tokens` a prompt that leaves less room in the context than the default gets the room there is (finish_reason
"length"), as OpenAI's API does, where a request's own `max_tokens` that does not fit is refused (400). Features
that would silently change results (`best_of`, penalties, `logit_bias`, legacy `functions`) are refused with 400
rather than ignored.

`n` (1..16) asks for several choices, each a generation of its own (`index` i in `choices` and in every streamed
chunk): sampled with seed + i when the request has a seed (choice 0 is then the answer of the same request with
n = 1), with a seed of its own otherwise. A greedy request (temperature 0) runs once and repeats its answer, since
every choice would be the same. With `--parallel` the choices decode together, and choices after the first wait
until the first has prefilled the prompt, so they take it from the prefix cache instead of prefilling it again.
`usage` counts the prompt once, as OpenAI does (its cached tokens are those of choice 0), and the completion tokens
of every choice; the top-level `doppler` object is choice 0's, and with n > 1 each choice also carries its own.

Structured output: `response_format` (OpenAI's text / json_object / json_schema) on both endpoints, or the extra
fields `regex` and `grammar` (a Lark grammar, llguidance's dialect); at most one, checked before the request
queues (400 naming the field). A request that gives one replaces a constraint among the server's defaults.
Tool calls on /v1/chat/completions: `tools`, `tool_choice`, `parallel_tool_calls` as OpenAI has them, answered
with `message.tool_calls` and finish_reason "tool_calls", streamed as OpenAI streams them (a first delta with the
call's id, type and name, then pieces of its arguments); see `doppler_py.tool_calls` for the constraint and prompt.

Log-probabilities: chat `"logprobs": true` with `top_logprobs` 0..20, completions `"logprobs": N` (0..20),
answered in OpenAI's shapes, streamed chunks included (each carries its own tokens' entries). They are the
target model's log_softmax(logits / T) at the request's temperature (T = 1 when greedy), before top-k/top-p
filtering (see `GenerationOptions`); a log-probability of -inf is sent as -9999.0, as OpenAI does.

With an API key (`serve --api-key KEY`, or the DOPPLER_API_KEY environment variable), every /v1/* request
needs `Authorization: Bearer KEY` or `x-api-key: KEY` (compared in constant time; otherwise 401 with an OpenAI-style
error body, Anthropic's on /v1/messages); /health stays open. Binding a non-loopback address without a key prints a
warning.

Generations run on the engine's `parallel` worker threads (`serve --parallel N`, default 1): with more than
one, the running generations decode together, every step of each sharing one forward of the model
(`speculative.batch`), and each answer is the one it would be alone. Requests beyond those wait in a bounded
queue and a full queue answers 429. A client that disconnects (mid-stream or while queued)
cancels its generation, which closes the engine's stream iterator and so frees its KV cache.

The package, by concern: `parsing` (a request body to a `GenerationRequest`, validated), `errors` (`RequestError`
and the engine's errors as HTTP answers), `jobs` (a generation on a GPU worker thread, the queue that admits and
runs them), `openai_shapes` (OpenAI's response and chunk objects), `anthropic_parsing`, `anthropic_shapes` and
`messages_route` (Anthropic's Messages API: its requests; its answers, events and errors; its routes),
`disconnect` (waiting on work while the client may leave), `metrics` (/health's KV figures and /metrics'
Prometheus text), `app` (`OpenAIServer`: the Starlette routes) and `serving` (uvicorn: `serve`,
`serving_in_background`).
"""

from doppler_py.server.app import OpenAIServer, ServerConfig
from doppler_py.server.errors import RequestError
from doppler_py.server.parsing import _options as _options  # tests/speculative/test_registry.py parses options
from doppler_py.server.serving import is_loopback, serve, serving_in_background

__all__ = ["OpenAIServer", "RequestError", "ServerConfig", "is_loopback", "serve", "serving_in_background"]
