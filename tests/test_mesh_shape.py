"""``mesh=`` (DESIGN §18): the spec's checks and the rank arithmetic, compared with torch's own ``DeviceMesh`` layout
(pure: no process group; the multi-process checks are in test_mesh_jobs.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_batch_process.errors import InvalidArgumentError
from torch_batch_process.mesh_shape import MeshShape, parse_mesh


def test_none_means_no_mesh():
    assert parse_mesh(None) is None


@pytest.mark.parametrize(
    "spec, names, sizes, members",
    [
        ({"replica": -1, "tp": 2}, ("replica", "tp"), (-1, 2), 2),
        ({"dp": 3, "pp": 2}, ("dp", "pp"), (3, 2), 2),
        ({"replica": -1, "pp": 2, "tp": 2}, ("replica", "pp", "tp"), (-1, 2, 2), 4),
        ({"replica": -1}, ("replica",), (-1,), 1),
        ({"replica": np.int64(-1), "tp": np.int32(2)}, ("replica", "tp"), (-1, 2), 2),
    ],
)
def test_parse_keeps_the_order_and_the_sizes(spec, names, sizes, members):
    shape = parse_mesh(spec)
    assert shape == MeshShape(names, sizes)
    assert shape.members == members
    assert all(type(s) is int for s in shape.sizes)


@pytest.mark.parametrize(
    "spec, message",
    [
        ([("replica", -1), ("tp", 2)], "must be None or a non-empty dict"),
        ({}, "non-empty dict"),
        ("replica=-1,tp=2", "non-empty dict"),
        ({"replica": -1, "tp": -1}, "only the outer dimension, the replicas, may be -1"),
        ({"replica": 2, "tp": -1}, "only the outer dimension"),
        ({"replica": -1, "tp": 0}, "'tp' must be an int >= 1"),
        ({"replica": 0, "tp": 2}, "'replica' must be an int >= 1, or -1"),
        ({"replica": -2, "tp": 2}, "'replica' must be"),
        ({"replica": -1, "tp": 2.0}, "'tp' must be an int"),
        ({"replica": -1, "tp": True}, "'tp' must be an int"),
        ({"replica": -1, "tp": "2"}, "'tp' must be an int"),
        ({"replica": -1, 2: 2}, "dimension name 2"),
        ({"replica": -1, "": 2}, "dimension name ''"),
        ({"replica": -1, "tensor parallel": 2}, "letters, digits and underscores"),
        ({"replica": -1, "2d": 2}, "does not start with a digit"),
        ({"replica": -1, "tp": 2, "TP": 2}, "differ by more than case"),
    ],
)
def test_bad_specs_are_refused_naming_the_fix(spec, message):
    with pytest.raises(InvalidArgumentError, match="mesh") as info:
        parse_mesh(spec)
    assert message in str(info.value)


def test_world_sizes_that_do_not_fit_name_the_sizes_and_the_fix():
    with pytest.raises(InvalidArgumentError) as info:
        parse_mesh({"replica": -1, "tp": 3}).resolve(4)
    text = str(info.value)
    assert "3 ranks (tp=3)" in text and "4 ranks" in text and "(3 or 6" in text and "(1, 2, 4)" in text
    with pytest.raises(InvalidArgumentError) as info:
        parse_mesh({"replica": 2, "pp": 2, "tp": 2}).resolve(4)
    assert "has 2 x 4 = 8 ranks but the job has 4: start 8 ranks" in str(info.value)
    assert "allows: 1" in str(info.value)
    with pytest.raises(InvalidArgumentError) as info:
        parse_mesh({"replica": -1, "pp": 2, "tp": 2}).resolve(6)
    assert "a replica has 4 ranks (pp=2 x tp=2), which does not divide the job's 6 ranks" in str(info.value)
    with pytest.raises(InvalidArgumentError) as info:
        parse_mesh({"dp": 2, "tp": 2}).resolve(8)
    assert "2 x 2 = 4 ranks but the job has 8" in str(info.value) and "'dp': -1" in str(info.value)
    assert "allows: 4" in str(info.value)


@pytest.mark.parametrize(
    "spec, world",
    [
        ({"replica": -1, "tp": 2}, 4),
        ({"replica": -1, "pp": 2}, 6),
        ({"replica": -1, "pp": 2, "tp": 2}, 8),
        ({"replica": -1, "tp": 2, "pp": 3}, 12),
        ({"replica": -1, "tp": 4}, 4),
        ({"replica": -1}, 3),
        ({"replica": 1, "tp": 1}, 1),
    ],
)
def test_positions_match_torch_device_mesh_layout(spec, world):
    layout = parse_mesh(spec).resolve(world)
    grid = torch.arange(world).reshape(layout.shape)  # what init_device_mesh builds
    k = layout.members
    assert layout.num_replicas * k == world
    writers = set()
    for rank in range(world):
        p = layout.position(rank)
        assert grid[p.coordinate].item() == rank
        assert p.coordinate[0] == p.replica_rank and p.num_replicas == layout.num_replicas
        assert rank in layout.replica_ranks(p.replica_rank)
        assert list(layout.replica_ranks(p.replica_rank)) == grid[p.replica_rank].flatten().tolist()
        assert p.member_rank == rank - p.first_rank and p.members == k
        # the writer is the member with the largest coordinate in every inner dimension: the last pipeline stage
        writer = layout.position(p.writer_rank)
        assert writer.replica_rank == p.replica_rank
        assert writer.coordinate[1:] == tuple(s - 1 for s in layout.shape[1:])
        assert p.is_writer == (rank == p.writer_rank) and p.is_source == (p.member_rank == 0)
        writers.add(p.writer_rank)
    assert len(writers) == layout.num_replicas
    assert layout.replicas() == [list(range(r * k, (r + 1) * k)) for r in range(layout.num_replicas)]


def test_out_of_range_ranks_and_replicas():
    layout = parse_mesh({"replica": -1, "tp": 2}).resolve(4)
    with pytest.raises(ValueError, match="rank 4"):
        layout.position(4)
    with pytest.raises(ValueError, match="replica 2"):
        layout.replica_ranks(2)


def test_describe_is_what_the_user_wrote():
    assert parse_mesh({"replica": -1, "tp": 2}).describe() == "{'replica': -1, 'tp': 2}"
