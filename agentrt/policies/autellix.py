"""PLAS and ATLAS: program-level attained-service scheduling (Autellix, arXiv 2502.13965).

A program's priority is the service it has received so far, so short programs overtake long
ones without anyone predicting lengths:

- PLAS: priority = Σ executor service of the program's completed calls.
- ATLAS: priority = the program's longest critical path of service. A new call inherits it as its
  `start_priority`; on completion `critical = max(critical, start_priority + call service)`. Parallel
  threads of one program therefore share one priority and are scheduled together.

The priority is discretized into K queues with doubling boundaries `[0, b), [b, 2b), [2b, 4b), ...,
[2^(K-2) b, inf)`. A new call enters the queue holding its program's priority, and from then on moves
like a call in an MLFQ (see `_multilevel`). Anti-starvation: a waiting call goes to the top queue when
`(W_program + W_call) / (T_program + T_call) >= beta`, W = waiting seconds, T = service (T_program =
the program's attained service); afterwards only the call's own W and T restart from zero.
"""

from __future__ import annotations

from typing import ClassVar

from agentrt._errors import ConfigError
from agentrt.policies._multilevel import (
    CallState,
    MultiLevelPolicy,
    ProgramState,
    ServiceUnit,
    doubling,
    queue_of,
)
from engine.request import Request

# Defaults, per service unit; chosen with `bench/programs.py` on a 2-core CPU (docs/benchmarks.md),
# where one decode step of the default model takes 0.1-0.5 s and a short call receives ~0.5-2 s of
# executor time (the reimplementation's 0.02 s boundaries assume ~20 ms GPU steps: scaled ~50x).
#   K = 8 queues: range enough (first boundary x 64) to separate one-call chats from tree searches;
#     more levels only split long programs further, which buys nothing but preemptions.
#   first boundary 1 s: about one short call, so a program leaves the top queue after its first
#     real call and a fresh program overtakes it.
#   quantum 1 s (= the first boundary, not half): a demotion in the middle of a call lets newer
#     calls displace it, and every displacement is a recompute preemption (~14 ms per prompt token
#     here); fewer demotions, fewer recomputes. Not yet tuned to the benchmark target (see docs).
#   beta 8 (the reimplementation's): a program that has waited 8x the service it received is
#     promoted, so a long program in a stream of short ones keeps moving.
DEFAULTS: dict[str, dict[str, float]] = {
    "time": {"first_boundary": 1.0, "quantum": 1.0, "beta": 8.0},
    "tokens": {"first_boundary": 128.0, "quantum": 64.0, "beta": 8.0},
}
DEFAULT_NUM_QUEUES = 8


class PLAS(MultiLevelPolicy):
    """Program-level attained service, discretized into K queues; see the module docstring.

    Arguments (None = the default for the service unit, see `DEFAULTS`):
        num_queues: K.
        first_boundary: upper bound of queue 0 in service units; queue i ends at `first_boundary * 2^i`.
        quantum: service a call may receive in queue 0 before dropping a level; doubles per level.
        beta: anti-starvation threshold on wait/service; `float("inf")` disables promotion.
        service: "time" (executor seconds) or "tokens" (`token_cost` per computed token).
        preempt: let a call of a higher queue displace a running call of a lower one (recompute).
    """

    name: ClassVar[str] = "plas"

    def __init__(
        self,
        *,
        num_queues: int = DEFAULT_NUM_QUEUES,
        first_boundary: float | None = None,
        quantum: float | None = None,
        beta: float | None = None,
        service: ServiceUnit = "time",
        token_cost: float = 1.0,
        preempt: bool = True,
    ) -> None:
        if service not in DEFAULTS:
            raise ConfigError(f"{self.name}: service must be 'time' or 'tokens', got {service!r}")
        d = DEFAULTS[service]
        first_boundary = d["first_boundary"] if first_boundary is None else first_boundary
        beta = d["beta"] if beta is None else beta
        super().__init__(
            num_queues=num_queues,
            quantum=d["quantum"] if quantum is None else quantum,
            service=service,
            token_cost=token_cost,
            preempt=preempt,
        )
        if not first_boundary > 0:
            raise ConfigError(f"{self.name}: first_boundary must be > 0, got {first_boundary!r}")
        if not beta > 0:
            raise ConfigError(f"{self.name}: beta must be > 0, got {beta!r}")
        self.boundaries = doubling(first_boundary, num_queues - 1)  # finite upper bounds of queues 0..K-2
        self.beta = beta

    def program_priority(self, prog: ProgramState) -> float:
        return prog.attained

    def entry_level(self, req: Request, prog: ProgramState, st: CallState) -> int:
        st.start_priority = self.program_priority(prog)
        return queue_of(self.boundaries, st.start_priority)

    def starving(self, prog: ProgramState, st: CallState) -> bool:
        wait = prog.wait + st.wait
        service = prog.attained + st.service
        return wait >= self.beta * service if service > 0 else wait > 0

    def on_call_done(self, prog: ProgramState, st: CallState) -> None:
        prog.attained += st.total_service
        prog.critical = max(prog.critical, st.start_priority + st.total_service)


class ATLAS(PLAS):
    """PLAS with the program's critical path of service as its priority; see the module docstring."""

    name: ClassVar[str] = "atlas"

    def program_priority(self, prog: ProgramState) -> float:
        return prog.critical
