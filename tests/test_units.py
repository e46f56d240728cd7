"""Unit tests of the pure building blocks: ranges, sharding, devices, reducers."""

from __future__ import annotations

import collections
import random
import sys

import numpy as np
import pytest
import torch

from torch_batch_process import InvalidArgumentError, MetricReducer, get_default_device, to_device
from torch_batch_process.engine.commit.background import BackgroundWork
from torch_batch_process.engine.commit.publisher import VotedStages
from torch_batch_process.engine.distributed import Collectives
from torch_batch_process.engine.plan.plans import ContiguousPlan, planned_batches
from torch_batch_process.engine.schedule.scheduler import StaticScheduler
from torch_batch_process.jobstore.layout import STAGED_FAILURES_NAME, failures_file, outputs_dir, staging_dir
from torch_batch_process.jobstore.ranges import IndexedRanges, RangeSet
from torch_batch_process.jobstore.store import JobStore
from torch_batch_process.reducers import ReducerRegistry
from torch_batch_process.storage.registry import open_storage


def test_rangeset_merges_and_counts():
    s = RangeSet()
    for v in [5, 3, 4, 10, 0, 1, 2, 11, 7]:
        s.add(v)
    assert s.to_json() == [[0, 6], [7, 8], [10, 12]]
    assert len(s) == 9
    assert 6 not in s and 7 in s and 11 in s and 12 not in s
    assert s.complement(14).to_json() == [[6, 7], [8, 10], [12, 14]]
    assert RangeSet.from_json(s.to_json()) == s


def test_rangeset_random_against_python_set():
    rng = random.Random(0)
    for _ in range(50):
        s, ref = RangeSet(), set()
        for _ in range(rng.randint(0, 40)):
            a = rng.randint(0, 60)
            b = a + rng.randint(0, 6)
            s.add_range(a, b)
            ref.update(range(a, b))
        assert list(s) == sorted(ref)
        assert len(s) == len(ref)
        assert list(s.complement(70)) == sorted(set(range(70)) - ref)
        idx = IndexedRanges(s)
        assert [idx[i] for i in range(len(idx))] == sorted(ref)


@pytest.mark.parametrize("bad", [[[3, 3]], [[-1, 2]], [[1]], "x", [[1, "2"]]])
def test_rangeset_rejects_malformed_json(bad):
    with pytest.raises(ValueError):
        RangeSet.from_json(bad)


def _deal(remaining: RangeSet, w: int) -> list[StaticScheduler]:
    return [StaticScheduler(remaining, Collectives(None, r, w), interval=1) for r in range(w)]


@pytest.mark.parametrize(
    "n,b,w,expected",
    [(50, 10, 1, [5]), (50, 10, 2, [3, 2]), (50, 20, 1, [3]), (50, 20, 2, [2, 1]), (7, 2, 3, [2, 1, 1])],
)
def test_determined_call_count_table(n, b, w, expected):
    plan = ContiguousPlan(n, b)
    ranks = _deal(RangeSet([(0, plan.num_batches)]), w)
    assert [len(list(rank.batch_ids())) for rank in ranks] == expected
    assert all(rank.num_steps == max(expected) for rank in ranks)
    assert [sum(rank.steps()) for rank in ranks] == expected, "a rank runs a batch in its first steps, then idles"
    seen = collections.Counter(g for rank in ranks for g in rank.batch_ids())
    assert sorted(seen) == list(range(plan.num_batches)) and set(seen.values()) == {1}


def test_fresh_plan_is_g_mod_w_and_resume_deals_remaining_round_robin():
    ranks = _deal(RangeSet([(0, 10)]), 3)
    assert [ranks[0].batch_at(s, r) for s in range(4) for r in range(3)] == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, None, None]
    remaining = RangeSet([(2, 3), (5, 9)])  # committed elsewhere: the rest
    ranks = _deal(remaining, 2)
    assert list(ranks[0].batch_ids()) == [2, 6, 8] and list(ranks[1].batch_ids()) == [5, 7]


def test_contiguous_plan_and_planned_batches():
    plan = ContiguousPlan(7, 2)
    assert plan.num_batches == 4 and plan.num_examples == 7
    assert list(plan.batch_indices(3)) == [6]
    assert plan.count_examples(RangeSet([(1, 4)])) == 5
    assert ContiguousPlan(7, 2, num_batches=2).num_examples == 4
    assert planned_batches(100, 3, 4) == 12 and planned_batches(10, 3, 4) == 10 and planned_batches(10, None, 4) == 10


