"""Miss-ratio curves: the hit ratio of a store tier at every capacity, from one pass over the requests.

A user sizing a tier wants the capacity the workload needs, not an A/B per size. Stack distances (Mattson et al.,
1970) give every capacity at once for an LRU: a block's stack distance is the number of distinct blocks referenced
since its previous reference, itself included, and an LRU of C blocks holds it exactly when that is <= C. The
store's lookups are prefix lookups (a chain is only as good as its first missing block), so a request hits at
capacity C the blocks of its longest hittable prefix whose stack distances are all <= C: the prefix's running
maximum is the capacity from which each of its blocks hits.

What is exact: the textbook LRU, where every block a request names (the prompt's blocks, hit or saved, then the
blocks its output completes) becomes the most recent. The store's own `lru` refreshes only the blocks its lookup
hit; a save skips the blocks present after the first miss without refreshing them, so a bigger tier may hold a
block older than a smaller one does, inclusion fails and no one-pass curve is exact for it. That policy and the
others (`fifo`, `tail_first`, `mooncake`, `lmcache`) are replayed on the store at a few capacities (`check`) and
their gap to the curve is reported, never assumed.

The pass is O(log n) per run of blocks referenced together before: a Fenwick tree over reference slots counts the
slots that are no longer a block's latest reference, and the blocks of such a run keep one stack distance, so a
multi-round chat's or a trace's shared prefixes cost one tree query and one update per run, not per block.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import chain, pairwise
from pathlib import Path

from kvscope.tierstore import scenario as spec
from kvscope.tierstore.workloads import Request, make_workload

COLD = math.inf  # the stack distance of a block never referenced before: no capacity hits it


@dataclass(slots=True)
class StackDistances:
    """What one pass found, per round: prompt tokens, and hit blocks keyed by the least capacity (in blocks) at
    which an LRU tier hits them."""

    block_tokens: int
    prompt_tokens: list[int]
    hits_from: list[dict[int, int]]
    distinct_blocks: int
    references: int  # block references the pass processed (every block of every request, output blocks included)
    _cumulative: list[tuple[list[int], list[int]]] = field(default_factory=list, repr=False)

    def hit_blocks(self, capacity: int) -> list[int]:
        """Blocks hit per round by an LRU tier of `capacity` blocks."""
        if not self._cumulative:
            for hits in self.hits_from:
                distances = sorted(hits)
                running, totals = 0, []
                for distance in distances:
                    running += hits[distance]
                    totals.append(running)
                self._cumulative.append((distances, totals))
        hit = []
        for distances, totals in self._cumulative:
            index = bisect_right(distances, capacity)
            hit.append(totals[index - 1] if index else 0)
        return hit

    def hit_ratio(self, capacity: int) -> float:
        """Hit tokens over prompt tokens, all rounds, at `capacity` blocks."""
        prompt = sum(self.prompt_tokens)
        return sum(self.hit_blocks(capacity)) * self.block_tokens / prompt if prompt else 0.0

    @property
    def ideal_ratio(self) -> float:
        """The hit ratio of an infinite tier (every block ever referenced kept)."""
        return self.hit_ratio(self.distinct_blocks)

    def capacity_for(self, share: float) -> int:
        """The least capacity (blocks) whose hit ratio reaches `share` of the infinite tier's."""
        target = share * sum(self.hit_blocks(self.distinct_blocks))
        distances = sorted({distance for hits in self.hits_from for distance in hits})
        low, high = 0, len(distances) - 1
        if not distances or target <= 0:
            return 0
        while low < high:  # the hits only grow with the capacity: bisect the distances where they change
            middle = (low + high) // 2
            if sum(self.hit_blocks(distances[middle])) >= target:
                high = middle
            else:
                low = middle + 1
        return distances[low]


