"""LoRA adapters on a running server (docs/lora.md): which one a generation request uses, and the routes that list,
add and remove them without reloading the base model.

A request picks an adapter by its `model` ("<model id>:<adapter>", or the adapter's name alone) or by the field
`adapter`; neither: the base model. A name that is not loaded is a 400 naming it.

    GET    /v1/adapters          the loaded adapters (always served)
    POST   /v1/adapters          {"name": ..., "path": <a PEFT folder on the server's disk>, "dtype": "f32"|"f16"}
    DELETE /v1/adapters/{name}   unload it (a generation still running with it fails with a 400)

POST and DELETE read and change what the server runs, from paths on its own disk, so they are served only when the
server was started with `--lora-admin` (`ServerConfig.adapter_admin`); else they are 403s. Both run off the event
loop and join the generations' loop between two of its steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from doppler_py.errors import UnknownAdapterError
from doppler_py.server.disconnect import engine_call
from doppler_py.server.errors import RequestError
from doppler_py.server.parsing import _field

if TYPE_CHECKING:
    from doppler_py.server.app import OpenAIServer


def request_adapter(server: OpenAIServer, body: dict) -> dict:
    """`body` with the adapter its `model` names moved into its `adapter` field (checked: loaded, and not
    contradicting a given `adapter`); a `model` that is neither the base nor an adapter is the usual 404."""
    model = _field(body, "model", (str,), "a string")
    named = _model_adapter(server, model)
    given = _field(body, "adapter", (str,), "a string (a loaded LoRA adapter's name)")
    if named is not None and given is not None and given != named:
        raise RequestError(400, f"model {model!r} names adapter {named!r} but 'adapter' is {given!r}", param="adapter")
    adapter = named or given
    if adapter is not None and adapter not in server.engine.adapters:
        loaded = ", ".join(server.engine.adapters) or "none"
        raise RequestError(
            400,
            f"no LoRA adapter named {adapter!r} is loaded (loaded: {loaded})",
            param="model" if named else "adapter",
            code="UnknownAdapterError",
        )
    return body | {"adapter": adapter} if adapter is not None else body


def _model_adapter(server: OpenAIServer, model: Any) -> str | None:
    if model is None or model in (server.model_id, server.engine.name):
        return None
    base, sep, adapter = model.rpartition(":")
    if sep and base in (server.model_id, server.engine.name):
        return adapter  # checked by the caller, so an unknown one is a 400 naming it
    if model in server.engine.adapters:
        return model
    server._check_model(model)  # the 404 of a model not served here
    return None


def model_cards(server: OpenAIServer) -> list[dict]:
    """/v1/models' entries for the adapters: "<model id>:<adapter>" each."""
    return [
        {**server._model_card(), "id": f"{server.model_id}:{name}", "parent": server.model_id}
        for name in server.engine.adapters
    ]


def _card(server: OpenAIServer, name: str) -> dict:
    adapter = server.engine.model.adapters.adapter(name)
    return {
        "id": name,
        "object": "adapter",
        "model": f"{server.model_id}:{name}",
        "path": str(adapter.path),
        "rank": adapter.rank,
        "lora_alpha": adapter.alpha,
        "modules": adapter.modules,
    }


async def list_adapters(server: OpenAIServer, _request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_card(server, name) for name in server.engine.adapters]})


def _check_admin(server: OpenAIServer) -> None:
    if not server.config.adapter_admin:
        raise RequestError(
            403,
            "adding or removing adapters is off: start the server with --lora-admin to allow it",
            kind="permission_error",
        )


async def add_adapter(server: OpenAIServer, request: Request) -> Response:
    _check_admin(server)
    body = await server._read_json(request)
    name = _field(body, "name", (str,), "a string")
    path = _field(body, "path", (str,), "a string (a PEFT adapter folder on the server)")
    dtype = _field(body, "dtype", (str,), '"f32" or "f16"') or "f32"
    if not name or not path:
        raise RequestError(400, "'name' and 'path' are required", param="name" if not name else "path")
    await engine_call(request, lambda: server.engine.add_adapter(name, path, dtype))  # AdapterError: a 400
    return JSONResponse(_card(server, name), status_code=201)


async def remove_adapter(server: OpenAIServer, request: Request) -> Response:
    _check_admin(server)
    name = request.path_params["name"]
    try:
        await engine_call(request, lambda: server.engine.remove_adapter(name))
    except RequestError as exc:
        if exc.code == UnknownAdapterError.__name__:
            raise RequestError(404, exc.message, code=exc.code) from None
        raise
    return JSONResponse({"id": name, "object": "adapter", "deleted": True})
