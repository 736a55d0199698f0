"""The exporter's own process_* series, as prometheus_client's default ProcessCollector serves them, read cheaply.

prometheus_client's collector lists /proc/self/fd to count open descriptors and reads /proc/self/stat and limits
through Python's io stack at every GET. The RDMA source keeps every attribute file open (about 250 descriptors
for 8 NICs' counters, 440 with their hw_counters), so that listing was most of it: 0.3 to 0.6 ms of CPU a GET of
the 8-NIC exporter (bench/scrape.py), a sixth of its whole cost. Here the count is the size of /proc/self/fd
(Linux 6.2 and later give the number of open descriptors there; an older kernel's 0 has it listed, as before), the
limit is getrlimit's, and /proc/self/stat is one read. The series, their help, types and values are
prometheus_client's, but for process_open_fds, which no longer counts the descriptor that listed them.
"""

from __future__ import annotations

import os
import resource

from prometheus_client import PROCESS_COLLECTOR, REGISTRY
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector


class LeanProcessCollector(ProcessCollector):
    """This process' ProcessCollector series, from one read of /proc/self/stat, the size of /proc/self/fd and
    getrlimit."""

    def __init__(self) -> None:
        super().__init__(registry=None)

    def collect(self) -> list[Metric]:
        if not self._btime:  # no /proc: nothing, as prometheus_client's
            return []
        found: list[Metric] = []
        try:
            parts = _read("/proc/self/stat").split(b")")[-1].split()
        except OSError:
            pass
        else:
            prefix, ticks = self._prefix, self._ticks
            found += [
                GaugeMetricFamily(prefix + "virtual_memory_bytes", "Virtual memory size in bytes.", float(parts[20])),
                GaugeMetricFamily(
                    prefix + "resident_memory_bytes",
                    "Resident memory size in bytes.",
                    float(parts[21]) * self._pagesize,
                ),
                GaugeMetricFamily(
                    prefix + "start_time_seconds",
                    "Start time of the process since unix epoch in seconds.",
                    float(parts[19]) / ticks + self._btime,
                ),
                CounterMetricFamily(
                    prefix + "cpu_seconds_total",
                    "Total user and system CPU time spent in seconds.",
                    float(parts[11]) / ticks + float(parts[12]) / ticks,
                ),
            ]
        try:
            open_fds = os.stat("/proc/self/fd").st_size or len(os.listdir("/proc/self/fd")) - 1
        except OSError:
            return found
        found += [
            GaugeMetricFamily(self._prefix + "open_fds", "Number of open file descriptors.", open_fds),
            GaugeMetricFamily(
                self._prefix + "max_fds",
                "Maximum number of open file descriptors.",
                float(resource.getrlimit(resource.RLIMIT_NOFILE)[0]),
            ),
        ]
        return found


def _read(path: str) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.read(fd, 65536)
    finally:
        os.close(fd)


def use_lean_process_collector() -> None:
    """In prometheus_client's default registry, LeanProcessCollector in place of its ProcessCollector (once: a
    registry without that collector is left as it is)."""
    try:
        REGISTRY.unregister(PROCESS_COLLECTOR)
    except KeyError:
        return
    REGISTRY.register(LeanProcessCollector())
