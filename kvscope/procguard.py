"""Exec a program that dies with the process that started it: `python -m kvscope.procguard PARENT_PID -- ARGV...`.

Linux's parent-death signal (prctl PR_SET_PDEATHSIG) survives execve, so setting it here and then exec'ing the real
program (mooncake_master, a store client, a vLLM server) makes the kernel SIGKILL that program when kvscope dies, even
by SIGKILL, where no cleanup code of kvscope's can run. Doing this in a separate exec step rather than in a
`preexec_fn` keeps Python code out of the forked child of a multi-threaded parent (the service).

The signal follows the *thread* that forked the child: kvscope starts and stops its processes from one thread that
outlives them (the CLI's main thread, or the A/B's own thread in the service).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--":
        sys.exit("usage: python -m kvscope.procguard PARENT_PID -- PROGRAM [ARGS...]")
    parent = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        sys.exit(f"procguard: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(ctypes.get_errno())}")
    if os.getppid() != parent:  # the parent died before the signal was armed: do not start at all
        sys.exit("procguard: the parent process is gone")
    os.execvp(argv[2], argv[2:])


if __name__ == "__main__":
    main(sys.argv[1:])
