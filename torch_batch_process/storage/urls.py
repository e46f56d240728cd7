"""The shape of a storage path, checked before anything is opened: a local path or an fsspec URL that names a
protocol fsspec knows, and no URL with a typo.

A typo in a URL must not become a local folder: ``s3:/bucket/x`` (one slash), ``s3:bucket/x`` or ``s3//bucket/x``
(no colon) are valid local paths, so without this check a job would write its outputs to ``./s3:/bucket/x`` on
the local disk and report success. A path whose first part is a known protocol followed by ``:`` but not ``://``
(or by ``//`` without the colon), or any ``word:/`` with a single slash, is refused with the URL it most likely
meant. An unknown protocol (``s33://``) is refused too. One-letter schemes (``C:/...``) stay local paths.

Imports fsspec but neither torch nor the storage backends, so ``tbp run`` checks a config's storage at once.
"""

from __future__ import annotations

import difflib
import os
import re
from typing import Any

from torch_batch_process.errors import StorageUrlError

__all__ = ["StorageUrlError", "check_storage_url"]

_SCHEME_TYPO = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):(?!//)/?(.*)$", re.DOTALL)
"""``scheme:rest`` without the ``//`` (``s3:/bucket``, ``s3:bucket``): a typo when ``scheme`` is a protocol."""

_MISSING_COLON = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+)//+(.*)$", re.DOTALL)
"""``scheme//rest`` (``s3//bucket``): a typo when ``scheme`` is a protocol."""


def _known_protocols() -> set[str]:
    import fsspec

    return {p.lower() for p in fsspec.available_protocols()} | {"file", "local"}


def check_storage_url(url: Any, name: str = "storage_path", *, fsspec_protocols: bool = True) -> str:
    """Returns ``url`` as a str when it is a non-empty local path or a URL of a known fsspec protocol.

    Args:
        url: what the user gave (a str or an ``os.PathLike``).
        name: how the error calls it (``storage_path``, ``--storage``, ``checkpoint_storage``...).
        fsspec_protocols: refuse a protocol fsspec does not know; ``False`` for URIs that another library opens
            (a Delta or Lance table: their object stores know other schemes), checked for typos only.

    Raises:
        StorageUrlError: (an :class:`~torch_batch_process.errors.InvalidArgumentError` and a
            :class:`~torch_batch_process.errors.StorageError`) naming ``name`` and the fix.
    """
    if isinstance(url, os.PathLike):
        url = os.fspath(url)
    if not isinstance(url, str) or not url.strip():
        raise StorageUrlError(f"{name} must be a non-empty local path or fsspec URL (e.g. s3://bucket/prefix), got {url!r}")
    if "://" in url and not fsspec_protocols:
        return url
    if "://" in url:
        protocols = url.split("://", 1)[0]
        known = _known_protocols()
        for protocol in protocols.split("::"):
            if protocol.lower() not in known:
                close = difflib.get_close_matches(protocol.lower(), sorted(known), n=1)
                hint = f"did you mean {close[0]}://? " if close else ""
                raise StorageUrlError(
                    f"{name} {url!r}: unknown protocol {protocol!r}; {hint}fsspec knows s3, gs, az, hdfs, file, "
                    f"memory... (fsspec.available_protocols()): fix the URL, or install the package that registers "
                    f"{protocol}://"
                )
        return url
    if os.path.isabs(url):
        return url
    for pattern in (_SCHEME_TYPO, _MISSING_COLON):
        match = pattern.match(url)
        if match is None:
            continue
        scheme, rest = match.groups()
        if scheme.lower() in _known_protocols() or (pattern is _SCHEME_TYPO and url[len(scheme) + 1 :][:1] == "/"):
            meant = f"{scheme}://{rest.lstrip('/')}" if scheme.lower() not in ("file", "local") else f"/{rest.lstrip('/')}"
            raise StorageUrlError(
                f"{name} {url!r} looks like a URL with a typo (a URL is protocol://path); it would be used as the "
                f"local folder ./{url}. Did you mean {meant!r}? (For a local folder whose name holds ':', give "
                f"'./{url}'.)"
            )
    return url
