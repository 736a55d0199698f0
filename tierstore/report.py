"""What people see of an A/B run or a prediction: rich tables for the terminal and a PNG of the rounds."""

from __future__ import annotations

from pathlib import Path

from rich.table import Table

from kvscope.tierstore.misses import CAUSES, dominant_cause, lost_hit_causes
from kvscope.tierstore.planner import Plan, cause_runs
from kvscope.units import format_bytes


def rounds_table(result: dict) -> Table:
    """Per round, for each arm: hit ratio against the ideal (a mirror's with the range of its seeds where they
    differ), tokens recomputed per request beyond the ideal's, bytes written per tier, evictions, and the cause that
    dominated the missed tokens and the one that dominated the hits lost against the ideal, each with its share (the
    planner's expected one beside it where it differs)."""
    arms = result["arms"]
    table = Table(title=f"{result['scenario']['name']}: hit ratio per round (ideal in the first column)")
    table.add_column("round", justify="right")
    table.add_column("ideal", justify="right")
    for name, arm in arms.items():
        table.add_column(f"{_arm_title(name, arm)}\nhit ratio", justify="right")
        table.add_column(f"{name}\nexcess\nrecompute/req", justify="right")
        for tier in arm["totals"]["written_bytes"]:
            table.add_column(f"{name}\n{tier} written", justify="right")
        table.add_column(f"{name}\nevictions", justify="right")
        table.add_column(f"{name}\nmissed most\n(expected)", justify="left")
        table.add_column(f"{name}\nhits lost to\n(expected)", justify="left")
    first = next(iter(arms.values()))
    for index, row in enumerate(first["rounds"]):
        cells = [str(row["round"]), f"{row['ideal_hit_ratio']:.3f}"]
        for arm in arms.values():
            arm_row = arm["rounds"][index]
            onset = arm["observed_collapse_round"]
            collapsed = onset is not None and arm_row["round"] >= onset
            ratio = f"{arm_row['hit_ratio']:.3f}"
            low, high = arm_row.get("hit_ratio_range", (arm_row["hit_ratio"],) * 2)
            if round(low, 3) != round(high, 3):
                ratio += f" ({low:.3f}-{high:.3f})"
            cells.append(f"[red]{ratio}[/red]" if collapsed else ratio)
            cells.append(f"{arm_row['excess_recompute_tokens_per_request']:,.0f}")
            cells += [format_bytes(arm_row["written_bytes"][tier]) for tier in arm["totals"]["written_bytes"]]
            cells.append(f"{sum(arm_row['evictions'].values()):,}")
            causes = arm_row.get("miss_causes")
            expected = arm["prediction"].get("dominant_miss_cause_by_round") or []
            cells.append(_dominant_cell(causes, expected[index] if index < len(expected) else None))
            expected = arm["prediction"].get("dominant_lost_hit_cause_by_round") or []
            lost = None
            if causes is not None:  # a round at its ideal lost none, whatever an infinite cache misses too
                lost = lost_hit_causes(causes) if arm_row["hit_tokens"] < arm_row["ideal_hit_tokens"] else _NO_MISSES
            cells.append(_dominant_cell(lost, expected[index] if index < len(expected) else None))
        table.add_row(*cells)
    return table


_NO_MISSES = dict.fromkeys(CAUSES, 0) | {"evicted_by_tier": {}}


def _dominant_cell(causes: dict | None, expected: str | None) -> str:
    """The cause most of a round's missed (or lost) tokens had and its share, with the expected one when they
    differ; '-' where the misses were not classified."""
    if causes is None:
        return "-" if expected is None else f"- ({expected})"
    cause = dominant_cause(causes)
    if cause is None:
        return "none" if expected is None else f"none ({expected})"
    text = f"{cause} {causes[cause] / sum(causes[name] for name in CAUSES):.0%}"
    if cause == "evicted" and len(causes["evicted_by_tier"]) > 1:
        text += f" ({max(causes['evicted_by_tier'].items(), key=lambda item: item[1])[0]})"
    return text if expected == cause else f"{text} ({expected or 'none'})"


