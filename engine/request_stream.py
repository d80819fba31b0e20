"""`RequestStream`: what a caller of `AsyncEngine.add_request` reads, one request's deltas then its output.

The engine pushes into the stream's `StreamSink` on the event loop; the stream holds the sink, never the other
way round, so a stream dropped unread can be collected (its finalizer, set by the engine, aborts the request).
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import AsyncIterator

import anyio

from agentrt.engine.outputs import RequestOutput, StreamDelta


class StreamSink:
    """The engine's side of one stream. Holds no reference to the `RequestStream`, so the user's
    object can be collected while the request runs (its finalizer then aborts the request)."""

    __slots__ = ("request_id", "n", "deltas", "changed", "open", "done", "output", "error", "finalizer")

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self.n = n  # completions
        self.deltas: deque[StreamDelta] = deque()  # pushed, not read yet
        self.changed = anyio.Event()  # set (and replaced by a fresh one) on every push and at the end
        self.open = set(range(n))  # completions without their final delta
        self.done = anyio.Event()
        self.output: RequestOutput | None = None
        self.error: BaseException | None = None
        self.finalizer: weakref.finalize | None = None

    def push(self, delta: StreamDelta) -> None:
        self.deltas.append(delta)
        if delta.finished:
            self.open.discard(delta.index)
        self._notify()

    def finish(self, output: RequestOutput | None, error: BaseException | None) -> None:
        self.output, self.error = output, error
        self.done.set()
        self._notify()
        if self.finalizer is not None:
            self.finalizer.detach()

    def _notify(self) -> None:
        changed, self.changed = self.changed, anyio.Event()
        changed.set()


class RequestStream:
    """Deltas of one request (all its n completions), then its final output. A stream dropped
    without being read to the end or aborted aborts its request when it is garbage-collected."""

    def __init__(self, sink: StreamSink):
        self.request_id = sink.request_id
        self._sink = sink

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamDelta]:
        sink = self._sink
        while True:
            while sink.deltas:
                yield sink.deltas.popleft()
            if sink.done.is_set():
                break
            await sink.changed.wait()
        if sink.error is not None:
            raise sink.error

    async def result(self) -> RequestOutput:
        """Wait for the request to end and return its full output."""
        await self._sink.done.wait()
        if self._sink.error is not None:
            raise self._sink.error
        assert self._sink.output is not None
        return self._sink.output
