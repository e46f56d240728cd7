"""The incremental planner and its parts (DESIGN §21, issue 46): content hash, keys, partitions, selection, diff."""

from __future__ import annotations

import errno
import hashlib
import struct

import numpy as np
import pyarrow as pa
import pytest
import torch

from torch_batch_process.errors import InvalidArgumentError, StorageError
from torch_batch_process.outputs.keyed.content_hash import content_hash, encode
from torch_batch_process.outputs.keyed.diff import DuplicateKeyError, VersionChangedError, plan_increment
from torch_batch_process.outputs.keyed.keys import check_key_spec, key_value
from torch_batch_process.outputs.keyed.partitions import KeyPartitions, partition_of
from torch_batch_process.outputs.keyed.selection import BLOCK_BITS, Selection


def _new(keys, hashes, rows=1000):
    """The dataset side, in batches of ``rows``."""
    keys, hashes = list(keys), list(hashes)
    kind = pa.string() if keys and isinstance(keys[0], str) else pa.int64()
    for first in range(0, len(keys), rows):
        yield pa.record_batch({"key": pa.array(keys[first : first + rows], kind),
                               "hash": pa.array(hashes[first : first + rows], pa.int64())})


def _stored(keys, hashes, run=1, version="v1", failed=False):
    n = len(keys)
    kind = pa.string() if keys and isinstance(keys[0], str) else pa.int64()
    return pa.record_batch({
        "key": pa.array(list(keys), kind), "hash": pa.array(list(hashes), pa.int64()),
        "run": pa.array([run] * n, pa.int32()), "version": pa.array([version] * n),
        "failed": pa.array([failed] * n),
    })


def _plan(new_keys, new_hashes, stored, **kwargs):
    kwargs.setdefault("version", "v1")
    kwargs.setdefault("stored_rows", sum(b.num_rows for b in stored))
    return plan_increment(_new(new_keys, new_hashes), stored, new_rows=len(new_keys), **kwargs)


def _selected(increment):
    return np.concatenate(list(increment.selection.chunks()) or [np.zeros(0, np.int64)]).tolist()


# ---------------------------------------------------------------------------------------------- content hash


def test_content_hash_is_blake2b_of_a_documented_encoding_and_stable_across_versions():
    def blake(data: bytes) -> int:
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little", signed=True)

    assert content_hash(5) == blake(b"i" + (5).to_bytes(8, "little", signed=True))
    assert content_hash("hé") == blake(b"s" + (3).to_bytes(8, "little") + "hé".encode())
    assert content_hash(1.5) == blake(b"f" + struct.pack("<d", 1.5))
    # a fixed value: a change of the encoding would make every stored row look changed (it needs a new HASH_SCHEME)
    example = {"id": 42, "text": "hello", "ids": np.arange(4, dtype=np.int32), "x": 1.5, "none": None,
               "flag": True, "l": [1, "a", b"b"]}
    assert content_hash(example) == 4276660571056520285
    assert content_hash(torch.ones(2, dtype=torch.bfloat16)) == 8420808825895926044


def test_content_hash_equal_for_equal_content_and_different_otherwise():
    a = {"text": "x", "ids": torch.arange(6).reshape(2, 3)}
    b = {"ids": np.arange(6).reshape(2, 3), "text": "x"}  # another key order, an array instead of a tensor
    assert content_hash(a) == content_hash(b)
    assert content_hash((1, 2)) == content_hash([1, 2])
    assert content_hash(float("nan")) == content_hash(-float("nan"))
    distinct = [0, 1, -1, 2**70, 1.0, True, None, "1", b"1", [1], [[1]], {"a": 1}, {"a": "1"},
                np.int64(1), np.float32(1), np.arange(3), np.arange(3).reshape(3, 1), np.arange(3, dtype=np.int32),
                torch.ones(2, dtype=torch.bfloat16), torch.ones(2, dtype=torch.float16), ["a", "b"], ["ab"], "ab"]
    assert len({content_hash(v) for v in distinct}) == len(distinct)
    big_endian = np.arange(3, dtype=">i4")
    assert encode(big_endian) == encode(np.arange(3, dtype="<i4"))
    assert content_hash(np.array(["a", 1], dtype=object)) == content_hash(np.array(["a", 1], dtype=object))


