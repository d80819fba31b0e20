"""Queue boundaries that follow the machine and the workload: the typical program's or call's service, fitted
online.

A fixed boundary in seconds means something else on every machine: 1 s of executor time is two calls of
the default model on one 2-core CPU, ten on another and a hundred on a GPU. A program-level policy only
needs to tell programs that received little from programs that received much, so its unit is what one
call of this workload receives on this engine: the median total service of the latest `window` finished
calls (in the policy's service unit, so it holds for "time" and "tokens" alike). PLAS's first queue then
ends at `scale` such calls, and a tree search that has run one round of parallel calls sits levels below
a program that has run none, whatever the speed of the machine.

The same fit over finished programs (their total service, when the runtime says they ended) gives PLAS a
boundary in programs' worth: a program that has received less than the typical finished program stays in the
first queue, whatever its calls look like (a call's service varies tenfold between a cold 500-token prompt and a
cached one, so calls' worth misplaces programs whose calls differ from the median call).

Until `min_calls` calls have finished the policy's fixed default is used; the median is refitted every
`every` finished calls (sorting at most `window` numbers). A median, not a mean: a few long prefills or a
fan-out of short branches must not move every program's queue.
"""

from __future__ import annotations

import collections
import statistics


class ServiceFit:
    """The median service of the latest finished calls (or programs), refitted every `every` of them (None until
    `min_calls`)."""

    def __init__(self, window: int = 256, every: int = 8, min_calls: int = 8) -> None:
        self.samples: collections.deque[float] = collections.deque(maxlen=window)
        self.every, self.min_calls = every, min_calls
        self.median: float | None = None
        self._since = 0

    def add(self, service: float) -> bool:
        """Record one finished call's service; True when the median changed."""
        if not service > 0:
            return False
        self.samples.append(service)
        self._since += 1
        if len(self.samples) < self.min_calls or (self.median is not None and self._since < self.every):
            return False
        self._since = 0
        median = statistics.median(self.samples)
        changed = median != self.median
        self.median = median
        return changed
