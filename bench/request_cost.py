"""Where a request's time goes in the embedded store, per stream and policy, against bench/sim.py's naive LRU; every
figure is measured in one run of this script.

For each stream of bench/sim.py (the long-output scenario's two arms and Mooncake's conversation trace, under `lru`,
`mooncake` and `lmcache`), microseconds per request of:
  - naive: the anchor of bench/sim.py, an OrderedDict LRU's get + put per block over the same requests;
  - serve: EngineEmulator.serve, what `kvscope ab run` times a request with (the whole-requests column of sim.py);
  - no causes: the same without the miss ledger (`build_engine(..., explains_misses=False)`, as a what-if sweep);
  - no checks (mooncake only): without the existence checks' leases (the tier's `probe` skipped);
  - neither: without both.
The last two are not the Mooncake model any more (a lookup then leases nothing): they are timed to show what the rest
of a request costs, so what a policy's own work leaves of the 1.2x goal. Ratios are naive time / that time.

Run: .venv/bin/python bench/request_cost.py [--repeat N]. A script, not a test: bench/ is outside pytest's testpaths.
"""

from __future__ import annotations

import argparse
import sys
import time
from statistics import median

from run_header import print_run_header
from sim import (
    REQUEST_GOAL_RATIO,
    Stream,
    long_output_streams,
    lookup_per_block,
    replay_naive,
    stream_engine,
    trace_stream,
)

from kvscope.tierstore.mooncake_tier import MooncakeTier


def serve_seconds(stream: Stream, causes: bool, checks: bool) -> float:
    """EngineEmulator.serve over the stream on the arm's clock, as bench/sim.py times it, with or without the miss
    ledger (`causes`) and the existence checks' leases (`checks`)."""
    engine = stream_engine(stream, explains_misses=causes)
    if not checks:
        for tier in engine.store.tiers:
            if isinstance(tier, MooncakeTier):
                tier.probe = lambda keys: None  # the existence check leases nothing
    start = time.perf_counter()
    for request in stream.requests:
        engine.serve(request)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5, help="replays of each variant (default 5)")
    args = parser.parse_args(argv)
    print_run_header()
    lru = [*long_output_streams(), trace_stream(20_000)]
    streams = lru + [stream.under(policy) for policy in ("mooncake", "lmcache") for stream in lru]
    goal = f"goal >= {REQUEST_GOAL_RATIO}x"
    print(f"\nmicroseconds per request (medians of {args.repeat}; in brackets naive / that, {goal})")
    print(f"   {'stream':<32} {'naive':>7} {'serve':>15} {'no causes':>15} {'no checks':>15} {'neither':>15}")
    for stream in streams:
        variants = {"serve": (True, True), "no causes": (False, True)}
        if "mooncake" in stream.label:
            variants |= {"no checks": (True, False), "neither": (False, False)}
        times: dict[str, list[float]] = {"naive": [], **{name: [] for name in variants}}
        for _ in range(args.repeat):  # interleaved, so a slow spell of the machine hits every variant
            times["naive"].append(replay_naive(stream, lookup_per_block).total_s)
            for name, (causes, checks) in variants.items():
                times[name].append(serve_seconds(stream, causes, checks))
        per_request = {name: median(seconds) * 1e6 / len(stream.requests) for name, seconds in times.items()}
        naive = per_request["naive"]
        cells = [
            f"{per_request[name]:>7.1f} ({naive / per_request[name]:.2f}x)" if name in per_request else f"{'':>15}"
            for name in ("serve", "no causes", "no checks", "neither")
        ]
        print(f"   {stream.label:<32} {naive:>7.1f} {' '.join(cells)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
