"""One long-lived thread that builds an engine and runs all its model steps.

Why not `anyio.to_thread.run_sync`: on CPU, torch's ops run on OpenMP thread teams, one pool per thread
that starts parallel regions. When more OpenMP threads are alive than the machine has cores, libgomp
stops spinning between regions and puts its workers to sleep, so every one of the hundreds of
parallel regions in a step pays a wake-up. Building the engine on the event-loop thread (loading and
packing weights run parallel regions there, so that thread keeps a pool) and stepping it on a worker
thread (a second pool) made decode steps ~1.5x slower than the same steps on one thread (2-core
machine: 4 rows, 128-token context: 19-21 ms vs 13 ms). anyio's workers also change over time (an idle
one exits after 10 s), each change another pool. Here the engine is built on the thread that steps it,
and that thread lives as long as the engine, so the process keeps one pool for the engine (the event
loop thread, which never runs a parallel region, keeps none).
"""

from __future__ import annotations

import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.from_thread
import anyio.lowlevel

T = TypeVar("T")
_STOP = object()
_RUNNING: dict[threading.Thread, queue.SimpleQueue[Any]] = {}  # pruned of ended threads as new ones start
_RUNNING_LOCK = threading.Lock()


class EngineThread:
    """Runs callables one at a time on its own daemon thread; stops when closed or garbage-collected."""

    def __init__(self, name: str = "agentrt-engine"):
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=_serve, args=(self._jobs,), name=name, daemon=True)
        with _RUNNING_LOCK:
            for done in [t for t in _RUNNING if not t.is_alive()]:
                del _RUNNING[done]
            _RUNNING[self._thread] = self._jobs
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._jobs.put, _STOP)

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and wait for it (blocking: for set-up, before an event loop uses it)."""
        done = threading.Event()
        box: list[Any] = [None, None]

        def finish() -> None:
            done.set()

        self._jobs.put((fn, box, finish))
        done.wait()
        if box[1] is not None:
            raise box[1]
        return box[0]

    async def run(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the thread and await it. Like `anyio.to_thread.run_sync`, a cancelled caller still waits
        for `fn` to finish (a model step is never abandoned half-way), then sees the cancellation."""
        event = anyio.Event()
        token = anyio.lowlevel.current_token()
        box: list[Any] = [None, None]

        def finish() -> None:
            try:
                anyio.from_thread.run_sync(event.set, token=token)
            except RuntimeError:  # the event loop is gone: nobody is waiting any more
                pass

        self._jobs.put((fn, box, finish))
        with anyio.CancelScope(shield=True):
            await event.wait()
        await anyio.lowlevel.checkpoint_if_cancelled()
        if box[1] is not None:
            raise box[1]
        return box[0]

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()


@atexit.register
def _stop_all() -> None:
    """Stop the engine threads, and wait for those already told to stop, before the interpreter finalizes
    (a thread still inside torch while C++ destructors run ends the process with `terminate called
    without an active exception`)."""
    with _RUNNING_LOCK:
        running = list(_RUNNING.items())
    for _, jobs in running:
        jobs.put(_STOP)
    for thread, _ in running:
        thread.join(timeout=10)


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while True:
        job = jobs.get()
        if job is _STOP:
            return
        fn, box, finish = job
        try:
            box[0] = fn()
        except BaseException as e:  # handed to the caller
            box[1] = e
        finally:
            del fn
            finish()
