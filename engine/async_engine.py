"""`AsyncEngine`: the engine behind an event loop.

Model steps run in the engine's own thread (`engine/engine_thread.py`, which also builds the engine),
so the event loop never waits on one.
All engine state is touched by one side at a time: requests added or aborted while a step runs
are queued and applied right after it, on the event-loop side. Each request gets a
`RequestStream` of `StreamDelta`s; its final `RequestOutput` comes from `await stream.result()`.

One bad request never hurts the others: `add_request` checks everything before it records
anything (a refused request leaves no trace), the core fails a request that errors while being
served alone, and the loop below survives any exception. Every per-request entry is dropped when
its stream ends, and a stream dropped unread (garbage-collected) aborts its request.

Program operations (`engine.program_ops`: start, reserve, pin, release, end) take the same road:
`program_op` applies one now, or queues it behind the adds and aborts received during a step; so do
`reset_prefix_cache` and `stats`, which their callers await. Work on the model (a LoRA adapter's load, a
score head) runs on the engine's thread between steps (`_on_engine_thread`). Above `engine/`, this class is
the only way in: `info` (engine.client.EngineInfo), `stats()`, `request_info`, `program_kv` and the
operations below; nothing there holds `core`.
"""

from __future__ import annotations

import logging
import queue
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from agentrt.engine.admission import CheckedRequest
from agentrt.engine.client import EngineInfo, EngineStats, RequestInfo, engine_info, engine_stats, request_info
from agentrt.engine.config import EngineConfig
from agentrt.engine.engine_core import EngineCore, KVStats, family_ids
from agentrt.engine.engine_thread import EngineThread
from agentrt.engine.llm import make_config
from agentrt.engine.lora import LoRAAdapter, LoRARequest
from agentrt.engine.outputs import CompletionOutput, RequestOutput, StreamDelta
from agentrt.engine.ownership import OwnerKV
from agentrt.engine.pooling import ClassificationOutput, classifications
from agentrt.engine.program_ops import ProgramOp
from agentrt.engine.request import Request
from agentrt.engine.request_stream import RequestStream, StreamSink
from agentrt.engine.sampling_params import SamplingParams
from agentrt.engine.structured import Constraint

T = TypeVar("T")

logger = logging.getLogger("agentrt.engine")


class EngineError(RuntimeError):
    """The engine failed a request it had accepted (an internal error, or the engine stopped)."""


@dataclass(slots=True)
class _Add:
    """An add received during a step, applied right after it."""

    sink: StreamSink
    checked: CheckedRequest  # admitted by the client side: the core queues it without checking again


@dataclass(slots=True)
class _Between:
    """Work on the core asked for during a step, done on the event loop right after it."""

    fn: Callable[[], Any]
    result: Any  # fn's answer; until it runs, the answer when the engine stops first
    done: anyio.Event = field(default_factory=anyio.Event)  # set once done (or the engine stopped)
    error: BaseException | None = None