def stack_distances(rounds: Iterable[Sequence[Request]], block_tokens: int) -> StackDistances:
    """One pass over the requests, round by round: each request's prefix hits by capacity (module docstring).

    Slot s is the s-th block reference. A slot is live while it is its block's latest reference; the stack distance
    of a block last referenced at slot t is 1 + the live slots after t. A run of blocks whose previous references
    were consecutive live slots keeps one distance (each member's predecessors left the slots between and joined
    the recent end), so the tree is asked once per run and told once that the run's old slots died: they are
    contiguous, the tree holds each dead run's length at its last slot, and since a live slot never lies inside a
    dead run, a prefix sum up to a live slot counts whole dead runs.
    """
    materialized = [list(requests) for requests in rounds]
    size = sum(len(r.keys) + len(r.output_keys) for requests in materialized for r in requests)
    tree = [0] * (size + 1)  # Fenwick tree, 1-based (slot s at s + 1): dead slots, each dead run at its last slot
    last: dict = {}  # block key -> the slot of its latest reference
    last_get = last.get
    dead_total = slot = 0
    prompt_tokens: list[int] = []
    hits_from: list[dict[int, int]] = []
    for requests in materialized:
        hits: dict[int, int] = {}
        prompt_tokens.append(sum(request.prompt_tokens for request in requests))
        hits_from.append(hits)
        for request in requests:
            first = slot
            runs: list[tuple[int, int]] = []  # (slot of the run's first block, its previous slot or -1 if new)
            expected, run_new = -2, slot  # the previous slot that continues the open run (-1: a run of new blocks)
            for key in chain(request.keys, request.output_keys) if request.output_keys else request.keys:
                previous = last_get(key, -1)
                last[key] = slot
                if previous < 0:
                    if expected != -1:
                        runs.append((slot, -1))
                        expected = -1
                elif previous != expected or previous >= run_new:  # a slot of this run is no previous reference
                    runs.append((slot, previous))
                    run_new, expected = slot, previous + 1
                else:
                    expected += 1
                slot += 1
            hittable = min(len(request.keys), (request.prompt_tokens - 1) // block_tokens)
            maximum = 0  # the running maximum of the prefix's stack distances, COLD from a new block on
            runs.append((slot, -1))  # where the last run ends
            for (new, old), (end, _) in pairwise(runs):
                if old < 0:
                    maximum = COLD
                else:
                    index, dead_before = old + 1, 0
                    while index:
                        dead_before += tree[index]
                        index &= index - 1
                    distance = new - old - dead_total + dead_before
                    length = end - new
                    index = old + length
                    while index <= size:
                        tree[index] += length
                        index += index & -index
                    dead_total += length
                    if distance > maximum:
                        maximum = distance
                position = new - first
                if position < hittable and maximum is not COLD:
                    hits[maximum] = hits.get(maximum, 0) + min(end - first, hittable) - position
    return StackDistances(block_tokens, prompt_tokens, hits_from, len(last), slot)


SHARES = (0.5, 0.9, 0.99)  # of the infinite tier's hits: the capacities reported as what the workload needs
CHECKED_SHARES = (0.25, 0.5, 0.75, 0.9)  # where each policy is replayed on the store, besides the arms' capacities


def lru_replay(rounds: Sequence[Sequence[Request]], block_tokens: int, capacity: int) -> list[int]:
    """Per round, the prefix hits of a textbook LRU of `capacity` blocks (an OrderedDict in which every block a
    request names, prompt then output, becomes the most recent): what the one-pass curve equals at that capacity,
    replayed one capacity at a time (the tests' reference, the bench's anchor)."""
    cache: OrderedDict = OrderedDict()
    per_round = []
    for requests in rounds:
        hits = 0
        for request in requests:
            for key in request.keys[: min(len(request.keys), (request.prompt_tokens - 1) // block_tokens)]:
                if key not in cache:
                    break
                hits += 1
            for key in [*request.keys, *request.output_keys]:
                if key in cache:
                    cache.move_to_end(key)
                else:
                    cache[key] = None
                    if len(cache) > capacity:
                        cache.popitem(last=False)
        per_round.append(hits)
    return per_round


@dataclass(frozen=True, slots=True)
class ArmTier:
    """An arm's first tier: what the curve is read at."""

    arm: str
    tier: str
    policy: str
    capacity_blocks: int


@dataclass(frozen=True, slots=True)
class Check:
    """A per-capacity replay of the store with one policy, against the curve at that capacity."""

    policy: str
    capacity_blocks: int
    store_hit_ratio: float
    curve_hit_ratio: float

    @property
    def gap(self) -> float:
        """The store's hit ratio less the curve's: what the curve misses for this policy at this capacity."""
        return self.store_hit_ratio - self.curve_hit_ratio


@dataclass(slots=True)
class MissRatioCurve:
    """A scenario's curve, its arms' first tiers and the checks of their policies."""

    scenario: spec.Scenario
    distances: StackDistances
    grid: list[int]
    arms: list[ArmTier]
    checks: list[Check]

    @property
    def block_bytes(self) -> int:
        return self.scenario.block_bytes

    def check(self, policy: str, capacity: int) -> Check | None:
        return next((c for c in self.checks if c.policy == policy and c.capacity_blocks == capacity), None)

    def as_json(self) -> dict:
        d, block_bytes = self.distances, self.block_bytes
        return {
            "scenario": self.scenario.name,
            "block_tokens": d.block_tokens,
            "block_bytes": block_bytes,
            "references": d.references,
            "distinct_blocks": d.distinct_blocks,
            "ideal_hit_ratio": d.ideal_ratio,
            "exact_for": "lru that refreshes every block a request names (textbook LRU)",
            "curve": [
                {"capacity_blocks": c, "capacity_bytes": c * block_bytes, "hit_ratio": d.hit_ratio(c)}
                for c in self.grid
            ],
            "capacity_for_share_of_ideal": {
                str(share): {"capacity_blocks": (c := d.capacity_for(share)), "capacity_bytes": c * block_bytes}
                for share in SHARES
            },
            "arms": {
                arm.arm: {
                    "tier": arm.tier,
                    "policy": arm.policy,
                    "capacity_blocks": arm.capacity_blocks,
                    "capacity_bytes": arm.capacity_blocks * block_bytes,
                    "curve_hit_ratio": d.hit_ratio(arm.capacity_blocks),
                    "store_hit_ratio": check.store_hit_ratio if (check := self.check(arm.policy, arm.capacity_blocks))
                    else None,
                }
                for arm in self.arms
            },
            "checks": [
                {"policy": c.policy, "capacity_blocks": c.capacity_blocks, "store_hit_ratio": c.store_hit_ratio,
                 "curve_hit_ratio": c.curve_hit_ratio, "gap": c.gap}
                for c in self.checks
            ],
        }  # fmt: skip


def arm_tiers(scenario: spec.Scenario) -> list[ArmTier]:
    """Each arm's first tier (a real Mooncake arm's is its model's segment); arms without a store have none."""
    tiers = []
    for name, arm in scenario.arms.items():
        if not arm.tiers:
            continue
        first = (arm.simulated() if arm.store == "mooncake" else arm).tiers[0]
        tiers.append(ArmTier(name, first.name, first.policy, first.capacity // scenario.block_bytes))
    return tiers


def capacity_grid(distinct_blocks: int, points: int, extra: Iterable[int] = ()) -> list[int]:
    """`points` capacities spaced evenly on a log scale from 1 block to every block the workload references (an
    infinite tier), with `extra` capacities added."""
    top = max(distinct_blocks, 1)
    grid = {round(top ** (step / (points - 1))) for step in range(points)} if points > 1 else {top}
    return sorted(grid | {c for c in extra if c > 0})


def replay_store(scenario: spec.Scenario, arm_name: str, capacity_blocks: int, rounds: Sequence[Sequence[Request]]):
    """Hit blocks per round of the store with only the arm's first tier, at `capacity_blocks`: the per-capacity run
    the curve stands in for. The engine emulator serves the requests (on the arm's clock, for a Mooncake model)
    with no GPU cache in front, as the curve counts them."""
    from kvscope.tierstore.ab import build_store, request_clock
    from kvscope.tierstore.engine import EngineEmulator

    arm = scenario.arms[arm_name]
    arm = arm.simulated() if arm.store == "mooncake" else arm
    tier = arm.tiers[0].model_copy(update={"capacity": capacity_blocks * scenario.block_bytes, "backend": "accounting",
                                           "path": None, "o_direct": False})  # fmt: skip
    single = arm.model_copy(update={"tiers": [tier], "attached": [], "placement": "replicate",
                                    "promote_on_hit": False})  # fmt: skip
    store = build_store(single, scenario.block_bytes, arm_name, None)
    engine = EngineEmulator(store, scenario.block_tokens, scenario.block_bytes, scenario.engine.prefill_tokens_per_s,
                            clock=request_clock(single, store))  # fmt: skip
    try:
        return [sum(engine.serve(r).external_hit_tokens for r in requests) // scenario.block_tokens
                for requests in rounds]  # fmt: skip
    finally:
        store.close()


def miss_ratio_curve(scenario: spec.Scenario, points: int = 16, check: bool = True) -> MissRatioCurve:
    """The scenario's curve on a grid of `points` capacities plus its arms' first tiers; with `check`, each arm's
    policy replayed on the store at the arm's capacity and where the curve reaches CHECKED_SHARES of the ideal."""
    rounds = [list(requests) for requests in make_workload(scenario).rounds()]
    distances = stack_distances(rounds, scenario.block_tokens)
    arms = arm_tiers(scenario)
    grid = capacity_grid(distances.distinct_blocks, points, (arm.capacity_blocks for arm in arms))
    checks: list[Check] = []
    if check:
        prompt = sum(distances.prompt_tokens)
        shared = [c for c in (distances.capacity_for(share) for share in CHECKED_SHARES) if c > 0]
        wanted: dict[tuple[str, int], str] = {}  # (policy, capacity) -> the arm whose tier is replayed
        for arm in arms:
            for capacity in [arm.capacity_blocks, *shared]:
                wanted.setdefault((arm.policy, capacity), arm.arm)
        for (policy, capacity), arm_name in sorted(wanted.items()):
            hits = sum(replay_store(scenario, arm_name, capacity, rounds))
            store_ratio = hits * scenario.block_tokens / prompt if prompt else 0.0
            checks.append(Check(policy, capacity, store_ratio, distances.hit_ratio(capacity)))
    return MissRatioCurve(scenario, distances, grid, arms, checks)


def table(curve: MissRatioCurve):
    """Hit ratio against capacity: the curve on its grid, each checked policy's store replay where it ran, the
    arms' capacities named."""
    from rich.table import Table

    from kvscope.units import format_bytes

    d, block_bytes = curve.distances, curve.block_bytes
    policies = sorted({check.policy for check in curve.checks})
    marks: dict[int, list[str]] = {}
    for arm in curve.arms:
        marks.setdefault(arm.capacity_blocks, []).append(f"{arm.arm} ({arm.tier})")
    for share in SHARES:
        marks.setdefault(d.capacity_for(share), []).append(f"{share:.0%} of ideal")
    grid = sorted(set(curve.grid) | set(marks) | {check.capacity_blocks for check in curve.checks})
    result = Table(title=f"{curve.scenario.name}: hit ratio against a tier's capacity (ideal {d.ideal_ratio:.3f})")
    for column in ("capacity", "blocks", "lru curve", *(f"{policy}\nstore" for policy in policies), "marks"):
        result.add_column(column, justify="left" if column == "marks" else "right")
    for capacity in grid:
        cells = [format_bytes(capacity * block_bytes), f"{capacity:,}", f"{d.hit_ratio(capacity):.3f}"]
        for policy in policies:
            check = curve.check(policy, capacity)
            cells.append(f"{check.store_hit_ratio:.3f} ({_gap(check.gap)})" if check else "")
        result.add_row(*cells, ", ".join(marks.get(capacity, [])))
    return result


def summary_lines(curve: MissRatioCurve) -> list[str]:
    """What the curve says of each arm, and how far each policy's store replays were from it."""
    from kvscope.units import format_bytes

    d, block_bytes = curve.distances, curve.block_bytes
    lines = [
        f"one pass: {d.references:,} block references, {d.distinct_blocks:,} distinct blocks "
        f"({format_bytes(d.distinct_blocks * block_bytes)}: an infinite tier's footprint)",
        "the curve is exact for an LRU that refreshes every block a request names; store columns replay the "
        "store at that capacity with the policy, (gap) = store - curve",
    ]
    for share in SHARES:
        capacity = d.capacity_for(share)
        lines.append(f"{share:.0%} of the ideal hits from {format_bytes(capacity * block_bytes)} ({capacity:,} blocks)")
    for arm in curve.arms:
        check = curve.check(arm.policy, arm.capacity_blocks)
        store = f", the store with {arm.policy}: {check.store_hit_ratio:.3f}" if check else ""
        lines.append(f"arm {arm.arm}: {arm.tier} of {format_bytes(arm.capacity_blocks * block_bytes)}, curve "
                     f"{d.hit_ratio(arm.capacity_blocks):.3f}{store}")  # fmt: skip
    for policy in sorted({check.policy for check in curve.checks}):
        gaps = [check.gap for check in curve.checks if check.policy == policy]
        lines.append(f"{policy}: store - curve from {_gap(min(gaps))} to {_gap(max(gaps))} at {len(gaps)} capacities")
    return lines


def _gap(gap: float) -> str:
    """A gap to three places, or `=` when the store hit exactly the curve's tokens (a rounded 0 would not say)."""
    return "=" if gap == 0 else f"{gap:+.3f}"


def plot(curve: MissRatioCurve, path: Path) -> None:
    """The curve (a step per capacity where it changes, log capacity), each policy's store replays as points, and a
    vertical line at each arm's tier capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d, block_bytes = curve.distances, curve.block_bytes
    top = max(d.distinct_blocks, max((arm.capacity_blocks for arm in curve.arms), default=1), 2)
    capacities = capacity_grid(top, 400, curve.grid)
    figure, axis = plt.subplots(figsize=(10, 5.5))
    axis.step([c * block_bytes for c in capacities], [d.hit_ratio(c) for c in capacities], where="post",
              label="lru (one pass, exact for textbook LRU)")  # fmt: skip
    for policy in sorted({check.policy for check in curve.checks}):
        checks = [check for check in curve.checks if check.policy == policy]
        axis.plot([c.capacity_blocks * block_bytes for c in checks], [c.store_hit_ratio for c in checks], "o",
                  label=f"store, {policy} (per-capacity run)")  # fmt: skip
    axis.axhline(d.ideal_ratio, color="grey", linestyle=":", label=f"ideal {d.ideal_ratio:.3f}")
    by_capacity: dict[int, list[str]] = {}  # arms whose tiers have one capacity share a line and a label
    for arm in curve.arms:
        by_capacity.setdefault(arm.capacity_blocks, []).append(f"{arm.arm}: {arm.tier}")
    for number, (capacity, names) in enumerate(sorted(by_capacity.items())):
        axis.axvline(capacity * block_bytes, color=f"C{number + 3}", linestyle="--", alpha=0.7)
        axis.annotate(", ".join(names), (capacity * block_bytes, 0.5), rotation=90, fontsize=8, va="center",
                      xytext=(3, 0), textcoords="offset points")  # fmt: skip
    axis.set_xscale("log")
    axis.set_xlabel("tier capacity (bytes)")
    axis.set_ylabel("hit ratio (hit tokens / prompt tokens)")
    axis.set_ylim(0, 1)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8, loc="upper left")
    axis.set_title(f"{curve.scenario.name}: miss-ratio curve")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
