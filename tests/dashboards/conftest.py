"""Fabric sources whose counters move, for the live dashboard test: an SPDK target and a sysfs tree of RDMA NICs.

Both replay the fixtures (tests/fixtures/spdk/live, tests/fixtures/rdma/sysfs, plus the SYNTHETIC RoCE port of
tests/fixtures/rdma/synthetic/sysfs and its made-up congestion counters) with their I/O, reactor, data, congestion
and error counters growing over time, so that rates, and latencies and busy shares as ratios of rates, have values.
Everything else is answered or read exactly as in the fixtures.
"""

from __future__ import annotations

import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.spdkpeer import Answer, SpdkPeer, capture

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"

# bdev_get_iostat fields that count (bytes, operations, time in ticks since start): scaled by the number of calls.
# Max/min latencies, queue depth and the tick rate are not counters and stay as captured.
_IOSTAT_COUNTER = re.compile(r"^(bytes_\w+|num_\w+_ops|(read|write|unmap|copy)_latency_ticks|ticks)$")
# framework_get_reactors fields scaled the same way: busy and idle ticks (so the busy share stays the captured one).
_REACTOR_COUNTER = re.compile(r"^(busy|idle)$")


class SpdkTarget(SpdkPeer):
    """An SPDK peer on the Unix socket `path` that answers like the captured nvmf_tgt: each method with its capture
    under fixtures/spdk/live/, bdev_get_iostat with its counters times the number of iostat calls so far,
    framework_get_reactors with its reactors' busy and idle ticks times the number of reactor calls so far, an
    unknown method with the captured "method not found" error."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.iostat_calls = 0
        self.reactor_calls = 0
        super().__init__(self.live, path)

    def live(self, method: str, params: object) -> Answer:
        if method == "bdev_get_iostat":
            self.iostat_calls += 1
            result = capture("live/bdev_get_iostat.json")["result"]
            _scale(result, self.iostat_calls, _IOSTAT_COUNTER)
            return {"result": result}
        if method == "framework_get_reactors":
            self.reactor_calls += 1
            result = capture("live/framework_get_reactors.json")["result"]
            _scale(result["reactors"], self.reactor_calls, _REACTOR_COUNTER)
            return {"result": result}
        path = f"live/{method}.json"
        return path if (FIXTURES / "spdk" / path).exists() else "live/error.method_not_found.json"


def _scale(value: object, factor: int, counters: re.Pattern) -> None:
    """Multiply in place the integer fields named by `counters`, at any depth (an iostat result's bdevs and
    per-channel lists, a reactor list)."""
    if isinstance(value, list):
        for item in value:
            _scale(item, factor, counters)
    elif isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, int) and not isinstance(item, bool) and counters.match(key):
                value[key] = item * factor
            else:
                _scale(item, factor, counters)


@pytest.fixture
def spdk_target(tmp_path: Path) -> Iterator[SpdkTarget]:
    target = SpdkTarget(tmp_path / "spdk.sock")
    yield target
    target.close()


class RdmaTree:
    """A copy of the RDMA sysfs fixture with the synthetic RoCE port (mlx5_1) added, whose counters grow every
    `period_s`, rewritten in place as sysfs would show them (the exporter keeps them open): every port's data
    counters (port_xmit_data, port_rcv_data, in 4-octet words), mlx5_1's congestion counters but rp_cnp_ignored,
    and one error counter each of its PMA (symbol_error) and its hw counters (out_of_sequence)."""

    def __init__(self, root: Path, period_s: float = 0.5) -> None:
        shutil.copytree(FIXTURES / "rdma" / "sysfs", root)
        shutil.copytree(FIXTURES / "rdma" / "synthetic" / "sysfs", root, dirs_exist_ok=True)
        self.root = root
        # (file, what it grows by each period): ~1-2 MB/s per port and direction, tens of congestion packets and a
        # few errors a second (symbol_error, 16 bits wide, would saturate after hours)
        data = sorted(root.glob("class/infiniband/*/ports/*/counters/port_*_data"))
        self.steps = [(path, 250_000 * (index + 1)) for index, path in enumerate(data)]
        port = root / "class" / "infiniband" / "mlx5_1" / "ports" / "1"
        self.steps += [(port / "hw_counters" / name, 20) for name in ("np_cnp_sent", "rp_cnp_handled")]
        self.steps += [(port / "hw_counters" / "np_ecn_marked_roce_packets", 25)]
        self.steps += [(port / "hw_counters" / "out_of_sequence", 2), (port / "counters" / "symbol_error", 1)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, args=(period_s,), daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def _tick(self, period_s: float) -> None:
        while not self._stop.wait(period_s):
            for path, step in self.steps:
                count = int(path.read_text().strip()) + step
                with path.open("r+") as file:
                    file.write(f"{count}\n")
                    file.truncate()


@pytest.fixture
def rdma_tree(tmp_path: Path) -> Iterator[RdmaTree]:
    tree = RdmaTree(tmp_path / "sysfs")
    yield tree
    tree.close()
