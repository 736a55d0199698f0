"""The one-pass miss-ratio curve against per-capacity LRU replays; every ratio is measured in one run of this script.

- kvscope: `stack_distances` over Mooncake's conversation trace (examples/trace.yaml), one pass that gives every
  capacity; its rate is block references per second (every block of every request: each is one lookup of the
  pass), goal >= 1 M/s.
- anchor: the per-capacity replay people write first, an OrderedDict LRU of one capacity in which every block a
  request names becomes the most recent, timed over the same requests at one capacity (the arms' 2 TB DRAM tier);
  printed as its own rate and as how many single capacities it replays in the time of the whole curve.
- equality: the curve's prefix hits per round against that replay at five capacities, and against the store with
  policy lru (TieredStore, as `kvscope ab run` runs it) at the same five, printed as the gap in blocks.

Run: .venv/bin/python bench/mrc.py [--repeat N]. A script, not a test: bench/ is outside pytest's testpaths.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from statistics import median

from run_header import print_run_header

from kvscope.tierstore.mrc import arm_tiers, lru_replay, replay_store, stack_distances
from kvscope.tierstore.scenario import load_scenario
from kvscope.tierstore.workloads import make_workload

ROOT = Path(__file__).resolve().parent.parent
TRACE_SCENARIO = ROOT / "examples" / "trace.yaml"
GOAL_PER_S = 1e6
EQUALITY_CAPACITIES = (100, 2_000, 20_000, 44_338, 120_000)  # blocks; 44,338 is the arms' 2 TB DRAM tier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="timed passes of each side (default 5)")
    args = parser.parse_args(argv)
    print_run_header()
    scenario = load_scenario(TRACE_SCENARIO)
    rounds = [list(requests) for requests in make_workload(scenario).rounds()]
    block_tokens = scenario.block_tokens
    arm_capacity = arm_tiers(scenario)[0].capacity_blocks
    curve_s, anchor_s, ratios = [], [], []
    for _ in range(args.repeat):  # interleaved, each ratio within one round: a slow spell hits both sides
        start = time.perf_counter()
        distances = stack_distances(rounds, block_tokens)
        curve_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        lru_replay(rounds, block_tokens, arm_capacity)
        anchor_s.append(time.perf_counter() - start)
        ratios.append(anchor_s[-1] / curve_s[-1])
    references = distances.references
    rate, anchor_rate = references / median(curve_s), references / median(anchor_s)
    print(f"\nconversation trace: {sum(map(len, rounds)):,} requests, {references:,} block references, "
          f"{distances.distinct_blocks:,} distinct blocks (medians of {args.repeat})")  # fmt: skip
    print(f"  one pass, every capacity:        {median(curve_s):.3f} s  {rate / 1e6:5.2f} M lookups/s  "
          f"goal >= {GOAL_PER_S / 1e6:.0f} M/s: {'met' if rate >= GOAL_PER_S else 'MISSED'}")  # fmt: skip
    print(f"  anchor, one capacity ({arm_capacity:,}): {median(anchor_s):.3f} s  {anchor_rate / 1e6:5.2f} M lookups/s")
    print(f"  ratio: the whole curve in {1 / median(ratios):.2f}x the time of one per-capacity replay")
    print("\n  capacity   curve hits  lru replay  store lru  store - curve (blocks)")
    equal = True
    for capacity in EQUALITY_CAPACITIES:
        curve_hits = distances.hit_blocks(capacity)
        replayed = lru_replay(rounds, block_tokens, capacity)
        store = replay_store(scenario, "dram_only", capacity, rounds)
        same = curve_hits == replayed
        equal &= same
        print(f"  {capacity:>8,}  {sum(curve_hits):>11,}  {sum(replayed):>10,}  {sum(store):>9,}  "
              f"{sum(store) - sum(curve_hits):>+8,}   per round: {'equal' if same else 'DIFFERENT'}")  # fmt: skip
    print("  curve = the one pass read at that capacity; lru replay = the anchor at it, compared round by round;\n"
          "  store lru = TieredStore with the arm's lru tier alone at that capacity (its lookup refreshes only the\n"
          "  blocks it hits: no stack algorithm, so its gap is measured, not assumed)")  # fmt: skip
    return 0 if equal else 1


if __name__ == "__main__":
    sys.exit(main())
