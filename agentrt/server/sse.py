"""Server-sent events, and work that stops when the client goes away.

`SSEResponse` streams an async iterator of events while listening for the client's disconnect;
on a disconnect the iterator is closed at once (not at its next chunk), so the engine request
behind it is aborted and its blocks freed. `until_disconnect` does the same for a non-streaming
handler, and `results` awaits calls' outputs that way.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:
    from agentrt._call import Call
    from agentrt.engine.outputs import RequestOutput

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


def event(obj: object) -> bytes:
    return b"data: " + msgspec.json.encode(obj) + b"\n\n"


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


async def _wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class SSEResponse(Response):
    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers({"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with contextlib.aclosing(self.events) as events, anyio.create_task_group() as tg:

            async def listen() -> None:
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()

            tg.start_soon(listen)
            try:
                await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
                async for chunk in events:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:  # the connection broke while sending
                pass
            tg.cancel_scope.cancel()


async def until_disconnect(request: Request, fn: Callable[[], Awaitable[T]]) -> T:
    """Await `fn()`; if the client disconnects first, cancel it and raise `ClientDisconnected`."""
    result: list[T] = []
    async with anyio.create_task_group() as tg:

        async def listen() -> None:
            await _wait_disconnect(request.receive)
            tg.cancel_scope.cancel()

        tg.start_soon(listen)
        result.append(await fn())
        tg.cancel_scope.cancel()
    if not result:
        raise ClientDisconnected()
    return result[0]


async def results(request: Request, calls: list[Call]) -> list[RequestOutput]:
    """The calls' outputs, in order; `ClientDisconnected` (the calls aborted) if the client goes first."""
    async def run() -> list[RequestOutput]:
        return [await c.result() for c in calls]

    try:
        return await until_disconnect(request, run)
    finally:
        for c in calls:
            if not c.closed:
                c.close()
