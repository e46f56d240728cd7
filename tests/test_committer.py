"""The committer in one process, with a fake world: each rank is a thread, the library's collectives are an exchange
through a barrier (each rank gets its own copy, as if pickled), and the dynamic schedule's rendezvous store is a
torch ``HashStore`` behind the library's :class:`RendezvousStore`. Everything else is real: a local storage path,
the job store, the stager, rank 0's record keeper, the publisher and both vote transports (gathered: the static
schedule; queued: the dynamic one), built as the engine builds them (:func:`make_committer`).

Each rank "processes" batches by writing one file per batch through ``upload_path()`` and commits; the tests check
what the committer promises: every committed batch's file is published exactly once under ``outputs/``, only
once a durable record covers its stage; every rank gets the same outcome; a record write that fails makes every
rank raise (rank 0 its own error, the others :class:`WorkerFailedError`) and leaves published exactly what the
durable records commit.
"""

from __future__ import annotations

import datetime
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from torch_batch_process.context import CurrentBatch
from torch_batch_process.engine.capabilities.records_participant import RecordOutputs
from torch_batch_process.engine.capabilities.timeline_participant import TimelineParticipant
from torch_batch_process.engine.commit.committer import Outcome
from torch_batch_process.engine.commit.participants import Participant, Participants
from torch_batch_process.engine.commit.reducer_summaries import ReducerSummaries
from torch_batch_process.engine.commit.wiring import CommitCall, make_committer
from torch_batch_process.engine.distributed import Exchanged, RendezvousStore
from torch_batch_process.engine.plan.plans import ContiguousPlan
from torch_batch_process.engine.rank_failure import SENT_CHARS, RankFailure
from torch_batch_process.engine.work import RankWork
from torch_batch_process.errors import StorageError, WorkerFailedError
from torch_batch_process.jobstore.layout import COMMITS_DIR, OUTPUTS_DIR, STAGING_DIR
from torch_batch_process.jobstore.opening import Start
from torch_batch_process.jobstore.store import JobStore, latest_record_at
from torch_batch_process.observe.observer import JobObserver
from torch_batch_process.observe.options import ObserveOptions
from torch_batch_process.outputs.records import RecordWriter
from torch_batch_process.outputs.stager import OutputStager
from torch_batch_process.processor import TorchBatchProcessor
from torch_batch_process.reducers import ReducerRegistry
from torch_batch_process.storage.local import LocalStorage

BATCHES_PER_RANK = 4


