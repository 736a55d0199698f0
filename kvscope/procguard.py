"""Run a program that dies with the process that started it:
`python -m kvscope.procguard PARENT_PID [--group] -- PROGRAM ARGS...`.

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) survives execve, so setting it here and then exec'ing the real
program (mooncake_master, a store client) makes the kernel SIGKILL that program when kvscope dies, even by SIGKILL,
where no cleanup code of kvscope's can run. Doing this in a separate exec step rather than in a `preexec_fn` keeps
Python code out of the forked child of a multi-threaded parent (the service).

`--group` is for programs that start processes of their own (vLLM's engine core and workers), which the signal does
not reach: this process stays, as the leader of the group they all share, runs the program as its child, and when
kvscope dies (the signal is then SIGTERM, so this process can act on it) or stops it, passes SIGTERM on, waits a
moment, and kills whatever of the group is left.

The signal follows the *thread* that forked the child: kvscope starts and stops its processes from one thread that
outlives them (the CLI's main thread, or the A/B's own thread in the service).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1
GRACE_S = 20.0  # how long a program stopped by SIGTERM may take before its group is killed
WAIT_STEP_S = 0.2  # how often the supervisor looks whether a stopped program's grace is over


def _arm(parent: int, signum: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        sys.exit(f"procguard: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the parent died before the signal was armed: do not start at all
        sys.exit("procguard: the parent process is gone")


def _kill_the_rest_of_the_group() -> None:
    """SIGKILL every other process of this process group (found in /proc)."""
    group, me = os.getpgrp(), os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry.name), signal.SIGKILL)


def _supervise(program: list[str]) -> int:
    """Run `program` to its end; on SIGTERM or SIGINT pass SIGTERM on and give it GRACE_S to end. The handler only
    signals and notes the time: it runs inside the main loop's wait, which holds the child's wait lock (a wait in
    the handler could not see the child end and would sit out its whole timeout)."""
    child = subprocess.Popen(program)
    stopped: list[tuple[int, float]] = []  # (signal, when)

    def stop(signum: int, _frame: object) -> None:
        if not stopped:
            stopped.append((signum, time.monotonic()))
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code: int | None = None
    while code is None and not (stopped and time.monotonic() - stopped[0][1] > GRACE_S):
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = child.wait(WAIT_STEP_S)
    _kill_the_rest_of_the_group()  # what the program left behind, or the program itself past its grace
    if stopped:
        return 128 + stopped[0][0]
    assert code is not None
    return code


def main(argv: list[str]) -> None:
    group = "--group" in argv[1:2]
    rest = argv[2:] if group else argv[1:]
    if len(argv) < 2 or not rest or rest[0] != "--" or len(rest) < 2:
        sys.exit("usage: python -m kvscope.procguard PARENT_PID [--group] -- PROGRAM [ARGS...]")
    parent, program = int(argv[0]), rest[1:]
    if group:
        _arm(parent, signal.SIGTERM)
        sys.exit(_supervise(program))
    _arm(parent, signal.SIGKILL)
    os.execvp(program[0], program)


if __name__ == "__main__":
    main(sys.argv[1:])
