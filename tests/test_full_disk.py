"""A real full disk (a small tmpfs mounted for the test): the job stops promptly with the disk's own error, the last
commit stays readable exactly once, and once there is room again the same call resumes and finishes exactly once.

Mounting needs root (CAP_SYS_ADMIN); elsewhere the tests skip, saying why. tests/test_segment_log.py covers the same
failure without privileges (a file size limit: ``EFBIG``).
"""

from __future__ import annotations

import errno
import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from harness import commit_records

from torch_batch_process import (
    StorageError,
    TorchBatchProcessor,
    read_failures,
    read_outputs,
    tables,
    torch_batch_process,
)

N, BATCH = 20_000, 50  # 64 floats and a label a row: ~6 MB of Arrow data, three times the disk


class Rows(TorchBatchProcessor):
    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        values = [int(v) for v in batch]
        self.context.write({"emb": torch.stack([torch.full((64,), float(v)) for v in values]),
                            "label": [f"ex{v}" for v in values]})


class Files(TorchBatchProcessor):
    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        with self.context.upload_path() as path:
            torch.save(torch.stack([torch.full((64,), float(v)) for v in batch]), path / f"batch_{batch_idx:05d}.pt")


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2-MiB tmpfs at ``tmp_path/disk``; ``remount(size)`` in the test gives it more room."""
    disk = tmp_path / "disk"
    disk.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)],
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"cannot mount a tmpfs for a full disk: {exc}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a full disk (needs root): {mounted.stderr.strip()}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30)


def _grow(disk: Path) -> None:
    subprocess.run(["mount", "-o", "remount,size=64m", str(disk)], check=True, capture_output=True, timeout=30)


def _committed_batches(storage: Path) -> list[int]:
    record = json.loads(commit_records(storage)[-1].read_text())
    return [g for a, b in record["committed"] for g in range(a, b)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_records_on_a_full_disk_stop_at_once_then_resume_exactly_once(small_disk, fmt):
    storage = small_disk / "job"
    with pytest.raises(StorageError) as raised:  # an OSError naming the file, with the disk's errno (not pyarrow's own
        torch_batch_process(Rows, torch.arange(N), batch_size=BATCH, storage_path=str(storage), checkpoint_interval=2,
                            output_format=fmt, progress=False)  # error, which names neither the file nor the job)
    assert raised.value.errno == errno.ENOSPC, raised.value
    assert "no space left" in str(raised.value) and str(storage) in str(raised.value), raised.value
    committed = _committed_batches(storage)
    assert 0 < len(committed) < N // BATCH
    index = read_outputs(storage).column("index").to_pylist()  # the last commit, readable on the full disk
    assert index == [i for g in committed for i in range(g * BATCH, (g + 1) * BATCH)]

    _grow(small_disk)
    result = torch_batch_process(Rows, torch.arange(N), batch_size=BATCH, storage_path=str(storage),
                                 checkpoint_interval=2, output_format=fmt, progress=False)
    assert result.finished
    table = read_outputs(storage)
    assert table.column("index").to_pylist() == list(range(N))
    assert table.column("label").to_pylist() == [f"ex{i}" for i in range(N)]
    assert not list((storage / "_tbp" / "segments").glob("*")), "segment logs are gone once the job finished"


def test_files_on_a_full_disk_stop_at_once_then_resume_exactly_once(small_disk):
    storage = small_disk / "job"
    # the user's torch.save fails first (torch says RuntimeError, not ENOSPC), or the library's commit (OSError)
    with pytest.raises((OSError, RuntimeError)):
        torch_batch_process(Files, torch.arange(N), batch_size=BATCH, storage_path=str(storage),
                            checkpoint_interval=2, progress=False)
    committed = set(_committed_batches(storage))
    published = sorted(p.name for p in (storage / "outputs").rglob("batch_*.pt"))
    assert published == [f"batch_{g:05d}.pt" for g in sorted(committed)], "committed batches' files, each once"

    _grow(small_disk)
    assert torch_batch_process(Files, torch.arange(N), batch_size=BATCH, storage_path=str(storage),
                               checkpoint_interval=2, progress=False).finished
    files = sorted((storage / "outputs").rglob("batch_*.pt"))
    assert [p.name for p in files] == [f"batch_{g:05d}.pt" for g in range(N // BATCH)]
    values = torch.cat([torch.load(p)[:, 0] for p in files])
    assert values.tolist() == [float(i) for i in range(N)]


class RandomRows(TorchBatchProcessor):
    """Rows that do not compress (a table's Parquet files hold the constant rows of :class:`Rows` in kilobytes)."""

    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        values = [int(v) for v in batch]
        self.context.write({"emb": torch.stack([torch.rand(64, generator=torch.Generator().manual_seed(v))
                                                for v in values])})


@pytest.mark.parametrize("kind", ["delta", "lance"])
def test_a_table_on_a_full_disk_is_a_storage_error_naming_it_then_resumes_exactly_once(small_disk, kind):
    pytest.importorskip("deltalake" if kind == "delta" else "lance")
    target = getattr(tables, kind)(str(small_disk / "table"))
    # the job's own storage on another disk: only the table's files fill this one (with both on it, which write meets
    # the full disk first is a race, and a commit record's StorageError names the job, not the table)
    run = dict(batch_size=BATCH, storage_path=str(small_disk.parent / "job"), checkpoint_interval=2, progress=False,
               table=target)
    with pytest.raises(StorageError) as raised:  # not the bare OSError of pyarrow or Lance, which names no table
        torch_batch_process(RandomRows, torch.arange(N), **run)
    assert raised.value.errno == errno.ENOSPC and "no space left" in str(raised.value), raised.value
    assert str(small_disk / "table") in str(raised.value), raised.value

    _grow(small_disk)
    assert torch_batch_process(RandomRows, torch.arange(N), **run).finished
    assert read_outputs(target).column("index").to_pylist() == list(range(N))


def _fill(disk: Path) -> None:
    """Fills ``disk`` to the last byte (another process's file)."""
    with open(disk / "filler", "ab", buffering=0) as filler:
        try:
            while True:
                filler.write(b"\0" * 4096)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc


class FailsThenFills(TorchBatchProcessor):
    """Example 5 fails (``on_error="skip"`` records it); the disk is full when the first commit stages that record."""

    disk: Path | None = None  # set by the test for the first run

    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        if 5 in [int(v) for v in batch]:
            raise ValueError("example 5 is bad")
        self.context.write({"value": [int(v) for v in batch]})

    def on_checkpoint_start(self) -> None:
        if self.disk is not None:
            _fill(self.disk)


def test_failure_records_on_a_full_disk_are_a_storage_error_naming_them_then_resume_exactly_once(small_disk):
    storage = small_disk / "job"
    run = dict(batch_size=4, storage_path=str(storage), checkpoint_interval=2, on_error="skip", progress=False)
    FailsThenFills.disk = small_disk
    try:
        with pytest.raises(StorageError) as raised:  # not the bare OSError of the stage's failures file, naming none
            torch_batch_process(FailsThenFills, torch.arange(40), **run)
    finally:
        FailsThenFills.disk = None
    assert raised.value.errno == errno.ENOSPC and "no space left" in str(raised.value), raised.value
    assert str(storage) in str(raised.value) and "failure records" in str(raised.value), raised.value

    (small_disk / "filler").unlink()
    result = torch_batch_process(FailsThenFills, torch.arange(40), **run)
    assert result.finished and result.failed_examples == 1
    assert read_outputs(storage).column("index").to_pylist() == [i for i in range(40) if i != 5]
    assert [f["index"] for f in read_failures(storage)] == [5]


def test_a_report_onto_a_full_disk_is_one_clear_line_and_leaves_no_part_of_it(small_disk, capsys):
    pytest.importorskip("plotly")
    from torch_batch_process.launch import cli

    storage = small_disk.parent / "job"
    assert torch_batch_process(Rows, torch.arange(40), batch_size=4, storage_path=str(storage), progress=False).finished
    _fill(small_disk)
    capsys.readouterr()
    assert cli.main(["report", str(storage), "-o", str(small_disk / "report.html")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"tbp report: cannot write --output {str(small_disk / 'report.html')!r}"), err
    assert "No space left" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"], "no part of the page is left behind"


class Reports(TorchBatchProcessor):
    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        self.context.report_metrics("inference", batch_idx + 1, {"sum": float(sum(batch))})


def test_a_full_tmpdir_loses_no_metrics_line_of_an_object_store_job(small_disk, memory_url, monkeypatch):
    """metrics.jsonl of an object store is appended through a local copy in $TMPDIR: on a full $TMPDIR every append
    failed (a warning) and the job finished without its metrics."""
    import tempfile

    import fsspec

    monkeypatch.setenv("TMPDIR", str(small_disk))
    monkeypatch.setattr(tempfile, "tempdir", str(small_disk))  # as chosen when the process started: the disk had room
    _fill(small_disk)
    assert torch_batch_process(Reports, torch.arange(40), batch_size=4, storage_path=memory_url, checkpoint_interval=2,
                               progress=False).finished
    fs, root = fsspec.core.url_to_fs(memory_url)
    lines = [json.loads(line) for line in fs.cat_file(f"{root}/metrics.jsonl").decode().splitlines()]
    assert sorted(line["steps_completed"] for line in lines if line["group"] == "inference") == list(range(1, 11))


class BigFiles(TorchBatchProcessor):
    """Each batch writes a 256-KiB file: more than the disk has left once the test filled it (small failure records
    still fit)."""

    disk: Path | None = None  # set by the test for the first run

    def __init__(self, context) -> None:
        self.context = context

    def process_batch(self, batch, batch_idx) -> None:
        if batch_idx == 3 and self.disk is not None:
            _fill(self.disk)
            with open(self.disk / "filler", "r+b") as filler:  # 64 KiB left: a failure record fits, a file does not
                filler.truncate(filler.seek(0, 2) - 64 * 1024)
        with self.context.upload_path() as path:
            (path / f"batch_{batch_idx:03d}.bin").write_bytes(bytes(256 * 1024))


def test_a_full_disk_in_your_code_is_no_examples_failure_with_on_error_skip(small_disk):
    """on_error="skip" recorded every example whose file met the full disk as a failure (bisected down to single
    examples), and the job went on skipping them: it could finish with them all failed. A full disk (ENOSPC) stops
    the job with your code's error; the resume, with room again, processes them."""
    storage = small_disk / "job"
    run = dict(batch_size=4, storage_path=str(storage), checkpoint_interval=2, on_error="skip", progress=False)
    BigFiles.disk = small_disk
    try:
        with pytest.raises(OSError) as raised:
            torch_batch_process(BigFiles, torch.arange(24), **run)
    finally:
        BigFiles.disk = None
    assert raised.value.errno == errno.ENOSPC and not isinstance(raised.value, StorageError), raised.value
    assert not (storage / "failures").exists() or not list((storage / "failures").iterdir())

    (small_disk / "filler").unlink()
    result = torch_batch_process(BigFiles, torch.arange(24), **run)
    assert result.finished and result.failed_examples == 0
    files = sorted(p.name for p in (storage / "outputs").rglob("batch_*.bin"))
    assert files == [f"batch_{g:03d}.bin" for g in range(6)]


@pytest.mark.parametrize("kind", ["delta", "lance", "iceberg"])
def test_a_table_created_on_a_full_disk_is_a_storage_error_naming_it_then_resumes_exactly_once(small_disk, kind):
    """The table's first files (Delta's log, Lance's manifest, Iceberg's metadata) met the full disk as the format's
    own OSError ("Generic LocalFileSystem error"), naming neither the table nor the cause."""
    pytest.importorskip({"delta": "deltalake", "lance": "lance", "iceberg": "pyiceberg"}[kind])
    if kind == "iceberg":
        catalog = {"type": "sql", "uri": f"sqlite:///{small_disk.parent}/catalog.db",
                   "warehouse": f"file://{small_disk}/warehouse"}
        target, shown = tables.iceberg("db.rows", catalog=catalog), "db.rows"
    else:
        target, shown = getattr(tables, kind)(str(small_disk / "table")), str(small_disk / "table")
    run = dict(batch_size=4, storage_path=str(small_disk.parent / "job"), checkpoint_interval=2, progress=False,
               table=target)
    _fill(small_disk)
    with pytest.raises(StorageError) as raised:
        torch_batch_process(RandomRows, torch.arange(40), **run)
    assert raised.value.errno == errno.ENOSPC and "no space left" in str(raised.value), raised.value
    assert f"create the {kind} table {shown!r}" in str(raised.value), raised.value

    (small_disk / "filler").unlink()
    assert torch_batch_process(RandomRows, torch.arange(40), **run).finished
    assert read_outputs(target).column("index").to_pylist() == list(range(40))
