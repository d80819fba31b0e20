"""The KV tiers in the simulator: the engine's own tier code (engine.kv_tiers.KVTiers, HostTier) over a
bookkeeping-only host tier and a file-less disk tier, with each tier's load time from a bandwidth model.

What is real: which blocks are demoted, found below T0, loaded instead of recomputed, and evicted from
each tier (the engine's `KVTiers`, `HostTier` and `KVCacheManager._promote`). What is modeled: a block's
load time (its bytes over the tier's bandwidth, charged to the step that needs it: loads are not overlapped
with compute, a conservative choice) and the disk writer (a written block is on disk after the step that
wrote it; writes cost the step nothing: they are DMA / a background thread in the engine).
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from agentrt.engine.kv_host import HostTier, TierStats
from agentrt.engine.kv_tiers import KVTiers, Moves


@dataclass(frozen=True, slots=True)
class TierCost:
    """Sizes and bandwidths of the tiers below one engine's KV cache, and a token's KV bytes."""

    kv_bytes_per_token: int
    host_tokens: int  # T1 capacity (0: no host tier)
    host_gb_s: float  # T1 -> T0 copy bandwidth
    disk_tokens: int  # T2 capacity (0: no disk tier)
    disk_gb_s: float  # T2 -> T0 read bandwidth
    source: str = ""
    in_place: bool = False  # T1 hits are read where they lie (a CPU engine's host tier, engine.kv_tiers): no load

    def load_s_per_block(self, tier: int, block_size: int) -> float:
        gb_s = self.host_gb_s if tier == 1 else self.disk_gb_s
        return self.kv_bytes_per_token * block_size / (gb_s * 1e9)


# One H100 SXM of a DGX H100 serving Llama-3.1-8B (KV 128 KiB/token, agentrt/bench/costs.py), from the spec sheets, not
# measured: T1 = 160 GB of the node's 2 TB host memory per GPU (pinned), loaded over PCIe 5.0 x16 (63 GB/s per
# direction, PCI-SIG) at ~80%: 50 GB/s; T2 = the GPU's share of the node's 8 x 3.84 TB U.2 NVMe data drives
# (one drive, 3.84 TB), read at 6 GB/s (PCIe 4.0 x4 NVMe drives' sequential read, ~7 GB/s on their sheets, less
# for 32 MiB reads through a file system).
H100_TIERS = TierCost(kv_bytes_per_token=131072, host_tokens=160_000_000_000 // 131072, host_gb_s=50.0,
                      disk_tokens=3_840_000_000_000 // 131072, disk_gb_s=6.0,
                      source="DGX H100 spec sheet (2 TB host memory, 8 x 3.84 TB NVMe), PCIe 5.0 x16 at 80%, "
                             "NVMe sequential read 6 GB/s; not measured")


class SimDisk:
    """The disk tier's bookkeeping without files: an LRU set of block hashes bounded in blocks, with the
    interface `KVTiers` uses of `engine.kv_disk.DiskTier`."""

    def __init__(self, max_blocks: int, block_bytes: int):
        self.max_blocks = max_blocks
        self.max_bytes = max_blocks * block_bytes
        self.block_bytes = block_bytes
        self.index: OrderedDict[bytes, None] = OrderedDict()
        self.stats = TierStats()
        self._lock = threading.Lock()
        self.dir = "(simulated)"

    def __len__(self) -> int:
        return len(self.index)

    def contains(self, h: bytes) -> bool:
        return h in self.index

    def maybe_rescan(self) -> None:
        pass

    def read(self, h: bytes, timed: bool = True) -> object | None:
        if h not in self.index:
            return None
        self.index.move_to_end(h)
        return True  # stands for the block's data

    def add(self, hashes: list[bytes]) -> None:
        for h in hashes:
            if h in self.index:
                continue
            if len(self.index) >= self.max_blocks:
                self.index.popitem(last=False)
                self.stats.evictions += 1
            self.index[h] = None
            self.stats.demotions += 1
        self.stats.blocks = len(self.index)
        self.stats.bytes = self.stats.blocks * self.block_bytes


def cpu_host(host_gib: float, model: str | None = None) -> TierCost:
    """The host tier (read in place) of a CPU engine serving `model` (None: the default) with `host_gib` of T1: a
    token's KV bytes from the model's config (bf16), nothing to load (in-place reads; the copies of a sequence's
    first and last blocks are left out)."""
    from agentrt.engine import loader

    path = loader.resolve_model(model)  # the default GGUF is converted once (a cached directory)
    cfg = json.loads((path / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    name = path.name
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 2
    return TierCost(kv_bytes_per_token=per_token, host_tokens=int(host_gib * 2**30) // per_token, host_gb_s=math.inf,
                    disk_tokens=0, disk_gb_s=math.inf, source=f"{name}'s KV, {host_gib:g} GiB read in place",
                    in_place=True)


def make_tiers(cost: TierCost, block_size: int, recompute_s_per_token: float, num_blocks: int = 0) -> KVTiers:
    """A `KVTiers` for a simulated engine with `num_blocks` blocks of `block_size` tokens."""
    shape = (cost.kv_bytes_per_token * block_size // 2,)  # bf16: a block's bytes, as one dimension
    if cost.in_place:
        tiers = KVTiers(shape, torch.bfloat16, "", host_bytes=cost.host_tokens * cost.kv_bytes_per_token,
                        prefetch=False, in_place=True)
        tiers.in_place_base = num_blocks  # T1's slots after the pool's blocks, as `attach` places them
    else:
        host = disk = None
        if cost.host_tokens:
            host = HostTier(cost.host_tokens // block_size, shape, torch.bfloat16, store=False)
        if cost.disk_tokens:
            disk = SimDisk(cost.disk_tokens // block_size, cost.kv_bytes_per_token * block_size)
        tiers = KVTiers(shape, torch.bfloat16, "", host=host, disk=disk, prefetch=False)
    tiers.block_size = block_size
    tiers.recompute_s_per_token = recompute_s_per_token
    tiers.probe_s_per_block = {t: cost.load_s_per_block(t, block_size) for t in (1, 2)}
    return tiers


def apply_moves(tiers: KVTiers, moves: Moves | None, cost: TierCost) -> float:
    """What the engine's `KVTiers.apply` does to the bookkeeping (blocks written reach the disk; counters), and
    the seconds the step waits for its loads."""
    if not moves:
        return 0.0
    seconds = 0.0
    saved = iter(moves.saved_hashes)
    bs = tiers.block_size
    for kind, blocks, _ in moves.ops:
        if kind in ("save", "write"):
            hashes = next(saved)
            if kind == "save" and tiers.host is not None:
                tiers.host.stats.demotions += len(blocks)
            if tiers.disk is not None:
                tiers.disk.add(hashes)
        else:
            tier = 1 if kind == "load" else 2
            dt = cost.load_s_per_block(tier, bs) * len(blocks)
            (tiers.host if tier == 1 else tiers.disk).stats.load_s += dt
            seconds += dt
    return seconds
