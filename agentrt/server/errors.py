"""Errors of the HTTP API, and the one place where every error becomes an OpenAI-style body.

    APIError(status, message, type, param, code)      raised by handlers for HTTP-level problems
    agentrt errors (InvalidCallError, ...)             mapped by `error_response`
    msgspec.ValidationError / DecodeError              a malformed body: 400 naming the field

A client never sees a traceback: anything else is logged and becomes a 500 with a generic message.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Awaitable, Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from agentrt._errors import (
    CallAbortedError,
    CallFailedError,
    InvalidCallError,
    ProgramExistsError,
    ProgramNotFoundError,
)
from agentrt.server.schemas import ErrorInfo, ErrorResponse

logger = logging.getLogger("agentrt.server")


class APIError(Exception):
    def __init__(
        self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
        code: str | None = None, headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", param, code)


_FIELD = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]*)`")


def to_api_error(exc: BaseException) -> APIError:
    """The API error a raised exception stands for."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, (msgspec.ValidationError, msgspec.DecodeError)):
        m, missing = _FIELD.search(str(exc)), _MISSING.search(str(exc))
        param = m.group(1) if m else None
        if missing:  # name the missing field itself, not the object that lacks it
            param = f"{param}.{missing.group(1)}" if param else missing.group(1)
        return bad_request(f"invalid request body: {exc}", param=param)
    if isinstance(exc, ProgramNotFoundError):
        return APIError(404, str(exc), "not_found_error", "program_id", "program_not_found")
    if isinstance(exc, ProgramExistsError):
        return APIError(409, str(exc), "conflict_error", "program_id", "program_exists")
    if isinstance(exc, InvalidCallError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, CallAbortedError):
        return APIError(409, str(exc), "conflict_error", None, "call_aborted")
    if isinstance(exc, CallFailedError):
        return APIError(500, str(exc), "server_error", None, "call_failed")
    logger.error("unhandled error in a request", exc_info=exc)
    return APIError(500, "internal server error", "server_error")


def error_body(err: APIError) -> bytes:
    return msgspec.json.encode(ErrorResponse(ErrorInfo(err.message, err.type, err.param, err.code)))


def error_response(exc: BaseException, render: Callable[[APIError], bytes] = error_body) -> Response:
    err = to_api_error(exc)
    return Response(render(err), err.status, headers=err.headers, media_type="application/json")


Handler = Callable[[Request], Awaitable[Response]]


def api_with(render: Callable[[APIError], bytes]) -> Callable[[Handler], Handler]:
    """A decorator for routes whose every error becomes a body `render` writes (and a client that left,
    an empty 499)."""
    from agentrt.server.sse import ClientDisconnected

    def decorate(fn: Handler) -> Handler:
        @functools.wraps(fn)
        async def handler(request: Request) -> Response:
            try:
                return await fn(request)
            except ClientDisconnected:
                return Response(status_code=499)
            except Exception as e:  # noqa: BLE001 - mapped, and logged when unexpected
                return error_response(e, render)

        return handler

    return decorate


api = api_with(error_body)  # OpenAI-style error bodies
