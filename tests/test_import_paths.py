"""The package's public sub-packages are attributes of ``import torch_batch_process``, as users spell them.

Determined code is often written as ``import determined as det`` then ``det.pytorch.experimental...`` and
``det.pytorch.MetricReducer``: with only the import changed (``import torch_batch_process as det``), that must run.
DESIGN §12 spells sources as ``torch_batch_process.sources.parquet(...)``. A bare import still does not import torch
(the ``tbp`` command starts fast), and every public name imports from the package on first use.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from harness import base_env

DETERMINED_ALIAS_JOB = textwrap.dedent(
    """
    import json, pathlib, sys

    import torch_batch_process as det  # was: import determined as det

    assert "torch" not in sys.modules, "a bare import must not import torch"
    sources_parquet = det.sources.parquet  # DESIGN §12's spelling, before anything else imported the package
    assert det.pytorch.MetricReducer is det.MetricReducer  # Determined's det.pytorch.MetricReducer

    class Processor(det.pytorch.experimental.TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            self.seen = context.wrap_reducer(lambda counts: sum(counts), name="examples")

        def process_batch(self, batch, batch_idx):
            self.seen.update(len(batch))
            with self.context.upload_path() as path:
                pathlib.Path(path, f"batch_{batch_idx}.json").write_text(json.dumps(batch.tolist()))


    result = det.pytorch.experimental.torch_batch_process(
        Processor, list(range(10)), batch_size=4, checkpoint_interval=1, storage_path=sys.argv[1]
    )
    print(json.dumps({"metrics": result.metrics, "finished": result.finished}))
    """
)


def test_determined_code_written_as_import_determined_as_det_runs_with_the_import_changed(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", DETERMINED_ALIAS_JOB, str(tmp_path / "storage")],
        env=base_env(), capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"metrics": {"examples": 10}, "finished": True}
    written = sorted((tmp_path / "storage" / "outputs").rglob("batch_*.json"))
    assert sorted(v for path in written for v in json.loads(path.read_text())) == list(range(10))


def test_public_submodules_are_listed_and_unknown_names_still_raise_attribute_error():
    import torch_batch_process

    assert {"sources", "pytorch", "lengths", "launch"} <= set(dir(torch_batch_process))
    try:
        torch_batch_process.no_such_thing  # noqa: B018
    except AttributeError as exc:
        assert "no_such_thing" in str(exc)
    else:
        raise AssertionError("an unknown attribute must raise AttributeError")


def test_package_import_is_lazy():
    code = textwrap.dedent(
        """
        import json, sys
        import torch_batch_process as tbp
        print(json.dumps({
            "version": tbp.__version__,
            "torch": "torch" in sys.modules,
            "all_in_dir": set(tbp.__all__) <= set(dir(tbp)),
        }))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=base_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"version": "0.1.0", "torch": False, "all_in_dir": True}
    import torch_batch_process as tbp

    assert set(tbp.__all__) == set(tbp._EXPORTS) | {"__version__"}, "every public name has its module"


def test_every_public_name_still_imports_from_the_package():
    import torch_batch_process as tbp
    from torch_batch_process import batch_process, experimental

    namespace: dict = {}
    exec("from torch_batch_process import *", namespace)
    assert set(tbp.__all__) <= set(namespace)
    assert namespace["torch_batch_process"] is batch_process.torch_batch_process
    assert namespace["__version__"] == "0.1.0"
    assert type(experimental).__name__ == "module", "a submodule, not a lazy name"
    assert experimental.TorchBatchProcessor is namespace["TorchBatchProcessor"]
    with pytest.raises(AttributeError, match="has no attribute 'no_such_name'"):
        tbp.no_such_name  # noqa: B018
