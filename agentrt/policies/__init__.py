"""agentrt's scheduling policies, registered into the engine's policy seam by name on import:
`plas`, `atlas` (Autellix) and `mlfq` (FastServe); `fcfs` is the engine's own. `plas+ttl` and
`atlas+ttl` are PLAS / ATLAS composed with TTL retention (`TTL_SETTINGS`, agentrt/policies/autellix.py:
pinned programs first within their queue, no displacement at all, newest victims; plain PLAS has the admission
control that keeps paused programs' pins too); given arguments override those settings."""

from __future__ import annotations

import json
from typing import Any

from agentrt.engine.policy import FCFS, make_policy, register_policy
from agentrt.policies._multilevel import RUNNING_CAP_FORMS, CallState, MultiLevelPolicy, ProgramState, parse_running_cap
from agentrt.policies.autellix import ATLAS, PLAS, TTL_SETTINGS
from agentrt.policies.fastserve import MLFQ

for _cls in (PLAS, ATLAS, MLFQ):
    register_policy(_cls.name, _cls)
register_policy("plas+ttl", lambda **kw: PLAS(**{**TTL_SETTINGS, **kw}))
register_policy("atlas+ttl", lambda **kw: ATLAS(**{**TTL_SETTINGS, **kw}))
POLICY_NAMES = ("plas", "plas+ttl", "atlas", "atlas+ttl", "mlfq", "fcfs")  # for command-line choices
POLICY_KWARGS_HELP = ("the policy's arguments as a JSON object, e.g. '{\"first_boundary\": 0.1, \"beta\": 4}' "
                      "(docs/programs.md, Scheduling policies; default: none, the policy's defaults)")


def policy_options(policy: str, text: str | None) -> dict[str, Any] | None:
    """`--policy-kwargs JSON` checked against the policy it is for: the arguments, or ValueError naming the flag
    and the bad value (the policy is built once here, so a wrong name or value fails before any model loads)."""
    if text is None:
        return None
    try:
        kwargs = json.loads(text)
    except ValueError:
        raise ValueError(f"--policy-kwargs must be a JSON object, got {text!r}") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"--policy-kwargs must be a JSON object, got {text!r}")
    try:
        make_policy(policy, **kwargs)
    except TypeError as e:
        raise ValueError(f"--policy-kwargs {text!r} for --policy {policy}: {e}") from None
    except ValueError as e:
        raise ValueError(f"--policy-kwargs for --policy {policy}: {e}") from None
    return kwargs

__all__ = ["ATLAS", "FCFS", "MLFQ", "PLAS", "POLICY_KWARGS_HELP", "POLICY_NAMES", "RUNNING_CAP_FORMS", "CallState",
           "MultiLevelPolicy", "ProgramState", "parse_running_cap", "policy_options"]