def test_to_device_recurses_and_converts_numpy():
    Point = collections.namedtuple("Point", "x y")
    data = {
        "a": np.arange(3),
        "b": [torch.ones(2), (torch.zeros(1), "text")],
        "p": Point(torch.tensor(1.0), 2),
        "n": None,
    }
    moved = to_device(data, "cpu")
    assert isinstance(moved["a"], torch.Tensor) and moved["a"].tolist() == [0, 1, 2]
    assert isinstance(moved["b"], list) and isinstance(moved["b"][1], tuple) and moved["b"][1][1] == "text"
    assert isinstance(moved["p"], Point) and moved["p"].y == 2
    assert moved["n"] is None


def _fast_tokenizer():
    """A fast tokenizer built in memory (no download): its encodings give ``word_ids()``."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    vocab = {"[UNK]": 0, "[PAD]": 1, "hello": 2, "world": 3}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")


def test_to_device_keeps_a_tokenizer_s_batch_encoding_whole():
    """Determined code moves a fast tokenizer's output with ``context.to_device(tokens)`` and then asks it for
    ``word_ids()``: the moved ``BatchEncoding`` keeps its encodings (as ``BatchEncoding.to(device)`` does), the
    original is left as it was, and so does the device prefetcher's copy."""
    from torch_batch_process.engine.feed.prefetch import _copy_ahead

    tokens = _fast_tokenizer()(["hello world", "world"], padding=True, return_tensors="pt")
    for moved in (to_device(tokens, "cpu"), _copy_ahead(tokens, torch.device("cpu"), set(), [], [False])):
        assert type(moved) is type(tokens) and moved is not tokens
        assert moved.word_ids(0) == [0, 1] and moved.word_ids(1) == [0, None]
        assert moved.n_sequences == 1 and moved["input_ids"].tolist() == [[2, 3], [3, 1]]
        assert moved.encodings is not None and moved.data is not tokens.data
    assert tokens.word_ids(0) == [0, 1]


