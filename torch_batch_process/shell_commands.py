"""Commands the library prints for the user to run, written so that they run as printed in this environment.

A clone's README installs into ``.venv`` and never activates it, so a bare ``tbp`` or ``pip`` is "command not
found" (or another environment's). The commands printed here name this interpreter's own ``tbp`` and ``pip``
(``.venv/bin/tbp`` when that is where they are, relative to the working directory; a bare ``tbp`` when the
``tbp`` on ``PATH`` is this environment's), install an extra from the checkout the package runs from
(``pip install -e ".[report]"``, as the README does) or else from the package index, and name local paths
relative to the working directory when they are below it.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

__all__ = ["job_commands", "pip_install", "shell_path", "tbp_command"]

DISTRIBUTION = "torch-batch-process"
_CHECKOUT_MARKER = "setup.cfg"  # a source checkout holds it next to the package folder


def shell_path(path: str | os.PathLike[str]) -> str:
    """``path`` for a command line: relative to the working directory when below it, quoted for a POSIX shell.
    URLs (``s3://...``) are kept as they are (quoted)."""
    text = os.fspath(path)
    if "://" not in text:
        try:
            relative = os.path.relpath(os.path.abspath(text))
        except ValueError:  # another drive (Windows)
            relative = text
        if not relative.startswith(os.pardir):
            text = relative
    return shlex.quote(text)


def _own_script(name: str) -> str | None:
    """How to run the console script ``name`` of this interpreter's environment: ``name`` when ``PATH`` finds that
    one, else its path (relative when below the working directory), else ``None`` (not installed as a script)."""
    script = Path(sys.executable).parent / name
    if not script.exists():
        return None
    found = shutil.which(name)
    if found is not None and Path(found).resolve() == script.resolve():
        return name
    return shell_path(script)


def tbp_command() -> str:
    """The ``tbp`` command as it runs here (``tbp``, ``.venv/bin/tbp``, or ``python -m`` its module)."""
    return _own_script("tbp") or f"{shell_path(sys.executable)} -m torch_batch_process.launch.cli"


def job_commands(storage_path: str) -> tuple[str, str]:
    """The two commands that show the job stored at ``storage_path``: ``tbp status`` and ``tbp report``."""
    tbp, where = tbp_command(), shell_path(storage_path)
    return f"{tbp} status {where}", f"{tbp} report {where}"


def _checkout() -> Path | None:
    """The source checkout the package runs from (an editable install or ``PYTHONPATH``), if it is one."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / _CHECKOUT_MARKER).is_file() else None


def pip_install(extra: str) -> str:
    """The command that installs the optional extra ``extra`` (``report``, ``records``...) here: from the checkout
    the package runs from (``.venv/bin/pip install -e ".[report]"``), else from the package index."""
    pip = _own_script("pip") or f"{shell_path(sys.executable)} -m pip"
    checkout = _checkout()
    if checkout is None:
        return f"{pip} install '{DISTRIBUTION}[{extra}]'"
    relative = os.path.relpath(checkout)
    where = relative if not relative.startswith(os.pardir) else str(checkout)
    return f'{pip} install -e "{where}[{extra}]"'
