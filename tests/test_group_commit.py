"""Group commits of rank 0's static record writes (engine/commit/group_commit.py): records that wait share one write."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from torch_batch_process.engine.commit.group_commit import GroupCommit


class RecordingKeeper:
    """Stands in for the record keeper: lists each write as the group of record numbers it was given."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.number = 0
        self.groups: list[list[int]] = []
        self.starts: list[float] = []
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()

    def prepare(self):
        self.number += 1
        return SimpleNamespace(record=SimpleNamespace(commit=self.number))

    def persist(self, *prepared):
        self.starts.append(time.monotonic())
        assert self.gate.wait(10)
        numbers = [p.record.commit for p in prepared]
        if self.fail_at in numbers:
            raise OSError(f"record {numbers[-1]} could not be written")
        self.groups.append(numbers)


def test_records_queued_during_a_write_are_written_as_one_and_all_become_durable():
    keeper = RecordingKeeper()
    writes = GroupCommit(keeper, spacing_s=0.0)
    keeper.gate.clear()  # the first write waits, so the next records queue up behind it
    writes.put(keeper.prepare())
    time.sleep(0.1)
    for _ in range(4):
        writes.put(keeper.prepare())
    assert writes.newest_durable() == 0
    keeper.gate.set()
    writes.settle()
    assert keeper.groups == [[1], [2, 3, 4, 5]]  # every record's lines go with the newest record of its group
    assert writes.durable == 5
    writes.close()


def test_writes_are_spaced_and_commits_made_meanwhile_share_the_next_one():
    keeper = RecordingKeeper()
    writes = GroupCommit(keeper, spacing_s=0.3)
    for _ in range(10):  # 10 commits in about 0.1 s
        writes.put(keeper.prepare())
        time.sleep(0.01)
    deadline = time.monotonic() + 5
    while writes.newest_durable() < 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert keeper.groups[0][0] == 1 and keeper.groups[-1][-1] == 10 and len(keeper.groups) == 2, keeper.groups
    assert keeper.starts[1] - keeper.starts[0] >= 0.3  # the second write waited for the spacing
    writes.close()


def test_settle_writes_at_once_without_waiting_for_the_spacing():
    keeper = RecordingKeeper()
    writes = GroupCommit(keeper, spacing_s=30.0)
    writes.put(keeper.prepare())
    writes.settle()
    writes.put(keeper.prepare())
    started = time.monotonic()
    writes.settle()
    assert time.monotonic() - started < 5 and writes.durable == 2
    writes.close()


def test_a_failed_write_raises_on_the_main_thread_and_its_records_are_never_called_durable():
    keeper = RecordingKeeper(fail_at=3)
    writes = GroupCommit(keeper, spacing_s=0.0)
    writes.put(keeper.prepare())
    writes.settle()
    keeper.gate.clear()
    writes.put(keeper.prepare())  # 2 is written alone (its write starts at once and waits at the gate) ...
    time.sleep(0.1)
    writes.put(keeper.prepare())  # ... 3 and 4 together, and that write fails
    writes.put(keeper.prepare())
    keeper.gate.set()
    with pytest.raises(OSError, match="could not be written"):
        writes.settle()
    with pytest.raises(OSError, match="could not be written"):
        writes.advance()
    assert writes.newest_durable() == 2
    writes.put(keeper.prepare())  # never raises: the failure travels through advance()
    writes.close()


def test_settle_without_check_waits_for_a_failing_write_and_tells_the_newest_durable_record():
    """A failing job settles its writes without raising (the failed write is what it reports already), then
    publishes what the newest written record covers: a failed write must not stop that publication."""
    keeper = RecordingKeeper(fail_at=3)
    writes = GroupCommit(keeper, spacing_s=0.0)
    writes.put(keeper.prepare())
    writes.settle()
    keeper.gate.clear()
    writes.put(keeper.prepare())  # 2 is written alone, 3 fails
    time.sleep(0.1)
    writes.put(keeper.prepare())
    threading.Timer(0.2, keeper.gate.set).start()
    writes.settle(check=False)  # waits for both writes, raises nothing
    assert isinstance(writes.error, OSError)
    assert writes.durable == 2 and keeper.groups == [[1], [2]]
    writes.close()
