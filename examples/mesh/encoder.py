"""A small transformer encoder built from a fixed seed (no download), a synthetic token dataset, and the two ways
the mesh examples split the encoder over ranks, shared by the library's examples and the hand-written loops: the
same weights on every process, so a tensor-parallel or pipelined run can be compared with the whole model on one
process.

- :func:`tensor_parallel_plan`: the plan for ``parallelize_module`` (attention's ``q``/``k``/``v`` and the MLP's
  ``up`` split column-wise, ``o`` and ``down`` row-wise: one all-reduce after the attention and one after the MLP).
  The attention reshapes with ``-1`` heads (``view(batch, length, -1, head_dim)``), so the same module runs whole or
  with its projections split (each rank then holds ``heads / tp`` heads).
- :class:`Pipeline`: the encoder cut into stages run by ``torch.distributed.pipelining`` with microbatches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

__all__ = [
    "Block",
    "Encoder",
    "EncoderConfig",
    "Pipeline",
    "TokenDataset",
    "build_encoder",
    "compare_with_whole",
    "pipeline_stage",
    "tensor_parallel_plan",
]


@dataclass(frozen=True)
class EncoderConfig:
    """The encoder's sizes (small by default: the examples run on CPU)."""

    vocab: int = 1000
    dim: int = 128
    heads: int = 4
    hidden: int = 512
    layers: int = 4
    length: int = 32
    seed: int = 0


class Block(nn.Module):
    """A pre-norm transformer block: self-attention (``q``, ``k``, ``v``, ``o``) and an MLP (``up``, ``down``)."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.heads
        self.norm1 = nn.LayerNorm(cfg.dim)
        self.q = nn.Linear(cfg.dim, cfg.dim)
        self.k = nn.Linear(cfg.dim, cfg.dim)
        self.v = nn.Linear(cfg.dim, cfg.dim)
        self.o = nn.Linear(cfg.dim, cfg.dim)
        self.norm2 = nn.LayerNorm(cfg.dim)
        self.up = nn.Linear(cfg.dim, cfg.hidden)
        self.down = nn.Linear(cfg.hidden, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.norm1(x)
        q, k, v = (proj(h).view(b, n, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        attn = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1) @ v
        x = x + self.o(attn.transpose(1, 2).reshape(b, n, -1))
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class Encoder(nn.Module):
    """Token embedding, ``layers`` blocks, a final norm and mean pooling: one ``dim``-vector per example."""

    def __init__(self, cfg: EncoderConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(dim=1)


def build_encoder(cfg: EncoderConfig = EncoderConfig()) -> Encoder:
    """The encoder with weights drawn from ``cfg.seed`` (identical on every process), in eval mode."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return Encoder(cfg).eval()


def compare_with_whole(table: Any, dataset: TokenDataset, cfg: EncoderConfig = EncoderConfig()) -> float:
    """Prints and returns the largest difference between a job's ``embedding`` column (``read_outputs``, in dataset
    order) and the whole encoder run on this process: what the split runs must give, up to float reassociation."""
    encoder = build_encoder(cfg)
    with torch.no_grad():
        whole = torch.cat(
            [
                encoder(torch.stack([dataset[i] for i in range(start, min(start + 256, len(dataset)))]))
                for start in range(0, len(dataset), 256)
            ]
        )
    embeddings = torch.tensor(table.column("embedding").to_pylist())
    difference = (embeddings - whole).abs().max().item()
    print(f"{table.num_rows} embeddings; largest difference from the whole encoder on one process: {difference:.2e}")
    return difference


class _Stage(nn.Module):
    """One pipeline stage of an :class:`Encoder`: the embedding on the first, the norm and pooling on the last."""

    def __init__(self, encoder: Encoder, blocks: range, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = encoder.embed if first else None
        self.blocks = nn.ModuleList(encoder.blocks[i] for i in blocks)
        self.norm = encoder.norm if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x).mean(dim=1) if self.norm is not None else x


def pipeline_stage(encoder: Encoder, stage: int, stages: int) -> nn.Module:
    """Stage ``stage`` of ``stages`` of ``encoder``: its share of the blocks, in order (the first stage embeds, the
    last one normalizes and pools)."""
    per = math.ceil(len(encoder.blocks) / stages)
    blocks = range(stage * per, min((stage + 1) * per, len(encoder.blocks)))
    return _Stage(encoder, blocks, first=stage == 0, last=stage == stages - 1).eval()


class TokenDataset(torch.utils.data.Dataset):
    """``size`` examples of ``cfg.length`` token ids, example ``i`` drawn from seed ``i`` (any process, any order)."""

    def __init__(self, size: int, cfg: EncoderConfig = EncoderConfig()) -> None:
        self.size = size
        self.cfg = cfg

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        generator = torch.Generator().manual_seed(index)
        return torch.randint(0, self.cfg.vocab, (self.cfg.length,), generator=generator)


def tensor_parallel_plan(cfg: EncoderConfig = EncoderConfig()) -> dict[str, ParallelStyle]:
    """``parallelize_module``'s plan for an :class:`Encoder`: Megatron-style blocks (the embedding, the norms and the
    pooling stay whole on every rank, so the output is the whole ``dim``-vector on every rank)."""
    plan: dict[str, ParallelStyle] = {}
    for i in range(cfg.layers):
        plan.update({f"blocks.{i}.{name}": ColwiseParallel() for name in ("q", "k", "v", "up")})
        plan.update({f"blocks.{i}.{name}": RowwiseParallel() for name in ("o", "down")})
    return plan


class Pipeline:
    """The encoder's stage on this rank, run with ``ScheduleGPipe`` over the stages' process group.

    A schedule learns its tensors' shapes at its first step and keeps them, so this keeps one schedule per batch
    shape: a batch of another size (the last batch of a dataset, a bucketed plan) through the first schedule fails on
    the last stage and leaves the stages out of step, and later batches come out wrong without an error (torch 2.14).
    Microbatches split a batch evenly: ``microbatches`` is lowered to the largest count that divides the batch (an
    uneven split, e.g. 6 examples in 4 microbatches, gives the last stage rows that are not the batch's).

    Every stage calls it with the batch (only the first stage reads the tokens; the others use its shape); the last
    stage gets the embeddings, the others ``None``.
    """

    def __init__(self, encoder: Encoder, group: dist.ProcessGroup, device: torch.device, microbatches: int = 4) -> None:
        self.stages = dist.get_world_size(group)
        self.stage = dist.get_rank(group)
        self.module = pipeline_stage(encoder, self.stage, self.stages).to(device)
        self.group = group
        self.device = device
        self.microbatches = microbatches
        self._schedules: dict[tuple[int, ...], ScheduleGPipe] = {}

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor | None:
        shape = tuple(tokens.shape)
        schedule = self._schedules.get(shape)
        if schedule is None:
            count = max(m for m in range(1, self.microbatches + 1) if shape[0] % m == 0)
            stage = PipelineStage(self.module, self.stage, self.stages, self.device, group=self.group)
            schedule = self._schedules[shape] = ScheduleGPipe(stage, n_microbatches=count)
        return schedule.eval(tokens) if self.stage == 0 else schedule.eval()
