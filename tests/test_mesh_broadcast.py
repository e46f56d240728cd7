"""What a replica's first member sends its members (engine/mesh/broadcast.py): any structure, tensors as raw bytes in
one aligned buffer, rebuilt equal (pure: the collectives themselves run in test_mesh_jobs.py, through the library)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from transformers import BatchEncoding

from torch_batch_process.engine.mesh.broadcast import pack_batch, unpack_batch


@dataclasses.dataclass
class Example:
    pixels: torch.Tensor
    label: int


def test_a_mixed_batch_comes_back_equal_with_its_types():
    shared = torch.arange(6).reshape(2, 3)
    batch = {
        "ids": shared,
        "again": [shared, torch.tensor(True)],
        "half": torch.randn(3, 5, dtype=torch.float16),
        "bf16": torch.randn(4, dtype=torch.bfloat16),
        "complex": torch.tensor([1 + 2j, 3 - 1j]),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4),
        "strided": torch.randn(4, 6)[:, 1::2],  # not contiguous
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "encoding": BatchEncoding({"input_ids": torch.ones(2, 7, dtype=torch.long)}),
        "example": Example(torch.rand(3, 2, 2), 7),
        "text": ["a", "b"],
        "array": np.arange(3),
    }
    header, buffer = pack_batch(batch)
    assert len(header.tensors) == 11  # the shared tensor once
    starts, length = header.offsets()
    assert all(s % 16 == 0 for s in starts) and buffer.numel() == length and buffer.dtype == torch.uint8
    out = unpack_batch(header, buffer.clone())
    assert out["again"][0] is out["ids"]
    assert type(out["encoding"]) is BatchEncoding and type(out["example"]) is Example
    for name in ("ids", "half", "bf16", "complex", "mask", "empty", "strided", "scalar"):
        assert out[name].dtype == batch[name].dtype and out[name].shape == batch[name].shape, name
        assert torch.equal(out[name], batch[name]), name
    assert torch.equal(out["encoding"]["input_ids"], batch["encoding"]["input_ids"])
    assert torch.equal(out["example"].pixels, batch["example"].pixels) and out["example"].label == 7
    assert out["text"] == ["a", "b"] and out["again"][1].item() is True
    assert np.array_equal(out["array"], batch["array"])


def test_a_batch_without_tensors_and_a_lone_tensor():
    header, buffer = pack_batch(["x", 1, None])
    assert header.tensors == () and buffer.numel() == 0
    assert unpack_batch(header, buffer) == ["x", 1, None]
    tensor = torch.randn(5, 3)
    assert torch.equal(unpack_batch(*pack_batch(tensor)), tensor)


def test_a_tensor_on_a_device_is_refused():
    with pytest.raises(ValueError, match="tensor on meta: send CPU tensors"):
        pack_batch({"x": torch.empty(2, device="meta")})
