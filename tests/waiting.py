"""Waiting on a condition instead of sleeping a guessed time (issue 48).

A test that sleeps "long enough" for something to happen is slow when the machine is fast and flaky
when it is slow. These helpers poll the condition at a short interval and give up at a deadline with
an AssertionError naming what was awaited (and the last value seen, where ``describe`` is given).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 10.0
DEFAULT_INTERVAL_S = 0.01


class _Poll:
    """One look at the condition a call: its value once truthy, None before, AssertionError past the deadline."""

    def __init__(self, predicate: Callable[[], Any], what: str, timeout_s: float, interval_s: float,
                 describe: Callable[[], Any] | None) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")
        self.predicate, self.what, self.timeout_s, self.describe = predicate, what, timeout_s, describe
        self.deadline = time.monotonic() + timeout_s

    def __call__(self) -> Any:
        value = self.predicate()
        if value:
            return value
        if time.monotonic() >= self.deadline:
            message = f"timed out after {self.timeout_s:g} s waiting for {self.what}"
            if self.describe is not None:
                message += f" (last seen: {self.describe()!r})"
            raise AssertionError(message)
        return None


def wait_until(
    predicate: Callable[[], Any],
    what: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """Block until ``predicate()`` is truthy and return its value; AssertionError after ``timeout_s``."""
    poll = _Poll(predicate, what, timeout_s, interval_s, describe)
    while not (value := poll()):
        time.sleep(interval_s)
    return value


async def await_until(
    predicate: Callable[[], Any],
    what: str,
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    interval_s: float = DEFAULT_INTERVAL_S,
    describe: Callable[[], Any] | None = None,
) -> Any:
    """The async form of :func:`wait_until`: yields to the event loop (anyio) between polls."""
    import anyio

    poll = _Poll(predicate, what, timeout_s, interval_s, describe)
    while not (value := poll()):
        await anyio.sleep(interval_s)
    return value
