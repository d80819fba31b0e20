"""MLFQ: FastServe's skip-join multi-level feedback queue (arXiv 2305.05920), a request-level baseline.

Queue i has quantum `quantum * 2^i`. A new call skips to the highest queue whose quantum covers
its predicted prefill cost (prompt length x `prefill_cost`); a call that uses up its quantum drops
one level; a call that has waited `alpha` seconds since it was last served goes back to the top.
Programs play no part: every call is scheduled on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from agentrt._errors import ConfigError
from agentrt.engine.request import Request
from agentrt.policies._multilevel import CallState, MultiLevelPolicy, ProgramState, ServiceUnit

# Defaults per service unit. prefill_cost: executor seconds per prompt token of the default model
# on a 2-core CPU (measured: ~0.4 ms/token in large prefill batches); in token mode a prompt token
# costs `token_cost` like any other. alpha: FastServe promotes after a fixed wait; a few seconds is
# several tens of steps here.
DEFAULTS: dict[str, dict[str, float]] = {
    "time": {"quantum": 0.25, "prefill_cost": 4e-4, "alpha": 10.0},
    "tokens": {"quantum": 64.0, "prefill_cost": 1.0, "alpha": 10.0},
}


class MLFQ(MultiLevelPolicy):
    """Skip-join MLFQ; see the module docstring. None = the default for the service unit."""

    name: ClassVar[str] = "mlfq"
    program_level: ClassVar[bool] = False

    def __init__(
        self,
        *,
        num_queues: int = 8,
        quantum: float | None = None,
        prefill_cost: float | None = None,
        alpha: float | None = None,
        service: ServiceUnit = "time",
        token_cost: float = 1.0,
    ) -> None:
        if service not in DEFAULTS:
            raise ConfigError(f"{self.name}: service must be 'time' or 'tokens', got {service!r}")
        d = DEFAULTS[service]
        super().__init__(
            num_queues=num_queues,
            quantum=d["quantum"] if quantum is None else quantum,
            service=service,
            token_cost=token_cost,
        )
        self.prefill_cost = d["prefill_cost"] * (token_cost if service == "tokens" else 1.0) if prefill_cost is None else prefill_cost
        self.alpha = d["alpha"] if alpha is None else alpha
        if not self.prefill_cost >= 0:
            raise ConfigError(f"{self.name}: prefill_cost must be >= 0, got {self.prefill_cost!r}")
        if not self.alpha > 0:
            raise ConfigError(f"{self.name}: alpha must be > 0, got {self.alpha!r}")

    def entry_level(self, req: Request, prog: ProgramState, st: CallState) -> int:
        predicted = req.num_prompt_tokens * self.prefill_cost
        for level, quantum in enumerate(self.quanta):
            if quantum >= predicted:
                return level
        return self.num_queues - 1

    def starving(self, prog: ProgramState, st: CallState) -> bool:
        return st.wait >= self.alpha

    def on_step(self, reqs: Sequence[Request], service_s: Sequence[float], num_tokens: Sequence[int], now: float) -> None:
        super().on_step(reqs, service_s, num_tokens, now)
        for req in reqs:
            self.state(req).wait = 0.0  # alpha counts the wait since the call was last served
