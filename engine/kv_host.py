"""T1 of the KV hierarchy (engine.kv_tiers): block slots in host memory, and what every tier shares: its
counters (`TierStats`) and the key a stored block must match (`block_key`).

On a CPU engine the slots can be the tail of the engine's own KV tensor (`HostTier.share`): block tables then
name a slot where it lies (engine.kv_tiers, "in-place reads"), and a slot a table names (`in_use`) is never
evicted or overwritten."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class TierStats:
    """One tier's counters (cumulative unless noted)."""

    blocks: int = 0  # blocks held now
    bytes: int = 0  # bytes held now
    hits: int = 0  # blocks a prefix lookup found here (and loaded into T0)
    demotions: int = 0  # blocks written here
    evictions: int = 0  # blocks (T1) or files' blocks (T2) dropped to make room
    load_s: float = 0.0  # time spent loading blocks from here into T0
    write_s: float = 0.0  # time spent writing blocks here
    skipped: int = 0  # blocks not written: disk full, writer backlog, write error
    write_errors: int = 0  # writes that failed (the block is skipped; no call fails)
    corrupt: int = 0  # files found truncated, corrupt or foreign (never served)
    prefetched: int = 0  # blocks read ahead for a waiting call (T2)
    in_place: int = 0  # of `hits`, blocks a block table named where they lie instead of a copy (T1 on a CPU engine)


def block_key(model_key: str, dtype: torch.dtype, block_shape: tuple[int, ...]) -> str:
    """What a stored block must match to be loaded: the model, the KV dtype and a block's shape."""
    return f"{model_key}|{dtype}|{'x'.join(map(str, block_shape))}"


