"""Recurrent-state snapshots below the state pool's in-memory LRU (engine.recurrent_state): T1 and T2 for a hybrid
model's snapshots, as engine.kv_tiers is for its KV blocks.

A snapshot is stored flat: one fp32 vector, the conv states of every linear layer then their recurrent states
(`StateShape.bytes_per_state` bytes), keyed by the chained hash of the block that ends at its boundary (the KV
block's hash: the same prefix finds both).
- T1: a `HostTier` (engine.kv_host) whose slots are flat states, in host memory (pinned beside a GPU), LRU.
- T2: a `DiskTier` (engine.kv_disk) of one snapshot a file, exact fp32 bytes, in a subdirectory of the KV disk
  tier's directory named by the snapshot key (model, shape): each file's header names that key and a CRC of the
  state, so a truncated, corrupt or foreign file is never served; written by the disk tier's background thread;
  bounded by bytes, least recently used files deleted first; shared by engines on one host and across restarts.

Flow: a snapshot the pool evicts for room is copied into a T1 slot now (before the forward that overwrites its
entry) and queued for T2 (`demote`); a prefix lookup whose boundary has no snapshot in memory finds it in T1, else
reads and checks it from T2 (`fetch`), and the pool copies it back into an entry. Inclusive, as the KV tiers: a
promoted snapshot keeps its T1 slot and its file. A snapshot still in memory reaches T2 at shutdown (`flush`); it
is not written through when saved, as KV blocks are: a decode saves one every block it completes, and a state
weighs as much as many KV blocks.

Sizes: a hybrid model's snapshots take `SNAPSHOT_SHARE` of each KV tier's budget (kv_host_gib, kv_disk_gib), the
KV blocks the rest (engine.engine_core)."""

from __future__ import annotations

import os

import torch

from agentrt.engine.kv_disk import DiskTier
from agentrt.engine.kv_host import HostTier, block_key

# a quarter of each tier: a call's resume point needs one snapshot beside the KV of its whole prefix, and a
# Qwen3.5 state weighs as much as the KV of hundreds to thousands of tokens (its attention layers are a quarter of
# its layers), so each tier keeps about a resume point for every few thousand tokens of KV it keeps
SNAPSHOT_SHARE = 0.25
WRITE_BACKLOG_BYTES = 256 << 20  # snapshots queued for the disk writer, at most (each queued copy is a full state)


def snapshot_key(model_key: str, shape) -> str:
    """What a stored snapshot must match to be loaded: the model and the state's shape (engine.recurrent_state's
    StateShape)."""
    dims = "x".join(map(str, (shape.num_layers, shape.conv_dim, shape.conv_width, shape.num_heads, shape.key_dim,
                                shape.value_dim)))
    return f"{block_key(model_key, torch.float32, (shape.bytes_per_state() // 4,))}|recurrent-state {dims}"


