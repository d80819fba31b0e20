"""agentrt's scheduling policies, registered into the engine's policy seam by name on import:
`plas`, `atlas` (Autellix) and `mlfq` (FastServe); `fcfs` is the engine's own."""

from __future__ import annotations

from agentrt.policies._multilevel import CallState, MultiLevelPolicy, ProgramState
from agentrt.policies.autellix import ATLAS, PLAS
from agentrt.policies.fastserve import MLFQ
from engine.policy import FCFS, register_policy

for _cls in (PLAS, ATLAS, MLFQ):
    register_policy(_cls.name, _cls)

__all__ = ["ATLAS", "CallState", "FCFS", "MLFQ", "MultiLevelPolicy", "PLAS", "ProgramState"]