class FakeWorld:
    """``size`` ranks in one process: each rank's collectives meet the others' at a barrier."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._barrier = threading.Barrier(size, timeout=60)
        self._slots: list[Any] = [None] * size

    def collectives(self, rank: int) -> FakeCollectives:
        return FakeCollectives(self, rank)

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait()
        gathered = pickle.loads(pickle.dumps(self._slots))  # every rank its own copy, as over the wire
        self._barrier.wait()
        return gathered


class FakeCollectives:
    """The collectives the committer uses (``Collectives``'), over a :class:`FakeWorld`."""

    def __init__(self, world: FakeWorld, rank: int) -> None:
        self._world = world
        self.rank = rank
        self.world_size = world.size

    def all_gather(self, obj: Any) -> list[Any]:
        return self._world.exchange(self.rank, obj)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._world.exchange(self.rank, obj)[src]

    def gather(self, obj: Any) -> list[Any] | None:
        gathered = self.all_gather(obj)
        return gathered if self.rank == 0 else None

    def start_exchange(self, header: list[int], obj: Any, capacity: int = 4096) -> _Done:
        # every rank starts it at the same step: done at once
        return _Done(Exchanged(self.all_gather(header), self.gather(obj), overflow=False))

    def start_max(self, values: list[int]) -> _Done:
        return _Done([max(column) for column in zip(*self.all_gather(values), strict=True)])


class _Done:
    """A collective that every rank started at the same step, done at once."""

    work = None  # nothing in flight for distributed.wait_together to watch

    def __init__(self, result: Any) -> None:
        self._result = result

    def wait(self) -> Any:
        return self._result


class Processor(TorchBatchProcessor):
    def process_batch(self, batch: Any, batch_idx: int) -> None:  # the tests stand in for the loop
        raise AssertionError("not called")


def run_rank(
    rank: int,
    world: FakeWorld,
    root: Path,
    store: Any,
    before_step: Callable[[int, int], None] = lambda rank, step: None,
) -> Outcome:
    """One rank's commits as the loop makes them: a file per batch, a commit after each batch, then the final
    closing commit. ``store``: the shared HashStore (queued votes), or ``None`` (gathered)."""
    size = world.size
    storage = LocalStorage(root)
    stager = OutputStager(storage, rank)
    plan = ContiguousPlan(dataset_length=size * BATCHES_PER_RANK, batch_size=1)
    start = Start(attempt=1, next_number=1, planned_batches=plan.num_batches, call_id="test")
    observer = JobObserver(
        ObserveOptions(progress="off"), rank=rank, world_size=size, job_name="committer", batch_size=1,
        tensorboard=storage.mirrored_folder(f"tensorboard/rank_{rank}", f"tb-{rank}"), device=torch.device("cpu"),
    )
    current = CurrentBatch()
    job_store = JobStore(storage)
    if rank == 0:
        job_store.take_lock()  # records are written under the job lock (the opener takes it)
    summaries = ReducerSummaries(ReducerRegistry(), job_store, None)
    records = RecordWriter(stager, current, rank, "parquet", None)
    participants = Participants([RecordOutputs(records, None), summaries, TimelineParticipant(size, observer)])
    work = RankWork()
    call = CommitCall(
        store=job_store, plan=plan, start=start, started=time.monotonic(), collectives=world.collectives(rank),  # type: ignore[arg-type]
        call_store=RendezvousStore(store, rank) if store is not None else None, on_background_error=lambda: None,
        result_json=lambda metrics, summary: {"metrics": metrics, "batches_committed": summary.batches_committed},
    )
    committer = make_committer(call, participants, summaries, stager, work, observer, RankFailure(rank))
    assert type(committer._transport).__name__ == ("QueuedVotes" if store is not None else "GatheredVotes")
    processor = Processor.__new__(Processor)
    try:
        for step in range(BATCHES_PER_RANK):
            before_step(rank, step)
            batch = step * size + rank  # round-robin, as the static schedule deals them
            with stager.upload_path() as folder:
                Path(folder, f"batch_{batch}.txt").write_text(str(batch))
            work.part.add_batch(batch, 1)
            committer.check()
            committer.poll()
            committer.commit(processor)
        return committer.close(processor, preempt=False, final=True)
    finally:
        committer.shutdown()
        stager.close()
        observer.close()
        job_store.release_lock()


def run_world(
    size: int, root: Path, *, queued: bool, before_step: Callable[[int, int], None] | None = None
) -> list[Any]:
    """Runs every rank on a thread; returns each rank's outcome, or the exception it raised."""
    world = FakeWorld(size)
    store = None
    if queued:
        store = dist.HashStore()
        store.set_timeout(datetime.timedelta(seconds=1))  # a blocking pop wakes up to wait again
    results: list[Any] = [None] * size
    JobStore(LocalStorage(root)).storage.write_json("_tbp/job.json", {"created": 0})  # what opening the job wrote

    def body(rank: int) -> None:
        try:
            results[rank] = run_rank(rank, world, root, store, before_step or (lambda rank, step: None))
        except BaseException as exc:  # noqa: BLE001 - the test looks at it
            results[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,), name=f"rank-{rank}") for rank in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
        assert not thread.is_alive(), "a rank hung"
    return results


def published_batches(root: Path) -> list[int]:
    """The batch of every published file, one entry per file."""
    return sorted(int(path.read_text()) for path in (root / OUTPUTS_DIR).rglob("batch_*.txt"))


def published_stages(root: Path) -> set[int]:
    return {int(path.name[len("commit_") :]) for path in (root / OUTPUTS_DIR).glob("commit_*")}


