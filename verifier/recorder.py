"""The recorder: what the exporters scrape, written into the verifier database as it arrives.

It hangs off the scrape loop (`Scraper(on_scrape=...)`), so a recording sees exactly the raw and normalized samples
the Prometheus endpoint and OTLP see. Two drivers:
- `record()`: a cluster from an exporter configuration, for a duration or until SIGINT/SIGTERM;
- `ABRecorder`: an A/B, one run per arm, recorded before the first round, after every round and at the end, so
  the verifier can cut the recording into rounds.
Batches are committed when full and at least every `flush_s` seconds, so a killed recorder loses little.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvscope.exporters.base import TargetConfig
from kvscope.exporters.config import ExporterConfig
from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.exporters.tierstore import TierstoreTargetConfig
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.ab import ArmRun
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
        # one append per scrape: a batch filled by size must not commit the raw half without the normalized half
        self.writer.append(name, state.scraped_at, [*state.raw, *state.normalized])
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


@dataclass
class _ArmRecording:
    run: Run
    writer: SampleWriter
    sink: _Sink
    scraper: Scraper
    target: str


class ABRecorder:
    """Records an A/B as it runs (an ArmListener of kvscope.tierstore.ab): one run per arm, `<prefix><arm>`.

    Each arm's engine is read through the `tierstore` exporter source, and a real store's own targets (Mooncake's
    master and client) are recorded from the very scrape the arm's figures were taken from. `arm_started` opens
    the arm's run (its config keeps the scenario and the store's settings, flags and sockets) and records round 0,
    `round_done` each round, `arm_ended` the end (a real store once its background work settled), each committed
    at once so a killed A/B keeps every round it finished; `finish()` closes every arm.
    """

    def __init__(
        self,
        db: Database,
        scenario: spec.Scenario,
        source: Path | None = None,
        prefix: str = "",
        store_names: Callable[[str], str] | None = None,
    ) -> None:
        self.prefix = prefix
        for arm in scenario.runnable_arms:  # refuse before running anything
            db.require_new_run(prefix + arm)
        self.db, self.scenario, self.source = db, scenario, source
        self._store_name = store_names or (lambda arm: f"{scenario.name}/{arm}")
        self.runs: list[Run] = []
        self._arms: dict[str, _ArmRecording] = {}

    def arm_started(self, arm: ArmRun) -> None:
        target = TierstoreTargetConfig(
            name=f"tierstore-{arm.name}", source="tierstore", stores=[self._store_name(arm.name)]
        )
        config = {
            "scenario": self.scenario.model_dump(mode="json"),
            "scenario_file": str(self.source or ""),
            "store": arm.store.report(),
        }
        targets = [target, *(state.config for state in arm.observed)]
        run, writer = _start_run(
            self.db, self.prefix + arm.name, targets, origin="ab", arm=arm.name, scenario=self.scenario.name,
            config=config,
        )  # fmt: skip
        sink = _Sink(writer, flush_s=float("inf"))
        self._arms[arm.name] = _ArmRecording(run, writer, sink, Scraper([target], on_scrape=sink), target.name)
        self.runs.append(run)
        self._record(arm)

    def round_done(self, arm: ArmRun, _row: dict) -> None:
        self._record(arm)

    def arm_ended(self, arm: ArmRun) -> None:
        self._record(arm)

    def finish(self) -> None:
        """Close every arm being recorded (each round is already committed)."""
        for recording in self._arms.values():
            asyncio.run(recording.scraper.close())
            self.db.finish_run(recording.run)
        self._arms.clear()

    def _record(self, arm: ArmRun) -> None:
        recording = self._arms.get(arm.name)
        if recording is None:
            raise RuntimeError(f"ABRecorder: arm {arm.name!r} finished a round before it started")
        state = asyncio.run(recording.scraper.scrape(recording.target))
        if not state.up:
            raise RuntimeError(f"recording the A/B: {state.last_error}")
        for observed in arm.observed:
            recording.sink(observed)
        recording.writer.flush()
