"""Scale-out: where each call goes among agentrt replicas (`agentrt.scale.router`, a pure function the
Ray router and the simulator share). Nothing here imports Ray."""

from agentrt.scale.router import Decision, ProgramHomes, ReplicaStats, RouterConfig, route

__all__ = ["Decision", "ProgramHomes", "ReplicaStats", "RouterConfig", "route"]