def miss_cause_line(causes: dict) -> str:
    """The miss causes of a run as shares of its misses: 'cold 21%, evicted 63% (dram), chain_broken 16%'."""
    total = sum(causes[cause] for cause in CAUSES)
    if not total:
        return "no misses"
    parts = []
    for cause in CAUSES:
        if causes[cause]:
            tiers = [tier for tier, tokens in causes["evicted_by_tier"].items() if tokens] if cause == "evicted" else []
            parts.append(f"{cause} {causes[cause] / total:.0%}" + (f" ({', '.join(tiers)})" if tiers else ""))
    return ", ".join(parts)


def _arm_title(name: str, arm: dict) -> str:
    """An arm's column title: its name, and which store served it when that is not the embedded one."""
    if "mirror_of" in arm:
        return f"{name} (sim)"
    kind = arm.get("store", {}).get("kind", "embedded")
    return name if kind == "embedded" else f"{name} ({kind})"


def store_lines(result: dict) -> list[str]:
    """For each arm a real store served: its return codes other than success, retries and refused puts."""
    lines = []
    for name, arm in result["arms"].items():
        store = arm.get("store", {})
        if store.get("kind", "embedded") in ("embedded", "none"):  # no store, or one with nothing to report
            continue
        codes = ", ".join(f"{code} x{count:,}" for code, count in store["codes"].items()) or "none"
        settings = store["settings"]
        lines.append(
            f"{name} ({store['kind']}): return codes other than success: {codes}; put retries "
            f"{store['put_retries']:,}, puts not admitted {store['not_admitted']:,}; lease "
            f"{settings['lease_ttl'] * 1000:g} ms, requests {settings['request_interval'] * 1000:g} ms apart"
        )
    return lines


def verdict_lines(result: dict) -> list[str]:
    """One line per arm: predicted against observed collapse round, and the totals."""
    lines = []
    for name, arm in result["arms"].items():
        predicted, observed = arm["prediction"]["collapse_round"], arm["observed_collapse_round"]
        totals = arm["totals"]
        written = ", ".join(f"{tier} {format_bytes(b)}" for tier, b in totals["written_bytes"].items())
        overflow = arm["prediction"]["overflow_round"]
        if predicted is None and observed is None:
            outcome = "no collapse predicted, none observed"
        elif predicted is None and overflow is not None and result["scenario"]["workload"]["kind"] == "trace":
            outcome = (
                f"working set exceeds capacity from round {overflow} (collapse is not predicted for traces); "
                f"hits first fell below the ideal in round {observed}"
            )
        elif predicted == observed:
            outcome = f"collapse predicted at round {predicted}, observed at round {observed}"
        else:
            outcome = f"collapse predicted at round {predicted}, observed at round {observed} (MISMATCH)"
        causes = totals.get("miss_causes")
        missed = f"; missed tokens: {miss_cause_line(causes)}" if causes else ""
        # what an infinite cache misses is cold: every other cause is a hit the arm lost against its ideal
        lost = lost_hit_causes(causes) if causes else None
        if lost and dominant_cause(lost):
            missed += f"; hits lost against the ideal: {miss_cause_line(lost)}"
        lines.append(
            f"{name}: {outcome}{_depth(arm)}; hit ratio {totals['hit_ratio']:.3f} overall, "
            f"{totals['excess_recompute_tokens_per_request']:,.0f} tokens a request recomputed beyond the ideal's; "
            f"mean TTFT {totals['ttft_s_mean']:.2f} s; written {written}{missed}"
        )
    return lines


def lifecycle_lines(result: dict) -> list[str]:
    """For each arm on an embedded store, its tiers' block lifecycle: the mean of each quantity and the bucket
    holding its median (vLLM's bounds), for the tiers that observed something."""
    lines = []
    for name, arm in result["arms"].items():
        lifecycle = arm["totals"].get("block_lifecycle")
        if not lifecycle:
            continue
        tiers = []
        for tier, quantities in lifecycle["tiers"].items():
            parts = [f"{label} {_histogram_summary(quantities[quantity], lifecycle['bounds_s'])}"
                     for quantity, label in _LIFECYCLE_LABELS.items() if quantities[quantity]["count"]]  # fmt: skip
            if parts:
                tiers.append(f"{tier}: {', '.join(parts)}")
        if tiers:
            lines.append(f"{name} block lifecycle (1 in {lifecycle['sampled_every']} blocks, request clock; mean, "
                         f"median bucket): {'; '.join(tiers)}")  # fmt: skip
    return lines