def test_to_device_pinned_source_is_non_blocking(monkeypatch):
    calls = []
    original = torch.Tensor.to

    def spy(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    to_device(torch.ones(2), "cpu")
    assert calls == [False]
    if torch.cuda.is_available():  # pin_memory needs an accelerator
        to_device(torch.ones(2).pin_memory(), "cpu")
        assert calls[-1] is True


def test_default_device_is_cpu_without_accelerator():
    assert get_default_device() == torch.device("cpu") or torch.cuda.is_available()


class _Avg(MetricReducer):
    def __init__(self):
        self.reset()

    def reset(self):
        self.s, self.n = 0.0, 0

    def update(self, v):
        self.s += v
        self.n += 1

    def per_slot_reduce(self):
        return self.s, self.n

    def cross_slot_reduce(self, per_slot_metrics):
        s, n = map(sum, zip(*per_slot_metrics))
        return s / n


def test_reducer_registry_semantics():
    registry = ReducerRegistry()
    fn = registry.wrap(lambda values: {"total": sum(values), "first": values[0]})
    avg = registry.wrap(_Avg(), name="avg")
    fn.update(1)
    fn.update(3)
    avg.update(2.0)
    other = [[5], (4.0, 1)]
    metrics = registry.cross_slot_reduce([registry.per_slot_states(), other])
    # Function reducers see the values interleaved across slots: slot0[0], slot1[0], slot0[1].
    assert metrics == {"total": 9, "first": 1, "avg": 3.0}
    with pytest.raises(ValueError):
        registry.wrap(avg)  # the same object twice
    with pytest.raises(TypeError):
        registry.wrap(42)


def test_wrap_reducer_refuses_a_reducer_class_and_an_empty_name():
    """A MetricReducer class is callable, so it was taken for a function fn(values): the job ran to its end and then
    failed in cross_slot_reduce() with R([...])."""
    registry = ReducerRegistry()
    with pytest.raises(InvalidArgumentError, match=r"got the class _Avg: pass _Avg\(\)"):
        registry.wrap(_Avg, name="avg")
    with pytest.raises(InvalidArgumentError, match="the metric needs a name"):
        registry.wrap(lambda values: 1.0, name="")
    assert registry.wrapped == []


def test_reducer_name_and_dict_mismatch_is_explained():
    registry = ReducerRegistry()
    registry.wrap(lambda values: 1.0)  # name=None but returns a scalar
    with pytest.raises(TypeError, match="name=None"):
        registry.cross_slot_reduce([registry.per_slot_states()])


def test_voted_stages_publish_each_covered_stage_with_files_once():
    voted = VotedStages()
    for stage, has_files in [(1, True), (2, False), (3, True), (5, True), (8, True)]:
        voted.append(stage, has_files)
    assert len(voted) == 5
    assert voted.covered(0) == 0 and voted.covered(3) == 3 and voted.covered(4) == 3 and voted.covered(99) == 5
    assert voted.take(voted.covered(3)) == [1, 3]  # stage 2 had no files
    assert voted.take(voted.covered(3)) == []  # never twice
    assert voted.take(2) == []  # a count below what was taken: nothing
    assert voted.covered(2) == 3  # votes taken count as covered
    voted.append(9, True)
    assert len(voted) == 6
    assert voted.take(len(voted)) == [5, 8, 9]
    assert voted.take(len(voted)) == []


def test_voted_stages_keep_only_what_is_not_published():
    voted = VotedStages()
    published = []
    for stage in range(1, 200_001):  # a long job: the covered/take cost must not grow with it
        voted.append(stage, stage % 3 != 0)
        if stage % 7 == 0:
            published += voted.take(voted.covered(stage - 2))
    published += voted.take(len(voted))
    assert published == [s for s in range(1, 200_001) if s % 3 != 0]
    assert len(voted._waiting) == 0


def test_inline_background_work_runs_at_submission_and_raises_at_the_next_check():
    import threading

    work = BackgroundWork(inline=True)
    ran: list[str] = []
    work.submit("first", lambda: ran.append(threading.current_thread().name))
    assert ran == [threading.current_thread().name]  # ran at once, on the caller's thread
    work.check()

    def fails() -> None:
        raise OSError("disk gone")

    work.submit("second", fails)  # never raises at submission: the error travels like a queued task's
    work.submit("third", lambda: ran.append("third"))
    with pytest.raises(OSError, match="disk gone"):
        work.check()
    assert ran[-1] == "third"
    work.settle()  # the failed task was reported once
    work.close()


def test_publishing_a_stage_moves_failure_records_only_when_told_it_has_some(tmp_path):
    storage = open_storage(str(tmp_path / "job"), None)
    store = JobStore(storage)
    for stage, with_failures in [(1, False), (2, True)]:
        folder = tmp_path / "job" / staging_dir(stage, 0)
        folder.mkdir(parents=True)
        (folder / "out.txt").write_text(str(stage))
        if with_failures:
            (folder / STAGED_FAILURES_NAME).write_text('{"index": 7}\n')
        store.publish(stage, 0, sole=True, failures=with_failures)
        assert (tmp_path / "job" / outputs_dir(stage, 0) / "out.txt").read_text() == str(stage)
        assert not (tmp_path / "job" / staging_dir(stage)).exists()
    assert (tmp_path / "job" / failures_file(2, 0)).read_text() == '{"index": 7}\n'
    assert not (tmp_path / "job" / outputs_dir(2, 0) / STAGED_FAILURES_NAME).exists()
    assert not (tmp_path / "job" / failures_file(1, 0)).exists()


def test_the_feed_skips_the_loaders_profiler_range_only_while_no_profiler_runs():
    from torch.profiler import profile

    from torch_batch_process.engine.feed.batches import BatchFeed
    from torch_batch_process.engine.feed.fitting import BatchFitter

    plan = ContiguousPlan(20, 4)
    scheduler = StaticScheduler(RangeSet([(0, plan.num_batches)]), Collectives(None, 0, 1), interval=1)
    fitter = BatchFitter.for_job(None, None, "cpu")
    feed = BatchFeed(list(range(20)), plan, scheduler, {}, torch.device("cpu"), fitter)
    feed.start()
    assert feed._direct is not None  # a DataLoader iterator: its batches are taken without the range
    first = [next(feed), next(feed)]
    with profile() as prof:
        during = next(feed)
    after = list(feed)
    got = [(i, b.tolist()) for i, b in [*first, during, *after]]
    assert got == [(g, list(range(4 * g, 4 * g + 4))) for g in range(5)]
    names = [event.name for event in prof.events()]
    assert any(name.startswith("enumerate(DataLoader)#") for name in names), names  # traces keep the range
    feed.close()


def test_heartbeats_report_a_rank_that_stops_beating_and_never_one_that_beats():
    import threading
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from torch_batch_process.engine.schedule.liveness import Heartbeats

    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False)
    connect = lambda: TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))  # noqa: E731
    lost: list[BaseException] = []
    reported = threading.Event()

    def on_lost(error: BaseException) -> None:
        lost.append(error)
        reported.set()

    timing = {"beat_s": 0.05, "silence_s": 0.5}
    watcher = Heartbeats(connect, 0, 3, on_lost, **timing).start()
    alive = Heartbeats(connect, 1, 3, on_lost, **timing).start()
    dying = Heartbeats(connect, 2, 3, on_lost, **timing).start()
    try:
        time.sleep(1.0)
        assert not lost, "every rank beats"
        dying.close()
        started = time.monotonic()
        assert reported.wait(10.0)
        assert time.monotonic() - started < 3.0
        assert len(lost) == 1 and "rank 2 stopped answering" in str(lost[0])
    finally:
        for beats in (watcher, alive, dying):
            beats.close()


