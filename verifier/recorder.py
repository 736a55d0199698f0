"""The recorder: what the exporters scrape, written into the verifier database as it arrives.

It hangs off the scrape loop (`Scraper(on_scrape=...)`), so a recording sees exactly the raw and normalized samples
the Prometheus endpoint and OTLP see. Two drivers:
- `record()`: a cluster from an exporter configuration, for a duration or until SIGINT/SIGTERM;
- `ABRecorder`: an embedded A/B, one run per arm, scraped before the first round and after every round, so the
  verifier can cut the recording into rounds.
Batches are committed when full and at least every `flush_s` seconds, so a killed recorder loses little.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

from kvscope.exporters.base import TargetConfig
from kvscope.exporters.config import ExporterConfig
from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.exporters.tierstore import TierstoreTargetConfig
from kvscope.tierstore import scenario as spec
from kvscope.verifier.db import Database, Run, SampleWriter


class _Sink:
    """The scrape callback: each successful scrape's samples into the writer, flushed by size or age."""

    def __init__(self, writer: SampleWriter, flush_s: float) -> None:
        self.writer, self.flush_s = writer, flush_s
        self._flushed_at = time.monotonic()

    def __call__(self, state: TargetState) -> None:
        if not state.up:  # a failed scrape keeps the previous samples on its state: nothing new to record
            return
        name = state.config.name
        self.writer.append(name, state.scraped_at, state.raw)
        self.writer.append(name, state.scraped_at, state.normalized)
        if time.monotonic() - self._flushed_at >= self.flush_s:
            self.flush()

    def flush(self) -> None:
        self.writer.flush()
        self._flushed_at = time.monotonic()


def _start_run(db: Database, name: str, targets: list[TargetConfig], **run: object) -> tuple[Run, SampleWriter]:
    recorded = db.create_run(name, **run)  # type: ignore[arg-type]
    for target in targets:
        db.add_target(recorded, target.name, target.source, target.model_dump(mode="json"))
    return recorded, db.writer(recorded)


async def record(
    db: Database,
    config: ExporterConfig,
    run_name: str,
    arm: str | None = None,
    cluster: str | None = None,
    duration_s: float | None = None,
    flush_s: float = 1.0,
    stop: asyncio.Event | None = None,
) -> Run:
    """Scrape `config`'s targets on their intervals into run `run_name` until `duration_s` passes or a signal."""
    run_config = {"exporter": config.exporter.model_dump(mode="json"), "duration_s": duration_s}
    recorded, writer = _start_run(
        db, run_name, config.targets, origin="recorder", arm=arm, scenario=cluster, config=run_config
    )
    sink = _Sink(writer, flush_s)
    scraper = Scraper(config.targets, on_scrape=sink)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    timer = loop.call_later(duration_s, stop.set) if duration_s else None
    try:
        await scraper.run(stop)
    finally:
        if timer:
            timer.cancel()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(signum)
        await scraper.close()
        sink.flush()
    db.finish_run(recorded)
    return recorded


class ABRecorder:
    """Records an embedded A/B through the `tierstore` exporter source: one run per arm, named after the arm.

    Pass `arm_started` and `round_done` to `run_ab(..., publish=True)`, then call `finish()`: each call takes one
    scrape of the arm's published engine (raw and normalized, as any exporter target) and commits it, so a killed
    A/B keeps every round it finished.
    """

    def __init__(self, db: Database, scenario: spec.Scenario, source: Path | None = None) -> None:
        for arm in scenario.arms:  # refuse before simulating anything
            db.require_new_run(arm)
        self.db, self.scenario, self.source = db, scenario, source
        self.runs: list[Run] = []
        self._current: tuple[Run, SampleWriter, Scraper, str] | None = None

    def arm_started(self, arm: str) -> None:
        self.finish()
        target = TierstoreTargetConfig(
            name=f"tierstore-{arm}", source="tierstore", stores=[f"{self.scenario.name}/{arm}"]
        )
        config = {"scenario": self.scenario.model_dump(mode="json"), "scenario_file": str(self.source or "")}
        run, writer = _start_run(
            self.db, arm, [target], origin="ab", arm=arm, scenario=self.scenario.name, config=config
        )
        scraper = Scraper([target], on_scrape=_Sink(writer, flush_s=float("inf")))
        self._current = (run, writer, scraper, target.name)
        self.runs.append(run)
        self._scrape()

    def round_done(self, _arm: str, _row: dict) -> None:
        self._scrape()

    def finish(self) -> None:
        """Close the arm being recorded, if any (its last round is already committed)."""
        if self._current is None:
            return
        run, _, scraper, _ = self._current
        asyncio.run(scraper.close())
        self.db.finish_run(run)
        self._current = None

    def _scrape(self) -> None:
        if self._current is None:
            raise RuntimeError("ABRecorder: a round finished before its arm started")
        _, writer, scraper, target = self._current
        state = asyncio.run(scraper.scrape(target))
        if not state.up:
            raise RuntimeError(f"recording the A/B: {state.last_error}")
        writer.flush()
