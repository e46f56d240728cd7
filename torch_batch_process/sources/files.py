"""The files of file-based sources: local paths and fsspec URLs, globs and folders, listed in a deterministic
order, and opened lazily in each process (:class:`FileSource`)."""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from torch_batch_process.errors import InvalidArgumentError, StorageError
from torch_batch_process.sources.base import Source
from torch_batch_process.storage.errors import missing_backend_hint
from torch_batch_process.storage.registry import check_storage_options

__all__ = ["FileEntry", "FileSource", "list_files", "open_filesystem"]


@dataclass(frozen=True)
class FileEntry:
    """One file of a file-based source, as listed at construction."""

    url: str  # user-facing: a local absolute path, or the full fsspec URL
    path: str  # the path on the filesystem (without protocol)
    size: int
    version: str | None  # ETag, mtime or creation time: whatever the filesystem reports

    def describe(self) -> dict[str, Any]:
        return {"name": self.url, "size": self.size, "version": self.version}


_GLOB_CHARS = ("*", "?", "[")


def list_files(
    urls_or_glob: Any,
    storage_options: dict[str, Any] | None,
    *,
    suffixes: tuple[str, ...],
    kind: str,
) -> tuple[str, dict[str, Any], list[FileEntry]]:
    """Expands ``urls_or_glob`` into files, in a deterministic order.

    Each item is a file, a glob (expanded and sorted by path) or a folder (its files whose name
    ends with one of ``suffixes``, recursively, sorted); items keep the order given. All items
    must be on one filesystem. A path that exists as named is taken as named even when its name has
    glob characters (``data[1].parquet``, a folder ``exp[1]``), never expanded to other files.

    Returns:
        ``(url of the first item, storage options, files)``; the first two re-create the filesystem
        in another process.

    Raises:
        InvalidArgumentError: bad types, no file, a missing file, a file listed twice, two filesystems.
        StorageError: the filesystem cannot be reached or listed.
    """
    items = _url_items(urls_or_glob)
    options = check_storage_options(storage_options) or {}
    protocols = {_protocol(item) for item in items}
    if len(protocols) > 1:
        raise InvalidArgumentError(
            f"urls_or_glob mixes filesystems ({', '.join(sorted(protocols))}); "
            f"make one {kind} source per filesystem, or copy the files to one place"
        )
    fs = open_filesystem(items[0], options)
    try:
        fs.invalidate_cache()  # listings must be fresh: the fingerprint compares them across runs
    except Exception:  # noqa: BLE001 - a filesystem without a cache
        pass
    entries: list[FileEntry] = []
    for item in items:
        found = _expand(fs, item, suffixes, kind)
        entries.extend(found)
    seen: set[str] = set()
    for entry in entries:
        if entry.path in seen:
            raise InvalidArgumentError(
                f"urls_or_glob lists {entry.url!r} more than once (its rows would be read twice); list each file once"
            )
        seen.add(entry.path)
    return items[0], options, entries


def open_filesystem(url: str, options: dict[str, Any]) -> fsspec.AbstractFileSystem:
    """The fsspec filesystem of ``url``, with errors that name the URL and the fix."""
    protocol = _protocol(url)
    try:
        fs, _ = fsspec.core.url_to_fs(url, **options)
        return fs
    except ImportError as exc:
        raise StorageError(
            f"urls_or_glob {url!r}: the filesystem of {protocol}:// is not installed; {missing_backend_hint(protocol)}"
        ) from exc
    except ValueError as exc:
        if "protocol" in str(exc).lower():
            raise InvalidArgumentError(
                f"urls_or_glob {url!r}: unknown protocol {protocol!r}; pass a local path or an fsspec URL"
            ) from exc
        raise StorageError(f"urls_or_glob {url!r}: cannot open the filesystem: {exc}") from exc
    except Exception as exc:  # noqa: BLE001 - any backend error at construction
        raise StorageError(f"urls_or_glob {url!r}: cannot open the filesystem: {type(exc).__name__}: {exc}") from exc


def _url_items(urls_or_glob: Any) -> list[str]:
    if isinstance(urls_or_glob, (str, os.PathLike)):
        items = [urls_or_glob]
    elif isinstance(urls_or_glob, Sequence) and not isinstance(urls_or_glob, (bytes, bytearray)):
        items = list(urls_or_glob)
    else:
        raise InvalidArgumentError(
            f"urls_or_glob={urls_or_glob!r} is not a path, URL or glob; pass a str (e.g. 's3://bucket/data/*.parquet') "
            "or a list of them"
        )
    if not items:
        raise InvalidArgumentError("urls_or_glob is an empty list; pass at least one path, URL or glob")
    out = []
    for item in items:
        if not isinstance(item, (str, os.PathLike)) or not os.fspath(item):
            raise InvalidArgumentError(
                f"urls_or_glob contains {item!r}; every item must be a non-empty path, URL or glob"
            )
        out.append(os.fspath(item))
    return out


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower() if "://" in url else "file"


