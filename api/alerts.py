"""Hit-rate-collapse alerts, predicted and live, with Prometheus' states: pending, firing, resolved.

`RULES` is the one definition of each alert the service raises: its meaning, its thresholds, its severity and its
runbook section (the shipped Prometheus rules and the runbook are held to it by tests). `evaluate_round` applies
them to an A/B arm's newest round, from the same rows the contract reports (kvscope.api.clusterwatch applies them
to scraped clusters):
- KVCacheCollapsePredicted: the planner says the arm collapses at round N (fires when the A/B starts, with N and
  the arithmetic; resolves when the A/B ends);
- KVCacheCollapseImminent: the top tier's occupancy, grown by its last round's growth, would pass its capacity
  next round (a round's predict_linear);
- KVCacheHitRateCollapse: the hit ratio below 1 - collapse_tolerance of its ideal (of its trailing peak where no
  ideal is known) while the bytes written per round are not falling;
each resolves when it no longer holds, and when its A/B ends. An alert is identified by its name and labels; every
transition is stamped and passed to the subscribers (the Alertmanager forwarder).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Literal

State = Literal["pending", "firing", "resolved"]


@dataclass(frozen=True)
class AlertRule:
    """One alert's definition, the one its every consumer follows: what it means, when it fires (the thresholds,
    by name), its severity (the shipped Alertmanager route pages on critical) and its runbook section. The shipped
    Prometheus rules use these numbers and the runbook states them (tests/deploy/test_rules.py holds both to
    this); the service evaluates them (the A/B manager for its arms, ClusterWatch for scraped clusters)."""

    name: str
    severity: Literal["critical", "warning"]
    meaning: str
    thresholds: Mapping[str, float] = field(default_factory=dict)

    @property
    def runbook_url(self) -> str:
        return f"docs/runbook.md#{self.name.lower()}"


RESOLVED_KEPT_S = 900.0  # a resolved alert stays listed (and re-sent to Alertmanager) this long, then is dropped
COLLAPSE = "KVCacheHitRateCollapse"
IMMINENT = "KVCacheCollapseImminent"
PREDICTED = "KVCacheCollapsePredicted"
FABRIC_SATURATED = "KVFabricSaturated"
OFFLOAD_NOT_PAYING = "KVOffloadNotPayingOff"
ROUTER_OVERESTIMATES = "KVRouterOverestimates"

RULES: dict[str, AlertRule] = {
    rule.name: rule
    for rule in (
        AlertRule(
            COLLAPSE,
            "critical",
            "the evict-recompute-rewrite loop: the prefix-cache hit ratio far below what the cache delivers while the "
            "bytes written to the tiers are not falling. What it delivers is the ideal hit ratio where it is known "
            "(an A/B arm, each round: below 1 - the scenario's collapse_tolerance x the ideal, the planner's collapse, "
            "so it fires in the round KVCacheCollapsePredicted names; a round stands for `for_s`), and otherwise "
            "the engine's own peak (a cluster: below `fraction_of_peak` x the peak of the last `peak_window_s`, over "
            "`rate_window_s`, writes at least `writes_floor` x those of the window before, held for `for_s`). Where "
            "no engine exports prefix-cache counters, a KV router's prefix-hit ratio stands in (NVIDIA Dynamo's: the "
            "cached prefix it expected on the workers it chose over the prompt tokens it routed, per router), with "
            "the same numbers and the KV blocks its workers stored (the KV events it applied) in place of the bytes "
            "written; a router one of whose workers exports engine prefix-cache counters is not judged",
            {
                "fraction_of_peak": 0.5,
                "peak_window_s": 3600.0,
                "rate_window_s": 300.0,
                "writes_floor": 0.9,
                "for_s": 300.0,
            },
        ),
        AlertRule(
            IMMINENT,
            "warning",
            "a top (DRAM) tier about to start evicting: its allocated bytes, fitted by least squares over "
            "`fit_window_s` and extrapolated `horizon_s` ahead, pass `watermark` x its capacity while still growing, "
            "held for `for_s` (an A/B arm: its growth over the last round, one round ahead, passes its capacity)",
            {"fit_window_s": 300.0, "horizon_s": 1800.0, "watermark": 0.95, "for_s": 300.0},
        ),
        AlertRule(
            PREDICTED,
            "warning",
            "the planner predicts an A/B arm's collapse (its hit ratio below 1 - collapse_tolerance of its ideal) at "
            "round N, before the round runs; raised when the A/B starts, resolved when it ends",
        ),
        AlertRule(
            FABRIC_SATURATED,
            "warning",
            "the KV fabric is the bottleneck: a role's NICs (their bytes over `rate_window_s`, summed over the role's "
            "ports, in the busier direction) above `utilization` x their line rate while the TTFT p90 of the engines "
            "given that role is above `ttft_rise_factor` x its value `ttft_rise_window_s` earlier, held for `for_s`. "
            "Raised by Prometheus only (the service does not evaluate it)",
            {
                "utilization": 0.9,
                "rate_window_s": 300.0,
                "ttft_rise_factor": 1.2,
                "ttft_rise_window_s": 900.0,
                "for_s": 300.0,
            },
        ),
        AlertRule(
            OFFLOAD_NOT_PAYING,
            "warning",
            "a KV tier behind the engines' own caches keeps storing while serving almost none of the hits: per store "
            "system and tier (not the engines' gpu caches; summed over the targets that report it, since one client "
            "may read what another stored), the bytes read from the medium over `rate_window_s` are below "
            "`read_share` x the bytes written to it while it is written faster than `written_floor_mib_per_s` MiB/s, "
            "held for `for_s`. Read over written is how often a stored block is loaded back on average: below "
            "`read_share` fewer than 1 block in 20 is, and the tier's write bandwidth and capacity (and the blocks "
            "its writes evict) buy almost nothing. The window is long because a tier's hits come when sessions "
            "return, minutes after the write; a tier exporting no read bytes is not judged. Raised by Prometheus "
            "only (the service does not evaluate it)",
            {"read_share": 0.05, "written_floor_mib_per_s": 1.0, "rate_window_s": 3600.0, "for_s": 1800.0},
        ),
        AlertRule(
            ROUTER_OVERESTIMATES,
            "warning",
            "a KV router that overestimates the workers' caches: per frontend (`target`), model and routing phase, "
            "the cached tokens the workers served (the frontend's responses) over the cached prefix the router "
            "expected on the workers it chose, both over `rate_window_s`, below `served_over_expected` while it "
            "expects more than `min_expected_tokens_per_s` cached tokens a second, held for `for_s`. The router "
            "counts when it routes and the frontend when a request completes, so a healthy index sits near 1 (the "
            "requests in flight at the window's edges apart); below `served_over_expected` the router counts on at "
            "least twice what the workers still hold, routes for hits that are recomputed, and its load balance is "
            "off by as much. Raised by Prometheus only (the service does not evaluate it)",
            {"served_over_expected": 0.5, "min_expected_tokens_per_s": 10.0, "rate_window_s": 300.0, "for_s": 900.0},
        ),
    )
}


@dataclass
class Alert:
    name: str
    labels: dict[str, str]
    state: State
    summary: str
    description: str = ""
    value: float | None = None
    active_at: float = field(default_factory=time.time)  # when it went pending (or straight to firing)
    fired_at: float | None = None
    resolved_at: float | None = None

    @property
    def key(self) -> tuple:
        return (self.name, tuple(sorted(self.labels.items())))

    def as_json(self) -> dict:
        return asdict(self)

    def copy(self) -> Alert:
        """A shallow copy (its labels are never changed in place), about 0.4 us where dataclasses.replace takes 3."""
        twin = object.__new__(Alert)
        twin.__dict__.update(self.__dict__)
        return twin


class AlertBook:
    """Every alert the service raised, by key; thread-safe; subscribers hear each transition."""

    def __init__(self, resolved_kept_s: float = RESOLVED_KEPT_S) -> None:
        self._alerts: dict[tuple, Alert] = {}
        self._lock = threading.Lock()
        self.resolved_kept_s = resolved_kept_s  # a long-running service does not keep every alert it ever raised
        self.subscribers: list[Callable[[Alert], None]] = []

    def list(self, state: str | None = None) -> list[Alert]:
        """The alerts, with those resolved more than `resolved_kept_s` ago dropped: copies taken under the lock, so
        a reader on another thread (the Alertmanager forwarder) never sees one half-way through a transition, e.g.
        resolved without its resolved_at, which it would post with endsAt pushed forward."""
        oldest = time.time() - self.resolved_kept_s
        with self._lock:
            for key in [k for k, a in self._alerts.items() if a.state == "resolved" and a.resolved_at < oldest]:
                del self._alerts[key]
            alerts = [a.copy() for a in self._alerts.values() if state is None or a.state == state]
        return alerts

    def active(self) -> list[Alert]:
        return [a for a in self.list() if a.state in ("pending", "firing")]

    def end(self, **labels: str) -> None:
        """What the alerts carrying these labels watched is over (an A/B ended or was stopped): the firing ones
        resolve, the pending ones are forgotten."""
        for alert in self.active():
            if all(alert.labels.get(key) == value for key, value in labels.items()):
                self.set(alert.name, alert.labels, None)

    def set(self, name: str, labels: dict[str, str], state: State | None, summary: str = "", **details) -> None:
        """Move the alert `name{labels}` to `state` (None: the condition is gone), stamping the transition."""
        key = (name, tuple(sorted(labels.items())))
        now = time.time()
        with self._lock:
            alert = self._alerts.get(key)
            current = alert.state if alert else None
            if state is None:
                if current == "firing":
                    state = "resolved"
                elif current == "pending":  # never fired: forget it, as Prometheus does
                    del self._alerts[key]
                    return
                else:
                    return
            if current == state or (current == "firing" and state == "pending"):
                if alert and summary:
                    alert.summary, alert.value = summary, details.get("value", alert.value)
                return
            if alert is None or current == "resolved":
                alert = self._alerts[key] = Alert(name, dict(labels), state, summary, active_at=now)
            alert.state = state
            alert.summary = summary or alert.summary
            alert.description = details.get("description", alert.description)
            alert.value = details.get("value", alert.value)
            if state == "firing":
                alert.fired_at = now
            elif state == "resolved":
                alert.resolved_at = now
        for subscriber in self.subscribers:
            subscriber(alert)


@dataclass
class ArmWatch:
    """What the live rule remembers of one arm between rounds."""

    peak_hit_ratio: float = 0.0
    last_written: int | None = None
    last_allocated: int | None = None


def evaluate_round(
    book: AlertBook, labels: dict[str, str], watch: ArmWatch, row: dict, top_tier: str, capacity: int, fraction: float
) -> None:
    """Apply KVCacheHitRateCollapse and KVCacheCollapseImminent to an arm's newest round row (the A/B contract's
    per-round row)."""
    written = sum(row["written_bytes"].values())
    allocated = row["allocated_bytes"][top_tier]
    ideal = row.get("ideal_hit_ratio")
    reference = ideal if ideal else watch.peak_hit_ratio
    writes_not_falling = watch.last_written is None or written >= watch.last_written
    collapsed = reference > 0 and row["hit_ratio"] < fraction * reference and writes_not_falling
    growth = allocated - watch.last_allocated if watch.last_allocated is not None else 0
    imminent = growth > 0 and allocated + growth > capacity
    watch.peak_hit_ratio = max(watch.peak_hit_ratio, row["hit_ratio"])
    watch.last_written, watch.last_allocated = written, allocated
    basis = "its ideal" if ideal else "its trailing peak"
    book.set(
        COLLAPSE,
        labels,
        "firing" if collapsed else None,
        f"round {row['round']}: hit ratio {row['hit_ratio']:.3f} < {fraction:g} x {basis} {reference:.3f} "
        f"while {written:,} B were written",
        value=row["hit_ratio"],
        description="evict, recompute, rewrite: chain heads are being evicted faster than sessions return",
    )
    book.set(
        IMMINENT,
        labels,
        "firing" if imminent and not collapsed else None,
        f"round {row['round']}: {top_tier} holds {allocated:,} of {capacity:,} B and grew {growth:,} B: "
        "next round passes capacity",
        value=allocated / capacity,
        description="the tier will start evicting within one round: its chain heads go first",
    )
