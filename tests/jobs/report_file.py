"""A job's report file, written whole or not at all (a temporary file, then a rename): a test that kills a rank
while it writes its report finds no report, never an empty or half-written one (issue 49: a kill test read an
empty report)."""

import json
import os
from pathlib import Path
from typing import Any


def write_report(path: Path, report: dict[str, Any]) -> None:
    """Writes ``report`` as JSON to ``path`` atomically (the temporary name matches no report glob)."""
    partial = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    partial.write_text(json.dumps(report))
    os.replace(partial, path)
