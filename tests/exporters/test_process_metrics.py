"""The exporter's process_* series are prometheus_client's ProcessCollector's: the same families, help, types and
values (open descriptors less the one prometheus_client lists them with; CPU time read a moment apart)."""

from __future__ import annotations

import os

from prometheus_client.process_collector import ProcessCollector

from kvscope.exporters.process_metrics import LeanProcessCollector


def described(collector) -> dict[str, tuple[str, str, float]]:
    return {f.name: (f.type, f.documentation, f.samples[0].value) for f in collector.collect()}


def test_the_series_are_prometheus_clients():
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(50)]  # descriptors held open, as the RDMA source does
    try:
        ours, theirs = described(LeanProcessCollector()), described(ProcessCollector(registry=None))
    finally:
        for fd in held:
            os.close(fd)
    assert ours.keys() == theirs.keys() and len(ours) == 6
    assert {name: kind_help for name, (*kind_help, _) in ours.items()} == {
        name: kind_help for name, (*kind_help, _) in theirs.items()
    }
    for name in ("process_start_time_seconds", "process_max_fds"):
        assert ours[name][2] == theirs[name][2]
    assert ours["process_open_fds"][2] == theirs["process_open_fds"][2] - 1 >= 50
    assert 0 <= theirs["process_cpu_seconds"][2] - ours["process_cpu_seconds"][2] < 0.5
    assert abs(ours["process_resident_memory_bytes"][2] - theirs["process_resident_memory_bytes"][2]) < 50e6