class SnapshotTiers:
    """T1 and/or T2 for recurrent-state snapshots (module docstring); the pool's entries go in and come back as
    (conv, ssm) views: [layers, conv_dim, conv_width] and [layers, heads, key_dim, value_dim], fp32."""

    def __init__(self, shape, key: str, host_bytes: int = 0, disk_dir: str | os.PathLike | None = None,
                 disk_bytes: int = 0, pin: bool = False):
        self.shape = shape
        self.state_bytes = shape.bytes_per_state()
        self.numel = self.state_bytes // 4
        self.conv_numel = shape.num_layers * shape.conv_dim * shape.conv_width
        slots = host_bytes // self.state_bytes
        self.host = HostTier(slots, (self.numel,), torch.float32, pin) if slots else None
        self.disk = None
        if disk_dir is not None and disk_bytes > 0:
            self.disk = DiskTier(disk_dir, disk_bytes, key, (self.numel,), torch.float32, chunk_blocks=1,
                                 backlog=max(1, min(64, WRITE_BACKLOG_BYTES // self.state_bytes)))

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A flat state's (conv, ssm) views."""
        s, c = self.shape, self.conv_numel
        return (flat[:c].view(s.num_layers, s.conv_dim, s.conv_width),
                flat[c:].view(s.num_layers, s.num_heads, s.key_dim, s.value_dim))

    def _flat(self, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
        """A CPU copy of one state, that no one writes again (the disk writer's)."""
        flat = torch.empty(self.numel, dtype=torch.float32)
        a, b = self.views(flat)
        a.copy_(conv)
        b.copy_(ssm)
        return flat

    # ---- the pool's calls (engine thread) ----------------------------------------------------
    def has(self, h: bytes) -> bool:
        """Is snapshot `h` in T1 or T2 (no LRU refresh)?"""
        return (self.host is not None and h in self.host.slots) or (self.disk is not None and self.disk.contains(h))

    def maybe_rescan(self) -> None:
        """Look for snapshots another engine wrote to the shared directory (rate-limited by the disk tier)."""
        if self.disk is not None:
            self.disk.maybe_rescan()

    def demote(self, h: bytes, conv: torch.Tensor, ssm: torch.Tensor, keep: bytes | None = None) -> None:
        """The pool evicts snapshot `h` (its entry's views) to reuse the entry: copy it into a T1 slot now, taking
        none from `keep` (the snapshot being promoted into the entry), and queue it for T2."""
        host, disk = self.host, self.disk
        to_disk = disk is not None and not disk.has_all([h])
        if host is not None:
            if host.get(h) is not None:
                return  # already there (inclusive), and queued for the disk when it first came
            slot = host.put(h, keep=keep)
            if slot is None:
                host.stats.skipped += 1  # the only slot holds `keep`
            else:
                a, b = self.views(host.data[slot])
                a.copy_(conv)
                b.copy_(ssm)
                host.stats.demotions += 1
                if to_disk:
                    disk.submit([h], host.data[slot].clone()[None])
                return
        if to_disk:
            disk.submit([h], self._flat(conv, ssm)[None])

    def fetch(self, h: bytes) -> torch.Tensor | None:
        """Snapshot `h`, flat: a view of its T1 slot (most recently used now; a `demote` that keeps it leaves it as
        it is), else read from T2 and CRC-checked; None if it is in neither or its file is corrupt (dropped: the
        prefix is recomputed)."""
        if self.host is not None:
            slot = self.host.get(h)
            if slot is not None:
                self.host.stats.hits += 1
                return self.host.data[slot]
        if self.disk is None:
            return None
        data = self.disk.read(h)
        if data is not None:
            self.disk.count_hit()
        return data

    def flush(self, items, timeout_s: float = 60.0) -> None:
        """Write snapshots (`(hash, conv, ssm)` of the pool's entries) to T2 and wait (a graceful shutdown keeps
        what memory held)."""
        if self.disk is None:
            return
        for h, conv, ssm in items:
            if not self.disk.contains(h):
                self.disk.flush(timeout_s)  # one at a time: the backlog is a few states
                self.disk.submit([h], self._flat(conv, ssm)[None])
        self.disk.flush(timeout_s)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # ---- accounting ----------------------------------------------------------------------------
    def check(self) -> None:
        """Every T1 slot free or holding one snapshot; the disk index within its files and its bound."""
        if self.host is not None:
            self.host.check()
        if self.disk is not None:
            self.disk.check()

    def describe(self) -> str:
        """For the start-up log line: each tier's size in snapshots."""
        parts = []
        if self.host is not None:
            n = self.host.num_slots
            parts.append(f"host {n} snapshots ({n * self.state_bytes / 2**20:.1f} MiB)")
        if self.disk is not None:
            parts.append(f"disk {self.disk.max_bytes // self.state_bytes} snapshots ({self.disk.max_bytes / 2**20:.1f} "
                         f"MiB in {self.disk.dir}, {len(self.disk)} there)")
        return ", ".join(parts)
