"""Streaming sources (DESIGN §12) as standalone readers: Parquet (local and S3 on moto), JSONL (plain and
gzip), Hugging Face iterable datasets and Sharded; row-range reads, seeking (counted rows), fingerprints,
errors at construction, pickling into a fresh interpreter and DataLoader workers."""

from __future__ import annotations

import gzip
import json
import pickle
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from torch_batch_process import InvalidArgumentError, StorageError, sources
from torch_batch_process.sources import RowsReadLog, ShardInfo, Source, SourceDataError

REPO = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# Four shards with different row counts and row-group sizes (the last one a single row group).
PARQUET_LAYOUT = [(1000, 128), (700, 100), (1, 10), (450, 1000)]


def shard_rows(shard: int, count: int) -> list[dict[str, Any]]:
    base = shard * 100_000
    return [{"id": base + i, "text": f"s{shard}-r{i}", "score": (base + i) / 8} for i in range(count)]


def write_parquet(fs: Any, path: str, rows: list[dict[str, Any]], row_group_size: int) -> None:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink, row_group_size=row_group_size)
    fs.pipe_file(path, sink.getvalue().to_pybytes())


def make_parquet_dir(url: str, layout: list[tuple[int, int]] = PARQUET_LAYOUT) -> tuple[str, list[list[dict]]]:
    """Writes one file per shard under ``url`` (in reverse order, so listing order is not writing order)."""
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    if isinstance(fs, fsspec.implementations.local.LocalFileSystem):
        fs.makedirs(root, exist_ok=True)
    expected = [shard_rows(k, n) for k, (n, _) in enumerate(layout)]
    for k in reversed(range(len(layout))):
        write_parquet(fs, f"{root}/part-{k:03d}.parquet", expected[k], layout[k][1])
    return url, expected


@pytest.fixture
def local_parquet(tmp_path: Path) -> tuple[str, list[list[dict]]]:
    return make_parquet_dir(str(tmp_path / "pq"))


@pytest.fixture
def s3_parquet(s3_url: str) -> tuple[str, list[list[dict]]]:
    return make_parquet_dir(f"{s3_url}/pq")


@pytest.fixture(params=["local", "s3"])
def any_parquet(request: pytest.FixtureRequest) -> tuple[str, list[list[dict]]]:
    return request.getfixturevalue(f"{request.param}_parquet")


def group_start(source: sources.ParquetSource, shard: int, row: int) -> int:
    return max(s for s in source.row_groups(shard) if s <= row)


# ====================================================================== Parquet


