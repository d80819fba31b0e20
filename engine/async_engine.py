"""`AsyncEngine`: the engine behind an event loop.

Model steps run in a worker thread (`anyio.to_thread`), so the event loop never waits on one.
All engine state is touched by one side at a time: requests added or aborted while a step runs
are queued and applied right after it, on the event-loop side. Each request gets a
`RequestStream` of `StreamDelta`s; its final `RequestOutput` comes from `await stream.result()`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator
from typing import Any

import anyio
from anyio.abc import TaskGroup

from engine.config import EngineConfig
from engine.engine_core import EngineCore, KVStats
from engine.outputs import RequestOutput, StreamDelta
from engine.request import Request
from engine.sampling import SamplingParams

logger = logging.getLogger("agentrt.engine")


class EngineError(RuntimeError):
    """The engine failed a request it had accepted (an internal error, or the engine stopped)."""


class RequestStream:
    """Deltas of one request (all its n completions), then its final output."""

    def __init__(self, request_id: str, n: int):
        self.request_id = request_id
        self._send, self._recv = anyio.create_memory_object_stream[StreamDelta](math.inf)
        self._pending = n  # completions not finished yet
        self._done = anyio.Event()
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None

    def _push(self, delta: StreamDelta) -> None:
        self._send.send_nowait(delta)
        if delta.finished:
            self._pending -= 1

    def _finish(self, output: RequestOutput | None, error: BaseException | None = None) -> None:
        self._output, self._error = output, error
        self._send.close()
        self._done.set()

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[StreamDelta]:
        async for d in self._recv:
            yield d
        if self._error is not None:
            raise self._error

    async def result(self) -> RequestOutput:
        """Wait for the request to end (draining unread deltas) and return its full output."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._output is not None
        return self._output


class AsyncEngine:
    def __init__(self, config: EngineConfig | None = None, **overrides: Any):
        self.core = EngineCore(config, **overrides)
        self._streams: dict[str, RequestStream] = {}  # by request id, forks included
        self._roots: dict[str, str] = {}  # request id -> id of the request its stream belongs to
        self._root_reqs: dict[str, Request] = {}  # stream id -> its root Request, until the stream ends
        self._queued: list[tuple[str, tuple]] = []  # ("add"|"abort", args) received during a step
        self._stepping = False
        self._wake = anyio.Event()
        self._tg: TaskGroup | None = None
        self._closed = False

    @property
    def tokenizer(self):
        return self.core.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.core.config

    async def __aenter__(self) -> AsyncEngine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc)
        finally:
            self._closed = True
            for rid in list(self._streams):
                self._fail(rid, EngineError(f"engine stopped before request {rid!r} finished"))
            for req in list(self.core.requests.values()):
                self.core.abort(req.request_id)

    # ---- client side ---------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        program_id: str | None = None,
        thread_id: str | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queue a request; bad input raises ValueError here, before anything is queued."""
        if self._closed or self._tg is None:
            raise EngineError("AsyncEngine is not running: use `async with AsyncEngine(...) as engine`")
        params = params or SamplingParams()
        ids = self.core.validate_prompt(prompt)
        if request_id is None:
            request_id = f"req-{next(self.core._ids)}"
        if request_id in self._streams or request_id in self.core.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = RequestStream(request_id, params.n)
        self._streams[request_id] = stream
        args = (ids, params, request_id, program_id, thread_id, cache_salt)
        if self._stepping:
            self._queued.append(("add", args))
        else:
            self._add_now(args)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort"); unknown ids are ignored."""
        if self._stepping:
            self._queued.append(("abort", (request_id,)))
        else:
            self._abort_now(request_id)

    def kv_stats(self) -> KVStats:
        return self.core.kv_stats()

    # ---- engine side ---------------------------------------------------------------------
    def _add_now(self, args: tuple) -> None:
        ids, params, request_id, program_id, thread_id, cache_salt = args
        if request_id not in self._streams:  # aborted before it was added
            return
        try:
            req = self.core.add_request(ids, params, request_id, program_id, thread_id, cache_salt)
        except ValueError as e:
            self._fail(request_id, e)
            return
        self._root_reqs[request_id] = req
        for r in (req, *req.children):
            self._roots[r.request_id] = request_id

    def _abort_now(self, request_id: str) -> None:
        deltas = self.core.abort(request_id)
        if deltas:
            self._dispatch(deltas)
        elif request_id in self._streams and request_id not in self._roots:  # queued, never added
            self._fail(request_id, None, aborted=True)

    def _fail(self, request_id: str, error: BaseException | None, aborted: bool = False) -> None:
        stream = self._streams.pop(request_id, None)
        self._root_reqs.pop(request_id, None)
        if stream is None:
            return
        for rid in [k for k, v in self._roots.items() if v == request_id]:
            del self._roots[rid]
        if aborted:
            stream._push(StreamDelta(request_id, 0, [], "", True, "abort"))
        stream._finish(None if not aborted else RequestOutput(request_id, [], []), error)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for d in deltas:
            root = self._roots.get(d.request_id)
            stream = self._streams.get(root) if root is not None else None
            if stream is None:
                continue
            stream._push(d)
            if stream._pending == 0:
                root_req = self._root_reqs.pop(root, None)
                del self._streams[root]
                for rid in [k for k, v in self._roots.items() if v == root]:
                    del self._roots[rid]
                output = self.core.finished_output(root_req) if root_req is not None else None
                if output is not None and output.outputs and output.outputs[0].finish_reason == "error":
                    stream._finish(output, ValueError(output.outputs[0].error))
                else:
                    stream._finish(output)

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                await self._wake.wait()
                self._wake = anyio.Event()
                continue
            self._stepping = True
            try:
                deltas = await anyio.to_thread.run_sync(core.step)
            except Exception as e:  # an engine bug: fail what is in flight, keep serving
                logger.exception("engine step failed")
                self._stepping = False
                for rid in list(self._streams):
                    self._fail(rid, EngineError(f"engine step failed: {e!r}"))
                for req in list(core.requests.values()):
                    core.abort(req.request_id)
                continue
            finally:
                self._stepping = False
            self._dispatch(deltas)
            queued, self._queued = self._queued, []
            for kind, args in queued:
                self._add_now(args) if kind == "add" else self._abort_now(*args)
