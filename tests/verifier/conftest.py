"""A verifier database filled sample by sample, so criteria are tested on values worked out by hand."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from kvscope.samples import Sample, labels_of
from kvscope.verifier.db import Database, Run


class Recording:
    """Runs of hand-written series: `add("a", "kv.store.put.bytes", [0, 10, 20], tier="dram")`."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.runs: dict[str, Run] = {}

    def add(
        self,
        run: str,
        name: str,
        values: Sequence[float],
        kind: str = "counter",
        normalized: bool = True,
        target: str = "t0",
        start: float = 1_000.0,
        step: float = 1.0,
        **labels: str,
    ) -> None:
        if run not in self.runs:
            self.runs[run] = self.db.create_run(run, origin="recorder", arm=run)
        writer = self.db.writer(self.runs[run])
        sample_labels = labels_of(labels)
        for index, value in enumerate(values):
            sample = Sample("test", name, sample_labels, float(value), kind, normalized)  # type: ignore[arg-type]
            writer.append(target, start + index * step, [sample])
        writer.flush()


@pytest.fixture
def recording(tmp_path) -> Callable[[], Recording]:
    with Database(tmp_path / "verifier.duckdb") as db:
        yield Recording(db)
