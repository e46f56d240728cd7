"""The examples an incremental run processes: a bit per dataset index, and its batches.

An incremental run (DESIGN §21) processes the examples its planner selected (new, changed, failed before, or all
under a new fingerprint). :class:`Selection` keeps them as a bitmap of the dataset's indices, one bit each (10**8
examples: 12.5 MB), with the count of selected examples before every block of :data:`BLOCK_BITS` bits, so that
batch ``g`` of ``B`` examples (the selected examples of ranks ``[g*B, (g+1)*B)`` in index order) is found without
a pass over the bitmap: :meth:`Selection.take`. It is stored as one file with the run (:meth:`Selection.to_bytes`),
so that every rank and every resume, on any world size, cuts the same batches.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator

import numpy as np

from torch_batch_process.errors import CheckpointCorruptError

__all__ = ["BLOCK_BITS", "Selection"]

BLOCK_BITS = 1 << 15
"""Bits per block of the count index."""

_MAGIC = b"TBPSEL1\n"
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


class Selection:
    """Selected dataset indices among ``size`` (see the module docstring)."""

    def __init__(self, size: int, bits: np.ndarray | None = None) -> None:
        self.size = int(size)
        nbytes = -(-self.size // 8)
        self.bits = np.zeros(nbytes, np.uint8) if bits is None else bits
        self._before: np.ndarray | None = None

    def add(self, indices: np.ndarray) -> None:
        """Selects ``indices`` (an integer array of dataset indices)."""
        indices = np.asarray(indices, np.int64)
        if len(indices) == 0:
            return
        if indices.min() < 0 or indices.max() >= self.size:
            raise IndexError(f"selected index out of range 0..{self.size - 1}")
        np.bitwise_or.at(self.bits, indices >> 3, (np.uint8(128) >> (indices & 7).astype(np.uint8)))
        self._before = None

    def _counts(self) -> np.ndarray:
        """Selected indices before each block (and the total, last)."""
        if self._before is None:
            block = BLOCK_BITS // 8
            padded = np.zeros(-(-len(self.bits) // block) * block, np.uint8)
            padded[: len(self.bits)] = self.bits
            per_block = _POPCOUNT[padded].reshape(-1, block).sum(axis=1, dtype=np.int64)
            self._before = np.concatenate((np.zeros(1, np.int64), np.cumsum(per_block)))
        return self._before

    @property
    def count(self) -> int:
        """Selected indices."""
        return int(self._counts()[-1])

    def __contains__(self, index: int) -> bool:
        return 0 <= index < self.size and bool(self.bits[index >> 3] & (128 >> (index & 7)))

    def take(self, first: int, count: int) -> np.ndarray:
        """The selected indices of ranks ``[first, first + count)`` (in index order), ascending."""
        before = self._counts()
        total = int(before[-1])
        first, stop = max(0, first), min(total, first + count)
        if first >= stop:
            return np.zeros(0, np.int64)
        block = int(np.searchsorted(before, first, side="right")) - 1
        found: list[np.ndarray] = []
        have, rank = 0, int(before[block])
        step = BLOCK_BITS // 8
        while have < stop - first:
            chunk = self.bits[block * step : (block + 1) * step]
            ones = np.flatnonzero(np.unpackbits(chunk)) + block * BLOCK_BITS
            skip = max(0, first - rank)
            part = ones[skip : skip + (stop - first - have)]
            found.append(part)
            have += len(part)
            rank += len(ones)
            block += 1
        return np.concatenate(found)

    def chunks(self, rows: int = 1 << 20) -> Iterator[np.ndarray]:
        """Every selected index, ascending, in arrays of at most ``rows``."""
        for first in range(0, self.count, rows):
            yield self.take(first, rows)

    def digest(self) -> str:
        """A short digest of the selection (part of the run's fingerprint)."""
        return hashlib.sha256(struct.pack("<Q", self.size) + self.bits.tobytes()).hexdigest()[:16]

    def to_bytes(self) -> bytes:
        return _MAGIC + struct.pack("<Q", self.size) + self.bits.tobytes()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Selection:
        head = len(_MAGIC) + 8
        if data[: len(_MAGIC)] != _MAGIC or len(data) < head:
            raise CheckpointCorruptError(f"{where} is not a selection of examples (damaged)")
        (size,) = struct.unpack("<Q", data[len(_MAGIC) : head])
        bits = np.frombuffer(data, np.uint8, offset=head).copy()
        if len(bits) != -(-size // 8):
            raise CheckpointCorruptError(f"{where}: a selection of {size} examples cut short (damaged)")
        return cls(size, bits)
