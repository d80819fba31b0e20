"""Recurrent state of a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet,
engine.linear_attention): per sequence a fixed-size state beside its paged KV, and snapshots of it at block
boundaries kept as prefix-cache entries.

- **Slots**: a running sequence holds one live slot: per linear layer its conv state (the last K - 1 inputs
  of the causal conv, [conv_dim, K - 1]) and its recurrent state ([heads, Dk, Dv]), fp32. A slot is taken when
  the runner first sees the request (zeroed, or restored from the snapshot its prefix hit ends at), and given
  back on every path that frees the request's KV (finish, abort, failure, preemption): the KV manager calls
  `on_free`. A fork (n > 1, beam search) copies its parent's slot (`on_fork`). The live tensors grow (double)
  when every slot is taken.
- **Snapshots**: the state after the token that ends a block, keyed by that block's chained hash (the KV
  manager's `block_hashes`: same prefix, same key), in a bounded LRU of `num_snapshots` entries (its tensors
  allocated once). A step that crosses a block boundary saves one: in decode at the token completing a block,
  in prefill at the last boundary of the scheduled chunk and at every multiple of `interval` tokens (256) it
  crosses (the scan is chunked at absolute multiples of `chunk`, which divides the block size, so any boundary
  is a chunk end). `usable_prefix` caps a prefix hit at the last block whose boundary has a snapshot: a request
  resumes from it, exactly (fp32 copies).
- **Tiers** (`tiers`, engine.recurrent_tiers, where the engine has KV tiers): a snapshot evicted for room is
  demoted to host memory (T1) and the disk (T2) instead of dropped, and a boundary whose snapshot is there counts
  for `usable_prefix` too: it is promoted back into an entry (an exact copy; from disk, CRC-checked) before the
  request's slot is restored from it. A promotion evicts the least recently used entry but those a lookup
  returned since the last step (`wanted`): a request admitted in the same schedule still finds its own.

Accounting: `num_free_slots + len(slot_of) == num_slots`, `num_free_snapshots + len(snapshots) ==
num_snapshots`, at every step; every T1 slot free or holding one snapshot, the disk index within its files and
bound; after all work every slot is free (`check`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agentrt.engine.recurrent_tiers import SnapshotTiers


@dataclass(slots=True, frozen=True)
class StateShape:
    num_layers: int  # linear-attention layers
    conv_dim: int  # channels of the causal conv (q, k and v of all heads)
    conv_width: int  # K - 1 inputs kept
    num_heads: int  # value heads of the recurrent state
    key_dim: int  # Dk
    value_dim: int  # Dv

    def bytes_per_state(self) -> int:
        return 4 * self.num_layers * (self.conv_dim * self.conv_width + self.num_heads * self.key_dim * self.value_dim)


@dataclass(slots=True)
class RecurrentStep:
    """What the linear layers of one forward read: where each sequence's state is and what to save."""

    pool: RecurrentStatePool
    slots: list[int]  # per sequence of the batch (batch order), its live slot
    starts: list[int]  # per sequence, the position of its first token this step
    query_start_loc: list[int]  # per sequence its first row in the flat batch; one past the last at the end
    snapshots: list[list[tuple[int, int]]]  # per sequence: (tokens of this step, snapshot entry) saved after them
    pending: list[tuple[bytes, int]] = field(default_factory=list)  # (key, entry) registered by `commit`
    decode_rows: tuple | None = None  # see `decode`, made by the first layer that asks

    def decode(self) -> tuple[list[int], torch.Tensor | None, torch.Tensor | None]:
        """The sequences with one row this step (they take one recurrent step together): (their indices in the
        batch, their rows in the flat batch, their slots), the tensors on the pool's device (None if none)."""
        if self.decode_rows is None:
            qsl = self.query_start_loc
            seqs = [i for i in range(len(self.slots)) if qsl[i + 1] - qsl[i] == 1]
            dev = self.pool.device

            def tensor(values):
                return torch.tensor(values, dtype=torch.long, device=dev) if seqs else None

            self.decode_rows = (seqs, tensor([qsl[i] for i in seqs]), tensor([self.slots[i] for i in seqs]))
        return self.decode_rows


