"""Where a tier's bytes live: nowhere (accounting), in preallocated memory slabs, or in a file.

The accounting backend is the simulation default: tiers of terabytes cost nothing. The real-bytes backends
store every block in a fixed-size slot and keep an XXH3-64 checksum per block; every read verifies it and raises
`CorruptBlockError` on a mismatch, so a flipped byte can never pass as a cache hit.
"""

from __future__ import annotations

import mmap
import os
from abc import ABC, abstractmethod
from collections.abc import Hashable
from pathlib import Path
from typing import ClassVar

import xxhash

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

    def verify(self, key: Key) -> None:
        """Read `key`'s bytes and check them, without handing them out (what serving a hit needs)."""
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
        self._where: dict[Key, tuple[int, int, int]] = {}  # key -> (slot, length, checksum)

    def store(self, key: Key, payload: bytes | memoryview) -> None:
        if len(payload) > self.slot_bytes:
            raise ValueError(f"block of {len(payload)} B does not fit a {self.slot_bytes} B slot")
        if key in self._where:
            self.drop(key)
        if not self._free:
            raise MemoryError(f"{self.name} backend full: all {self.slots} slots in use")
        slot = self._free.pop()
        self._write(slot, payload)
        self._where[key] = (slot, len(payload), checksum(payload))

    def load(self, key: Key) -> bytes:
        return bytes(self._checked_view(key))

    def verify(self, key: Key) -> None:
        self._checked_view(key)

    def drop(self, key: Key) -> None:
        where = self._where.pop(key, None)
        if where is not None:
            self._free.append(where[0])

    def _checked_view(self, key: Key) -> memoryview:
        slot, length, expected = self._where[key]
        data = self._view(slot, length)
        if checksum(data) != expected:
            raise CorruptBlockError(f"{self.name} backend: block {key!r} in slot {slot} fails its checksum")
        return data

    @abstractmethod
    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        """Put `payload` at the start of `slot`."""

    @abstractmethod
    def _view(self, slot: int, length: int) -> memoryview:
        """The first `length` bytes of `slot`, valid until the next call (no copy where the medium allows)."""


class MemoryBackend(_SlottedBackend):
    """Real bytes in one preallocated anonymous mapping, cut into slots."""

    name = "memory"

    def __init__(self, capacity: int, slot_bytes: int) -> None:
        super().__init__(capacity, slot_bytes)
        self._slab = mmap.mmap(-1, max(self.slots * slot_bytes, 1))
        self._slab_view = memoryview(self._slab)

    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        offset = slot * self.slot_bytes
        self._slab[offset : offset + len(payload)] = payload

    def _view(self, slot: int, length: int) -> memoryview:
        offset = slot * self.slot_bytes
        return self._slab_view[offset : offset + length]

    def close(self) -> None:
        self._slab_view.release()
        self._slab.close()


class FileBackend(_SlottedBackend):
    """Real bytes in one file, written with pwrite; with `direct=True` the page cache is bypassed (O_DIRECT).

    Buffered reads check the bytes where they lie, in a read-only shared mapping of the file (no copy: the page
    cache is the buffer, so a hit costs the checksum alone). O_DIRECT reads land in one reused page-aligned
    buffer (no allocation per block); slot sizes must then be multiples of 4 KiB.
    """

    name = "file"

    def __init__(self, capacity: int, slot_bytes: int, path: str | Path, direct: bool = False) -> None:
        if direct and slot_bytes % DIRECT_IO_ALIGNMENT:
            raise ValueError(f"o_direct needs a block size that is a multiple of {DIRECT_IO_ALIGNMENT} B: {slot_bytes}")
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
        self._size = self.slots * slot_bytes
        os.ftruncate(self._fd, self._size)
        self._direct = direct
        self._buffer = mmap.mmap(-1, slot_bytes)
        self._buffer_view = memoryview(self._buffer)
        self._mapping = None if direct or not self._size else mmap.mmap(self._fd, self._size, prot=mmap.PROT_READ)
        self._mapping_view = memoryview(self._mapping) if self._mapping else None

    def _write(self, slot: int, payload: bytes | memoryview) -> None:
        offset = slot * self.slot_bytes
        if self._direct:  # O_DIRECT writes whole aligned slots from the aligned buffer
            self._buffer[: len(payload)] = payload
            written, wanted = os.pwritev(self._fd, [self._buffer], offset), self.slot_bytes
        else:
            written, wanted = os.pwrite(self._fd, payload, offset), len(payload)
        if written < wanted:
            raise OSError(f"short write to {self.path} at offset {offset}: {written} of {wanted} B")

    def _view(self, slot: int, length: int) -> memoryview:
        offset = slot * self.slot_bytes
        if self._mapping_view is not None:
            # A mapped page beyond the end of a file someone truncated would kill the process (SIGBUS): check.
            if os.fstat(self._fd).st_size < self._size:
                raise OSError(f"{self.path} was truncated below its {self._size} B behind the backend's back")
            return self._mapping_view[offset : offset + length]
        read = os.preadv(self._fd, [self._buffer_view], offset)
        if read < length:
            raise OSError(f"short read from {self.path} at offset {offset}: {read} of {length} B")
        return self._buffer_view[:length]

    def drop_page_cache(self) -> None:
        """Flush the file and evict its pages from the page cache, so the next reads come from the medium (what a
        cold-cache measurement needs). The read mapping lets go of its pages first: the kernel keeps mapped ones."""
        os.fsync(self._fd)
        if self._mapping is not None:
            self._mapping.madvise(mmap.MADV_DONTNEED)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self._mapping is not None:
            self._mapping_view.release()  # type: ignore[union-attr]
            self._mapping.close()
        os.close(self._fd)
        self._buffer_view.release()
        self._buffer.close()


def checksum(data: bytes | memoryview) -> int:
    """XXH3-64 of a block: detects any flipped byte, and at several GB/s it costs a hit less than a copy."""
    return xxhash.xxh3_64_intdigest(data)


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