def _expand(fs: fsspec.AbstractFileSystem, item: str, suffixes: tuple[str, ...], kind: str) -> list[FileEntry]:
    _, path = _split(fs, item)
    try:
        if any(ch in path for ch in _GLOB_CHARS) and not fs.exists(path):
            infos = fs.glob(path, detail=True)
            files = sorted((info for info in infos.values() if info.get("type") != "directory"), key=_name)
            if not files:
                raise InvalidArgumentError(
                    f"urls_or_glob {item!r} matches no file; check the pattern (and the bucket or folder it names)"
                )
            return [_entry(fs, info) for info in files]
        try:
            info = fs.info(path)
        except FileNotFoundError:
            raise InvalidArgumentError(
                f"urls_or_glob {item!r} does not exist; fix the path (or the bucket), or pass a glob such as "
                f"'{item.rstrip('/')}/*{suffixes[0]}'"
            ) from None
        if info.get("type") != "directory":
            return [_entry(fs, info)]
        found = fs.find(path, detail=True)
        files = sorted(
            (i for i in found.values() if i.get("type") != "directory" and _name(i).lower().endswith(suffixes)),
            key=_name,
        )
        if not files:
            raise InvalidArgumentError(
                f"urls_or_glob {item!r} is a folder without {kind} files (names ending in {', '.join(suffixes)}); "
                "pass a glob or the files themselves"
            )
        return [_entry(fs, i) for i in files]
    except InvalidArgumentError:
        raise
    except FileNotFoundError as exc:
        raise InvalidArgumentError(f"urls_or_glob {item!r}: not found ({exc}); fix the path or the bucket") from exc
    except Exception as exc:  # noqa: BLE001 - any listing failure names the URL
        raise StorageError(f"urls_or_glob {item!r}: cannot list it: {type(exc).__name__}: {exc}") from exc


def _split(fs: fsspec.AbstractFileSystem, url: str) -> tuple[fsspec.AbstractFileSystem, str]:
    path = fs._strip_protocol(url)
    if isinstance(fs, LocalFileSystem):
        path = os.path.abspath(path)
    return fs, path


def _name(info: dict[str, Any]) -> str:
    return str(info["name"])


def _entry(fs: fsspec.AbstractFileSystem, info: dict[str, Any]) -> FileEntry:
    path = _name(info)
    url = path if isinstance(fs, LocalFileSystem) else fs.unstrip_protocol(path)
    return FileEntry(url=url, path=path, size=int(info.get("size") or 0), version=_version(info))


def _version(info: dict[str, Any]) -> str | None:
    for key in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified", "updated", "created"):
        value = info.get(key)
        if value is None:
            continue
        if isinstance(value, datetime.datetime):
            return value.isoformat()
        if isinstance(value, float):
            return repr(value)
        return str(value).strip('"')
    return None


class FileSource(Source):
    """A source whose shards are files on one fsspec filesystem, opened lazily in each process."""

    _TRANSIENT = ("_fs",)
    _fs: fsspec.AbstractFileSystem | None

    def __init__(self, urls_or_glob: Any, storage_options: dict[str, Any] | None, *, suffixes: tuple[str, ...]) -> None:
        super().__init__()
        self._fs_url, self._options, self._files = list_files(
            urls_or_glob, storage_options, suffixes=suffixes, kind=self.kind
        )

    @property
    def files(self) -> list[FileEntry]:
        """The files, in shard order."""
        return list(self._files)

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        """This process's filesystem (created on first use in each process)."""
        self._own_process()
        if self._fs is None:
            self._fs = open_filesystem(self._fs_url, self._options)
        return self._fs

    @property
    def is_local(self) -> bool:
        """Whether the files are on the local filesystem (read with native I/O)."""
        return _protocol(self._fs_url) in ("file", "local")

    def open_file(self, shard: int) -> Any:
        """A binary file object of shard ``shard``; the caller closes it."""
        entry = self._files[shard]
        if self.is_local:
            return open(entry.path, "rb", buffering=1 << 20)  # noqa: SIM115 - closed by the cursor
        try:
            return self.fs.open(entry.path, "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"{self.kind} shard {entry.url!r} has disappeared since the source was created") from exc
        except Exception as exc:  # noqa: BLE001
            raise StorageError(f"cannot open {self.kind} shard {entry.url!r}: {type(exc).__name__}: {exc}") from exc
