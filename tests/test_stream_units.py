"""Units of the stream engine (DESIGN §12): the plan of row ranges inside shards, batches collated from
Arrow columns, the block dealing over ranks and the worker-affine order over DataLoader workers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
import torch
from test_stream_jobs import write_parquet_files
from torch.utils.data import default_collate

from torch_batch_process import sources
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.feed.stream_columns import ArrowRows, StreamCollate, columns_of
from torch_batch_process.engine.feed.stream_order import WorkerAffineOrder
from torch_batch_process.engine.plan.streamed import StreamPlan
from torch_batch_process.engine.schedule.scheduler import BlockScheduler, StaticScheduler
from torch_batch_process.jobstore.ranges import RangeSet


def test_stream_plan_cuts_each_shard_into_batches() -> None:
    plan = StreamPlan({"kind": "x"}, [10, 0, 7, 3], batch_size=4)
    assert plan.num_batches == 3 + 0 + 2 + 1 and plan.dataset_length == 20
    assert [plan.locate(g) for g in range(plan.num_batches)] == [
        (0, 0, 4), (0, 4, 8), (0, 8, 10), (2, 0, 4), (2, 4, 7), (3, 0, 3)
    ]
    assert list(plan.batch_indices(3)) == [10, 11, 12, 13]  # shard 2 starts at global row 10
    assert list(plan.batch_indices(5)) == [17, 18, 19]
    assert plan.row_of(17) == (3, 0) and plan.row_of(9) == (0, 9)
    assert plan.count_examples(RangeSet([(0, 6)])) == 20
    assert plan.count_examples(RangeSet([(2, 4), (5, 6)])) == 2 + 4 + 3
    cut = plan.cut(4)
    assert cut.num_batches == 4 and cut.num_examples == 14 and cut.fingerprint() == plan.fingerprint()
    with pytest.raises(IndexError):
        cut.locate(4)
    assert StreamPlan({"kind": "x"}, [10, 0, 7, 4], 4).fingerprint() != plan.fingerprint()


def _same(a: Any, b: Any) -> None:
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    else:
        assert a == b


def test_parquet_batches_from_arrow_columns_equal_default_collate_of_rows() -> None:
    table = pa.table({
        "i8": pa.array([1, -2, 3], pa.int8()), "u32": pa.array([1, 2, 2**32 - 1], pa.uint32()),
        "i64": pa.array([2**40, 0, -1]), "f32": pa.array([0.5, 1.25, -3.0], pa.float32()),
        "f64": pa.array([0.1, 0.2, 0.3]), "b": pa.array([True, False, True]),
        "s": pa.array(["a", "bé", ""]), "bin": pa.array([b"x", b"", b"yz"]),
    })
    columns = columns_of(table)
    assert columns is not None
    _same(columns, default_collate(table.to_pylist()))
    _same(StreamCollate()(ArrowRows(table)), default_collate(table.to_pylist()))
    for other in (pa.table({"l": pa.array([[1], [2, 3], []])}), pa.table({"n": pa.array([1, None, 3])})):
        assert columns_of(other) is None  # lists, nulls: the row way, same result as without the fast path
    _same(StreamCollate()(ArrowRows(other.slice(0, 1))), default_collate(other.slice(0, 1).to_pylist()))


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_block_scheduler_deals_contiguous_blocks_in_lockstep(world: int) -> None:
    remaining = RangeSet([(0, 4), (6, 13), (20, 22)])  # 13 batches left after a resume
    ranks = [BlockScheduler(remaining, Collectives(None, r, world), interval=2) for r in range(world)]
    dealt = [list(rank.batch_ids()) for rank in ranks]
    assert sorted(sum(dealt, [])) == list(remaining)  # every batch left, once
    assert sum(dealt, []) == list(remaining)  # rank r's block follows rank r-1's
    steps = [list(rank.steps()) for rank in ranks]
    assert all(len(s) == -(-13 // world) for s in steps)  # lockstep: the same number of steps everywhere
    for r, rank in enumerate(ranks):
        assert sum(steps[r]) == len(dealt[r]) == rank.num_batches_of(r)
        assert [rank.batch_at(step, r) for step in range(len(dealt[r]))] == dealt[r]


@pytest.mark.parametrize("world, rank", [(1, 0), (3, 1)])
def test_worker_affine_order_gives_each_row_group_to_one_worker(tmp_path: Path, world: int, rank: int) -> None:
    counts = [100, 64, 0, 37]
    write_parquet_files(str(tmp_path / "data"), counts, row_group=20)
    source = sources.parquet(str(tmp_path / "data"))
    plan = StreamPlan(source.fingerprint(), counts, 5)
    remaining = RangeSet([(0, 7), (9, plan.num_batches)])  # a resume: batches 7 and 8 committed
    scheduler = StaticScheduler(remaining, Collectives(None, rank, world), interval=3)
    mine = list(scheduler.batch_ids())
    order = list(WorkerAffineOrder(scheduler, plan, source, 3).batch_ids())
    assert sorted(order) == sorted(mine)  # the same batches, each once
    workers: dict[tuple[int, int], set[int]] = {}
    for position, batch in enumerate(order):
        shard, start, _ = plan.locate(batch)
        workers.setdefault((shard, source.seek_origin(shard, start)), set()).add(position % 3)
    shared = [unit for unit, who in workers.items() if len(who) > 1]
    # one worker per row group, but for the last ones, when the batches left are all in one worker's units
    # and the others' turns must still be filled: at most one unit per other worker
    assert len(shared) <= 3 - 1 and all(unit in list(workers)[-3:] for unit in shared), workers
