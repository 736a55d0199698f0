"""The RDMA source's transport: sysfs attribute files kept open and re-read with pread, and the directory
listings of the tree. No parsing (exporters/rdma_text.py) and no layout (exporters/rdma.py, whose docstring says
when the tree is listed again and which failures are read errors).
"""

from __future__ import annotations

import errno
import os
import resource
import stat
from typing import Protocol

from kvscope.exporters.base import ReadErrorReason


class Reporter(Protocol):
    """Where a failed read is reported (the scan in progress)."""

    def error(self, reason: ReadErrorReason, path: str, detail: str) -> None: ...


# Read errors that mean the file (or its whole device) went away: sysfs answers ENODEV on a descriptor whose
# attribute was removed, when the device was unregistered (and perhaps registered again under the same name).
_GONE = frozenset({errno.ENODEV, errno.ENOENT, errno.ESTALE})


_READ_SIZE = 65536  # a sysfs attribute is at most one page (64 KiB on some arm64 and ppc64 kernels)


class Stale(Exception):
    """The tree changed under the layout (a device went away, a netdev was renamed): it is listed again. `path`:
    the file that answered ENODEV or ENOENT, if that is how it showed."""

    def __init__(self, detail: str, path: str | None = None) -> None:
        super().__init__(detail)
        self.path = path


class NotAFile(OSError):
    """Not a regular file (a FIFO, a device, a directory): never read, as its read could block."""


class Attr:
    """One attribute file, kept open.

    sysfs regenerates an attribute's text on every read at offset 0, so a descriptor opened once and re-read with
    pread gives the current value for one syscall instead of three (open, read, close). Past the descriptor budget
    (fd -1) the file is opened on every read instead.
    """

    __slots__ = ("fd", "path", "seen")

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd
        self.seen = False  # read once: from then on, ENODEV or ENOENT means the file went away

    def read(self, scan: Reporter) -> bytes | None:
        """The file's bytes; None when it cannot be read (EINVAL, EIO, EACCES, a FIFO, ...), which is a read error of
        `scan`. Stale when a file read before is gone (a file that never could be read is only reported, so it
        cannot make every scrape list the tree again)."""
        try:
            data = os.pread(self.fd, _READ_SIZE, 0) if self.fd >= 0 else read_bytes(self.path)
        except NotAFile as error:
            scan.error("not_a_file", self.path, error.strerror or "not a regular file")
            return None
        except OSError as error:
            if self.seen and error.errno in _GONE:
                raise Stale(f"{self.path}: {error.strerror}", self.path) from None
            scan.error("unreadable", self.path, error.strerror or type(error).__name__)
            return None
        self.seen = True
        return data


class Files:
    """The descriptors a collector holds, at most FD_SHARE of the soft limit: the process shares that limit with
    every other target's connections."""

    def __init__(self, share: float) -> None:
        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._budget = int((soft if soft != resource.RLIM_INFINITY else 1 << 20) * share)
        self._fds: list[int] = []
        self.paths: set[str] = set()  # every file of the listing, open or opened on every read

    def open(self, path: str, listed: bool = True) -> Attr | None:
        """The file as an Attr. A file that cannot be opened (EACCES, not a regular file, gone since it was
        listed, no descriptor to spare) is opened on every read instead, so that each read reports why it fails.
        An optional attribute (`listed` False: a name the kernel may not have, such as board_id) that does not
        exist is None."""
        if not listed and not os.path.lexists(path):
            return None
        self.paths.add(path)
        if len(self._fds) >= self._budget:
            return Attr(path, -1)
        try:
            fd = open_regular(path)
        except OSError:
            return Attr(path, -1)
        self._fds.append(fd)
        return Attr(path, fd)

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()
        self.paths.clear()


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file `path`; NotAFile for a FIFO, a device or a directory (opened
    with O_NONBLOCK, so a FIFO with no writer does not block the open, and never read)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "a device or socket"
        raise NotAFile(errno.EINVAL, f"not a regular file: {kind}")
    return fd


def read_bytes(path: str) -> bytes:
    """One read of a regular file by path (os.open/os.read: the io stack's buffered wrappers cost more)."""
    fd = open_regular(path)
    try:
        return os.read(fd, _READ_SIZE)
    finally:
        os.close(fd)


def read_text(path: str) -> str | None:
    """The file's text, stripped; None when it cannot be read (missing, EINVAL, EIO, EACCES, not text)."""
    try:
        return read_bytes(path).decode().strip()
    except (OSError, UnicodeDecodeError):
        return None


def list_files(directory: str, broken: list) -> list[tuple[str, str]]:
    """(name, path) of the entries of `directory` that are not directories, by name: files, and also FIFOs and
    dangling links, which the read reports. A directory that does not exist has none (counters_ext/ and
    hw_counters/ are optional); one that cannot be listed is added to `broken`."""
    try:
        with os.scandir(directory) as entries:  # DirEntry.is_dir needs no stat for regular files
            return sorted((entry.name, entry.path) for entry in entries if not entry.is_dir())
    except FileNotFoundError:
        return []
    except OSError as error:
        broken.append(("unreadable", directory, error.strerror or type(error).__name__))
        return []


def unlistable(directory: str) -> str | None:
    """Why `directory` cannot be listed (a dangling link, EACCES, not a directory); None when it can."""
    try:
        with os.scandir(directory):
            return None
    except FileNotFoundError:
        return "no such directory (a dangling link?)"
    except OSError as error:
        return error.strerror or type(error).__name__


def subdirs(directory: str, broken: list) -> list[str]:
    """The names of the subdirectories (ports), numbers first, in numeric order."""
    try:
        with os.scandir(directory) as entries:
            names = [entry.name for entry in entries if entry.is_dir()]
    except FileNotFoundError:
        return []
    except OSError as error:
        broken.append(("unreadable", directory, error.strerror or type(error).__name__))
        return []
    return sorted(names, key=lambda name: (not name.isdigit(), int(name) if name.isdigit() else 0))


def by_index(directory: str) -> list[str]:
    try:
        names = [name for name in os.listdir(directory) if name.isdigit()]
    except OSError:
        return []
    return [os.path.join(directory, name) for name in sorted(names, key=int)]
