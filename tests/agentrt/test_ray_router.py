"""ProgramAffinityRouter's Ray hooks without a cluster: choose_replicas ranks by agentrt.scale.router, the
calls Ray reports sent and ended make a program live (running, then in a tool gap), and a DELETE of the
program forgets its home.

Skips, saying why, where the `ray` extra is not installed (`pip install agentrt[ray]`); CI installs it."""

from __future__ import annotations

from collections import namedtuple
from types import SimpleNamespace

import anyio
import pytest

pytest.importorskip("ray.serve", reason="ray[serve] is not installed: pip install 'agentrt[ray]'")

from agentrt.scale.ray_app import ProgramAffinityRouter  # noqa: E402


class _Loads(dict):
    """Stands in for Ray's replica queue-length cache (get by replica id)."""


ReplicaID = namedtuple("ReplicaID", "unique_id")  # hashable, as Ray's is


def _replica(name: str) -> SimpleNamespace:
    return SimpleNamespace(replica_id=ReplicaID(name))


def _request(rid: str, pid: str | None, *, ends: bool = False) -> SimpleNamespace:
    return SimpleNamespace(kwargs={"program_id": pid, "prompt_tokens": 100, "program_ends": ends},
                           metadata=SimpleNamespace(request_id=rid, internal_request_id=f"internal-{rid}"))


def test_ray_hooks_track_live_programs_and_a_delete_forgets_the_home():
    router = ProgramAffinityRouter.__new__(ProgramAffinityRouter)  # Ray builds it with its own arguments
    router.initialize_state()
    router._replica_queue_len_cache = loads = _Loads()
    a, b = _replica("a"), _replica("b")
    loads[a.replica_id], loads[b.replica_id] = 0, 1

    def choose(req: SimpleNamespace) -> list[str]:
        ranked = anyio.run(router.choose_replicas, [a, b], req)
        return [r.replica_id.unique_id for rank in ranked for r in rank]

    assert choose(_request("1", "p1")) == ["a", "b"]  # placed on the less loaded
    router.on_request_routed(_request("1", "p1"), a.replica_id, None)
    assert router.homes.active(0.0, 30.0)["a"] == 1 and router.sent == {"internal-1": "p1"}
    loads[a.replica_id] = 3
    assert choose(_request("2", "p2")) == ["b", "a"]  # p1 runs on a: the next program goes to b
    router.on_request_completed(a.replica_id, "internal-1")
    assert router.sent == {} and router.homes._homes["p1"].inflight == 0
    assert choose(_request("3", "p1")) == ["a", "b"]  # its later call goes home, busier or not
    router.on_request_completed(a.replica_id, "internal-unknown")  # a call of no program: nothing to do
    assert choose(_request("4", "p1", ends=True))[0] == "a"  # the DELETE goes where it lived ...
    assert router.homes.get("p1") is None  # ... and its home is forgotten
    assert router.decisions["home"] == 2 and router.decisions["placed"] == 2