class HostTier:
    """T1: `num_slots` block slots in host memory, an LRU index hash -> slot (head = next victim).

    `int8` (opt-in, lossy): a slot holds the block as int8 with a scale per (layer, K/V, head), absmax over the
    block's tokens and head dims, about half the bytes of bf16; blocks demoted with `exact` (a sequence's first
    block, the attention sink, and the last full blocks a call left: the recent window) also keep a full copy
    in a side area of `exact_slots` full blocks (least recently written dropped first), read instead."""

    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False,
                 store: bool = True, int8: bool = False, exact_slots: int = 0):
        if num_slots < 1:
            raise ValueError(f"the host tier needs at least one block slot, got {num_slots}")
        if int8 and len(block_shape) != 5:
            raise ValueError(f"an int8 host tier needs blocks [layers, K/V, tokens, heads, head_dim], got {block_shape}")
        # `store` False: the bookkeeping alone (the simulator's engine, agentrt/bench/sim_engine.py)
        self.int8 = int8
        self.dtype = dtype
        self.data = (torch.empty((num_slots, *block_shape), dtype=torch.int8 if int8 else dtype, pin_memory=pin)
                     if store else None)
        self.num_slots = num_slots
        self.slots: OrderedDict[bytes, int] = OrderedDict()
        self.free: list[int] = list(range(num_slots - 1, -1, -1))
        self.block_shape = tuple(block_shape)
        self.block_bytes = int(torch.Size(block_shape).numel()) * dtype.itemsize
        self.slot_bytes = self.block_bytes
        if int8:
            layers, kv, _, heads, _ = block_shape
            self.scale = torch.empty((num_slots, layers, kv, 1, heads, 1), dtype=torch.float32) if store else None
            self.slot_bytes = int(torch.Size(block_shape).numel()) + layers * kv * heads * 4
            self.exact_data = torch.empty((max(1, exact_slots), *block_shape), dtype=dtype) if store else None
            self.exact_of: OrderedDict[int, int] = OrderedDict()  # slot -> its full copy in exact_data (LRU)
            self.exact_free = list(range(max(1, exact_slots) - 1, -1, -1))
            self.want_exact = [False] * num_slots  # set by `put`, for the write that follows
        self.in_use: set[int] = set()  # slots some block table names (in-place reads): never evicted, never written
        self.stats = TierStats()

    def share(self, data: torch.Tensor) -> None:
        """Hold the slots in `data` ([num_slots, *block_shape], a view of the engine's KV tensor on a CPU engine)
        instead of a tensor of their own, so a block table can name a slot where it lies."""
        if self.int8:
            raise ValueError("an int8 host tier cannot share the KV tensor: its slots hold another dtype")
        if tuple(data.shape) != (self.num_slots, *self.block_shape) or data.dtype != self.dtype:
            raise ValueError(f"the shared slots must be {self.num_slots} blocks of {self.block_shape} in {self.dtype}, "
                             f"got {tuple(data.shape)} in {data.dtype}")
        self.data = data

    def hold(self, slot: int, held: bool) -> None:
        """Slot `slot` is named by a block table now (`held`) or no longer: while it is, `put` never takes it."""
        if held:
            self.in_use.add(slot)
        else:
            self.in_use.discard(slot)

    @staticmethod
    def int8_slots(host_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype) -> tuple[int, int]:
        """(int8 slots, full-precision side slots) for `host_bytes`: 1/8 of the bytes for the exact copies."""
        layers, kv, _, heads, _ = block_shape
        numel = int(torch.Size(block_shape).numel())
        exact = max(1, host_bytes // 8 // (numel * dtype.itemsize))
        return max(1, (host_bytes - exact * numel * dtype.itemsize) // (numel + layers * kv * heads * 4)), exact

    def write(self, slots: list[int], data: torch.Tensor) -> None:
        """Store `data[i]` (a block, the KV dtype) in slot `slots[i]`."""
        idx = torch.tensor(slots, dtype=torch.long)
        if not self.int8:
            self.data.index_copy_(0, idx, data)
            return
        x = data.float()
        scale = x.abs().amax(dim=(3, 5), keepdim=True).clamp_min(1e-12) / 127.0
        self.data.index_copy_(0, idx, (x / scale).round_().clamp_(-127, 127).to(torch.int8))
        self.scale.index_copy_(0, idx, scale)
        for i, s in enumerate(slots):
            e = self.exact_of.pop(s, None)
            if not self.want_exact[s]:
                if e is not None:
                    self.exact_free.append(e)
                continue
            if e is None:
                if self.exact_free:
                    e = self.exact_free.pop()
                else:
                    _, e = self.exact_of.popitem(last=False)
            self.exact_data[e].copy_(data[i])
            self.exact_of[s] = e

    def read(self, slots: list[int]) -> torch.Tensor:
        """The blocks in `slots`, in the KV dtype."""
        idx = torch.tensor(slots, dtype=torch.long)
        if not self.int8:
            return self.data.index_select(0, idx)
        out = self.data.index_select(0, idx).to(self.dtype)
        out.mul_(self.scale.index_select(0, idx).to(self.dtype))
        for i, s in enumerate(slots):
            e = self.exact_of.get(s)
            if e is not None:
                out[i].copy_(self.exact_data[e])
        return out

    def get(self, h: bytes) -> int | None:
        s = self.slots.get(h)
        if s is not None:
            self.slots.move_to_end(h)
        return s

    def put(self, h: bytes, exact: bool = False, keep: bytes | None = None) -> int | None:
        """A slot for `h` (its own if it has one), evicting the least recently used entry other than `keep` (a block
        being loaded) and those a block table reads in place (`in_use`) if none is free; None if that leaves
        nothing to evict. `exact`: an int8 tier keeps a full copy too (the class docstring)."""
        s = self.slots.get(h)
        if s is not None:
            self.slots.move_to_end(h)
            return s
        if self.free:
            s = self.free.pop()
        else:
            in_use = self.in_use
            victim = next((v for v, vs in self.slots.items() if v != keep and vs not in in_use), None)
            if victim is None:
                return None
            s = self.slots.pop(victim)
            self.stats.evictions += 1
        self.slots[h] = s
        if self.int8:
            self.want_exact[s] = exact
        self.stats.blocks = len(self.slots)
        self.stats.bytes = self.stats.blocks * self.slot_bytes
        return s

    def check(self) -> None:
        """The invariants (tests)."""
        used = list(self.slots.values())
        assert len(set(used)) == len(used), "a T1 slot holds two hashes"
        assert not set(used) & set(self.free), "a T1 slot is both free and used"
        assert len(used) + len(self.free) == self.num_slots, "a T1 slot is lost"
        assert self.in_use <= set(used), "a T1 slot read in place holds no block"
