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
import types

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


DETERMINED_DISTRIBUTED_JOB = textwrap.dedent(
    """
    import json, pathlib, sys

    import torch_batch_process as det  # was: import determined as det

    distributed = det.core.DistributedContext.from_torch_distributed()


    class Processor(det.pytorch.experimental.TorchBatchProcessor):
        def __init__(self, context):
            self.context = context
            self.seen = []

        def process_batch(self, batch, batch_idx):
            self.seen.extend(batch.tolist())

        def on_finish(self):
            everything = self.context.distributed.gather(self.seen)
            if self.context.distributed.get_rank() == 0:
                pathlib.Path(sys.argv[1], "seen.json").write_text(json.dumps(sorted(sum(everything, []))))


    det.pytorch.experimental.torch_batch_process(
        Processor, list(range(12)), batch_size=2, storage_path=sys.argv[1] + "/storage", distributed_context=distributed
    )
    d = distributed
    ranks = [d.get_rank(), d.get_size(), d.get_local_rank(), d.get_local_size(), d.get_cross_rank(), d.get_num_agents()]
    record = json.dumps({"ranks": ranks, "gathered": d.allgather(d.get_rank())})
    pathlib.Path(sys.argv[1], f"ranks-{d.get_rank()}.json").write_text(record)  # not stdout: the ranks' prints interleave
    """
)


@pytest.mark.slow
def test_determined_s_distributed_context_from_torch_distributed_runs_a_2_rank_job(tmp_path):
    """``distributed_context=det.core.DistributedContext.from_torch_distributed()`` (Determined's spelling) under
    torchrun: the job takes it, every example once, and its object collectives run over the job's ranks."""
    from harness import run_torchrun

    script = tmp_path / "job.py"
    script.write_text(DETERMINED_DISTRIBUTED_JOB)
    done = run_torchrun(2, script, str(tmp_path), timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads((tmp_path / "seen.json").read_text()) == list(range(12))
    lines = [json.loads(path.read_text()) for path in sorted(tmp_path.glob("ranks-*.json"))]
    assert sorted(line["ranks"][0] for line in lines) == [0, 1]
    assert all(line["ranks"][1:] == [2, line["ranks"][0], 2, 0, 1] for line in lines), lines
    assert all(line["gathered"] == [0, 1] for line in lines), lines


def test_determined_s_distributed_context_takes_the_ranks_and_rejects_what_cannot_be_ranks(monkeypatch):
    from torch_batch_process import InvalidArgumentError
    from torch_batch_process.core import DistributedContext

    one = DistributedContext()  # no ranks: one process, collectives without a process group
    assert (one.get_rank(), one.get_size(), one.get_num_agents()) == (0, 1, 1)
    collectives = (one.allgather("x"), one.gather("x"), one.broadcast("x"), one.allgather_local("x"))
    assert collectives == (["x"], ["x"], "x", ["x"])
    ranks = dict(rank=3, size=4, local_rank=1, local_size=2, cross_rank=1, cross_size=2)
    four = DistributedContext(**ranks, chief_ip="10.0.0.1")
    assert (four.get_rank(), four.get_size(), four.get_local_rank(), four.get_cross_rank()) == (3, 4, 1, 1)
    with pytest.raises(RuntimeError, match="init_process_group"):
        four.allgather(1)  # no process group in this process: a clear error, not a hang
    with pytest.raises(InvalidArgumentError, match="missing: cross_rank, cross_size"):
        DistributedContext(rank=0, size=1, local_rank=0, local_size=1)
    with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, size\)"):
        DistributedContext(**dict(ranks, rank=4))
    with pytest.raises(InvalidArgumentError, match="local_size must be an int"):
        DistributedContext(**dict(ranks, local_size="2"))

    environment = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                   "GROUP_WORLD_SIZE": "1"}
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert DistributedContext.from_torch_distributed().get_rank() == 1
    monkeypatch.delenv("GROUP_WORLD_SIZE")
    with pytest.raises(InvalidArgumentError, match="GROUP_WORLD_SIZE is not set: start the script with torchrun"):
        DistributedContext.from_torch_distributed()
    monkeypatch.setenv("LOCAL_SIZE", "2")
    monkeypatch.setenv("CROSS_RANK", "0")
    monkeypatch.setenv("CROSS_SIZE", "x")
    with pytest.raises(InvalidArgumentError, match="CROSS_SIZE='x' is not an integer"):
        DistributedContext.from_deepspeed()

    horovod = types.SimpleNamespace(  # what horovod.torch answers once initialized
        rank=lambda: 2, size=lambda: 4, local_rank=lambda: 0, local_size=lambda: 2, cross_rank=lambda: 1,
        cross_size=lambda: 2,
    )
    assert DistributedContext.from_horovod(horovod).get_cross_rank() == 1


def test_a_distributed_context_for_other_ranks_than_the_job_s_is_refused_before_any_work(tmp_path):
    import torch_batch_process as det

    class Processor(det.TorchBatchProcessor):
        def __init__(self, context):
            self.context = context

        def process_batch(self, batch, batch_idx):
            raise AssertionError("no batch may run")

    context = det.core.DistributedContext(rank=1, size=2, local_rank=1, local_size=2, cross_rank=0, cross_size=1)
    with pytest.raises(det.InvalidArgumentError, match="distributed_context says rank 1 of 2"):
        det.torch_batch_process(Processor, list(range(4)), batch_size=2, storage_path=str(tmp_path / "s"),
                                distributed_context=context)
    assert not (tmp_path / "s").exists()