def test_the_heartbeat_silence_comes_from_the_environment_and_a_bad_value_is_refused_naming_it(monkeypatch):
    from torch_batch_process.engine.schedule.liveness import SILENCE_ENV, SILENCE_S, heartbeat_silence_s

    monkeypatch.delenv(SILENCE_ENV, raising=False)
    assert heartbeat_silence_s() == SILENCE_S
    monkeypatch.setenv(SILENCE_ENV, "120")
    assert heartbeat_silence_s() == 120.0
    for bad in ("abc", "0", "1", "nan", "-5"):
        monkeypatch.setenv(SILENCE_ENV, bad)
        with pytest.raises(InvalidArgumentError, match=f"{SILENCE_ENV} must be a number of seconds >= 2"):
            heartbeat_silence_s()


def test_the_start_line_of_a_resume_says_where_it_resumes_or_that_nothing_is_left(caplog):
    from torch_batch_process.engine.announce import log_start
    from torch_batch_process.jobstore.opening import Start

    plan = ContiguousPlan(400, 10)  # 40 batches
    common = dict(job_name="j", start=Start(attempt=2, next_number=3, planned_batches=40), plan=plan, world_size=1,
                  schedule="static", storage_url="/s", plan_s=0.0)
    with caplog.at_level("INFO", logger="torch_batch_process.engine.announce"):
        log_start(remaining=RangeSet([(30, 40)]), **common)
        log_start(remaining=RangeSet(), **common)
    resumed, nothing_left = (record.getMessage() for record in caplog.records)
    assert "resuming at batch 30; 30 of 40 batches already committed, 10 to go" in resumed
    assert "all 40 batches already committed, none to go" in nothing_left and "None" not in nothing_left


def test_the_quick_lane_rule_tells_job_processes_from_quick_commands():
    """conftest.py fails a test not marked slow that starts one of these (the README's quick lane is true)."""
    from conftest import starts_a_job
    from harness import GENERIC_JOB, launcher_cmd, tbp_cmd, torchrun_cmd

    assert starts_a_job(torchrun_cmd(2, GENERIC_JOB), None)
    assert starts_a_job(launcher_cmd("--nproc-per-node", "2", "job.py"), None)
    assert starts_a_job([sys.executable, str(GENERIC_JOB), "{}"], None)
    assert starts_a_job([sys.executable, "job.py"], {"WORLD_SIZE": "2", "RANK": "1"})
    assert starts_a_job(tbp_cmd("run", "job.yaml"), None)
    assert not starts_a_job(tbp_cmd("run", "job.yaml", "--dry-run"), None)
    assert not starts_a_job(tbp_cmd("status", "/some/job"), None)
    assert not starts_a_job([sys.executable, "-c", "print(1)"], None)


def test_a_single_process_distributed_context_has_determined_s_local_collectives():
    """Determined's ``DistributedContext`` methods answer without communication in a one-process job."""
    from torch_batch_process import DistributedInfo

    info = DistributedInfo(0, 1, 0, 1, 0, 1)
    assert info.get_num_agents() == 1
    assert info.allgather_local("x") == ["x"] and info.gather_local("x") == ["x"] and info.broadcast_local("x") == "x"
    info.close()


def test_determined_s_experimental_names_import_from_both_determined_style_modules():
    """Every name of Determined's ``determined.pytorch.experimental`` imports from ``torch_batch_process``'s
    Determined-style modules, ``get_default_device(core_context)`` (Determined's signature) included."""
    import types

    from torch_batch_process import experimental
    from torch_batch_process.pytorch import experimental as pytorch_experimental

    determined_names = {"TorchBatchProcessor", "TorchBatchProcessorContext", "get_default_device", "torch_batch_process"}
    for module in (experimental, pytorch_experimental):
        assert determined_names <= set(module.__all__) and all(hasattr(module, name) for name in determined_names)
    core_context = types.SimpleNamespace(distributed=types.SimpleNamespace(local_rank=0))
    assert experimental.get_default_device(core_context) == experimental.get_default_device() == get_default_device()