def test_content_hash_refuses_values_without_a_stable_hash_naming_where():
    with pytest.raises(InvalidArgumentError, match=r"example\['meta'\]\[0\] is a builtins.object"):
        content_hash({"meta": [object()]})


# ---------------------------------------------------------------------------------------------- keys


def test_keys_are_ints_or_strings_and_others_are_refused_naming_the_example():
    assert key_value(np.int32(3), "x") == 3 and key_value(torch.tensor(4), "x") == 4 and key_value("a", "x") == "a"
    for bad in (1.0, None, b"a", (1, 2), True, torch.tensor(1.0), 2**63):
        with pytest.raises(InvalidArgumentError, match="example 7"):
            key_value(bad, "example 7")
    spec = check_key_spec("id", ["text"])
    batch = spec.key_batch([{"id": 1, "text": "a"}, {"id": 2, "text": "b", "extra": 3}], 10)
    assert batch.column("key").to_pylist() == [1, 2]
    assert batch.column("hash").to_pylist() == [content_hash({"text": "a"}), content_hash({"text": "b"})]
    with pytest.raises(InvalidArgumentError, match="example 11 has a str key .* example 10 has a int key"):
        spec.key_batch([{"id": 1, "text": "a"}, {"id": "2", "text": "b"}], 10)
    with pytest.raises(InvalidArgumentError, match="example 10 has no field 'id'"):
        spec.key_batch([{"text": "a"}], 10)
    with pytest.raises(InvalidArgumentError, match="example 10 is a tuple"):
        spec.key_batch([(1, 2)], 10)
    assert check_key_spec(lambda ex: ex[1], None).key_batch([(0, "k")], 0).column("key").to_pylist() == ["k"]
    for key, content in (("index", None), ("_tbp_run", None), (3, None), ("id", "text"), ("id", [])):
        with pytest.raises(InvalidArgumentError):
            check_key_spec(key, content)
    with pytest.raises(InvalidArgumentError, match="give key= too"):
        check_key_spec(None, ["text"])


def test_partition_of_strings_does_not_depend_on_slicing_or_chunking():
    words = pa.array([f"k{i}" * (i % 7) for i in range(5000)])
    whole = partition_of(words, 13)
    assert set(whole.tolist()) == set(range(13))
    sliced = np.concatenate([partition_of(words.slice(i, 333), 13) for i in range(0, 5000, 333)])
    assert whole.tolist() == sliced.tolist()
    assert partition_of(pa.chunked_array([words.slice(0, 100), words.slice(100)]), 13).tolist() == whole.tolist()
    assert partition_of(words.cast(pa.large_string()), 13).tolist() == whole.tolist()


# ---------------------------------------------------------------------------------------------- selection


def test_selection_takes_batches_across_blocks_and_round_trips():
    size = 3 * BLOCK_BITS + 17
    rng = np.random.default_rng(0)
    chosen = np.unique(rng.integers(0, size, 5000))
    selection = Selection(size)
    selection.add(chosen[::2])
    selection.add(chosen[1::2])
    assert selection.count == len(chosen)
    for first, count in ((0, 7), (1000, 1500), (len(chosen) - 3, 10), (len(chosen), 5)):
        assert selection.take(first, count).tolist() == chosen[first : first + count].tolist()
    copy = Selection.from_bytes(selection.to_bytes(), "here")
    assert copy.digest() == selection.digest()
    members = set(chosen.tolist())
    assert [i in copy for i in range(size)] == [i in members for i in range(size)]
    assert np.concatenate(list(copy.chunks(999))).tolist() == chosen.tolist()
    with pytest.raises(Exception, match="cut short"):
        Selection.from_bytes(selection.to_bytes()[:-1], "here")


# ---------------------------------------------------------------------------------------------- the planner


