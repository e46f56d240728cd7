"""Every bad input is refused with a clear error naming the argument, before any work or storage write."""

from __future__ import annotations

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
    "storage_path empty": (dict(storage_path=""), "storage_path", ValueError),
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
