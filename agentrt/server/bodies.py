"""Request and response bodies every route shares: the size-capped read, the JSON response, the version."""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from agentrt.server.errors import APIError
from agentrt.server.schemas import decode


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("agentrt")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "0.0.0+unknown"


VERSION = _version()


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, or 413 once it passes `limit` bytes (checked while reading)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit} bytes (--max-body-bytes)",
                       "invalid_request_error", None, "body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (--max-body-bytes)",
                           "invalid_request_error", None, "body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def decode_body(request: Request, type_: type, limit: int) -> Any:
    """The request body (`read_body`) decoded into `type_` by `schemas.decode` (msgspec.ValidationError /
    DecodeError: a 400)."""
    return decode(await read_body(request, limit), type_)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status, media_type="application/json")
