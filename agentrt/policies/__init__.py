"""agentrt's scheduling policies, registered into the engine's policy seam by name on import:
`plas`, `atlas` (Autellix) and `mlfq` (FastServe); `fcfs` is the engine's own. `plas+ttl` and
`atlas+ttl` are PLAS / ATLAS composed with TTL retention (`TTL_SETTINGS`, agentrt/policies/autellix.py:
pinned programs first, no displacement, newest victims, admission control that keeps paused programs'
pins); given arguments override those settings."""

from __future__ import annotations

from agentrt.engine.policy import FCFS, register_policy
from agentrt.policies._multilevel import RUNNING_CAP_FORMS, CallState, MultiLevelPolicy, ProgramState, parse_running_cap
from agentrt.policies.autellix import ATLAS, PLAS, TTL_SETTINGS
from agentrt.policies.fastserve import MLFQ

for _cls in (PLAS, ATLAS, MLFQ):
    register_policy(_cls.name, _cls)
register_policy("plas+ttl", lambda **kw: PLAS(**{**TTL_SETTINGS, **kw}))
register_policy("atlas+ttl", lambda **kw: ATLAS(**{**TTL_SETTINGS, **kw}))
POLICY_NAMES = ("plas", "plas+ttl", "atlas", "atlas+ttl", "mlfq", "fcfs")  # for command-line choices

__all__ = ["ATLAS", "FCFS", "MLFQ", "PLAS", "POLICY_NAMES", "RUNNING_CAP_FORMS", "CallState", "MultiLevelPolicy",
           "ProgramState", "parse_running_cap"]
