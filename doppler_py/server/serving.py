"""Serving an `OpenAIServer` with uvicorn: `serve` (the `serve` command, until interrupted) and
`serving_in_background` (a free port in a background thread, for a program that is its own client)."""

from __future__ import annotations

import contextlib
import ipaddress
import sys
import threading
import time
from collections.abc import Iterator

from starlette.applications import Starlette

from doppler_py.api import Engine
from doppler_py.errors import DopplerError
from doppler_py.server.app import OpenAIServer, ServerConfig


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False


def serve(engine: Engine, config: ServerConfig = ServerConfig(), *, log_level: str = "info") -> None:
    """Serve `engine` until interrupted (Ctrl-C)."""
    import uvicorn

    server = OpenAIServer(engine, config)
    if not config.api_key and not is_loopback(config.host):
        print(
            f"doppler-py: warning: serving on {config.host} without an API key: anyone who can reach this address "
            "can use the model (set --api-key or DOPPLER_API_KEY)",
            file=sys.stderr,
            flush=True,
        )
    print(f"doppler-py: serving {server.model_id!r} at http://{config.host}:{config.port}/v1", flush=True)
    uvicorn.run(server.app, host=config.host, port=config.port, log_level=log_level, timeout_graceful_shutdown=5)


@contextlib.contextmanager
def serving_in_background(app: Starlette, host: str = "127.0.0.1") -> Iterator[str]:
    """`app` (an `OpenAIServer`'s) served by uvicorn on a free port of `host` in a background thread, for a Python
    program or notebook that serves and calls the server itself; yields the base URL and stops the server on exit."""
    import socket

    import uvicorn

    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="doppler-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise DopplerError(f"the server on {host}:{port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=60)
