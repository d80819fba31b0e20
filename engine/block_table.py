"""Block tables kept per sequence across steps: the step metadata of the model runner.

A running request owns one row of a persistent `[rows, cols]` int32 array per layer group (its block
table in group 0: `req.block_ids`; groups 1..G-1: `req.extra_tables`), taken when it is first scheduled
and given back when it leaves the running set (finished, aborted, failed or preempted). Each step a row
changes by the block ids its request's table gained since the last step (its tail), and is rewritten
whole only when the request's `blocks_version` changed (the KV manager replaced, merged or dropped an
entry: copy-on-write, dedup, free, fork), when its table is another list object, or when the request
carries no version (then it is rewritten every step: correct, not fast). Entries past a row's table are 0,
and a window group's entries for blocks that left its window (-1 in the request's table) are written as
block 0 when a row is written; a block that leaves the window later does not bump the version, so the row
keeps naming it: no query attends there, whatever the block holds now.

Per step, `prepare` walks the batch once (a few attribute reads per sequence, never a loop over a
sequence's blocks) and computes positions and slot mappings with numpy: `slot = table[row, pos //
block_size] * block_size + pos % block_size` for every new token at once. The batch's block table is a
view of the persistent rows when the batch holds consecutive rows in order (steady decode), else one
row gather; it stays valid until the next `prepare`.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from agentrt.engine.request import RequestStatus

__all__ = ["BlockTables", "StepTables"]


@dataclass(slots=True)
class StepTables:
    positions: np.ndarray  # [T] int64, absolute position of each new token, batch order
    block_tables: list[np.ndarray]  # per layer group: [B, cols] int32, row b = sequence b's table, 0-padded
    slot_mappings: list[np.ndarray]  # per layer group: [T] int64, cache slot each new token's K/V goes to


class BlockTables:
    """Rows of block tables for the running requests, per layer group (module docstring)."""

    def __init__(self, block_size: int, num_groups: int = 1, rows: int = 16, cols: int = 64):
        if block_size < 1 or num_groups < 1 or rows < 1 or cols < 1:
            raise ValueError(f"block_size, num_groups, rows and cols must be >= 1, got {block_size}, {num_groups}, "
                             f"{rows} and {cols}")
        self.block_size = block_size
        self.num_groups = num_groups
        self._tables = [np.zeros((rows, cols), dtype=np.int32) for _ in range(num_groups)]  # per group [rows, cols]
        self._row_of: dict[object, int] = {}  # request -> its row
        self._req: list[object | None] = [None] * rows  # per row: its request
        self._lists: list[tuple[list[int], ...] | None] = [None] * rows  # per row: the table lists it mirrors
        self._lens: list[list[int]] = [[0] * num_groups for _ in range(rows)]  # per row, per group: entries written
        self._versions: list[int | None] = [None] * rows  # per row: the request's blocks_version when written
        self._nblocks = np.zeros(rows, dtype=np.int64)  # per row: group 0's entries (= _lens[row][0]), for numpy
        self._free_rows = list(range(rows))  # a heap: the lowest free row first, so a batch stays in order

    # ---- queries ------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows held by requests now."""
        return len(self._row_of)

    def holds(self, req: object) -> bool:
        return req in self._row_of

    def row(self, req: object, group: int = 0) -> np.ndarray:
        """A copy of the entries written for `req` in `group` (its table as the kernels see it)."""
        r = self._row_of.get(req)
        if r is None:
            raise KeyError(f"request {getattr(req, 'request_id', req)!r} holds no block table row")
        return self._tables[group][r, : self._lens[r][group]].copy()

    # ---- the step -----------------------------------------------------------------------------------
    def prepare(self, reqs: Sequence, starts: Sequence[int], num_tokens: Sequence[int]) -> StepTables:
        """Bring the rows of this step's requests up to date and build the batch's tables and slots.
        `starts[i]`: the first position request i computes this step (its num_computed_tokens);
        `num_tokens[i]`: how many it computes. Rows of requests that left the running set are released."""
        b, bs = len(reqs), self.block_size
        if len(starts) != b or len(num_tokens) != b:
            raise ValueError(f"{b} requests but {len(starts)} starts and {len(num_tokens)} token counts")
        row_of, lists, lens, versions, sync = self._row_of, self._lists, self._lens, self._versions, self._sync
        rows = []
        if self.num_groups == 1:
            table, cols, nblocks = self._tables[0], self._tables[0].shape[1], self._nblocks
            for req in reqs:  # the common cases inline: a row whose table is the same list at the same version,
                # as long as before or one block longer
                row = row_of.get(req)
                ids = req.block_ids
                if (row is None or ids is not lists[row][0] or versions[row] is None
                        or getattr(req, "blocks_version", None) != versions[row]):
                    row = sync(req)
                    table, cols, nblocks = self._tables[0], self._tables[0].shape[1], self._nblocks  # may have grown
                elif (n := len(ids)) != (have := lens[row][0]):
                    if n == have + 1 and n <= cols:
                        table[row, have] = max(ids[have], 0)
                        lens[row][0] = nblocks[row] = n
                    else:
                        row = sync(req)
                        table, cols, nblocks = self._tables[0], self._tables[0].shape[1], self._nblocks
                rows.append(row)
        else:
            rows = [self._sync_groups(req) for req in reqs]
        if len(row_of) > b:
            self._release_unused(rows)
        rows_a = np.asarray(rows, dtype=np.int64)
        starts_a = np.asarray(starts, dtype=np.int64)
        counts = np.asarray(num_tokens, dtype=np.int64)
        short = (starts_a + counts + (bs - 1)) // bs > self._nblocks[rows_a]
        if short.any():
            i = int(short.argmax())
            raise ValueError(f"request {reqs[i].request_id!r} computes positions {starts[i]}..{starts[i] + num_tokens[i] - 1} "
                             f"but its block table has {lens[rows[i]][0]} blocks of {bs}")
        r0 = rows[0] if b else 0
        if rows == list(range(r0, r0 + b)):
            tables = [t[r0 : r0 + b] for t in self._tables]  # a view: consecutive rows in batch order
        else:
            tables = [t[rows_a] for t in self._tables]
        total = int(counts.sum())
        if b and total == b and int(counts.min()) == 1:  # decode: one token a sequence
            positions, tok_rows = starts_a, rows_a
        else:
            offsets = np.cumsum(counts) - counts  # first row of each sequence in the flat batch
            positions = np.arange(total, dtype=np.int64) + np.repeat(starts_a - offsets, counts)
            tok_rows = np.repeat(rows_a, counts)
        blocks, within = np.divmod(positions, bs)
        slots = [t[tok_rows, blocks].astype(np.int64) * bs + within for t in self._tables]
        return StepTables(positions, tables, slots)

    def _sync_groups(self, req) -> int:
        """`_sync` with layer groups, the common case inline: every table the same list at the same version, as long
        as before or one block longer."""
        row = self._row_of.get(req)
        if row is None or self._versions[row] is None or getattr(req, "blocks_version", None) != self._versions[row]:
            return self._sync(req)
        held, have, tables = self._lists[row], self._lens[row], self._tables
        extra = req.extra_tables
        if len(extra) + 1 != self.num_groups:
            return self._sync(req)  # raises: the request's layout is not the runner's
        cols = tables[0].shape[1]
        for g, ids in enumerate((req.block_ids, *extra)):
            if ids is not held[g]:
                return self._sync(req)
            n, h = len(ids), have[g]
            if n != h:
                if n != h + 1 or n > cols:
                    return self._sync(req)  # what this loop wrote so far is in `have`: _sync goes on from there
                tables[g][row, h] = max(ids[h], 0)
                have[g] = n
        self._nblocks[row] = have[0]
        return row

    def _sync(self, req) -> int:
        """The row of `req`, brought up to date with its tables."""
        lists = (req.block_ids,) if self.num_groups == 1 else (req.block_ids, *getattr(req, "extra_tables", ()))
        if len(lists) != self.num_groups:
            raise ValueError(f"request {req.request_id!r} has {len(lists)} block tables, the runner's layout "
                             f"has {self.num_groups} layer groups")
        version = getattr(req, "blocks_version", None)
        row = self._row_of.get(req)
        if row is None:
            row = self._take_row(req)
        elif version is not None and version == self._versions[row]:
            held, lens = self._lists[row], self._lens[row]
            for g, ids in enumerate(lists):
                n, have = len(ids), lens[g]
                if ids is not held[g] or n < have:  # another list, or shrank without a version bump: rewrite
                    break
                if n > have:  # the table grew: copy the new ids only
                    self._write(g, row, have, ids[have:])
                    lens[g] = n
            else:
                self._nblocks[row] = lens[0]
                return row
        self._rewrite(row, lists, version)
        return row

    def _write(self, g: int, row: int, start: int, ids: list[int]) -> None:
        end = start + len(ids)
        if end > self._tables[g].shape[1]:
            self._grow_cols(end)
        seg = self._tables[g][row, start:end]
        seg[:] = ids
        np.maximum(seg, 0, out=seg)  # -1 (a block that left a window group's window) -> block 0, never read

    def _rewrite(self, row: int, lists: tuple[list[int], ...], version: int | None) -> None:
        lens = self._lens[row]
        for g, ids in enumerate(lists):
            self._write(g, row, 0, ids)
            if lens[g] > len(ids):
                self._tables[g][row, len(ids) : lens[g]] = 0
            lens[g] = len(ids)
        self._nblocks[row] = lens[0]
        self._lists[row] = lists
        self._versions[row] = version

    # ---- rows ---------------------------------------------------------------------------------------
    def _take_row(self, req) -> int:
        if not self._free_rows:
            self._grow_rows()
        row = heapq.heappop(self._free_rows)
        self._row_of[req] = row
        self._req[row] = req
        return row

    def release(self, req) -> None:
        """Give back the row of `req` (nothing if it holds none); its entries are zeroed for the next holder."""
        row = self._row_of.pop(req, None)
        if row is None:
            return
        for g, t in enumerate(self._tables):
            t[row, : self._lens[row][g]] = 0
        self._lens[row] = [0] * self.num_groups
        self._nblocks[row] = 0
        self._req[row] = self._lists[row] = self._versions[row] = None
        heapq.heappush(self._free_rows, row)

    def release_ended(self) -> int:
        """Release the rows of requests that are no longer running (finished, aborted, failed, or preempted:
        waiting again); returns how many. `prepare` does it for the requests outside its batch."""
        ended = [r for r in self._row_of if r.status is not RequestStatus.RUNNING]
        for r in ended:
            self.release(r)
        return len(ended)

    def _release_unused(self, rows: list[int]) -> None:
        """Release the rows of requests outside this batch (`rows`) that are no longer running."""
        in_batch = set(rows)
        for req, row in list(self._row_of.items()):
            if row not in in_batch and req.status is not RequestStatus.RUNNING:
                self.release(req)

    def _grow_rows(self) -> None:
        old = len(self._req)
        new = 2 * old
        self._tables = [np.concatenate([t, np.zeros_like(t)]) for t in self._tables]
        self._req += [None] * old
        self._lists += [None] * old
        self._versions += [None] * old
        self._lens += [[0] * self.num_groups for _ in range(old)]
        self._nblocks = np.concatenate([self._nblocks, np.zeros(old, dtype=np.int64)])
        for r in range(old, new):
            heapq.heappush(self._free_rows, r)

    def _grow_cols(self, need: int) -> None:
        cols = self._tables[0].shape[1]
        while cols < need:
            cols *= 2
        grown = []
        for t in self._tables:
            g = np.zeros((t.shape[0], cols), dtype=np.int32)
            g[:, : t.shape[1]] = t
            grown.append(g)
        self._tables = grown
