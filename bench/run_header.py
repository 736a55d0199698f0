"""The first lines of every benchmark's output: the command and the machine, so that a figure can be traced to the
run that printed it."""

from __future__ import annotations

import os
import shlex
import sys
import time


def print_run_header() -> None:
    print(f"command: {shlex.join([sys.executable, *sys.argv])}")
    print(f"python {sys.version.split()[0]} on {os.cpu_count()} CPUs; {time.strftime('%Y-%m-%d %H:%M:%S')}")
