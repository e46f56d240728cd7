"""Counting the rows a job reads, across processes: an ``on_rows_read`` hook of a source
(:attr:`~torch_batch_process.sources.base.Source.on_rows_read`)."""

from __future__ import annotations

import os

__all__ = ["RowsReadLog"]


class RowsReadLog:
    """An ``on_rows_read`` hook that adds up the rows read by every process in one local file.

    Each call appends one short line (an ``O_APPEND`` write, atomic between processes), so the
    counts of DataLoader workers and of every rank on the machine add up; :meth:`total` sums them.
    It is picklable (it holds only the path)::

        log = RowsReadLog(tmp_path / "reads")
        source.on_rows_read = log
        ...  # run the job
        assert log.total() <= 0.15 * source.num_rows
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def __call__(self, rows: int) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, b"%d\n" % rows)
        finally:
            os.close(fd)

    def total(self) -> int:
        """Rows recorded so far (0 when nothing was read yet)."""
        try:
            with open(self.path, "rb") as f:
                return sum(int(line) for line in f if line.strip())
        except FileNotFoundError:
            return 0

    def reset(self) -> None:
        """Forgets the rows recorded so far."""
        try:
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def __repr__(self) -> str:
        return f"RowsReadLog({self.path!r})"
