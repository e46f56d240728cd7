"""``tbp report`` and ``tbp dashboard``: a job you can look at (DESIGN §17).

- :mod:`~torch_batch_process.observe.report.data`: what the page shows, read from the stored job (read-only);
- :mod:`~torch_batch_process.observe.report.series`: the numbers behind the plots (rates, ranks, attempts);
- :mod:`~torch_batch_process.observe.report.figures`: the plots (plotly);
- :mod:`~torch_batch_process.observe.report.page`: the self-contained HTML page;
- :mod:`~torch_batch_process.observe.report.dashboard`: the page served live on localhost;
- :mod:`~torch_batch_process.observe.report.commands`: the two ``tbp`` subcommands.

Plots need the optional ``plotly`` package (``pip install -e ".[report]"``). Nothing here imports
the engine's loop: the page is made from what the job stores.
"""

from __future__ import annotations

from typing import Any

__all__ = ["build_report", "write_report"]


def build_report(storage_path: str, storage_options: dict[str, Any] | None = None) -> str:
    """The report page (HTML) of the job stored at ``storage_path`` (imports here: ``tbp --help`` stays fast)."""
    from torch_batch_process.observe.report.data import read_job_data
    from torch_batch_process.observe.report.page import build_model, render_page

    return render_page(build_model(read_job_data(storage_path, storage_options)))


def write_report(storage_path: str, output: str, storage_options: dict[str, Any] | None = None) -> int:
    """Writes the report page of the job stored at ``storage_path`` to the local file ``output`` (atomically:
    written next to it, then renamed); returns its size in bytes."""
    import contextlib
    import os

    page = build_report(storage_path, storage_options).encode("utf-8")
    folder = os.path.dirname(os.path.abspath(output))
    os.makedirs(folder, exist_ok=True)
    partial = f"{output}.tmp-{os.getpid()}"
    try:
        with open(partial, "wb") as file:
            file.write(page)
        os.replace(partial, output)
    except BaseException:  # a full disk: no part of the page left behind next to it
        with contextlib.suppress(OSError):
            os.remove(partial)
        raise
    return len(page)
