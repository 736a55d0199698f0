"""Processes kvscope starts and owns (a Mooncake master and store client per A/B arm, later engines): started on
127.0.0.1 with free ports, killed by the kernel if kvscope dies (kvscope.procguard), stopped in order, their logs
kept for the error message of a failed start, and their listening sockets read from the kernel's socket table.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

HOST = "127.0.0.1"
T = TypeVar("T")


class ProcessError(RuntimeError):
    """A process kvscope started failed to start or died; the message names it and ends with its log's tail."""


_handed_out: set[int] = set()  # every port free_port gave this process
_handed_out_lock = threading.Lock()
FREE_PORT_TRIES = 1000


def free_port(host: str = HOST) -> int:
    """A TCP port of `host` that nothing listens on just now and that this process has not been given before: the
    kernel soon hands a port that was just closed out again, and two servers started at once on one port both
    listen and split its connections between them (two A/B arms talking to one engine)."""
    with _handed_out_lock:
        for _ in range(FREE_PORT_TRIES):
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port
    raise ProcessError(f"no port of {host} that kvscope has not used already in {FREE_PORT_TRIES} tries")


def port_listens(port: int, host: str = HOST) -> bool:
    """Whether a TCP connect to host:port succeeds (something accepts there)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


class OwnedProcess:
    """One child program: dies with kvscope (parent-death signal), runs in its own session (a terminal's Ctrl-C
    reaches kvscope, which stops it in order), writes stdout and stderr to `log`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        pipe_stdin: bool = False,
        pipe_stdout: bool = False,
        group: bool = False,
    ) -> None:
        """`group`: the program starts processes of its own, which must die with it (kvscope.procguard --group)."""
        self.name, self.argv, self.log = name, list(argv), log
        # local wall time, as the program's own log lines give it (glog's name no year: they follow from this)
        self.started = datetime.datetime.now()
        self._log_read = 0  # bytes of the log new_log_lines() has handed out or holds back as a partial line
        self._log_partial = b""
        guard = [sys.executable, "-m", "kvscope.procguard", str(os.getpid()), *(["--group"] if group else []), "--"]
        self._log_file = log.open("ab")
        try:
            self.popen = subprocess.Popen(
                guard + self.argv,
                stdin=subprocess.PIPE if pipe_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipe_stdout else self._log_file,
                stderr=self._log_file,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
            )
        except OSError as error:
            self._log_file.close()
            raise ProcessError(f"{name}: cannot start {self.argv[0]}: {error.strerror}") from None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def check_alive(self) -> None:
        """ProcessError with the log's tail if the process has exited."""
        if not self.alive():
            raise ProcessError(f"{self.name} exited with status {self.popen.returncode}\n{self.tail()}")

    def tail(self, lines: int = 20, containing: str | None = None) -> str:
        """The last lines of the log (only those `containing` a word, e.g. ERROR, when given), for error messages."""
        self._log_file.flush()
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        chosen = [line for line in text.splitlines() if containing is None or containing in line]
        return "\n".join(f"  | {line}" for line in chosen[-lines:])

    def new_log_lines(self) -> list[str]:
        """The complete lines the log gained since the last call (a last line still being written waits for the
        next), so a log followed round after round costs what it grew, not its whole size each time."""
        try:
            with self.log.open("rb") as log:
                log.seek(self._log_read)
                grown = log.read()
        except OSError:
            return []
        self._log_read += len(grown)
        complete, _, self._log_partial = (self._log_partial + grown).rpartition(b"\n")
        return complete.decode(errors="replace").splitlines()

    def stop(self, timeout_s: float = 10.0) -> int:
        """SIGTERM, then SIGKILL after `timeout_s`, to the process's whole group (a server's own worker processes
        too); the exit status. Safe to call twice."""
        if self.alive():
            self._signal_group(signal.SIGTERM)
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.popen.wait(timeout_s)
        self._signal_group(signal.SIGKILL)  # whatever of the group outlived its leader
        for stream in (self.popen.stdin, self.popen.stdout):
            if stream:
                stream.close()
        self._log_file.close()
        return self.popen.returncode

    def _signal_group(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signum)  # its own session (start_new_session), so its group is its pid

    def listening(self) -> list[Listener]:
        """The TCP sockets this process and the processes it started listen on, now."""
        return _listeners_of(self._socket_inodes())

    def unix_listening(self) -> list[str]:
        """The paths of the Unix sockets this process and the processes it started listen on, now (`@name` for an
        abstract one). A path outlives an unlink: a socket whose file another process replaced still shows it."""
        inodes = self._socket_inodes()
        return sorted({path for path, inode in _unix_listen_table() if inode in inodes})

    def _socket_inodes(self) -> set[str]:
        """The sockets this process and the processes it started hold open."""
        return {inode for pid in [self.pid, *_descendants(self.pid)] for inode in _socket_inodes(pid)}

    def wait_listening(self, port: int, timeout_s: float) -> None:
        """Until this process (or one it started) listens on `port`; ProcessError as soon as it has exited, or when
        a process kvscope did not start listens there too (a port is free only until someone binds it, and two
        sockets bound before either listens may both listen), rather than talk to that process unawares."""

        def listens() -> bool:
            holders = port_listeners(port)  # read first: a socket of ours that opens in between is still ours
            if not holders:
                return False
            if holders - self._socket_inodes():
                raise ProcessError(
                    f"{self.name}: port {port}, handed out as free, is listened on by another process too\n"
                    f"{self.tail()}"
                )
            return True

        wait_until(listens, f"{self.name} to listen on port {port}", timeout_s, [self])

    def peak_rss_bytes(self) -> int | None:
        """The most resident memory the process has had (the kernel's VmHWM); None once it is gone."""
        return _peak_rss(self.pid)

    def peak_rss_by_process(self) -> dict[str, int]:
        """Each living process of the tree (this one and the processes it started), by `pid name`: its peak
        resident memory. Their sum bounds the tree's peak from above (the peaks need not have coincided)."""
        peaks = {}
        for pid in [self.pid, *_descendants(self.pid)]:
            if (peak := _peak_rss(pid)) is not None:
                with contextlib.suppress(OSError):
                    peaks[f"{pid} {Path(f'/proc/{pid}/comm').read_text().strip()}"] = peak
        return peaks