@pytest.mark.parametrize("queued", [False, True], ids=["gathered", "queued"])
@pytest.mark.parametrize("size", [1, 2, 3])
def test_every_committed_file_is_published_exactly_once_and_every_rank_gets_the_same_outcome(tmp_path, size, queued):
    if queued and size == 1:
        pytest.skip("one process always takes the gathered path")
    results = run_world(size, tmp_path, queued=queued)
    assert all(isinstance(result, Outcome) for result in results), results
    assert len({pickle.dumps((r.preempted, r.summary.batches_committed, r.summary.commits)) for r in results}) == 1
    total = size * BATCHES_PER_RANK
    assert results[0].summary.batches_committed == total
    assert published_batches(tmp_path) == list(range(total))  # each file once
    assert not list((tmp_path / STAGING_DIR).rglob("batch_*.txt"))  # nothing left staged
    latest = latest_record_at(LocalStorage(tmp_path))
    assert latest is not None and latest.finished and len(latest.committed) == total
    assert published_stages(tmp_path) <= set(latest.output_stages)
    assert (tmp_path / "result.json").exists()


@pytest.mark.parametrize("queued", [False, True], ids=["gathered", "queued"])
def test_a_failing_record_write_makes_every_rank_raise_and_publishes_exactly_what_the_durable_record_commits(
    tmp_path, queued
):
    commits = tmp_path / COMMITS_DIR
    blocked: list[Path] = []

    def break_records(rank: int, step: int) -> None:
        """Rank 0, before its third batch: once a record is durable, every later record write fails (a folder
        stands where it goes)."""
        if rank != 0 or step != 2:
            return
        deadline = time.monotonic() + 30
        while not list(commits.glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)
        for number in range(1, 40):
            path = commits / f"{number:08d}.json"
            try:
                path.mkdir(parents=True)
            except FileExistsError:  # written already (the queued transport's ranks race ahead)
                continue
            blocked.append(path)

    results = run_world(2, tmp_path, queued=queued, before_step=break_records)
    assert isinstance(results[0], StorageError), results  # rank 0 raises its own error
    assert isinstance(results[1], WorkerFailedError), results  # the other its traceback
    assert "rank 0 failed" in str(results[1])
    for path in blocked:
        path.rmdir()
    latest = latest_record_at(LocalStorage(tmp_path))
    assert latest is not None and not latest.finished
    committed = sorted(batch for a, b in latest.committed.ranges() for batch in range(a, b))
    assert committed and len(committed) < 2 * BATCHES_PER_RANK
    assert published_batches(tmp_path) == committed  # published: exactly what the durable record commits, once
    assert published_stages(tmp_path) <= set(latest.output_stages)


def test_a_failure_sent_to_the_other_ranks_is_cut_to_a_few_thousand_characters():
    """A message holding a whole document was copied whole into the votes and into every other rank's
    WorkerFailedError (twice: the message and the traceback's last line) and log; the failing rank's own error stays
    whole."""
    failing = RankFailure(1)
    try:
        raise ValueError("bad document: " + "d" * 1_000_000)
    except ValueError as exc:
        failing.record(exc, "process_batch of batch 3")
    assert failing.info is not None and failing.info.message.startswith("bad document: ddd")
    with pytest.raises(WorkerFailedError) as raised:
        RankFailure(0).raise_for([None, failing.info])
    text = str(raised.value)
    assert len(text) < 3 * SENT_CHARS and text.count("more characters in the failing rank's own error") == 2, text
    assert "in test_a_failure_sent_to_the_other_ranks_is_cut_to_a_few_thousand_characters" in text  # its frame
    with pytest.raises(ValueError) as own:
        failing.raise_for([None, failing.info])
    assert len(str(own.value)) == len("bad document: ") + 1_000_000


def test_participants_run_each_moment_on_those_that_take_part_in_it_in_order():
    """Each moment skips the participants that keep its default (it does nothing), never one that overrides it, as a
    subclass or an instance of its own; the order stays the participants' order."""
    calls: list[tuple[str, str]] = []

    class Merges(Participant):
        def __init__(self, name: str) -> None:
            self.name = name

        def merge(self, vote: Any) -> None:
            calls.append(("merge", self.name))

    class Seals(Participant):
        def seal(self, closing: bool) -> None:
            calls.append(("seal", "b"))

    own = Participant()
    own.seal = lambda closing: calls.append(("seal", "d"))  # type: ignore[method-assign]
    participants = Participants([Merges("a"), Seals(), Merges("c"), own])
    participants.seal(False)
    participants.merge([object(), object()])  # type: ignore[list-item]
    assert calls == [("seal", "b"), ("seal", "d"), ("merge", "a"), ("merge", "c"), ("merge", "a"), ("merge", "c")]
    assert len(participants) == 4 and participants.contribute(RankWork().take(), False) is not None
