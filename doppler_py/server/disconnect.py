"""Waiting on work while the client may leave: `_unless_disconnected` gives the work's result, or `_DISCONNECTED`
once the client has gone (shared by the OpenAI routes in `app` and Anthropic's in `messages_route`)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from doppler_py.server.errors import _engine_error

_DISCONNECTED = object()


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """The result of `work`, or _DISCONNECTED when the client goes away first."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    return task.result() if task.done() and not task.cancelled() else _DISCONNECTED


async def engine_call(request: Request, run: Callable[[], Any]) -> Any:
    """`run` (a blocking call into the engine) on an executor thread: its result, or _DISCONNECTED when the client
    went away first; the engine's errors raised as the request's (`_engine_error`)."""
    try:
        return await _unless_disconnected(request, asyncio.get_running_loop().run_in_executor(None, run))
    except Exception as exc:
        raise _engine_error(exc) from None
