"""kvscope's own processes: a program run under `kvscope.procguard --group` (vLLM's server, which starts processes
of its own) stops with its whole group when kvscope stops it, as soon as it has ended."""

from __future__ import annotations

import sys
import time

from support.proctree import alive, descendants

from kvscope.processes import OwnedProcess
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