_LIFECYCLE_LABELS = {"lifetime": "lifetime", "idle_before_evict": "idle before eviction", "reuse_gap": "reuse gap"}


def _histogram_summary(histogram: dict, bounds: list[float]) -> str:
    """'12.5 s (<= 20 s)': the mean, and the smallest bound at or above the median."""
    count = histogram["count"]
    median = next((f"<= {bound:g} s" for bound, below in zip(bounds, histogram["buckets"], strict=True)
                   if 2 * below >= count), f"> {bounds[-1]:g} s")  # fmt: skip
    return f"{histogram['sum'] / count:.3g} s ({median})"


def _depth(arm: dict) -> str:
    """The predicted depth of the collapse beside the observed one: the hit ratios of its round and the next."""
    depth = arm["prediction"].get("collapse_depth") or []
    if not depth:
        return ""
    rounds = "-".join(str(entry["round"]) for entry in depth)
    predicted = ", ".join(f"{entry['hit_ratio']:.3f}" for entry in depth)
    observed = ", ".join(f"{arm['rounds'][entry['round'] - 1]['hit_ratio']:.3f}" for entry in depth)
    return f"; hit ratio in round{'s' if len(depth) > 1 else ''} {rounds} predicted {predicted}, observed {observed}"


def plan_table(the_plan: Plan) -> Table:
    """Per round: requests, prompt tokens, the working set and the ideal hit ratio."""
    table = Table(title="prediction per round")
    for column in ("round", "requests", "prompt tokens", "working set", "ideal hit ratio"):
        table.add_column(column, justify="right")
    for r in the_plan.rounds:
        table.add_row(
            str(r.round), f"{r.requests:,}", f"{r.query_tokens:,}", format_bytes(r.footprint_bytes),
            f"{r.ideal_hit_ratio:.3f}",
        )  # fmt: skip
    return table


def plan_lines(the_plan: Plan) -> list[str]:
    lines = list(the_plan.explanation)
    for name, arm in the_plan.arms.items():
        depth = " then ".join(f"{ratio:.3f}" for _, ratio in arm.collapse_depth)
        depth = f" (hit ratio {depth})" if depth else ""
        lines.append(
            f"[bold]{name}[/bold]: collapse round {arm.collapse_round}{depth}, overflow round {arm.overflow_round}; "
            f"expected to miss most: {cause_runs(arm.dominant_miss_causes, 1)}"
        )
        lines += [f"  {line}" for line in arm.explanation]
    return lines


def plot(result: dict, path: Path) -> None:
    """Hit ratio per round for each arm against the ideal, and bytes written per round, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (ratio_axis, bytes_axis) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    ideal_drawn = False
    for name, arm in result["arms"].items():
        rounds = [r["round"] for r in arm["rounds"]]
        if not ideal_drawn:
            ratio_axis.plot(rounds, [r["ideal_hit_ratio"] for r in arm["rounds"]], "k--", label="ideal (bound)")
            ideal_drawn = True
        ratio_axis.plot(rounds, [r["hit_ratio"] for r in arm["rounds"]], marker="o", label=name)
        predicted = arm["prediction"]["collapse_round"]
        if predicted is not None:
            ratio_axis.axvline(predicted, linestyle=":", color=ratio_axis.lines[-1].get_color())
        for tier in arm["totals"]["written_bytes"]:
            written = [r["written_bytes"][tier] / 1e9 for r in arm["rounds"]]
            bytes_axis.plot(rounds, written, marker=".", label=f"{name}: {tier}")
    ratio_axis.set_ylabel("prefix hit ratio")
    ratio_axis.set_ylim(0, 1.05)
    ratio_axis.set_title(f"{result['scenario']['name']}: hit ratio per round (dotted: predicted collapse)")
    ratio_axis.legend()
    ratio_axis.grid(alpha=0.3)
    bytes_axis.set_ylabel("bytes written per round (GB)")
    bytes_axis.set_xlabel("round")
    bytes_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    bytes_axis.legend()
    bytes_axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
