"""Every bad input is refused with a clear error naming the argument, before any work or storage write."""

from __future__ import annotations

import re

import pytest
import torch

from torch_batch_process import InvalidArgumentError, TorchBatchProcessor, torch_batch_process

CALLS: list[int] = []


class Ok(TorchBatchProcessor):
    def __init__(self, context):
        CALLS.append(-1)

    def process_batch(self, batch, batch_idx):
        CALLS.append(batch_idx)


class NoProcessBatch(TorchBatchProcessor):
    def __init__(self, context):
        pass


class NotAProcessor:
    def __init__(self, context):
        pass

    def process_batch(self, batch, batch_idx):
        pass


class NoLen:
    def __getitem__(self, i):
        return i


class Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(3))


CASES = {
    "batch_size=0": (dict(batch_size=0), "batch_size", ValueError),
    "batch_size=-3": (dict(batch_size=-3), "batch_size", ValueError),
    "batch_size=str": (dict(batch_size="8"), "batch_size", TypeError),
    "batch_size=float": (dict(batch_size=2.0), "batch_size", TypeError),
    "batch_size twice": (dict(batch_size=4, dataloader_kwargs={"batch_size": 4}), "batch_size", ValueError),
    "dataloader batch_size=0": (dict(dataloader_kwargs={"batch_size": 0}), "batch_size", ValueError),
    "checkpoint_interval=0": (dict(checkpoint_interval=0), "checkpoint_interval", ValueError),
    "checkpoint_interval=-1": (dict(checkpoint_interval=-1), "checkpoint_interval", ValueError),
    "checkpoint_interval=str": (dict(checkpoint_interval="5"), "checkpoint_interval", TypeError),
    "max_batches=0": (dict(max_batches=0), "max_batches", ValueError),
    "max_batches=-2": (dict(max_batches=-2), "max_batches", ValueError),
    "shuffle=True": (dict(dataloader_kwargs={"shuffle": True}), "shuffle", ValueError),
    "sampler": (dict(dataloader_kwargs={"sampler": torch.utils.data.SequentialSampler(range(10))}), "sampler", ValueError),
    "batch_sampler": (dict(dataloader_kwargs={"batch_sampler": [[0, 1]]}), "batch_sampler", ValueError),
    "drop_last=True": (dict(dataloader_kwargs={"drop_last": True}), "drop_last", ValueError),
    "in_order=False": (
        dict(dataloader_kwargs={"num_workers": 2, "in_order": False}), "dataloader_kwargs['in_order']=False", ValueError
    ),
    "timeout without workers": (dict(dataloader_kwargs={"timeout": 5}), "needs num_workers > 0", ValueError),
    "unknown loader key": (dict(dataloader_kwargs={"num_wrokers": 2}), "num_wrokers", ValueError),
    "bad loader value": (dict(dataloader_kwargs={"num_workers": -1}), "dataloader_kwargs", ValueError),
    "prefetch without workers": (dict(dataloader_kwargs={"prefetch_factor": 2}), "dataloader_kwargs", ValueError),
    "dataloader_kwargs not a dict": (dict(dataloader_kwargs=[("num_workers", 1)]), "dataloader_kwargs", TypeError),
    "collate_fn not callable": (
        dict(dataloader_kwargs={"collate_fn": "stack"}),
        "dataloader_kwargs['collate_fn'] must be a function",
        TypeError,
    ),
    "worker_init_fn not callable": (
        dict(dataloader_kwargs={"num_workers": 1, "worker_init_fn": 3}),
        "dataloader_kwargs['worker_init_fn'] must be a function",
        TypeError,
    ),
    "generator not a Generator": (
        dict(dataloader_kwargs={"generator": 5}),
        "dataloader_kwargs['generator'] must be a torch.Generator",
        TypeError,
    ),
    "pin_memory_device not a str": (
        dict(dataloader_kwargs={"pin_memory_device": 3}),
        "dataloader_kwargs['pin_memory_device'] must be a device name str",
        TypeError,
    ),
    "bucket_window without bucket_by": (dict(bucket_window=5), "bucket_window=5 needs bucket_by", ValueError),
    "resume not bool": (dict(resume="yes"), "resume", TypeError),
    "job_name bad": (dict(job_name="../escape"), "job_name", ValueError),
    "job_name ending in a newline": (dict(job_name="job\n"), "job_name", ValueError),
    "storage_path empty": (dict(storage_path=""), "storage_path", ValueError),
    # DataLoader options the DataLoader itself only trips over once its workers start (after the job opened its
    # storage), or takes silently as truthy.
    "num_workers float": (dict(dataloader_kwargs={"num_workers": 1.5}), "dataloader_kwargs['num_workers']", TypeError),
    "num_workers bool": (dict(dataloader_kwargs={"num_workers": True}), "dataloader_kwargs['num_workers']", TypeError),
    "prefetch_factor 0": (
        dict(dataloader_kwargs={"num_workers": 1, "prefetch_factor": 0}), "dataloader_kwargs['prefetch_factor']", ValueError
    ),
    "prefetch_factor float": (
        dict(dataloader_kwargs={"num_workers": 1, "prefetch_factor": 2.5}),
        "dataloader_kwargs['prefetch_factor']",
        TypeError,
    ),
    "timeout str": (dict(dataloader_kwargs={"num_workers": 1, "timeout": "5"}), "dataloader_kwargs['timeout']", TypeError),
    "pin_memory str": (dict(dataloader_kwargs={"pin_memory": "no"}), "dataloader_kwargs['pin_memory'] must be True or", TypeError),
    "shuffle str": (dict(dataloader_kwargs={"shuffle": "no"}), "dataloader_kwargs['shuffle'] must be True or False", TypeError),
    "persistent_workers int": (
        dict(dataloader_kwargs={"num_workers": 1, "persistent_workers": 1}), "dataloader_kwargs['persistent_workers']", TypeError
    ),
    # A storage path that is a URL with a typo would silently become a local folder (./s3:/bucket/x).
    "storage_path s3 one slash": (dict(storage_path="s3:/bucket/x"), "Did you mean 's3://bucket/x'", ValueError),
    "storage_path s3 no slash": (dict(storage_path="s3:bucket/x"), "Did you mean 's3://bucket/x'", ValueError),
    "storage_path s3 no colon": (dict(storage_path="s3//bucket/x"), "Did you mean 's3://bucket/x'", ValueError),
    "storage_path file one slash": (dict(storage_path="file:/tmp/x"), "Did you mean '/tmp/x'", ValueError),
    "storage_path unknown protocol": (dict(storage_path="s33://bucket/x"), "unknown protocol 's33'; did you mean s3://", ValueError),
    "storage_path int": (dict(storage_path=5), "storage_path", TypeError),
    # Beyond int64: an OverflowError in the plan (max_tokens, with bucket_by) or in numpy, not a clear error.
    "batch_size 10**30": (dict(batch_size=10**30), "batch_size must be at most 2**63 - 1", ValueError),
    "checkpoint_interval 10**30": (dict(checkpoint_interval=10**30), "checkpoint_interval must be at most", ValueError),
    "max_tokens 10**30": (dict(bucket_by=[1] * 10, max_tokens=10**30), "max_tokens=10000", ValueError),
    "bucket_window 10**30": (dict(bucket_by=[1] * 10, bucket_window=10**30), "bucket_window=10000", ValueError),
    "bucket_by two parameters": (dict(bucket_by=lambda i, j: 1), "bucket_by must be a callable index -> length", TypeError),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_argument_is_refused_before_any_work(case, tmp_path):
    overrides, needle, kind = CASES[case]
    kwargs = dict(batch_size=None, storage_path=str(tmp_path / "store"))
    kwargs.update(overrides)
    CALLS.clear()
    with pytest.raises(kind) as info:
        torch_batch_process(Ok, list(range(10)), **kwargs)
    assert isinstance(info.value, InvalidArgumentError)
    assert needle in str(info.value)
    assert CALLS == [], "no processor was built"
    assert not (tmp_path / "store").exists(), "nothing was written to storage"


@pytest.mark.parametrize(
    "processor,needle",
    [
        (NoProcessBatch, "process_batch"),
        (NotAProcessor, "TorchBatchProcessor"),
        (Ok(None), "not an instance"),
        ("Ok", "TorchBatchProcessor"),
    ],
)
def test_bad_processor_class_is_refused(processor, needle, tmp_path):
    with pytest.raises((TypeError, ValueError), match=needle):
        torch_batch_process(processor, list(range(4)), storage_path=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


class NoContext(TorchBatchProcessor):
    def __init__(self):
        pass

    def process_batch(self, batch, batch_idx):
        pass


class OneArgProcessBatch(TorchBatchProcessor):
    def __init__(self, context):
        pass

    def process_batch(self, batch):
        pass


class Fine(TorchBatchProcessor):
    """Required hooks as they should be (the classes below each get one optional hook wrong)."""

    def __init__(self, context):
        pass

    def process_batch(self, batch, batch_idx):
        pass


class FinishWithArgument(Fine):
    def on_finish(self, result):  # called as on_finish(): failed only when the job had done all its work
        pass


class LoadWithoutState(Fine):
    def state_dict(self):
        return {}

    def load_state_dict(self):
        pass


class StarArgs(TorchBatchProcessor):
    def __init__(self, *args, **kwargs):
        CALLS.append(-1)

    def process_batch(self, *args):
        CALLS.append(args[1])


@pytest.mark.parametrize(
    "processor,needle",
    [
        (NoContext, r"NoContext.__init__\(self, context\) is required"),
        (OneArgProcessBatch, r"OneArgProcessBatch.process_batch\(self, batch, batch_idx\) is required"),
        (FinishWithArgument, r"FinishWithArgument.on_finish\(self\) is required \(the library calls it as on_finish\(\)\)"),
        (LoadWithoutState, r"LoadWithoutState.load_state_dict\(self, state\) is required"),
    ],
)
def test_a_processor_with_the_wrong_hook_signature_is_refused_before_any_work(processor, needle, tmp_path):
    """A hook with the wrong parameters failed only once the job had opened (and written) its storage."""
    with pytest.raises(InvalidArgumentError, match=needle):
        torch_batch_process(processor, list(range(4)), storage_path=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_a_processor_with_star_args_hooks_is_accepted(tmp_path):
    CALLS.clear()
    torch_batch_process(StarArgs, list(range(3)), storage_path=str(tmp_path / "store"), progress=False)
    assert CALLS == [-1, 0, 1, 2]


@pytest.mark.parametrize(
    "dataset,needle",
    [
        ("data/train.parquet", "sources.parquet"),
        (b"abc", "map-style dataset"),
        ({"text": ["a", "b"], "label": [0, 1]}, "datasets.Dataset.from_dict"),
        ({1: "a", 2: "b"}, "not the indices 0..1"),
    ],
)
def test_a_str_or_a_dict_of_columns_is_not_taken_for_a_dataset(dataset, needle, tmp_path):
    """A str has a len() and indexes (its characters would be the examples); a dict of columns has a len() (its
    keys) and dataset[0] fails only in the first batch, after the job opened its storage."""
    with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
        torch_batch_process(Ok, dataset, storage_path=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_a_batch_size_far_beyond_the_dataset_plans_one_batch_with_bucket_by(tmp_path):
    """bucket_window * batch_size overflowed numpy's int64 in the plan (OverflowError after the job opened its
    storage); a batch or a window holds at most the dataset's examples, whatever is asked."""
    CALLS.clear()
    result = torch_batch_process(
        Ok, list(range(10)), batch_size=10**18, bucket_by=[3] * 10, storage_path=str(tmp_path / "s"), progress=False
    )
    assert result.finished and CALLS == [-1, 0]


def test_a_dict_indexed_by_position_is_a_dataset(tmp_path):
    CALLS.clear()
    torch_batch_process(Ok, {1: "b", 0: "a"}, storage_path=str(tmp_path / "store"), progress=False)
    assert CALLS == [-1, 0, 1]


def test_a_storage_url_with_a_typo_is_refused_on_the_read_side_too(tmp_path, monkeypatch):
    from torch_batch_process import read_failures, read_outputs

    monkeypatch.chdir(tmp_path)
    for bad in ("", "s3:/bucket/x", "gs//bucket"):
        for read in (read_outputs, read_failures):
            with pytest.raises(InvalidArgumentError, match="storage_path"):
                read(bad)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(InvalidArgumentError, match="storage_path"):
        read_failures(None)
    with pytest.raises(InvalidArgumentError, match="storage_options must be a dict"):
        read_failures(str(tmp_path), storage_options=[1])  # was ignored for a local path


def test_a_storage_path_from_the_environment_is_checked_and_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TBP_STORAGE_PATH", "s3:/bucket/x")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidArgumentError, match="environment variable TBP_STORAGE_PATH 's3:/bucket/x'"):
        torch_batch_process(Ok, list(range(4)))
    assert list(tmp_path.iterdir()) == []


def test_a_local_folder_whose_name_holds_a_colon_is_given_with_dot_slash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    CALLS.clear()
    torch_batch_process(Ok, list(range(2)), storage_path="./s3:/x", progress=False)
    assert (tmp_path / "s3:" / "x" / "_tbp" / "job.json").exists()


@pytest.mark.parametrize("dataset,needle", [(NoLen(), "__len__"), (Stream(), "IterableDataset"), (iter(range(3)), "__len__")])
def test_dataset_without_len_is_refused(dataset, needle, tmp_path):
    with pytest.raises((TypeError, ValueError), match=needle):
        torch_batch_process(Ok, dataset, storage_path=str(tmp_path / "store"))
    assert not (tmp_path / "store").exists()


def test_shuffle_false_and_valid_loader_options_are_accepted(tmp_path):
    CALLS.clear()
    result = torch_batch_process(
        Ok,
        list(range(10)),
        dataloader_kwargs={
            "shuffle": False,
            "batch_size": 4,
            "num_workers": 0,
            "sampler": None,
            "collate_fn": torch.utils.data.default_collate,
            "worker_init_fn": None,
            "generator": torch.Generator().manual_seed(0),
            "in_order": True,
            "timeout": 0,
        },
        storage_path=str(tmp_path / "store"),
    )
    assert CALLS == [-1, 0, 1, 2]
    assert result.finished and result.num_batches == 3


@pytest.mark.parametrize("where", ["arguments", "dataloader_kwargs"])
def test_counts_computed_with_numpy_are_accepted_as_determined_accepts_them(where, tmp_path):
    """``batch_size``, ``max_batches`` and ``checkpoint_interval`` given as numpy integers (computed with numpy) run,
    and the job stores them as plain ints (its record is JSON): a resume with plain ints is the same job."""
    np = pytest.importorskip("numpy")
    CALLS.clear()
    counts = {"max_batches": np.int64(2), "checkpoint_interval": np.int32(1)}
    if where == "arguments":
        counts["batch_size"] = np.int64(3)
    else:
        counts["dataloader_kwargs"] = {"batch_size": np.int64(3)}
    result = torch_batch_process(Ok, list(range(10)), storage_path=str(tmp_path / "store"), **counts)
    assert CALLS == [-1, 0, 1] and result.finished and result.num_batches == 2
    again = torch_batch_process(Ok, list(range(10)), 3, 2, 1, storage_path=str(tmp_path / "store"))
    assert again.already_finished


@pytest.mark.parametrize("option", [dict(schedule="dynamic"), dict(batch_timeout=30)])
def test_options_that_need_the_stores_queues_are_refused_on_a_torch_without_them(option, tmp_path, monkeypatch):
    """torch before 2.8 has no Store.queue_push / Store.clone (the dynamic schedule's votes, the watchdog's own
    connection): such a torch gets an error naming the option and the version before any work, not a lost worker
    once the ranks run."""
    monkeypatch.setattr(torch.distributed, "Store", type("Store", (), {}))  # a store class as torch 2.4's
    CALLS.clear()
    with pytest.raises(InvalidArgumentError, match=r"needs torch >= 2\.8") as info:
        torch_batch_process(Ok, list(range(10)), storage_path=str(tmp_path / "store"), **option)
    assert next(iter(option)) in str(info.value) and torch.__version__ in str(info.value)
    assert CALLS == [] and not (tmp_path / "store").exists()


@pytest.mark.parametrize(
    ("variable", "value", "needle"),
    [
        ("TBP_STORAGE_RETRIES", "x", "environment variable TBP_STORAGE_RETRIES must be an int >= 1, got 'x'"),
        ("TBP_STORAGE_RETRIES", "0", "TBP_STORAGE_RETRIES must be an int >= 1"),
        ("TBP_STORAGE_RETRY_S", "-1", "TBP_STORAGE_RETRY_S must be a number >= 0"),
        ("TBP_UPLOAD_THREADS", "0", "TBP_UPLOAD_THREADS must be an int >= 1"),
        ("TBP_LEASE_TTL_S", "soon", "TBP_LEASE_TTL_S must be a number > 0"),
        ("TBP_COLLECTIVE_TIMEOUT_S", "-5", "TBP_COLLECTIVE_TIMEOUT_S must be a number > 0"),
        ("TBP_JOIN_TIMEOUT_S", "x", "TBP_JOIN_TIMEOUT_S must be a number of seconds > 0"),
        ("TBP_AGREEMENT_S", "-1", "environment variable TBP_AGREEMENT_S must be a number of seconds >= 0, got '-1'"),
    ],
)
def test_a_documented_tuning_variable_with_a_bad_value_is_refused_when_the_call_starts(
    variable, value, needle, tmp_path, monkeypatch
):
    """These were read only when first needed: a storage retry (raising ValueError instead of retrying), an upload or
    the lease on an object store, or a multi-process join; TBP_COLLECTIVE_TIMEOUT_S=-5 was taken,
    TBP_STORAGE_RETRIES=0 silently became 1. (TBP_HPARAMS stays lazy: a bad value fails only get_hparams(), see
    test_progress_and_hparams.)"""
    monkeypatch.setenv(variable, value)
    CALLS.clear()
    with pytest.raises(InvalidArgumentError, match=re.escape(needle)):
        torch_batch_process(Ok, list(range(4)), storage_path=str(tmp_path / "store"))
    assert CALLS == [] and not (tmp_path / "store").exists()