class AsyncEngine:
    def __init__(self, model: str | EngineConfig | None = None, **config: Any):
        """The same arguments as `LLM`: a model path (None: the default model) and EngineConfig
        fields, or one EngineConfig."""
        cfg = make_config(model, config)
        self._thread = EngineThread()  # builds the engine and runs every step of it (engine/engine_thread.py)
        try:
            self.core = self._thread.call(lambda: EngineCore(cfg))
        except BaseException:
            self._thread.close()
            raise
        self.info: EngineInfo = engine_info(self.core)  # read-only, built once
        self._streams: dict[str, StreamSink] = {}  # root request id -> its stream's engine side, until it ends
        self._roots: dict[str, str] = {}  # request id (forks included) -> its root's id, until the stream ends
        self._root_reqs: dict[str, Request] = {}  # root id -> its Request once in the core, until the stream ends
        self._queued: list[_Add | str | ProgramOp | _Between] = []  # adds, aborts (by id), program ops and
        # other work on the core received during a step
        # streams collected unread; a finalizer may run on any thread, so a thread-safe queue. Drained
        # before every step: a request still in the core keeps the loop stepping, so no wake-up is needed.
        self._abandoned: queue.SimpleQueue[StreamSink] = queue.SimpleQueue()
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
        """Start serving (again, after an earlier `async with` ended: the model stays loaded)."""
        if self._tg is not None:
            raise EngineError("AsyncEngine is already running")
        if self._thread.closed:
            raise EngineError("AsyncEngine was closed: build a new one")
        self._closed = False
        self._wake = anyio.Event()
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._run)
        return self

    async def __aexit__(self, *exc) -> bool | None:
        assert self._tg is not None
        self._closed = True
        self._tg.cancel_scope.cancel()
        try:
            return await self._tg.__aexit__(*exc)
        finally:
            self._tg = None
            self._stepping = False
            for item in self._queued:
                if isinstance(item, _Between):
                    item.done.set()
            self._queued.clear()
            for rid in list(self._streams):
                self._fail(rid, EngineError(f"engine stopped before request {rid!r} finished"))
            for rid in list(self.core._families):
                self.core.release(rid)
            self._reap_abandoned()

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
        lora_request: LoRARequest | LoRAAdapter | None = None,
    ) -> RequestStream:
        """Queue a request. Everything is checked here, before anything is recorded: bad input raises
        `InvalidRequestError` (a ValueError; `InvalidRequestTypeError` is also a TypeError) naming the
        field and value, and leaves no trace."""
        if self._closed or self._tg is None:
            raise EngineError("AsyncEngine is not running: use `async with AsyncEngine(...) as engine`")
        checked = self.core.admit(prompt, params, request_id, program_id, thread_id, cache_salt, taken=self._roots,
                                  lora_request=lora_request)
        request_id, params = checked.request_id, checked.params
        sink = StreamSink(request_id, params.n)
        stream = RequestStream(sink)
        add = _Add(sink, checked)
        self._streams[request_id] = sink
        for rid in family_ids(request_id, params.n) if params.n > 1 else (request_id,):
            self._roots[rid] = request_id
        if self._stepping:
            self._queued.append(add)
        else:
            try:
                self._add_now(add)
            except BaseException:
                self._forget(request_id)
                raise
        sink.finalizer = weakref.finalize(stream, self._abandoned.put, sink)
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (its stream ends with finish_reason "abort"); unknown ids are ignored."""
        if self._stepping:
            self._queued.append(request_id)
        else:
            self._abort_now(request_id)

    def program_op(self, op: ProgramOp) -> None:
        """Apply a program operation between steps, in order with this engine's adds and aborts."""
        if self._stepping:
            self._queued.append(op)
        else:
            self.core.program_op(op)
            self._wake.set()  # idle, the loop sleeps until the earliest pin deadline: this op may have moved it

    async def reset_prefix_cache(self) -> bool:
        """vLLM's reset_prefix_cache, between steps (EngineCore.reset_prefix_cache): cached blocks no one holds
        are forgotten. True when nothing cached is left (False too when the engine stopped first)."""
        return await self._between_steps(self.core.reset_prefix_cache, False)

    async def stats(self) -> EngineStats:
        """A snapshot of the engine's state, taken between steps (engine.client.EngineStats)."""
        stats = await self._between_steps(self._snapshot, None)
        return stats if stats is not None else self._snapshot()  # the engine stopped meanwhile

    def _snapshot(self) -> EngineStats:
        return engine_stats(self.core, self.num_tracked())

    def request_info(self, request_id: str) -> RequestInfo | None:
        """An unfinished request's blocks and queue level (None once it is not in the engine)."""
        return request_info(self.core, request_id)

    def program_kv(self, program_id: str) -> OwnerKV:
        """A program's KV: blocks held, pinned, reserved; its TTL hits, misses, expiries (engine.ownership)."""
        return self.core.kv.owner_kv(program_id)

    def check_prompt(self, prompt: str | list[int]) -> list[int]:
        """The token ids of a prompt that can run; InvalidRequestError naming what is wrong otherwise."""
        return self.core.validate_prompt(prompt)

    def compile_constraint(self, constraint: Constraint) -> None:
        """Compile (cached) an output grammar; InvalidRequestError if it does not compile. Blocking: call it
        from a worker thread. Not on the engine's thread: a compile can take longer than many steps, and the
        grammar cache is thread-safe (engine.structured.GrammarCache)."""
        self.core.compile_constraint(constraint)

    async def load_lora(self, lora_request: LoRARequest) -> LoRAAdapter:
        """Load (once) the adapter a request names, on the engine's thread between steps; InvalidRequestError
        when it cannot serve (engine.lora)."""
        adapter = await self._on_engine_thread(lambda: self.core.lora_adapter(lora_request))
        assert adapter is not None
        return adapter

    def unload_lora(self, lora_int_id: int) -> bool:
        """Drop a loaded adapter (requests running with it keep theirs); False if it is not loaded."""
        loras = self.core.loras
        return loras is not None and loras.remove(lora_int_id)

    async def classify(self, request_ids: list[str], pooled: list[list[float]]) -> list[ClassificationOutput]:
        """Class probabilities of pooled last-token states (`LLM.classify`'s), through the model's score head
        on the engine's thread between steps."""
        return await self._on_engine_thread(
            lambda: classifications(self.core.model, self.core.hf_config, request_ids, pooled))

    def close(self) -> None:
        """Stop the engine's thread once it is not serving (it cannot serve again). An engine dropped without
        `close` stops it when collected; a process that builds engines one after another (benchmarks, a
        `Runtime` each) closes each, or their idle threads keep OpenMP pools that slow the next one's steps."""
        if self._tg is not None:
            raise EngineError("the engine is serving: leave `async with` before closing it")
        if self.core.tiers is not None and not self._thread.closed:
            try:  # the KV cache's blocks to the disk tier (a restarted engine finds them), its writer stopped
                self._thread.call(self.core.close)
            except Exception:
                logger.exception("closing the KV tiers failed")
        self._thread.close()

    def call_on_engine_thread(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread that builds and steps this engine, and wait for it (blocking). For tools that
        drive `self.core` directly while the engine is not serving (calibration): CPU steps run fastest on
        that thread (engine/engine_thread.py)."""
        if self._tg is not None:
            raise EngineError("the engine is serving: stop it (leave `async with`) before driving its core directly")
        return self._thread.call(fn)

    def kv_stats(self) -> KVStats:
        return self.core.kv_stats()

    async def _between_steps(self, fn: Callable[[], T], if_stopped: T) -> T:
        """`fn()` now when no step runs, else right after the running one (`if_stopped` if the engine stops
        first)."""
        if not self._stepping:
            return fn()
        item = _Between(fn, if_stopped)
        self._queued.append(item)
        await item.done.wait()
        if item.error is not None:
            raise item.error
        return item.result

    async def _on_engine_thread(self, fn: Callable[[], T]) -> T:
        """`fn()` on the engine's thread, after the step it runs now (steps queue behind it)."""
        if self._thread.closed:
            raise EngineError("AsyncEngine was closed: build a new one")
        return await self._thread.run(fn)

    def num_tracked(self) -> dict[str, int]:
        """Entries of every per-request map, here and in the core (debugging, leak tests): all 0 once
        every stream has ended."""
        counts = {"streams": len(self._streams), "roots": len(self._roots), "root_reqs": len(self._root_reqs),
                  "queued": len(self._queued), "abandoned": self._abandoned.qsize()}
        counts.update({f"core.{k}": v for k, v in self.core.num_tracked().items()})
        return counts

    # ---- engine side ---------------------------------------------------------------------
    def _add_now(self, add: _Add) -> None:
        rid = add.sink.request_id
        if self._streams.get(rid) is not add.sink:  # aborted (and maybe the id reused) before it was added
            return
        self._root_reqs[rid] = self.core.add_checked(add.checked)

    def _abort_now(self, request_id: str) -> None:
        sink = self._streams.get(request_id)
        if sink is not None and request_id not in self._root_reqs:  # queued, never added
            for i in range(sink.n):
                sink.push(StreamDelta(request_id, i, [], "", True, "abort"))
            comps = [CompletionOutput(i, "", [], "abort") for i in range(sink.n)]
            self._forget(request_id)
            sink.finish(RequestOutput(request_id, [], comps), None)
            return
        self._dispatch(self.core.abort(request_id))

    def _forget(self, root: str) -> StreamSink | None:
        """Drop a stream's entries here (not the core's)."""
        sink = self._streams.pop(root, None)
        self._root_reqs.pop(root, None)
        if sink is not None:
            for rid in family_ids(root, sink.n):
                self._roots.pop(rid, None)
        return sink

    def _fail(self, root: str, error: BaseException) -> None:
        """End a stream with `error`, releasing its request in the core."""
        try:
            self.core.release(root)
        except Exception:
            logger.exception("releasing request %r failed", root)
        sink = self._forget(root)
        if sink is not None:
            sink.finish(None, error)

    def _dispatch(self, deltas: list[StreamDelta]) -> None:
        for d in deltas:
            root = self._roots.get(d.request_id)
            if root is None:
                continue
            try:
                self._dispatch_one(root, d)
            except Exception as e:
                logger.exception("delivering output of request %r failed", root)
                self._fail(root, EngineError(f"delivering output of request {root!r} failed: {e!r}"))

    def _dispatch_one(self, root: str, d: StreamDelta) -> None:
        sink = self._streams.get(root)
        if sink is None:
            return
        sink.push(d)
        if sink.open:
            return
        req = self._root_reqs.get(root)
        output = self.core.finished_output(req) if req is not None else None
        self._forget(root)
        if output is not None and output.outputs and output.outputs[0].finish_reason == "error":
            sink.finish(output, ValueError(output.outputs[0].error))
        else:
            sink.finish(output, None)

    def _reap_abandoned(self) -> None:
        """Abort the requests of streams collected unread."""
        while True:
            try:
                sink = self._abandoned.get_nowait()
            except queue.Empty:
                return
            if self._streams.get(sink.request_id) is sink:
                logger.info("request %r: its stream was dropped unread; aborting it", sink.request_id)
                self._abort_now(sink.request_id)

    def _fail_everything(self, e: Exception) -> list[StreamDelta]:
        """An error outside any one request (a bug): fail what is in flight, keep serving."""
        msg = f"engine step failed: {e!r}"
        try:
            return self.core.fail_all(msg)
        except Exception:
            logger.exception("failing the in-flight requests failed")
            for rid in list(self._streams):
                self._fail(rid, EngineError(msg))
            return []

    async def _run(self) -> None:
        core = self.core
        while True:
            try:
                self._reap_abandoned()
            except Exception:
                logger.exception("aborting abandoned requests failed")
            if not core.has_work():
                with anyio.move_on_after(core.expire_pins()):  # idle: no steps, so pins expire from here
                    await self._wake.wait()
                    self._wake = anyio.Event()
                continue
            self._stepping = True
            try:
                deltas = await self._thread.run(core.step)
            except Exception as e:
                logger.exception("engine step failed")
                deltas = self._fail_everything(e)
            finally:
                self._stepping = False
            self._dispatch(deltas)
            queued, self._queued = self._queued, []
            for item in queued:
                try:
                    if isinstance(item, _Add):
                        self._add_now(item)
                    elif isinstance(item, str):
                        self._abort_now(item)
                    elif isinstance(item, _Between):
                        try:
                            item.result = item.fn()
                        except Exception as e:
                            item.error = e
                        finally:
                            item.done.set()
                    else:
                        self.core.program_op(item)
                except Exception as e:
                    rid = item.sink.request_id if isinstance(item, _Add) else item
                    logger.exception("applying a queued add/abort/program op %r failed", rid)
                    if isinstance(item, _Add):
                        self._fail(rid, e)
