"""BlockTables (engine.block_table): rows kept across steps, exact after appends, version bumps, releases and
reuse; slot mappings and positions as the per-request computation gives them."""

from dataclasses import dataclass, field

import numpy as np
import pytest

from agentrt.engine.block_table import BlockTables
from agentrt.engine.request import RequestStatus


@dataclass(eq=False)
class Req:
    request_id: str
    block_ids: list[int]
    extra_tables: list[list[int]] = field(default_factory=list)
    blocks_version: int | None = 0
    status: RequestStatus = RequestStatus.RUNNING

    @property
    def tables(self) -> list[list[int]]:
        return [self.block_ids, *self.extra_tables]


def expected(reqs, starts, counts, bs, group=0):
    """The old per-request computation: positions, slots, and the 0-padded table (NULL entries as block 0)."""
    tables = [np.maximum(np.asarray(([r.block_ids, *r.extra_tables])[group], dtype=np.int64), 0) for r in reqs]
    pos = [np.arange(s, s + n) for s, n in zip(starts, counts)]
    slots = np.concatenate([t[p // bs] * bs + p % bs for t, p in zip(tables, pos)])
    padded = np.zeros((len(reqs), max(map(len, tables))), dtype=np.int32)
    for i, t in enumerate(tables):
        padded[i, : len(t)] = t
    return np.concatenate(pos), slots, padded


def check(bt, reqs, starts, counts):
    st = bt.prepare(reqs, starts, counts)
    for g in range(bt.num_groups):
        pos, slots, padded = expected(reqs, starts, counts, bt.block_size, g)
        assert st.positions.tolist() == pos.tolist()
        assert st.slot_mappings[g].dtype == np.int64 and st.slot_mappings[g].tolist() == slots.tolist()
        table = st.block_tables[g]
        assert table.dtype == np.int32 and table.shape[0] == len(reqs) and table.shape[1] >= padded.shape[1]
        assert table[:, : padded.shape[1]].tolist() == padded.tolist()
        assert not table[:, padded.shape[1]:].any()  # padding is 0
    return st


def test_rows_follow_appends_and_version_bumps():
    bt = BlockTables(block_size=4, rows=2, cols=2)
    a, b = Req("a", [7, 3]), Req("b", [5])
    check(bt, [a, b], [0, 0], [8, 3])  # prefill
    assert bt.row(a).tolist() == [7, 3] and bt.row(b).tolist() == [5]
    a.block_ids.append(9)  # decode crosses into a new block: the tail is copied
    b.block_ids.extend([2, 8, 6])  # grows past the array's columns: they double
    check(bt, [a, b], [8, 3], [1, 9])
    assert bt.row(a).tolist() == [7, 3, 9] and bt.row(b).tolist() == [5, 2, 8, 6]
    a.block_ids[1] = 4  # copy-on-write replacement: not an append, so the version is bumped
    a.blocks_version += 1
    check(bt, [a, b], [9, 12], [1, 1])
    assert bt.row(a).tolist() == [7, 4, 9]
    b.block_ids = [1]  # another list (a free and a new admission) with a smaller table: rewritten, tail zeroed
    b.blocks_version += 1
    st = check(bt, [b, a], [0, 10], [2, 1])
    assert bt.row(b).tolist() == [1] and st.block_tables[0][0, 1:].tolist() == [0] * (st.block_tables[0].shape[1] - 1)


def test_an_unbumped_in_place_change_is_not_seen_but_a_request_without_version_is_rewritten():
    bt = BlockTables(block_size=2)
    a = Req("a", [1, 2])
    bt.prepare([a], [0], [3])
    a.block_ids[0] = 5  # the contract: such a change bumps blocks_version; without the bump the row is stale
    bt.prepare([a], [3], [1])
    assert bt.row(a).tolist() == [1, 2]
    legacy = Req("legacy", [1, 2], blocks_version=None)  # no version: rewritten every step
    bt.prepare([legacy], [0], [3])
    legacy.block_ids[0] = 5
    check(bt, [legacy], [3], [1])
    assert bt.row(legacy).tolist() == [5, 2]


def test_rows_are_released_on_every_way_out_and_reused_lowest_first():
    bt = BlockTables(block_size=4, rows=2)
    reqs = [Req(str(i), [10 * i + 1, 10 * i + 2]) for i in range(4)]  # 4 requests: the rows double to 4
    bt.prepare(reqs, [0] * 4, [3] * 4)
    assert [bt._row_of[r] for r in reqs] == [0, 1, 2, 3] and bt.num_rows == 4
    finished, aborted, preempted, waits = reqs
    finished.status = RequestStatus.FINISHED_STOPPED
    aborted.status = RequestStatus.FINISHED_ABORTED
    preempted.status = RequestStatus.WAITING
    st = check(bt, [waits], [3], [1])  # a running request outside the batch keeps its row
    assert bt.num_rows == 1 and bt.holds(waits) and not any(bt.holds(r) for r in reqs[:3])
    assert np.shares_memory(st.block_tables[0], bt._tables[0])  # one row: a view of the kept rows
    assert not bt._tables[0][:3].any()  # released rows are zeroed
    new = Req("new", [40])
    check(bt, [new, waits], [0, 4], [1, 1])
    assert bt._row_of[new] == 0  # the lowest free row
    preempted.status = RequestStatus.RUNNING  # admitted again with a new table and a bumped version
    preempted.block_ids, preempted.blocks_version = [50, 51], preempted.blocks_version + 1
    check(bt, [waits, new, preempted], [5, 1, 0], [1, 1, 4])
    assert bt.row(preempted).tolist() == [50, 51] and bt._row_of[preempted] == 1
    waits.status = RequestStatus.FINISHED_LENGTH
    assert bt.release_ended() == 1 and bt.num_rows == 2
    bt.release(new)
    bt.release(new)  # nothing held: nothing to do
    assert bt.num_rows == 1 and sorted(bt._free_rows) == [0, 2, 3]


def test_layer_groups_each_get_a_row_and_null_entries_read_as_block_0():
    bt = BlockTables(block_size=4, num_groups=3)
    a = Req("a", [1, 2, 3], extra_tables=[[-1, 5, 6], [-1, -1, 9]])
    b = Req("b", [4], extra_tables=[[7], [8]])
    check(bt, [a, b], [9, 0], [2, 4])
    assert bt.row(a, 1).tolist() == [0, 5, 6] and bt.row(a, 2).tolist() == [0, 0, 9]
    a.extra_tables[0][1] = -1  # a window group freed a block: bumped
    a.blocks_version += 1
    for t in (*a.tables, *b.tables):
        t.append(t[-1] + 10)
    check(bt, [a, b], [11, 4], [2, 1])
    assert bt.row(a, 1).tolist() == [0, 0, 6, 16] and bt.row(a, 2).tolist() == [0, 0, 9, 19]
    for t in a.tables:  # a block more in every group, no bump: copied inline
        t.append(t[-1] + 1)
    b.extra_tables[1].extend([30, 31])  # two more in one group: the general path
    check(bt, [a, b], [13, 5], [4, 1])
    assert bt.row(a, 0).tolist() == [1, 2, 3, 13, 14] and bt.row(a, 2).tolist() == [0, 0, 9, 19, 20]
    assert bt.row(b, 2).tolist() == [8, 18, 30, 31] and bt.row(b, 1).tolist() == [7, 17]
    with pytest.raises(ValueError, match=r"request 'c' has 1 block tables, the runner's layout has 3 layer groups"):
        bt.prepare([Req("c", [1])], [0], [1])


def test_a_position_past_the_table_is_an_error():
    bt = BlockTables(block_size=4)
    with pytest.raises(ValueError, match=r"request 'a' computes positions 6..8 but its block table has 2 blocks of 4"):
        bt.prepare([Req("a", [1, 2])], [6], [3])
    with pytest.raises(ValueError, match=r"2 requests but 1 starts and 2 token counts"):
        bt.prepare([Req("a", [1]), Req("b", [2])], [0], [1, 1])


def test_random_steps_match_the_per_request_computation():
    rng = np.random.default_rng(0)
    bt = BlockTables(block_size=4, rows=1, cols=1)
    free = list(range(1, 400))
    rng.shuffle(free)
    live: list[tuple[Req, int]] = []  # (request, tokens computed)
    for step in range(60):
        if len(live) < 6 and rng.random() < 0.5:
            live.append((Req(f"r{step}", []), 0))
        batch, starts, counts = [], [], []
        for i, (r, done) in enumerate(live):
            n = int(rng.integers(1, 9))
            need = -(-(done + n) // 4) - len(r.block_ids)
            r.block_ids.extend(free.pop() for _ in range(need))
            if r.block_ids and rng.random() < 0.1:
                r.block_ids[int(rng.integers(len(r.block_ids)))] = free.pop()
                r.blocks_version += 1
            batch.append(r)
            starts.append(done)
            counts.append(n)
            live[i] = (r, done + n)
        order = rng.permutation(len(batch))
        if batch:
            check(bt, [batch[i] for i in order], [starts[i] for i in order], [counts[i] for i in order])
        for r, _ in list(live):
            if rng.random() < 0.15:
                r.status = RequestStatus.FINISHED_STOPPED
                live = [x for x in live if x[0] is not r]
    for r, _ in live:
        r.status = RequestStatus.FINISHED_ABORTED
    bt.prepare([], [], [])
    assert bt.num_rows == 0 and not bt._tables[0].any()


def test_the_runner_s_kept_tables_equal_each_request_s_through_preemption_forks_and_aborts(tiny_model_path):
    """On the engine: every step's block table and slot mapping equal what the request's table gives (copy-on-write
    of forks, dedup merges of a shared prefix, preemptions and an abort all change tables), and the rows of
    requests that left are released at the next step."""
    from agentrt.engine import LLM, SamplingParams
    from tests.engine.test_engine import prompts_of

    llm = LLM(str(tiny_model_path), num_blocks=24, block_size=4, max_num_seqs=8, max_num_batched_tokens=32)
    core, runner = llm.core, llm.core.runner
    bt = runner.block_tables
    prepare, seen = runner._prepare, {"steps": 0, "rewrites": 0}

    def checked(out):
        held_before = {r for r in bt._row_of}
        res = prepare(out)
        _, positions, slots, meta = res[:4]
        starts = [r.num_computed_tokens for r in out.reqs]
        pos, want_slots, padded = expected(out.reqs, starts, out.num_tokens, 4)
        assert positions.tolist() == pos.tolist() and slots.tolist() == want_slots.tolist()
        assert meta.block_tables[:, : padded.shape[1]].tolist() == padded.tolist()
        for r in held_before - set(out.reqs):  # outside the batch: kept only while running
            assert bt.holds(r) == (r.status == RequestStatus.RUNNING)
        seen["steps"] += 1
        return res

    runner._prepare = checked
    shared = prompts_of([12], seed=3)[0]
    params = SamplingParams(max_tokens=12, temperature=0.8, seed=1, ignore_eos=True, n=2)
    reqs = [core.add_request(shared + p, params) for p in prompts_of([5, 9, 7], seed=4)]
    aborted = core.add_request(prompts_of([10], seed=5)[0], SamplingParams(max_tokens=30, ignore_eos=True))
    for i in range(400):
        if not core.has_work():
            break
        core.step()
        if i == 3:
            core.abort(aborted.request_id)
    stats = llm.kv_stats()
    assert stats.num_preemptions > 0 and stats.cow_copies > 0, "the shapes no longer preempt or copy on write"
    assert seen["steps"] > 10 and all(r.finished for r in reqs)
    held = bt.num_rows  # the last step's requests: they leave the running set after it
    assert held > 0 and bt.release_ended() == held
    assert bt.num_rows == 0 and not bt._tables[0].any()
