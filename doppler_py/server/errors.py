"""Refusals as the server answers them: `RequestError`, a status with OpenAI's error body, and the engine's errors
mapped to one (400 for what the request asked for, 500 for anything else)."""

from __future__ import annotations

from starlette.responses import JSONResponse

from doppler_py.errors import (
    AdapterError,
    CapacityError,
    DopplerError,
    GenerationOptionError,
    UnsupportedModelError,
    VocabularyMismatchError,
)

# Engine errors caused by what the request asked for; any other DopplerError is the server's fault.
_CLIENT_ERRORS = (GenerationOptionError, CapacityError, UnsupportedModelError, VocabularyMismatchError, AdapterError)


class RequestError(Exception):
    """A request the server refuses, answered with an OpenAI-style error body."""

    def __init__(
        self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None, code=None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def response(self) -> JSONResponse:
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(_error_body(self.message, self.kind, self.param, self.code), self.status, headers)


def _error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def _engine_error(exc: Exception) -> RequestError:
    if isinstance(exc, _CLIENT_ERRORS):
        return RequestError(400, str(exc), code=type(exc).__name__, param=getattr(exc, "option", None))
    if isinstance(exc, DopplerError):
        return RequestError(500, f"{type(exc).__name__}: {exc}", kind="server_error", code=type(exc).__name__)
    return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")
