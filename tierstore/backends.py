"""Where a tier's bytes live: nowhere (accounting), in preallocated memory slabs, or in a file.

The accounting backend is the simulation default: tiers of terabytes cost nothing. The real-bytes backends
store every block in a fixed-size slot and keep a CRC32 per block; every load verifies it and raises
`CorruptBlockError` on a mismatch, so a flipped byte can never pass as a cache hit.
"""

from __future__ import annotations

import mmap
import os
import zlib
from abc import ABC, abstractmethod
from collections.abc import Hashable
from pathlib import Path
from typing import ClassVar

Key = Hashable

DIRECT_IO_ALIGNMENT = 4096


class CorruptBlockError(RuntimeError):
    """A block's bytes no longer match the checksum taken when it was stored."""


class Backend:
    """Accounting only: blocks have sizes but no bytes. The interface every backend implements."""

    name: ClassVar[str] = "accounting"
    holds_bytes: ClassVar[bool] = False

    def store(self, key: Key, payload: bytes | memoryview) -> None:
        """Keep `payload` as the bytes of `key`."""

    def load(self, key: Key) -> bytes:
        """The bytes stored for `key`, verified against their checksum."""
        raise KeyError(key)

    def drop(self, key: Key) -> None:
        """Forget `key` and free its slot."""

    def close(self) -> None:
        """Release memory or file handles."""


class _SlottedBackend(Backend, ABC):
    """Fixed-size slots with a free list and a checksum per block; subclasses move the bytes."""

    holds_bytes = True

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot size must be positive, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.slots = capacity // slot_bytes
        self._free = list(range(self.slots - 1, -1, -1))
        self._where: dict[Key, tuple[int, int, int]] = {}  # key -> (slot, length, crc32)

    def store(self, key: Key, payload: bytes | memoryview) -> None:
        if len(payload) > self.slot_bytes:
            raise ValueError(f"block of {len(payload)} B does not fit a {self.slot_bytes} B slot")
        if key in self._where:
            self.drop(key)
        if not self._free:
            raise MemoryError(f"{self.name} backend full: all {self.slots} slots in use")
        slot = self._free.pop()
        self._write(slot, payload)
        self._where[key] = (slot, len(payload), zlib.crc32(payload))

    def load(self, key: Key) -> bytes:
        slot, length, crc = self._where[key]
        data = self._read(slot, length)
        if zlib.crc32(data) != crc:
            raise CorruptBlockError(f"{self.name} backend: block {key!r} in slot {slot} fails its CRC32 check")
        return data

    def drop(self, key: Key) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            self._free.append(where[0])

    @abstractmethod
    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        """Put `payload` at the start of `slot`."""

    @abstractmethod
    def _read(self, slot: int, length: int) -> bytes:
        """The first `length` bytes of `slot`."""


class MemoryBackend(_SlottedBackend):
    """Real bytes in one preallocated anonymous mapping, cut into slots."""

    name = "memory"

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        super().__init__(capacity, slot_bytes)
        self._slab = mmap.mmap(-1, max(self.slots * slot_bytes, 1))

    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        offset = slot * self.slot_bytes
        self._slab[offset : offset + len(payload)] = payload

    def _read(self, slot: int, length: int) -> bytes:
        offset = slot * self.slot_bytes
        return self._slab[offset : offset + length]

    def close(self) -> None:
        self._slab.close()


class FileBackend(_SlottedBackend):
    """Real bytes in one file with pread/pwrite; with `direct=True` the page cache is bypassed (O_DIRECT).

    O_DIRECT needs slot sizes and buffers aligned to 4 KiB; buffers come from mmap, which is page aligned.
    """

    name = "file"

    def __init__(self, capacity: int, slot_bytes: int, path: str | Path, direct: bool = False) -> None:
        if direct and slot_bytes % DIRECT_IO_ALIGNMENT:
            raise ValueError(
                f"o_direct needs a block size that is a multiple of {DIRECT_IO_ALIGNMENT} B, got {slot_bytes}"
            )
        super().__init__(capacity, slot_bytes)
        self.path = Path(path)
        flags = os.O_RDWR | os.O_CREAT
        if direct:
            if not hasattr(os, "O_DIRECT"):
                raise OSError("o_direct is not available on this platform")
            flags |= os.O_DIRECT
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as error:
            raise OSError(f"cannot open file backend {self.path} (o_direct={direct}): {error.strerror}") from error
        os.ftruncate(self._fd, self.slots * slot_bytes)
        self._direct = direct
        self._buffer = mmap.mmap(-1, slot_bytes) if direct else None

    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        offset = slot * self.slot_bytes
        if self._buffer is None:
            written = os.pwrite(self._fd, payload, offset)
        else:
            self._buffer[: len(payload)] = payload
            written = os.pwritev(self._fd, [self._buffer], offset)
        if written < len(payload):
            raise OSError(f"short write to {self.path} at offset {offset}: {written} of {len(payload)} B")

    def _read(self, slot: int, length: int) -> bytes:
        offset = slot * self.slot_bytes
        if self._buffer is None:
            return os.pread(self._fd, length, offset)
        os.preadv(self._fd, [self._buffer], offset)
        return self._buffer[:length]

    def close(self) -> None:
        os.close(self._fd)
        if self._buffer is not None:
            self._buffer.close()


BACKENDS = ("accounting", "memory", "file")


def make_backend(
    name: str, capacity: int, slot_bytes: int, path: str | Path | None = None, direct: bool = False
) -> Backend:
    """A backend by name; `path` is required for `file`."""
    if name == "accounting":
        return Backend()
    if name == "memory":
        return MemoryBackend(capacity, slot_bytes)
    if name == "file":
        if path is None:
            raise ValueError("the file backend needs a path")
        return FileBackend(capacity, slot_bytes, path, direct)
    raise ValueError(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
