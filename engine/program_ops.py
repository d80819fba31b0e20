"""Program operations: how the runtime's per-program decisions reach the engine.

The engine knows blocks and owners; agentrt decides what a program deserves and says so with these
typed operations, queued by `AsyncEngine.program_op` and applied between steps (`EngineCore.program_op`
-> `Scheduler.program_op`), on the engine's clock. They are the only way in: no attribute pokes.

    StartProgram(pid)            the program exists (pins give way in reverse start order)
    Reserve(pid, num_tokens)     set blocks aside for it (0: drop the reservation)
    Pin(pid, ttl_s)              keep its finished calls' cached blocks for ttl_s after each call ends
                                 (an existing pin's deadline moves to now + ttl_s; 0: no pins)
    Release(pid)                 drop its pins now and make no more (its last call, say)
    EndProgram(pid)              release everything it holds; the scheduling policy hears of it too
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StartProgram:
    program_id: str


@dataclass(frozen=True, slots=True)
class Reserve:
    program_id: str
    num_tokens: int  # tokens' worth of blocks to set aside; 0 drops the reservation

    def __post_init__(self) -> None:
        if not isinstance(self.num_tokens, int) or self.num_tokens < 0:
            raise ValueError(f"Reserve.num_tokens must be an int >= 0, got {self.num_tokens!r} "
                             f"(program {self.program_id!r})")


@dataclass(frozen=True, slots=True)
class Pin:
    program_id: str
    ttl_s: float  # seconds after each call's end (engine clock); 0 = no pins

    def __post_init__(self) -> None:
        if not isinstance(self.ttl_s, (int, float)) or not 0 <= self.ttl_s < math.inf:
            raise ValueError(f"Pin.ttl_s must be a finite number >= 0, got {self.ttl_s!r} (program {self.program_id!r})")


@dataclass(frozen=True, slots=True)
class Release:
    program_id: str


@dataclass(frozen=True, slots=True)
class EndProgram:
    program_id: str


ProgramOp = StartProgram | Reserve | Pin | Release | EndProgram