class RecurrentStatePool:
    def __init__(self, shape: StateShape, num_slots: int, num_snapshots: int, block_size: int, device,
                 chunk: int = 64, interval: int = 256):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots!r}")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots!r}")
        self.shape = shape
        self.device = torch.device(device)
        self.block_size = block_size
        self.chunk = min(chunk, block_size)  # block sizes are powers of two: it divides them
        # a long prefill also saves the state every `interval` tokens (a multiple of the block size), so a request
        # sharing only its head (a system prompt, a program's other thread) resumes within `interval` of it
        self.interval = max(block_size, interval // block_size * block_size)
        self.conv, self.ssm = self._alloc(num_slots)  # live states
        self.snap_conv, self.snap_ssm = self._alloc(num_snapshots)
        self.free_slots = list(range(num_slots - 1, -1, -1))  # popped from the end: lowest first
        self.slot_of: dict[str, int] = {}  # request id -> its live slot
        self.snapshots: OrderedDict[bytes, int] = OrderedDict()  # key -> entry, least recently used first
        self.free_entries = list(range(num_snapshots - 1, -1, -1))
        self.block_hashes: Callable | None = None  # the KV manager's block_hashes(req, n); None = no snapshots
        self.tiers: SnapshotTiers | None = None  # where evicted snapshots go, and are found again (the engine's)
        self.wanted: set[bytes] = set()  # snapshots a lookup returned since the last step: a promotion keeps them
        self.hits = self.saves = 0  # snapshot resumes and saves (stats)

    @classmethod
    def for_model(cls, args, num_slots: int, num_snapshots: int, block_size: int, device) -> RecurrentStatePool | None:
        """The pool of a model's linear-attention layers (engine.model_args.ModelArgs), None for a model without."""
        la = args.linear
        if la is None:
            return None
        shape = StateShape(args.layer_kinds.count("linear_attention"), la.conv_dim, la.conv_kernel - 1, la.num_v_heads,
                           la.key_dim, la.value_dim)
        return cls(shape, num_slots, num_snapshots, block_size, device)

    def _alloc(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.shape
        return (torch.zeros(s.num_layers, n, s.conv_dim, s.conv_width, dtype=torch.float32, device=self.device),
                torch.zeros(s.num_layers, n, s.num_heads, s.key_dim, s.value_dim, dtype=torch.float32,
                            device=self.device))

    # ---- accounting ----------------------------------------------------------------------------
    @property
    def num_slots(self) -> int:
        return self.conv.shape[1]

    @property
    def num_free_slots(self) -> int:
        return len(self.free_slots)

    @property
    def num_snapshots(self) -> int:
        return self.snap_conv.shape[1]

    def check(self) -> None:
        """Every slot and snapshot entry is either free or held exactly once, in memory and in each tier below."""
        held = sorted(self.slot_of.values())
        assert sorted(self.free_slots + held) == list(range(self.num_slots)), "live slots lost or held twice"
        assert sorted(self.free_entries + list(self.snapshots.values())) == list(range(self.num_snapshots)), \
            "snapshot entries lost or held twice"
        assert self.wanted <= self.snapshots.keys(), "a wanted snapshot is not kept"
        if self.tiers is not None:
            self.tiers.check()

    # ---- live slots ----------------------------------------------------------------------------
    def new_slot(self) -> int:
        """A zeroed live slot (the tensors double when none is free)."""
        if not self.free_slots:
            n = self.num_slots
            conv, ssm = self._alloc(n)
            self.conv, self.ssm = torch.cat([self.conv, conv], dim=1), torch.cat([self.ssm, ssm], dim=1)
            self.free_slots = list(range(2 * n - 1, n - 1, -1))
        slot = self.free_slots.pop()
        self.conv[:, slot].zero_()
        self.ssm[:, slot].zero_()
        return slot

    def release_slot(self, slot: int) -> None:
        if slot in self.free_slots or not 0 <= slot < self.num_slots:
            raise ValueError(f"state slot {slot!r} is not held")
        self.free_slots.append(slot)

    def slot(self, req) -> int:
        """The request's live slot, taken now if it has none: zeroed at position 0, else restored from the snapshot
        at the end of its prefix hit (`num_computed_tokens`, a block boundary `usable_prefix` allowed)."""
        rid = req.request_id
        if rid in self.slot_of:
            return self.slot_of[rid]
        slot = self.new_slot()
        self.slot_of[rid] = slot
        done = req.num_computed_tokens
        if done:
            key = self._key(req, done)
            entry = self.snapshots.get(key) if key is not None else None
            if entry is None and key is not None and self.tiers is not None:
                entry = self._promote(key)
            if entry is None:
                self.on_free(req)
                raise RuntimeError(f"request {rid!r} resumes at token {done} but no state snapshot is kept there "
                                   "(its prefix hit should have been capped by usable_prefix)")
            self.snapshots.move_to_end(key)
            self.conv[:, slot] = self.snap_conv[:, entry]
            self.ssm[:, slot] = self.snap_ssm[:, entry]
            self.hits += 1
        return slot

    def _key(self, req, boundary: int) -> bytes | None:
        if self.block_hashes is None or boundary % self.block_size:
            return None
        return self.block_hashes(req, boundary // self.block_size)[-1]

    def _promote(self, key: bytes) -> int | None:
        """Copy snapshot `key` from the tiers into an entry (a free one, else the least recently used one not
        `wanted`, demoted first) and keep it there, most recently used; None if no entry can be had or the tiers
        cannot give it (gone, or a corrupt file)."""
        victim = None
        if not self.free_entries:
            victim = next((k for k in self.snapshots if k not in self.wanted), None)
            if victim is None:
                return None
        flat = self.tiers.fetch(key)
        if flat is None:
            return None
        entry = self.free_entries.pop() if victim is None else self._evict(victim, keep=key)
        conv, ssm = self.tiers.views(flat)
        self.snap_conv[:, entry].copy_(conv)
        self.snap_ssm[:, entry].copy_(ssm)
        self.snapshots[key] = entry
        return entry

    def _evict(self, key: bytes, keep: bytes | None = None) -> int:
        """Drop snapshot `key` from memory (to the tiers, if any, where it takes no room from `keep`): its entry,
        to reuse."""
        entry = self.snapshots.pop(key)
        self.wanted.discard(key)
        if self.tiers is not None:
            self.tiers.demote(key, self.snap_conv[:, entry], self.snap_ssm[:, entry], keep)
        return entry

    # ---- hooks the KV manager calls -----------------------------------------------------------
    def usable_prefix(self, hashes: list[bytes]) -> int:
        """How many of a prefix hit's blocks (their chained hashes, in order) a request may resume from: up to the
        last one whose boundary has a state snapshot (0: none), in memory or in a tier below (promoted now)."""
        tiers = self.tiers
        if tiers is not None and hashes and hashes[-1] not in self.snapshots:
            tiers.maybe_rescan()
        for n in range(len(hashes), 0, -1):
            h = hashes[n - 1]
            if h in self.snapshots or (tiers is not None and tiers.has(h) and self._promote(h) is not None):
                self.wanted.add(h)
                return n
        return 0

    def on_free(self, req) -> None:
        """The request's KV was freed (finish, abort, preemption): its live slot goes back."""
        slot = self.slot_of.pop(req.request_id, None)
        if slot is not None:
            self.release_slot(slot)

    def on_fork(self, parent, child) -> None:
        """`child` continues from `parent`'s state: a copy in a slot of its own."""
        if child.request_id in self.slot_of:
            raise ValueError(f"fork target {child.request_id!r} already holds a state slot")
        src = self.slot_of.get(parent.request_id)
        if src is None:
            return  # the parent has computed nothing yet: the child starts as it would
        dst = self.new_slot()
        self.slot_of[child.request_id] = dst
        self.conv[:, dst] = self.conv[:, src]
        self.ssm[:, dst] = self.ssm[:, src]

    def clear_snapshots(self) -> None:
        """Forget every snapshot in memory (reset_prefix_cache; as for KV blocks, the tiers below keep theirs)."""
        self.free_entries.extend(self.snapshots.values())
        self.snapshots.clear()
        self.wanted.clear()

    def flush_snapshots(self, timeout_s: float = 60.0) -> None:
        """Write the snapshots in memory to the disk tier and wait (a graceful shutdown; nothing without one)."""
        if self.tiers is not None:
            self.tiers.flush([(k, self.snap_conv[:, e], self.snap_ssm[:, e]) for k, e in self.snapshots.items()],
                             timeout_s)

    # ---- a step ------------------------------------------------------------------------------
    def prepare(self, reqs, num_tokens: list[int]) -> RecurrentStep:
        """The step's slots (taken and restored where new) and the snapshots it saves: for each request, at the
        last block boundary its tokens this step reach and at each multiple of `interval` tokens they cross, where
        that boundary has none yet."""
        slots, starts, qsl, snaps = [], [], [0], []
        for req, n in zip(reqs, num_tokens):
            slots.append(self.slot(req))
            start = req.num_computed_tokens
            starts.append(start)
            qsl.append(qsl[-1] + n)
            snaps.append([])
        self.wanted.clear()  # every request of the step has its slot: what a lookup returned is needed no more
        step = RecurrentStep(self, slots, starts, qsl, snaps)
        if self.block_hashes is None or not self.num_snapshots:
            return step
        bs, every = self.block_size, self.interval
        for i, (req, n) in enumerate(zip(reqs, num_tokens)):
            start = starts[i]
            end = min(start + n, req.num_tokens)  # known tokens only (drafts are not hashed)
            last = end // bs * bs
            if last <= start:
                continue
            # the last boundary first: when entries run short it is the one worth most (a call's next call resumes there)
            for boundary in [last, *range(last - 1 - (last - 1) % every, start, -every)]:
                if boundary <= start or (boundary != last and boundary % every):
                    continue
                key = self._key(req, boundary)
                if key in self.snapshots:
                    self.snapshots.move_to_end(key)
                    continue
                if any(key == k for k, _ in step.pending):
                    continue
                entry = self._take_entry(step)
                if entry is None:
                    break
                step.pending.append((key, entry))
                snaps[i].append((boundary - start, entry))
            snaps[i].sort()
        return step

    def _take_entry(self, step: RecurrentStep) -> int | None:
        if not self.free_entries:
            if not self.snapshots:
                return None  # every entry is being written this step
            return self._evict(next(iter(self.snapshots)))  # demoted now: the forward overwrites the entry
        return self.free_entries.pop()

    def commit(self, step: RecurrentStep) -> None:
        """The step's forward ran: its snapshots are written, register them."""
        for key, entry in step.pending:
            self.snapshots[key] = entry
        self.saves += len(step.pending)
        step.pending = []

    def abandon(self, step: RecurrentStep) -> None:
        """The step's forward failed: its snapshot entries go back unused."""
        self.free_entries.extend(e for _, e in step.pending)
        step.pending = []
