"""`kvscope whatif`: a scenario's TTFT over a sweep of its keys, e.g. the fabric's bandwidth against the prompt.

Why apart from the A/B runner: an A/B compares tier layouts round by round; a what-if asks how TTFT and what it is
made of (compute, loading, the PD transfer, the fixed overhead) move when one setting moves, over every request the
engine emulator serves. Each setting is the scenario's own mapping with the varied keys set (dotted paths, values
read as YAML scalars: `400Gb/s`, `40000`, `true`), validated as any scenario, and served on every arm.
"""

from __future__ import annotations

import itertools
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from rich.table import Table

from kvscope.tierstore.ab import TTFT_PARTS, build_engine, build_store, request_clock, ttft_share
from kvscope.tierstore.scenario import Scenario, ScenarioError, parse_scenario
from kvscope.tierstore.workloads import make_workload


class SweepError(ValueError):
    """A --vary that cannot be used (its syntax, or a setting that is no valid scenario)."""


@dataclass(frozen=True, slots=True)
class Vary:
    """One swept key: a dotted path into the scenario and the values it takes, in order."""

    key: str
    values: tuple[object, ...]

    @classmethod
    def parse(cls, text: str) -> Vary:
        """`fabric.east_west=400Gb/s,1.6Tb/s`: the key, then comma-separated values, each read as a YAML scalar."""
        key, sep, values = text.partition("=")
        if not sep or not key.strip() or not values.strip():
            raise SweepError(f"--vary {text!r}: write KEY=VALUE[,VALUE...], e.g. fabric.east_west=400Gb/s,1.6Tb/s")
        return cls(key.strip(), tuple(yaml.safe_load(value.strip()) for value in values.split(",")))