def owned_directory(prefix: str) -> Path:
    """A new empty temporary directory for the files of kvscope's processes, marked with kvscope's pid; first the
    ones with this prefix that a killed kvscope left (its processes died with it, their files did not) are removed."""
    for directory in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        try:
            owner = int((directory / "owner.pid").read_text())
        except (OSError, ValueError):
            continue
        if not Path(f"/proc/{owner}").exists():
            shutil.rmtree(directory, ignore_errors=True)
    directory = Path(tempfile.mkdtemp(prefix=prefix))
    (directory / "owner.pid").write_text(str(os.getpid()))
    return directory


def wait_until(check: Callable[[], T], what: str, timeout_s: float, watch: Sequence[OwnedProcess] = ()) -> T:
    """Poll `check` until it returns something truthy; ProcessError naming `what` after `timeout_s`, or as soon as
    one of `watch` exits (with that process's log)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.01
    while True:
        for process in watch:
            process.check_alive()
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            logs = "\n".join(f"{process.name}:\n{process.tail()}" for process in watch)
            raise ProcessError(f"timed out after {timeout_s:g} s waiting for {what}\n{logs}".rstrip())
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


# ------------------------------------------------------------------------------------------------ socket table


@dataclass(frozen=True, slots=True)
class Listener:
    """A listening TCP socket: its address as the kernel shows it (127.0.0.1, or the IPv4 or IPv6 wildcard when it
    listens on every interface) and port."""

    address: str
    port: int

    @property
    def loopback_only(self) -> bool:
        return self.address.startswith("127.") or self.address == "::1"

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if ":" in self.address else f"{self.address}:{self.port}"


_LISTEN = "0A"


def listening_sockets(pid: int) -> list[Listener]:
    """The TCP sockets process `pid` listens on, from /proc/net/tcp{,6} and its open file descriptors (all of its
    threads share them). Empty when the process is gone."""
    return _listeners_of(_socket_inodes(pid))


def _listeners_of(inodes: set[str]) -> list[Listener]:
    """The listening TCP sockets among the socket `inodes`, by port then address."""
    if not inodes:
        return []
    found = {listener for listener, inode in _listen_table() if inode in inodes}
    return sorted(found, key=lambda listener: (listener.port, listener.address))


def port_listeners(port: int) -> set[str]:
    """The socket inodes that listen on TCP `port` (any address), whichever process holds them."""
    return {inode for listener, inode in _listen_table() if listener.port == port}


def _listen_table() -> Iterator[tuple[Listener, str]]:
    """Every listening TCP socket of this network namespace and its inode, from /proc/net/tcp{,6}."""
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == _LISTEN:
                address, port = fields[1].split(":")
                yield Listener(_address(address, family), int(port, 16)), fields[9]


_ACCEPTING = 0x10000  # __SO_ACCEPTCON in /proc/net/unix's flags: a listening socket


def _unix_listen_table() -> Iterator[tuple[str, str]]:
    """Every listening Unix socket with a name, and its inode, from /proc/net/unix."""
    try:
        lines = Path("/proc/net/unix").read_text(errors="replace").splitlines()[1:]
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and int(fields[3], 16) & _ACCEPTING:
            yield fields[7], fields[6]


def _peak_rss(pid: int) -> int | None:
    """A process's VmHWM in bytes; None once it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    line = next((line for line in status.splitlines() if line.startswith("VmHWM:")), None)
    return int(line.split()[1]) * 1024 if line else None


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, from each thread's children list in /proc."""
    found: list[int] = []
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                children = Path(f"/proc/{current}/task/{task}/children").read_text().split()
            except OSError:
                continue
            found += map(int, children)
            pending += map(int, children)
    return found


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        entries = os.scandir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    with entries:
        for entry in entries:
            try:
                target = os.readlink(entry.path)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    return inodes


def _address(hex_address: str, family: int) -> str:
    """The kernel prints addresses as host-order 32-bit words in hex."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, words)
