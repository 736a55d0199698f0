"""kvscope's own processes: a program run under `kvscope.procguard --group` (vLLM's server, which starts processes
of its own) stops with its whole group when kvscope stops it, as soon as it has ended; the ports they are given are
theirs alone, and a server counts as listening only on a socket of its own."""

from __future__ import annotations

import socket
import sys
import time

import pytest
from support.proctree import alive, descendants

from kvscope.processes import HOST, OwnedProcess, ProcessError, free_port, wait_until
from kvscope.procguard import GRACE_S

# a program that starts a process of its own and ends on SIGTERM
PARENT_OF_ONE = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"


def test_a_stopped_group_ends_when_its_program_does_not_after_the_grace(tmp_path):
    process = OwnedProcess("parent", [sys.executable, "-c", PARENT_OF_ONE], tmp_path / "log", group=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(descendants(process.pid)) < 2:  # the program and its sleep
        time.sleep(0.05)
    group = descendants(process.pid)
    assert len(group) == 2
    started = time.monotonic()
    process.stop(timeout_s=GRACE_S + 10)
    # the supervisor passes SIGTERM on and returns once the program ended, its sleep killed with the group; a
    # supervisor that sat out its grace period took GRACE_S (it once did, for every vLLM server stopped)
    assert time.monotonic() - started < GRACE_S / 4
    assert not [pid for pid in [process.pid, *group] if alive(pid)]


def test_free_port_never_hands_out_a_port_twice():
    # the kernel soon reuses a port just closed: two arms once were given one port, and both of their servers
    # listened on it, so each arm's requests and scrapes reached either engine
    ports = [free_port() for _ in range(3000)]
    assert len(set(ports)) == len(ports)


# a program that starts one that listens on the port in argv[1]
PARENT_OF_A_LISTENER = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    '\'import socket, sys, time; s = socket.socket(); s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(); '
    "time.sleep(60)', sys.argv[1]]); time.sleep(60)"
)


def test_wait_listening_finds_the_socket_of_a_process_the_program_started(tmp_path):
    port = free_port()
    argv = [sys.executable, "-c", PARENT_OF_A_LISTENER, str(port)]
    process = OwnedProcess("parent", argv, tmp_path / "log", group=True)
    try:
        process.wait_listening(port, timeout_s=20)
    finally:
        process.stop()


def test_wait_listening_refuses_a_port_that_another_process_listens_on(tmp_path):
    port = free_port()
    process = OwnedProcess("sleeper", ["sleep", "60"], tmp_path / "log")
    try:
        with socket.socket() as taken:  # someone took the port between free_port and the program's bind
            taken.bind((HOST, port))
            taken.listen()
            with pytest.raises(ProcessError, match=f"sleeper: port {port}, handed out as free, is listened on by"):
                process.wait_listening(port, timeout_s=20)
    finally:
        process.stop()


def test_wait_listening_ends_when_the_program_exits(tmp_path):
    process = OwnedProcess("quitter", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path / "log")
    with pytest.raises(ProcessError, match="quitter exited with status 3"):
        process.wait_listening(free_port(), timeout_s=20)


# a program that starts a process of its own which, as vLLM's Mooncake connector does with its lookup socket,
# removes the file it finds at a path and listens there
PARENT_OF_A_UNIX_LISTENER = (
    "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    "'import os, socket, sys, time; os.path.exists(sys.argv[1]) and os.unlink(sys.argv[1]); "
    "s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(); "
    "c = socket.socket(socket.AF_UNIX); c.connect(sys.argv[1]); time.sleep(60)', sys.argv[1]]); time.sleep(60)"
)


def test_unix_listening_names_a_descendants_socket_also_once_another_process_took_its_path(tmp_path):
    """The path of a listening Unix socket a process's child holds (not the one it connected); a second program
    that replaces the file leaves the first listening on it, unlinked: both trees show the path."""
    path = str(tmp_path / "lookup.sock")
    first = OwnedProcess("first", [sys.executable, "-c", PARENT_OF_A_UNIX_LISTENER, path], tmp_path / "1", group=True)
    second = None
    try:
        wait_until(lambda: first.unix_listening() == [path], "the first listener", 20, [first])
        second = OwnedProcess("second", [sys.executable, "-c", PARENT_OF_A_UNIX_LISTENER, path], tmp_path / "2",
                              group=True)  # fmt: skip
        wait_until(lambda: second.unix_listening() == [path], "the second listener", 20, [second])
        assert first.unix_listening() == [path]
    finally:
        for process in (first, second):
            if process is not None:
                process.stop()
    assert first.unix_listening() == []


def test_new_log_lines_hands_out_each_complete_line_once_as_the_log_grows(tmp_path):
    """A log followed every round is read from where the last read stopped; a line still being written waits."""
    program = (
        "import sys, time; w = sys.stderr.write; w('one\\ntw'); sys.stderr.flush(); time.sleep(1); w('o\\nthree\\n');"
        " sys.stderr.flush(); time.sleep(60)"
    )
    process = OwnedProcess("writer", [sys.executable, "-c", program], tmp_path / "log")
    try:
        wait_until(lambda: (tmp_path / "log").read_bytes().endswith(b"tw"), "the first write", 20, [process])
        assert process.new_log_lines() == ["one"]
        assert process.new_log_lines() == []
        wait_until(lambda: (tmp_path / "log").read_bytes().endswith(b"three\n"), "the second write", 20, [process])
        assert process.new_log_lines() == ["two", "three"]
        assert process.new_log_lines() == []
    finally:
        process.stop()