@dataclass(slots=True)
class Point:
    """One setting served on one arm: every counted request's TTFT and its parts, summed."""

    setting: tuple[object, ...]
    arm: str
    ttft_s: list[float] = field(default_factory=list)
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TTFT_PARTS, 0.0))

    def quantile(self, q: float) -> float:
        """The request at rank q (the A/B rows' rule: sorted[min(n - 1, int(n x q))], p50 sorted[n // 2])."""
        ordered = sorted(self.ttft_s)
        if not ordered:
            return 0.0
        return ordered[len(ordered) // 2] if q == 0.5 else ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    @property
    def share(self) -> dict[str, float]:
        return ttft_share(self.parts)


def set_key(data: dict, key: str, value: object) -> dict:
    """A copy of `data` with the dotted `key` set (missing mappings on the way are made)."""
    head, _, rest = key.partition(".")
    copy = dict(data)
    if rest:
        inner = copy.get(head)
        copy[head] = set_key(inner if isinstance(inner, dict) else {}, rest, value)
    else:
        copy[head] = value
    return copy


def settings(data: dict, varies: list[Vary], source: str, base_dir: Path | None) -> list[tuple[tuple, Scenario]]:
    """Every combination of the varied values (the first key slowest), each as a validated scenario."""
    out = []
    for combination in itertools.product(*(vary.values for vary in varies)):
        changed = data
        for vary, value in zip(varies, combination, strict=True):
            changed = set_key(changed, vary.key, value)
        where = f"{source} with " + ", ".join(f"{v.key}={value}" for v, value in zip(varies, combination, strict=True))
        try:
            out.append((combination, parse_scenario(changed, where, base_dir)))
        except ScenarioError as error:
            raise SweepError(str(error)) from None
    return out


def serve(setting: tuple, scenario: Scenario, from_round: int = 1, arms: list[str] | None = None) -> list[Point]:
    """Serve the scenario's requests on each arm (or those named in `arms`; a store of its own, file tiers in a
    scratch folder); count the requests of round `from_round` on (the earlier ones warm the cache)."""
    points = []
    unknown = sorted(set(arms or ()) - set(scenario.runnable_arms))
    if unknown:
        raise SweepError(f"no arm {unknown[0]!r} in the scenario (arms: {', '.join(scenario.runnable_arms)})")
    with tempfile.TemporaryDirectory(prefix="kvscope-whatif-") as scratch:
        for name, arm in scenario.runnable_arms.items():
            if arms and name not in arms:
                continue
            store = build_store(arm, scenario.block_bytes, name, Path(scratch))
            try:
                engine = build_engine(scenario, store, request_clock(arm, store), arm, explains_misses=False)
                point = Point(setting, name)
                for index, requests in enumerate(make_workload(scenario).rounds()):
                    for request in requests:
                        served = engine.serve(request)
                        if index + 1 < from_round:
                            continue
                        point.ttft_s.append(served.ttft_s)
                        if served.ttft_parts is not None:
                            for part in TTFT_PARTS:
                                point.parts[part] += getattr(served.ttft_parts, part)
            finally:
                store.close()
            points.append(point)
    return points


def sweep(
    data: dict,
    varies: list[Vary],
    source: str = "scenario",
    base_dir: Path | None = None,
    from_round: int = 1,
    arms: list[str] | None = None,
) -> list[Point]:
    """Every setting of the sweep on every arm (or those of `arms`), in order."""
    return [point for setting, scenario in settings(data, varies, source, base_dir)
            for point in serve(setting, scenario, from_round, arms)]  # fmt: skip


def table(points: list[Point], varies: list[Vary], title: str) -> Table:
    """Per setting and arm: requests counted, TTFT p50 and p90, and the shares of TTFT."""
    result = Table(title=title)
    for vary in varies:
        result.add_column(vary.key, justify="right")
    result.add_column("arm")
    for column in ("requests", "TTFT p50", "TTFT p90", "compute", "load", "PD transfer", "overhead"):
        result.add_column(column, justify="right")
    for point in points:
        share = point.share
        result.add_row(
            *(str(value) for value in point.setting), point.arm, f"{len(point.ttft_s):,}",
            _seconds(point.quantile(0.5)), _seconds(point.quantile(0.9)),
            *(f"{share[part]:.1%}" for part in TTFT_PARTS),
        )  # fmt: skip
    return result


def _seconds(value: float) -> str:
    return f"{value * 1000:,.1f} ms" if value < 10 else f"{value:,.2f} s"


def plot(points: list[Point], varies: list[Vary], path: Path, title: str) -> None:
    """TTFT p50 (solid) and p90 (dashed) against the first varied key, a line per value of the others and arm;
    beside it, each setting's TTFT split into its parts (a stacked bar per setting and arm, p50 x shares)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # one bar per setting and arm, a line of text each: the figure grows with them, so labels never overlap
    height = max(5.5, 0.3 * len(points) + 1.5)
    figure, (lines_axis, parts_axis) = plt.subplots(1, 2, figsize=(14, height), width_ratios=(3, 2))
    first = varies[0]
    series: dict[tuple, list[Point]] = {}
    for point in points:
        series.setdefault((point.setting[1:], point.arm), []).append(point)
    positions = range(len(first.values))
    for number, ((rest, arm), members) in enumerate(series.items()):
        label = ", ".join([*(f"{v.key}={value}" for v, value in zip(varies[1:], rest, strict=True)), arm])
        (line,) = lines_axis.plot(positions, [p.quantile(0.5) for p in members], marker="o", label=label)
        lines_axis.plot(positions, [p.quantile(0.9) for p in members], "--", color=line.get_color(),
                        label="p90 (dashed; solid: p50)" if number == 0 else "_p90")  # fmt: skip
    lines_axis.set_xticks(list(positions), [str(value) for value in first.values])
    lines_axis.set_xlabel(first.key)
    lines_axis.set_ylabel("TTFT (s)")
    lines_axis.set_yscale("log")
    lines_axis.grid(alpha=0.3)
    lines_axis.legend(fontsize=7)
    labels = [", ".join([*(str(value) for value in point.setting), point.arm]) for point in points]
    left = [0.0] * len(points)
    for part in TTFT_PARTS:
        widths = [point.share[part] for point in points]
        parts_axis.barh(range(len(points)), widths, left=left, label=part)
        left = [a + w for a, w in zip(left, widths, strict=True)]
    parts_axis.set_yticks(range(len(points)), labels, fontsize=8)
    parts_axis.invert_yaxis()  # the first setting on top, as in the table
    parts_axis.set_xlabel("share of TTFT (at p50)")
    parts_axis.set_xlim(0, 1)
    parts_axis.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(TTFT_PARTS))
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
