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

    def prepare(self, lines=None):
        self.number += 1
        self.prepared_on = threading.current_thread()
        return SimpleNamespace(record=SimpleNamespace(commit=self.number), metrics={"lines": lines} if lines else None)

    def skip(self, lines=None):  # a record of a group that is never written: its number only, no metrics
        self.number += 1
        self.skipped = getattr(self, "skipped", 0) + 1
        return SimpleNamespace(record=SimpleNamespace(commit=self.number), metrics=None)

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


def test_one_process_the_writer_prepares_merged_records_in_order_and_hands_their_metrics_back():
    keeper = RecordingKeeper()
    writes = GroupCommit(keeper, spacing_s=0.0)
    for lines in ([], [], [{"n": 3}]):  # a commit's votes merged on the main thread, their record left to the writer
        writes.put_merged(lines)
    writes.settle()
    assert [n for group in keeper.groups for n in group] == [1, 2, 3] and writes.durable == 3
    assert keeper.prepared_on is not threading.current_thread()  # off the batch's thread
    assert writes.take_metrics() == {"lines": [{"n": 3}]}  # the newest metrics prepared, once
    assert writes.take_metrics() is None
    writes.close()


def test_one_process_only_the_written_record_of_a_group_is_prepared_in_full():
    keeper = RecordingKeeper()
    writes = GroupCommit(keeper, spacing_s=0.0)
    keeper.gate.clear()  # the first write waits, so the next commits queue up behind it
    writes.put_merged([])
    time.sleep(0.1)
    for _ in range(4):
        writes.put_merged([{"n": 1}])
    keeper.gate.set()
    writes.settle()
    assert keeper.groups == [[1], [2, 3, 4, 5]] and writes.durable == 5  # every number, in order
    assert keeper.skipped == 3  # records 2-4 are never written: numbered and their lines kept, not prepared
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


# ------------------------------------------------------------------ the dynamic schedule's vote collector


class MergingKeeper:
    """Stands in for the record keeper of engine/commit/queued.py's collector: counts the votes of each record it
    writes."""

    def __init__(self) -> None:
        self.records: list[int] = []
        self._votes = 0
        self.written = threading.Event()

    def merge(self, votes):
        self._votes = len(votes)
        return []

    def prepare(self, lines):
        return SimpleNamespace(record=SimpleNamespace(commit=len(self.records) + 1))

    def persist(self, *prepared):
        time.sleep(0.01)  # a record write takes a while: votes keep arriving meanwhile
        self.records.append(self._votes)
        self.written.set()

    def share(self):
        from torch_batch_process.engine.commit.participants import Payloads

        return Payloads()  # nothing every rank must learn (on_oom="split" shares memory limits through the store)


def _queue():
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torch_batch_process.engine.commit.votes import Vote
    from torch_batch_process.engine.distributed import RendezvousStore

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    vote = Vote(rank=1, stage=1, has_files=False, batches=[[0, 1]], examples=1, state_file=None, lines=[], timings={})
    return server, _votes(RendezvousStore(server, 0), 0), vote


def _votes(store, rank):
    """A rank's queued votes, without a keeper (the collector under test is started with its own)."""
    from torch_batch_process.engine.commit.queued import QueuedVotes

    return QueuedVotes(store, rank, stage_counter=lambda: 0, keeper=None, on_error=lambda: None, committed=(0, 0))


def test_the_collector_writes_records_while_votes_keep_arriving():
    """A record covers the votes waiting when the collector looks, not those that arrive while it takes them: with
    many ranks votes never stop arriving, and waiting for an empty queue wrote no record until the job's end."""
    from torch_batch_process.engine.commit.queued import VoteCollector
    from torch_batch_process.engine.distributed import RendezvousStore

    server, queue, vote = _queue()
    keeper = MergingKeeper()
    collector = VoteCollector(queue, keeper, lambda: None, spacing_s=0.0)
    try:
        pusher = _votes(RendezvousStore(server.clone(), 1), 1)
        pushed = 0
        started = time.monotonic()
        deadline = started + 20  # a loaded machine: the collector thread may get little of the GIL
        while time.monotonic() < deadline and len(keeper.records) < 2:  # faster than the collector takes them:
            for _ in range(100):  # the queue is never empty
                pusher.send(vote)
            pushed += 100
        written = len(keeper.records)
        assert written >= 2, f"{written} record(s) for {pushed} votes pushed in {time.monotonic() - started:.1f} s"
        collector.stop(expected=pushed)  # waits (without polling) until every vote is in a record
        assert collector.taken == pushed == sum(keeper.records)
        collector.check()
    finally:
        collector.stop(expected=None, check=False)


def test_stopping_the_collector_waits_for_the_votes_each_rank_queued():
    from torch_batch_process.engine.commit.queued import VoteCollector

    server, queue, vote = _queue()
    keeper = MergingKeeper()
    collector = VoteCollector(queue, keeper, lambda: None)
    threading.Timer(0.3, lambda: [queue.send(vote) for _ in range(3)]).start()  # late votes
    started = time.monotonic()
    try:
        collector.stop(expected=3)
        assert collector.taken == 3 and sum(keeper.records) == 3
        assert time.monotonic() - started < 10
    finally:
        collector.stop(expected=None, check=False)


def test_the_collector_spaces_its_records_and_votes_made_meanwhile_share_one():
    from torch_batch_process.engine.commit.queued import VoteCollector

    server, queue, vote = _queue()
    keeper = MergingKeeper()
    collector = VoteCollector(queue, keeper, lambda: None, spacing_s=0.1)
    try:
        started = time.monotonic()
        for _ in range(300):  # a vote every ~2 ms for ~0.6 s
            queue.send(vote)
            time.sleep(0.002)
        elapsed = time.monotonic() - started
        collector.stop(expected=300)
        assert sum(keeper.records) == 300
        assert len(keeper.records) <= elapsed / 0.1 + 2, keeper.records
    finally:
        collector.stop(expected=None, check=False)
