"""A TensorBoard event file, written without TensorBoard's writer stack.

``torch.utils.tensorboard.SummaryWriter`` imports TensorBoard's file-system layer, which imports ``boto3``
where it is installed: about 0.13 s of CPU at the start of every call, and 0.2-0.3 s of a short job's time
when the import runs beside a CPU-bound loop (measured on the data-bound CNN benchmark: ~10% of a 3-second
job). The library writes few values (scalars at most every 10 seconds, a hyperparameter table once), so it
writes the file itself: the file's version and the scalars encoded here (a scalar's ``Event`` is four fields of
protocol buffers' wire format), the text and hyperparameter summaries with the ``tensorboard`` package's generated
protocol buffer classes, imported at their first use (35 ms of CPU: every call's first scalars, at the end of a
short job, paid it before):

- the file is named ``events.out.tfevents.<time>.<host>.<pid>.<n>`` (TensorBoard reads every file whose name
  holds ``tfevents``) and starts with an ``Event`` whose ``file_version`` is ``brain.Event:2``;
- each ``Event`` is one TFRecord: its length (uint64, little-endian), the masked CRC-32C of those 8 bytes,
  the serialized ``Event``, and its masked CRC-32C (CRC-32C is the Castagnoli polynomial; *masked* means
  rotated right by 15 bits plus ``0xa282ead8``, modulo 2**32).

TensorBoard's own readers (``EventAccumulator``, the HParams tab) read these files as they read the writer's.
"""

from __future__ import annotations

import importlib
import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["EventFile", "masked_crc32c"]

HPARAMS_PLUGIN = "hparams"
SESSION_START_TAG = "_hparams_/session_start_info"
"""The tag under which TensorBoard's HParams tab finds a run's hyperparameters."""

_counter = itertools.count()


def _crc32c_table() -> list[int]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1  # the Castagnoli polynomial, reflected
        table.append(crc)
    return table


_TABLE = _crc32c_table()


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of ``data``, as TFRecord framing stores it."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= 0xFFFFFFFF
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


class EventFile:
    """One event file in ``folder`` (created with it); values are on disk after :meth:`flush`.

    Raises ``ImportError`` when the ``tensorboard`` package is not installed.
    """

    def __init__(self, folder: Path) -> None:
        importlib.import_module("tensorboard.compat.proto")  # installed? (the package, not its classes: < 1 ms)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_counter)}"
        self.path = folder / name
        self._file = open(self.path, "ab")  # noqa: SIM115 - open for the writer's life, closed by close()
        self._write(_event(time.time(), 0, file_version="brain.Event:2"))

    def scalar(self, tag: str, value: float, step: int) -> None:
        """A scalar (TensorBoard's Scalars tab)."""
        value_bytes = _string(1, tag) + _key(2, _FIXED32) + struct.pack("<f", float(value))  # Summary.Value
        self._write(_event(time.time(), step, summary=_bytes(1, value_bytes)))  # Summary: its one value

    def text(self, tag: str, text: str, step: int) -> None:
        """A text, Markdown rendered (the Text tab, under ``<tag>/text_summary``)."""
        from tensorboard.compat.proto import tensor_pb2, tensor_shape_pb2
        from tensorboard.plugins.text import plugin_data_pb2

        metadata = self._metadata("text", plugin_data_pb2.TextPluginData(version=0).SerializeToString())
        tensor = tensor_pb2.TensorProto(
            dtype="DT_STRING",
            string_val=[_utf8(text)],
            tensor_shape=tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=1)]),
        )
        value = self._summary_pb2.Summary.Value(tag=_text(f"{tag}/text_summary"), metadata=metadata, tensor=tensor)
        self._summary(step, value)

    def hparams(self, values: dict[str, float | str], step: int) -> None:
        """The run's hyperparameters (the HParams tab's session start: numbers and strings)."""
        from tensorboard.plugins.hparams import plugin_data_pb2

        start = plugin_data_pb2.SessionStartInfo(start_time_secs=time.time())
        for key, value in values.items():
            if isinstance(value, str):
                start.hparams[_text(key)].string_value = _text(value)
            else:
                start.hparams[_text(key)].number_value = float(value)
        content = plugin_data_pb2.HParamsPluginData(version=0, session_start_info=start).SerializeToString()
        metadata = self._metadata(HPARAMS_PLUGIN, content)
        self._summary(step, self._summary_pb2.Summary.Value(tag=SESSION_START_TAG, metadata=metadata))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    @property
    def _summary_pb2(self) -> Any:
        from tensorboard.compat.proto import summary_pb2

        return summary_pb2

    def _metadata(self, plugin: str, content: bytes) -> Any:
        plugin_data = self._summary_pb2.SummaryMetadata.PluginData(plugin_name=plugin, content=content)
        return self._summary_pb2.SummaryMetadata(plugin_data=plugin_data)

    def _summary(self, step: int, value: Any) -> None:
        summary = self._summary_pb2.Summary(value=[value]).SerializeToString()
        self._write(_event(time.time(), step, summary=summary))

    def _write(self, data: bytes) -> None:
        header = struct.pack("<Q", len(data))
        self._file.write(
            header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data))
        )


# -------------------------------------------------------------------------- protocol buffers' wire format

_VARINT, _FIXED64, _LENGTH, _FIXED32 = 0, 1, 2, 5
"""The wire types of the fields written here."""


def _event(wall_time: float, step: int, *, file_version: str = "", summary: bytes = b"") -> bytes:
    """A serialized ``Event``: ``wall_time`` (1, double), ``step`` (2, int64), ``file_version`` (3, string),
    ``summary`` (5, a serialized ``Summary``); fields at their default value are left out, as protobuf does."""
    data = _key(1, _FIXED64) + struct.pack("<d", wall_time)
    if step:
        data += _key(2, _VARINT) + _varint(step & 0xFFFFFFFFFFFFFFFF)  # int64: a negative one in ten bytes
    if file_version:
        data += _string(3, file_version)
    if summary:
        data += _bytes(5, summary)
    return data


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _string(field: int, text: str) -> bytes:
    return _bytes(field, _utf8(text))


def _utf8(text: str) -> bytes:
    """``text`` as UTF-8, a character UTF-8 cannot hold (a lone surrogate: a name decoded from bad bytes) as ``?``:
    event files hold UTF-8 strings, and one odd metric name must not end the run's event file."""
    return text.encode("utf-8", "replace")


def _text(text: str) -> str:
    """``text`` as a string protocol buffers take (see :func:`_utf8`)."""
    return _utf8(text).decode("utf-8")


def _bytes(field: int, data: bytes) -> bytes:
    return _key(field, _LENGTH) + _varint(len(data)) + data


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