def test_parquet_shards_from_footers_in_sorted_order(any_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = any_parquet
    source = sources.parquet(f"{url}/*.parquet")
    assert isinstance(source, Source)
    infos = source.shards()
    assert [info.num_rows for info in infos] == [len(rows) for rows in expected]
    assert [info.name.rsplit("/", 1)[1] for info in infos] == [f"part-{k:03d}.parquet" for k in range(4)]
    if url.startswith("s3://"):
        assert all(info.name.startswith("s3://") for info in infos)
    assert source.num_rows == sum(len(rows) for rows in expected)
    assert source.row_groups(0) == list(range(0, 1000, 128))
    assert source.rows_read == 0  # construction reads footers only
    assert source.columns == ["id", "text", "score"]
    # a folder is its parquet files, in the same order
    assert sources.parquet(url).shards() == infos


def test_parquet_reads_full_shards(any_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = any_parquet
    source = sources.parquet(f"{url}/*.parquet")
    for k, rows in enumerate(expected):
        assert list(source.read(k)) == rows
    assert source.rows_read == sum(len(rows) for rows in expected)


def test_parquet_read_from_offset_skips_row_groups(any_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = any_parquet
    source = sources.parquet(f"{url}/*.parquet")
    for shard, start in [(0, 0), (0, 1), (0, 129), (0, 640), (0, 999), (1, 350), (1, 699), (3, 449), (2, 0)]:
        source.close()  # a fresh reader: no cursor left by the previous read
        source.rows_read = 0
        got = list(source.read(shard, start))
        assert got == expected[shard][start:]
        # rows decoded: from the first row of start's row group to the end, never the earlier row groups
        assert source.rows_read == len(expected[shard]) - group_start(source, shard, start)


def test_parquet_slices(any_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = any_parquet
    source = sources.parquet(f"{url}/*.parquet")
    for shard, start, stop in [(0, 0, 1), (0, 100, 300), (0, 990, 5000), (1, 50, 50), (1, 699, 700), (3, 7, 8)]:
        assert list(source.read(shard, start, stop)) == expected[shard][start:stop]
    assert list(source.read(0, 1000)) == []
    assert list(source.read(2, 5, 10)) == []


def test_parquet_consecutive_batches_decode_each_row_once(tmp_path: Path) -> None:
    """Batch-sized reads one after another continue one reader (no row group decoded again), also when
    two shards are read alternately and when the consumer stops early."""
    url, expected = make_parquet_dir(str(tmp_path / "big"), [(5000, 5000), (3000, 3000)])
    source = sources.parquet(url)
    got: dict[int, list] = {0: [], 1: []}
    for start in range(0, 5000, 64):
        for shard in (0, 1):
            got[shard].extend(source.read(shard, start, start + 64))
    assert got[0] == expected[0] and got[1] == expected[1]
    assert source.rows_read == 8000

    source.close()
    source.rows_read = 0
    iterator = source.read(0, 100)
    first = [next(iterator) for _ in range(10)]
    iterator.close()  # the consumer took 10 rows and stopped: the next read starts at row 110
    assert first == expected[0][100:110]
    assert list(source.read(0, 110, 120)) == expected[0][110:120]
    assert list(source.read(0, 150, 160)) == expected[0][150:160]  # a small gap is skipped in the same reader
    assert source.rows_read <= 5000  # at most the one row group, decoded once (in steps sized to the reads)
    assert list(source.read(0, 5, 8)) == expected[0][5:8]  # backwards: a new reader
    assert list(source.read(0, 4990)) == expected[0][4990:]


def test_parquet_resume_at_90_percent_reads_little(tmp_path: Path) -> None:
    url, expected = make_parquet_dir(str(tmp_path / "r"), [(4000, 250)] * 8)
    source = sources.parquet(f"{url}/*.parquet")
    total = source.num_rows
    log = RowsReadLog(tmp_path / "reads.log")
    source.on_rows_read = log
    for shard, info in enumerate(source.shards()):
        start = int(info.num_rows * 0.9)
        assert list(source.read(shard, start)) == expected[shard][start:]
    # each shard: from the row group of row 3600 (rows 3500..3749) to the end, 500 rows of 4000
    assert source.rows_read == log.total() == 8 * 500
    assert source.rows_read <= 0.15 * total


def test_parquet_sequential_read_memory_stays_flat(tmp_path: Path) -> None:
    """Arrow memory in use while reading a file through stays below a few row groups, not the file."""
    n = 400_000
    table = pa.table({"id": pa.array(range(n), pa.int64()), "blob": pa.array([b"%031d" % i for i in range(n)])})
    path = tmp_path / "big.parquet"
    pq.write_table(table, path, row_group_size=20_000, compression="none")
    del table
    group_bytes = pq.read_metadata(path).row_group(0).total_byte_size
    source = sources.parquet(str(path))
    base = pa.total_allocated_bytes()
    peak = 0
    count = 0
    for start in range(0, n, 4096):
        for _ in source.read(0, start, start + 4096):
            count += 1
        peak = max(peak, pa.total_allocated_bytes() - base)
    assert count == n
    assert peak < 4 * group_bytes < path.stat().st_size / 4


def test_parquet_columns_and_read_batches(local_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = local_parquet
    source = sources.parquet(f"{url}/*.parquet", columns=["text", "id"])
    assert source.columns == ["text", "id"]
    assert list(source.read(1, 10, 12)) == [{"text": r["text"], "id": r["id"]} for r in expected[1][10:12]]
    batches = list(source.read_batches(0, 100, 650, batch_rows=200))
    assert [b.num_rows for b in batches] == [200, 200, 150]
    assert all(isinstance(b, pa.RecordBatch) for b in batches)
    assert pa.Table.from_batches(batches).column("id").to_pylist() == [r["id"] for r in expected[0][100:650]]
    # a python read that stopped early leaves rows that the columnar read serves first
    it = source.read(0, 0)
    assert next(it)["id"] == expected[0][0]["id"]
    it.close()
    batch = next(source.read_batches(0, 1, 5))
    assert batch.column("id").to_pylist() == [r["id"] for r in expected[0][1:5]]
    # a narrower view (a keyed job's planner: key and content columns) reads the same rows, only those columns
    narrow = source.with_columns(["id"])
    assert narrow.columns == ["id"] and narrow.shards() == source.shards() and source.columns == ["text", "id"]
    assert list(narrow.read(1, 10, 12)) == [{"id": r["id"]} for r in expected[1][10:12]]
    with pytest.raises(InvalidArgumentError, match="no column 'other'"):
        source.with_columns(["other"])


def test_parquet_arguments_and_storage_errors(tmp_path: Path, local_parquet: tuple[str, list[list[dict]]]) -> None:
    url, _ = local_parquet
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        sources.parquet(str(tmp_path / "nothing" / "*.parquet"))
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        sources.parquet(str(tmp_path / "missing.parquet"))
    with pytest.raises(InvalidArgumentError, match="empty list"):
        sources.parquet([])
    with pytest.raises(InvalidArgumentError, match="urls_or_glob"):
        sources.parquet(42)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="more than once"):
        sources.parquet([f"{url}/part-000.parquet", f"{url}/*.parquet"])
    with pytest.raises(InvalidArgumentError, match="no column 'nope'"):
        sources.parquet(url, columns=["id", "nope"])
    with pytest.raises(InvalidArgumentError, match="columns=\\['text'\\]"):
        sources.parquet(url, columns="text")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="storage_options"):
        sources.parquet(url, storage_options="anon")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="mixes filesystems"):
        sources.parquet([f"{url}/part-000.parquet", "memory://x/y.parquet"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.parquet").write_bytes(b"this is not parquet at all" * 10)
    with pytest.raises(StorageError, match="a.parquet.*footer"):
        sources.parquet(str(bad / "*.parquet"))
    (tmp_path / "empty-folder").mkdir()
    with pytest.raises(InvalidArgumentError, match="without parquet files"):
        sources.parquet(str(tmp_path / "empty-folder"))

    source = sources.parquet(url)
    with pytest.raises(InvalidArgumentError, match="shard=4 is out of range"):
        source.read(4)
    with pytest.raises(InvalidArgumentError, match="negative"):
        source.read(0, -1)
    with pytest.raises(InvalidArgumentError, match="before start"):
        source.read(0, 10, 5)
    with pytest.raises(InvalidArgumentError, match="bool"):
        source.read(True)
    assert list(source.read(torch.tensor(2), 0)) == list(source.read(2))  # integer-like indices are fine


def test_paths_whose_names_have_glob_characters_are_read_as_named(any_parquet: tuple[str, list[list[dict]]]) -> None:
    """A file or folder named with ``[ ] * ?`` that exists is that file or folder, never a pattern matching others
    (``exp[1]`` as a glob names ``exp1``: without the check, the decoys below were read in its place)."""
    url, _ = any_parquet
    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    named, decoy = [{"id": 1, "text": "named", "score": 0.5}], [{"id": 2, "text": "decoy", "score": 0.25}]
    for folder, rows in ((f"{root}/exp[1]", named), (f"{root}/exp1", decoy)):
        fs.makedirs(folder, exist_ok=True)
        write_parquet(fs, f"{folder}/a[0].parquet" if rows is named else f"{folder}/a0.parquet", rows, 10)
    write_parquet(fs, f"{root}/exp1/a[0].parquet", decoy, 10)
    fs.invalidate_cache()
    for item in (f"{url}/exp[1]", f"{url}/exp[1]/a[0].parquet", [f"{url}/exp[1]/a[0].parquet"]):
        assert [list(sources.parquet(item).read(0))] == [named], item
    # a pattern that names no existing path stays a pattern (``exp[1]`` in it is the class ``[1]``: exp1's files)
    pattern = sources.parquet(f"{url}/exp[1]/a*.parquet")
    assert [row["text"] for k in range(len(pattern.shards())) for row in pattern.read(k)] == ["decoy", "decoy"]
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        sources.parquet(f"{url}/exp[1]/b[0].parquet")


def test_parquet_s3_errors(s3_url: str) -> None:
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        sources.parquet(f"{s3_url}/none/*.parquet")
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        sources.parquet(f"{s3_url}/none/x.parquet")
    fs, root = fsspec.core.url_to_fs(s3_url, skip_instance_cache=True)
    fs.pipe_file(f"{root}/junk/a.parquet", b"PAR1 not really")
    with pytest.raises(StorageError, match="footer"):
        sources.parquet(f"{s3_url}/junk/a.parquet")


def test_parquet_fingerprint_stable_and_detects_changes(any_parquet: tuple[str, list[list[dict]]]) -> None:
    url, expected = any_parquet
    first = sources.parquet(f"{url}/*.parquet").fingerprint()
    assert json.loads(json.dumps(first)) == first
    assert first["kind"] == "parquet" and len(first["shards"]) == 4
    assert all(s["version"] for s in first["shards"])
    again = sources.parquet(f"{url}/*.parquet")
    assert again.fingerprint() == first
    assert pickle.loads(pickle.dumps(again)).fingerprint() == first
    assert sources.parquet(f"{url}/*.parquet", columns=["id"]).fingerprint() != first

    fs, root = fsspec.core.url_to_fs(url, skip_instance_cache=True, use_listings_cache=False)
    time.sleep(0.01)  # a new mtime on local disks with coarse clocks
    rows = expected[1][:-1] + [dict(expected[1][-1], text="changed")]
    write_parquet(fs, f"{root}/part-001.parquet", rows, 100)  # same row count, other content
    changed = sources.parquet(f"{url}/*.parquet").fingerprint()
    assert changed != first
    assert [s["name"] for s in changed["shards"]] == [s["name"] for s in first["shards"]]
    write_parquet(fs, f"{root}/part-004.parquet", shard_rows(4, 3), 10)  # a new file matches the glob
    assert len(sources.parquet(f"{url}/*.parquet").fingerprint()["shards"]) == 5


# ====================================================================== JSONL


def write_jsonl(path: Path, rows: list[Any], *, blank_every: int = 0) -> None:
    lines = []
    for i, row in enumerate(rows):
        lines.append(json.dumps(row) + "\n")
        if blank_every and i % blank_every == 0:
            lines.append("\n")  # blank lines are not rows
    data = "".join(lines).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)


@pytest.fixture
def jsonl_dir(tmp_path: Path) -> tuple[Path, list[list[dict]]]:
    folder = tmp_path / "jl"
    folder.mkdir()
    expected = [shard_rows(k, n) for k, n in enumerate([2500, 10, 1200])]
    names = ["a.jsonl", "b.jsonl.gz", "c.jsonl"]
    for name, rows in zip(names, expected, strict=True):
        write_jsonl(folder / name, rows, blank_every=7)
    return folder, expected


def test_jsonl_reads_plain_and_gzip(jsonl_dir: tuple[Path, list[list[dict]]]) -> None:
    folder, expected = jsonl_dir
    source = sources.jsonl(str(folder / "*"))
    assert [Path(i.name).name for i in source.shards()] == ["a.jsonl", "b.jsonl.gz", "c.jsonl"]
    assert [i.num_rows for i in source.shards()] == [None, None, None]
    assert source.num_rows is None
    for k, rows in enumerate(expected):
        assert list(source.read(k)) == rows
    assert list(source.read(1, 3, 6)) == expected[1][3:6]
    assert list(source.read(1, 50)) == []  # past the end of an unknown-length shard: nothing
    source.close()
    source.rows_read = 0
    assert list(source.read(0, 2000, 2010)) == expected[0][2000:2010]
    assert source.rows_read == 2010  # no index: the lines before are scanned (not parsed)


def test_jsonl_count_rows_indexes_offsets(
    jsonl_dir: tuple[Path, list[list[dict]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder, expected = jsonl_dir
    monkeypatch.setattr(sources.JsonlSource, "INDEX_EVERY", 100)
    source = sources.jsonl(str(folder), count_rows=True)
    assert [i.num_rows for i in source.shards()] == [2500, 10, 1200]
    assert source.num_rows == 3710
    assert source.rows_read == 0  # the scan counts newlines; it decodes nothing
    for shard, start, stop in [(0, 0, 5), (0, 2345, 2350), (0, 2499, None), (2, 1100, 1200), (1, 4, 9)]:
        source.close()
        source.rows_read = 0
        assert list(source.read(shard, start, stop)) == expected[shard][start:stop]
        end = len(expected[shard]) if stop is None else stop
        seek = 0 if shard == 1 else (start // 100) * 100  # the .gz shard cannot seek
        assert source.rows_read == end - seek
    # the index travels with the source, whatever the class attribute says where it is read
    copy = pickle.loads(pickle.dumps(source))
    monkeypatch.setattr(sources.JsonlSource, "INDEX_EVERY", 7)
    assert list(copy.read(0, 1234, 1240)) == expected[0][1234:1240]
    assert copy.rows_read == 40


def test_jsonl_errors(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        sources.jsonl(str(tmp_path / "*.jsonl"))
    with pytest.raises(InvalidArgumentError, match="count_rows"):
        sources.jsonl(str(tmp_path), count_rows="yes")  # type: ignore[arg-type]
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": \n{"a": 4}\n')
    source = sources.jsonl(str(path))
    rows = source.read(0)
    with pytest.raises(SourceDataError, match=r"bad.jsonl.*row 2"):
        list(rows)
    assert list(source.read(0, 0, 2)) == [{"a": 1}, {"a": 2}]
    truncated = tmp_path / "trunc.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"a": 1}\n' * 1000)[:40])
    with pytest.raises(StorageError, match="trunc.jsonl.gz"):
        sources.jsonl(str(truncated), count_rows=True)


def test_jsonl_on_s3_plain_and_gzip(s3_url: str) -> None:
    fs, root = fsspec.core.url_to_fs(s3_url, skip_instance_cache=True)
    expected = [shard_rows(0, 3000), shard_rows(1, 500)]
    fs.pipe_file(f"{root}/jl/x-0.jsonl", "".join(json.dumps(r) + "\n" for r in expected[0]).encode())
    fs.pipe_file(f"{root}/jl/x-1.jsonl.gz", gzip.compress("".join(json.dumps(r) + "\n" for r in expected[1]).encode()))
    source = sources.jsonl(f"{s3_url}/jl/x-*", count_rows=True)
    assert [i.num_rows for i in source.shards()] == [3000, 500]
    assert source.shards()[0].name == f"{s3_url}/jl/x-0.jsonl"
    assert list(source.read(1)) == expected[1]
    source.rows_read = 0
    assert list(source.read(0, 2900, 2950)) == expected[0][2900:2950]
    assert source.rows_read == 2950 - 2048  # seeks to the indexed row 2048
    fingerprint = source.fingerprint()
    assert fingerprint == sources.jsonl(f"{s3_url}/jl/x-*", count_rows=True).fingerprint()
    fs.pipe_file(f"{root}/jl/x-0.jsonl", b'{"id": 1}\n')
    assert sources.jsonl(f"{s3_url}/jl/x-*", count_rows=True).fingerprint() != fingerprint


# ====================================================================== Hugging Face iterable datasets


def hf_generate(starts: list[int], size: int) -> Iterator[dict[str, Any]]:
    for start in starts:
        for i in range(size):
            yield {"id": start * 1000 + i, "text": f"g{start}-{i}"}


def hf_generator_dataset(num_shards: int = 5, size: int = 300) -> Any:
    datasets = pytest.importorskip("datasets")
    return datasets.IterableDataset.from_generator(
        hf_generate, gen_kwargs={"starts": list(range(num_shards)), "size": size}
    )


def hf_json_dataset(folder: Path, counts: list[int]) -> tuple[Any, list[list[dict]]]:
    datasets = pytest.importorskip("datasets")
    folder.mkdir(exist_ok=True)
    expected = [[{"id": k * 100_000 + i, "text": f"s{k}-r{i}"} for i in range(n)] for k, n in enumerate(counts)]
    files = []
    for k, rows in enumerate(expected):
        write_jsonl(folder / f"d{k}.jsonl", rows)
        files.append(str(folder / f"d{k}.jsonl"))
    ds = datasets.load_dataset("json", data_files=files, split="train", streaming=True)
    return ds, expected


def test_hf_json_files_read_by_shard(tmp_path: Path) -> None:
    ds, expected = hf_json_dataset(tmp_path / "hf", [600, 30, 1000])
    source = sources.from_hf(ds)
    assert source.shards() == [ShardInfo(f"hf:json/train#{k}", None) for k in range(3)]
    for k, rows in enumerate(expected):
        assert list(source.read(k)) == rows
    source.close()
    source.rows_read = 0
    assert list(source.read(2, 900, 905)) == expected[2][900:905]
    assert source.rows_read >= 905  # no seeking: the rows before are read and dropped
    # consecutive batches go on with one iterator
    source.close()
    source.rows_read = 0
    got = []
    for start in range(0, 1000, 64):
        got.extend(source.read(2, start, start + 64))
    assert got == expected[2] and source.rows_read == 1000
    fingerprint = source.fingerprint()
    assert json.loads(json.dumps(fingerprint)) == fingerprint
    assert [s["data"]["base_files"] for s in fingerprint["shards"]] == [
        [str(tmp_path / "hf" / f"d{k}.jsonl")] for k in range(3)
    ]
    again, _ = hf_json_dataset(tmp_path / "hf", [600, 30, 1000])
    assert sources.from_hf(again).fingerprint() == fingerprint
    other, _ = hf_json_dataset(tmp_path / "hf2", [600, 30, 1000])
    assert sources.from_hf(other).fingerprint() != fingerprint


def test_hf_parquet_files_read_by_shard(local_parquet: tuple[str, list[list[dict]]]) -> None:
    datasets = pytest.importorskip("datasets")
    url, expected = local_parquet
    files = sorted(str(p) for p in Path(url).glob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=True)
    source = sources.from_hf(ds)
    assert source.num_shards >= len(files)  # one per file, or more if the builder splits files by row group
    got = [row for k in range(source.num_shards) for row in source.read(k)]
    assert got == [row for rows in expected for row in rows]
    last = source.num_shards - 1
    assert list(source.read(last, 2)) == list(source.read(last))[2:]


@pytest.mark.filterwarnings("ignore:To copy construct from a tensor")  # datasets' torch formatter
def test_hf_generator_with_gen_kwargs_lists() -> None:
    source = sources.from_hf(hf_generator_dataset(num_shards=5, size=300))
    assert source.num_shards == 5 and source.num_rows is None
    assert [s["data"]["starts"] for s in source.fingerprint()["shards"]] == [[k] for k in range(5)]
    for k in range(5):
        assert [r["id"] for r in source.read(k)] == [k * 1000 + i for i in range(300)]
    assert list(source.read(3, 298, 1000)) == [{"id": 3298, "text": "g3-298"}, {"id": 3299, "text": "g3-299"}]
    torch_source = sources.from_hf(hf_generator_dataset(num_shards=2, size=10).with_format("torch"))
    row = next(torch_source.read(1, 4))
    assert int(row["id"]) == 1004 and row["text"] == "g1-4"


def test_hf_refuses_what_it_cannot_read_by_shard(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    with pytest.raises(InvalidArgumentError, match="map-style"):
        sources.from_hf(datasets.Dataset.from_list([{"a": 1}]))
    with pytest.raises(InvalidArgumentError, match="IterableDataset"):
        sources.from_hf([{"a": 1}])
    ds = hf_generator_dataset(num_shards=4, size=3)
    with pytest.raises(InvalidArgumentError, match="split_dataset_by_node"):
        sources.from_hf(split_dataset_by_node(ds, rank=0, world_size=2))
    with pytest.raises(InvalidArgumentError, match="arrow"):
        sources.from_hf(ds.with_format("arrow"))


# ====================================================================== Sharded


def open_range_shard(shard: tuple[int, int]) -> Iterator[dict[str, int]]:
    first, count = shard
    for i in range(count):
        yield {"value": first + i}


def test_sharded_reads_and_checks_counts() -> None:
    shards = [(0, 100), (1000, 5), (2000, 0), (3000, 250)]
    source = sources.Sharded(shards, open_range_shard)
    assert [i.num_rows for i in source.shards()] == [None] * 4
    assert [i.name for i in source.shards()] == [repr(s) for s in shards]
    assert [r["value"] for r in source.read(3, 240)] == list(range(3240, 3250))
    assert source.rows_read == 250
    assert list(source.read(2)) == []
    assert [r["value"] for r in source.read(0, 10, 13)] == [10, 11, 12]

    counted = sources.Sharded(shards, open_range_shard, num_rows=[100, 5, 0, 250], names=["a", "b", "c", "d"])
    assert counted.num_rows == 355 and counted.shards()[1] == ShardInfo("b", 5)
    assert list(counted.read(1, 0, 99)) == [{"value": 1000 + i} for i in range(5)]
    wrong = sources.Sharded(shards, open_range_shard, num_rows=[100, 6, 0, None])
    with pytest.raises(SourceDataError, match="ended after 5 rows but num_rows says 6"):
        list(wrong.read(1))
    fingerprint = counted.fingerprint()
    assert fingerprint["open_shard"].endswith("open_range_shard")
    assert (
        sources.Sharded(shards, open_range_shard, num_rows=[100, 5, 0, 250], names=list("abcd")).fingerprint()
        == fingerprint
    )


def test_sharded_errors() -> None:
    with pytest.raises(InvalidArgumentError, match="empty"):
        sources.Sharded([], open_range_shard)
    with pytest.raises(InvalidArgumentError, match="not a list"):
        sources.Sharded("abc", open_range_shard)
    with pytest.raises(InvalidArgumentError, match="not callable"):
        sources.Sharded([1], None)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="num_rows"):
        sources.Sharded([1, 2], open_range_shard, num_rows=[1])
    with pytest.raises(InvalidArgumentError, match="num_rows contains -1"):
        sources.Sharded([1, 2], open_range_shard, num_rows=[1, -1])
    with pytest.raises(InvalidArgumentError, match="named '1'"):
        sources.Sharded([1, "1"], open_range_shard)
    with pytest.raises(InvalidArgumentError, match="memory address"):
        sources.Sharded([object()], open_range_shard)


# ====================================================================== pickling, subprocesses, DataLoader workers

_CHILD = """
import pickle, sys, json
sys.path[:0] = [{repo!r}, {tests!r}]
out = []
for source in pickle.loads(sys.stdin.buffer.read()):
    rows = [list(source.read(k, 0, {limit})) for k in range(source.num_shards)]
    out.append({{"rows": rows, "rows_read": source.rows_read}})
sys.stdout.write(json.dumps(out, default=str))
"""


def read_in_fresh_interpreter(batch: list[Source], limit: int = 50) -> list[dict[str, Any]]:
    """Unpickles sources in a new Python process (nothing inherited) and reads each shard's first rows."""
    child = _CHILD.format(repo=str(REPO), tests=str(TESTS), limit=limit)
    proc = subprocess.run(
        [sys.executable, "-c", child], input=pickle.dumps(batch), capture_output=True, timeout=180, check=False
    )
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    return json.loads(proc.stdout)


def test_sources_pickle_into_a_fresh_interpreter(
    s3_parquet: tuple[str, list[list[dict]]], jsonl_dir: tuple[Path, list[list[dict]]]
) -> None:
    url, expected_pq = s3_parquet
    parquet = sources.parquet(f"{url}/*.parquet")
    list(parquet.read(0, 0, 10))  # an open reader and filesystem in this process must not travel
    folder, expected_jl = jsonl_dir
    sharded = sources.Sharded([(0, 60), (500, 3)], open_range_shard)
    cases = [
        (parquet, expected_pq),
        (sources.jsonl(str(folder), count_rows=True), expected_jl),
        (sharded, [list(open_range_shard((0, 60))), list(open_range_shard((500, 3)))]),
        (sources.from_hf(hf_generator_dataset(num_shards=3, size=70)), [list(hf_generate([k], 70)) for k in range(3)]),
    ]
    results = read_in_fresh_interpreter([source for source, _ in cases])
    for (_, expected), out in zip(cases, results, strict=True):
        assert out["rows"] == [json.loads(json.dumps(rows[:50])) for rows in expected]
        assert out["rows_read"] > 0


class ShardRanges(IterableDataset):
    """A test stand-in for the engine: work units (shard, start, stop) dealt round-robin to DataLoader workers."""

    def __init__(self, source: Source, units: list[tuple[int, int, int | None]]) -> None:
        self.source = source
        self.units = units

    def __iter__(self) -> Iterator[tuple[int, int, Any]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for k, (shard, start, stop) in enumerate(self.units):
            if k % workers == worker:
                for row in self.source.read(shard, start, stop):
                    yield worker, shard, row


def as_is(item: Any) -> Any:
    return item


def load_with_workers(source: Source, units: list[tuple[int, int, int | None]], **kwargs: Any) -> list[tuple]:
    loader = DataLoader(
        ShardRanges(source, units), batch_size=None, num_workers=2, timeout=120, collate_fn=as_is, **kwargs
    )
    return list(loader)


def units_of(counts: list[int], size: int) -> list[tuple[int, int, int | None]]:
    return [(shard, start, start + size) for shard, n in enumerate(counts) for start in range(0, n, size)]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_parquet_in_dataloader_workers_exactly_once(where: str, request: pytest.FixtureRequest, tmp_path: Path) -> None:
    url, expected = request.getfixturevalue(f"{where}_parquet")
    source = sources.parquet(f"{url}/*.parquet")
    # the parent holds a reader at row 150 of shard 0 (where worker 1's first range starts) and a
    # filesystem when the workers fork: a worker must open its own
    assert len(list(source.read(0, 0, 150))) == 150
    read_here = source.rows_read
    log = RowsReadLog(tmp_path / "reads.log")
    source.on_rows_read = log
    counts = [len(rows) for rows in expected]
    units = units_of(counts, 150)
    out = load_with_workers(source, units)
    assert {worker for worker, _, _ in out} == {0, 1}
    ids = [row["id"] for _, _, row in out]
    assert len(ids) == len(set(ids)) and set(ids) == {r["id"] for rows in expected for r in rows}
    # a worker decodes each of its ranges from the first row of the range's row group, and at most
    # one decoding step (MIN_BATCH_ROWS here) past the range's end; never the earlier row groups
    bound = sum(
        min(stop, counts[k]) - group_start(source, k, start) + source.MIN_BATCH_ROWS for k, start, stop in units
    )
    assert sum(counts) <= log.total() <= bound
    assert source.rows_read == read_here  # the workers read, not this process


def test_hf_in_dataloader_workers_reads_whole_shards(tmp_path: Path) -> None:
    """Inside a DataLoader worker a Hugging Face dataset splits itself again between the workers when
    iterated plainly; the source reads the shard it is asked for, whole, in any worker."""
    source = sources.from_hf(hf_generator_dataset(num_shards=3, size=200))
    out = load_with_workers(source, [(0, 0, None), (1, 0, None), (2, 0, 100), (2, 100, None)])
    assert {worker for worker, _, _ in out} == {0, 1}
    by_shard: dict[int, list[int]] = {}
    for _, shard, row in out:
        by_shard.setdefault(shard, []).append(row["id"])
    assert {k: sorted(v) for k, v in by_shard.items()} == {k: [k * 1000 + i for i in range(200)] for k in range(3)}


def test_jsonl_and_sharded_in_spawned_dataloader_workers(
    jsonl_dir: tuple[Path, list[list[dict]]], tmp_path: Path
) -> None:
    folder, expected = jsonl_dir
    source = sources.jsonl(str(folder), count_rows=True)
    log = RowsReadLog(tmp_path / "reads.log")
    source.on_rows_read = log
    out = load_with_workers(source, units_of([len(r) for r in expected], 400), multiprocessing_context="spawn")
    assert sorted(row["id"] for _, _, row in out) == sorted(r["id"] for rows in expected for r in rows)
    assert log.total() <= 2 * sum(len(r) for r in expected)

    sharded = sources.Sharded([(0, 300), (10_000, 301)], open_range_shard)
    out = load_with_workers(sharded, [(0, 0, 150), (0, 150, None), (1, 0, None)])
    assert sorted(row["value"] for _, _, row in out) == list(range(300)) + list(range(10_000, 10_301))


def test_rows_read_log_adds_up_processes(tmp_path: Path) -> None:
    log = RowsReadLog(tmp_path / "n")
    assert log.total() == 0
    copy = pickle.loads(pickle.dumps(log))
    log(5)
    copy(7)
    assert log.total() == 12
    log.reset()
    assert log.total() == 0


def test_memory_url_source(memory_url: str) -> None:
    url, expected = make_parquet_dir(f"{memory_url}/pq", [(300, 64), (5, 5)])
    source = sources.parquet(url)
    assert [list(source.read(k)) for k in range(2)] == expected
    list(source.read(0, 0, 10))
    assert len(pickle.dumps(source)) < 10_000  # names, counts and row-group offsets travel; no reader, no data