@pytest.mark.parametrize("kind", ["int", "str"])
@pytest.mark.parametrize("rows_per_partition", [1 << 21, 300])
def test_ten_percent_changed_and_ten_percent_appended(tmp_path, kind, rows_per_partition):
    n = 2000
    keys = list(range(n + n // 10)) if kind == "int" else [f"doc-{i}" for i in range(n + n // 10)]
    stored = [_stored(keys[first : first + 500], range(first, min(first + 500, n))) for first in range(0, n, 500)]
    hashes = [i + (1000000 if i % 10 == 3 else 0) for i in range(len(keys))]
    increment = _plan(keys, hashes, stored, rows_per_partition=rows_per_partition, scratch=tmp_path)
    expected = [i for i in range(len(keys)) if i % 10 == 3 and i < n or i >= n]
    assert _selected(increment) == expected
    c = increment.counts
    assert (c.total, c.new, c.changed, c.unchanged, c.failed, c.recompute, c.removed) == (2200, 200, 200, 1800, 0, 0, 0)
    assert c.selected == 400 and increment.versions == {"v1": 2000}
    assert list(tmp_path.iterdir()) == []  # the partition files are gone


def test_empty_stored_side_and_empty_dataset(tmp_path):
    increment = _plan(range(10), range(10), [], scratch=tmp_path)
    assert _selected(increment) == list(range(10)) and increment.counts.new == 10
    increment = _plan([], [], [_stored(range(5), range(5))], scratch=tmp_path)
    assert increment.selection.count == 0 and increment.counts.removed == 5


def test_all_unchanged_selects_nothing():
    increment = _plan(range(100), range(100), [_stored(range(100), range(100))], rows_per_partition=50)
    assert increment.selection.count == 0 and increment.counts.unchanged == 100


@pytest.mark.parametrize("kind", ["int", "str"])
def test_duplicate_keys_are_refused_naming_the_key_and_both_examples(kind):
    keys = [5, 1, 2, 3, 5] if kind == "int" else ["e", "a", "b", "c", "e"]
    with pytest.raises(DuplicateKeyError, match=r"examples 0 and 4 have the same key (5|'e')"):
        _plan(keys * 1, range(5), [], rows_per_partition=2)
    with pytest.raises(DuplicateKeyError, match="examples 1 and 1500"):  # in two batches of the dataset
        _plan([*range(1500), 1], range(1501), [])


def test_a_changed_version_is_refused_before_the_dataset_is_read_or_recomputed():
    stored = [_stored(range(0, 60), range(60), version="v1"), _stored(range(60, 100), range(60, 100), version="v0")]

    def unread():
        raise AssertionError("the dataset was read")
        yield

    with pytest.raises(VersionChangedError, match=r"60 key\(s\) of version v1 \(model a\); 40 key\(s\) of version v0"):
        plan_increment(unread(), stored, new_rows=100, stored_rows=100, version="v2", on_change="refuse",
                       describe_version=lambda v: "model a" if v == "v1" else "model b")
    increment = _plan(range(100), [*range(99), -1], stored, version="v1", on_change="recompute")
    assert _selected(increment) == list(range(60, 100))
    assert (increment.counts.recompute, increment.counts.changed) == (39, 1)
    assert increment.versions == {"v1": 60, "v0": 40}
    with pytest.raises(InvalidArgumentError, match="on_change"):
        _plan(range(3), range(3), [], on_change="keep")


def test_the_newest_event_of_a_key_decides_and_failures_are_retried():
    stored = [
        _stored([1, 2, 3, 4], [10, 20, 30, 40], run=1),
        _stored([2, 3], [21, 31], run=2),  # 2 and 3 changed in run 2: their run 1 rows are shadowed
        _stored([4, 5], [0, 0], run=2, failed=True),  # 4 failed in run 2 (its run 1 row is stale), 5 failed
        _stored([5], [50], run=3),  # 5 succeeded in run 3
        _stored([6], [0], run=3, failed=True),  # 6 failed and is gone from the dataset: not "removed"
        _stored([7], [70], run=1),  # 7 is gone: removed
    ]
    increment = _plan([1, 2, 3, 4, 5], [10, 20, 31, 40, 50], stored, rows_per_partition=3)
    assert _selected(increment) == [1, 3]  # key 2 changed back to run 1's content: changed; key 4 failed
    c = increment.counts
    assert (c.changed, c.failed, c.unchanged, c.removed, c.stored, c.stored_failed, c.shadowed) == (1, 1, 3, 1, 5, 2, 4)


def test_a_key_removed_by_a_finished_run_is_new_again():
    removal = _stored([2, 3], [0, 0], run=2).append_column("removed", pa.array([True, True]))
    stored = [_stored([1, 2, 3], [10, 20, 30], run=1).append_column("removed", pa.array([False] * 3)), removal,
              _stored([3], [31], run=3).append_column("removed", pa.array([False]))]  # 3 came back in run 3
    increment = _plan([1, 2, 3], [10, 20, 31], stored)
    assert _selected(increment) == [1]
    c = increment.counts
    assert (c.new, c.unchanged, c.removed, c.stored) == (1, 2, 0, 2)


def test_removed_keys_are_written_when_asked(tmp_path):
    stored = [_stored([f"k{i}" for i in range(50)], range(50))]
    increment = _plan([f"k{i}" for i in range(0, 50, 2)], range(0, 50, 2), stored, removed_to=tmp_path / "gone",
                      rows_per_partition=20)
    with pa.OSFile(str(increment.removed)) as f:
        gone = pa.ipc.open_stream(f).read_all().column("key").to_pylist()
    assert sorted(gone) == sorted(f"k{i}" for i in range(1, 50, 2)) and increment.counts.removed == 25


def test_keys_of_another_type_or_missing_are_refused():
    with pytest.raises(InvalidArgumentError, match="the dataset has str keys, but the stored outputs have int keys"):
        _plan(["a"], [1], [_stored([1], [1])])
    with pytest.raises(InvalidArgumentError, match="the stored outputs has str keys, but its earlier rows have int"):
        _plan([1], [1], [_stored([1], [1]), _stored(["a"], [1])])
    batch = pa.record_batch({"key": pa.array([1, None]), "hash": pa.array([1, 2])})
    with pytest.raises(InvalidArgumentError, match="example 1 of the dataset has no key"):
        plan_increment([batch], [], new_rows=2, stored_rows=0, version="v1")
    batch = pa.record_batch({"key": pa.array([1.5]), "hash": pa.array([1])})
    with pytest.raises(InvalidArgumentError, match="must hold ints or strings"):
        plan_increment([batch], [], new_rows=1, stored_rows=0, version="v1")
    with pytest.raises(InvalidArgumentError, match="gave 3 keys, but it has 4"):
        plan_increment(_new(range(3), range(3)), [], new_rows=4, stored_rows=0, version="v1")


def test_partitions_are_sized_from_the_rows():
    from torch_batch_process.outputs.keyed.partitions import partition_count

    assert (partition_count(0, 10), partition_count(25, 10), partition_count(10**8, 1 << 21)) == (1, 3, 48)


@pytest.mark.parametrize("flush_rows", [1, 1 << 20])  # a flush while adding rows, or the last one at close
def test_a_full_scratch_disk_is_a_storage_error_naming_the_spill_file(tmp_path, flush_rows):
    """The planner (and a keyed read-back) spills keys under TMPDIR: a full disk there was the bare OSError of pyarrow
    ('Error writing bytes to file', naming no file). It is a StorageError naming the file and TMPDIR, with the disk's
    errno (/dev/full: a real ENOSPC without root)."""
    folder = tmp_path / "spill"
    folder.mkdir()
    (folder / "stored-0.arrows").symlink_to("/dev/full")
    parts = KeyPartitions(folder, "stored", 1, flush_rows=flush_rows)
    with pytest.raises(StorageError, match=r"stored-0\.arrows'.*no space left") as caught:
        parts.add(pa.record_batch({"key": pa.array([1, 2], pa.int64())}))
        parts.close()
    assert caught.value.errno == errno.ENOSPC and "TMPDIR" in str(caught.value), caught.value


def test_a_full_disk_while_writing_the_removed_keys_is_a_storage_error_naming_the_file():
    """prune_missing=True writes the removed keys to a local file while the partitions are compared: a full disk there
    was pyarrow's bare OSError too (/dev/full: a real ENOSPC)."""
    stored = [_stored([f"k{i}" for i in range(10)], range(10))]
    with pytest.raises(StorageError, match=r"'/dev/full'.*no space left") as caught:
        _plan([f"k{i}" for i in range(0, 10, 2)], range(0, 10, 2), stored, removed_to="/dev/full")
    assert caught.value.errno == errno.ENOSPC
