"""Scenarios as the API accepts them: the YAML schema as JSON, minus what would touch the server's files or take
it down: a bounded amount of simulated work, real-bytes tiers (memory, file) of bounded size, and real Mooncake
arms of bounded size and duration."""

from __future__ import annotations

from fastapi import HTTPException, status

from kvscope.tierstore.scenario import ArmSpec, Scenario

MAX_BLOCK_LOOKUPS = 50_000_000  # the work of an A/B, in block lookups: about a minute; long_output is 1.6 M + 0.8 M
# Each round of each arm is also recorded: a scrape of its engine through the exporters and the round's database
# commits, ~20 ms on a 2-core machine, what this many lookups cost (1 session x 1,000 rounds is cheap in lookups
# and still minutes of commits)
ROUND_COST_LOOKUPS = 20_000
MAX_REQUESTS = 1_000_000  # sessions x rounds: each request is an object and a pass of the engine
# Every round costs each arm a row of the answer (predict, an A/B's detail) and a recorded scrape, whatever its
# requests: a 700-byte body of 10 arms x 1,000,000 rounds once asked for a 136 MB prediction.
MAX_ROUNDS = 1_000
MAX_ARMS = 16
# Each tier of an arm (attached ones too) is a key of four maps in every row of the arm and a line of its layout: so
# bounded, a row is about 2 KB at most (200 tiers named in 60 characters made rows of 60 KB, and a 1 MB body holds
# thousands of tiers)
MAX_TIERS = 8
MAX_TIER_NAME = 32
MAX_REAL_BYTES = 2 * 1024**3  # memory and file backends hold real bytes: their sum over a scenario's arms
# A real Mooncake arm holds its segment in memory and its SSD tier on the service's disk, and paces its requests
# (request_interval): bound both, and the requests, so one A/B takes minutes, not hours.
MAX_MOONCAKE_SEGMENT = 1024**3
MAX_MOONCAKE_SSD = 4 * 1024**3
# The example body of the OpenAPI documentation: two policies on a small embedded DRAM tier
EXAMPLE_SCENARIO = {
    "name": "small",
    "workload": {"kind": "multi_round", "sessions": 4, "rounds": 3, "first_prompt_tokens": 512,
                 "user_tokens": 128, "output_tokens": 64},
    "kv": {"block_tokens": 128, "bytes_per_token": 1024},
    "arms": {"lru": {"tiers": [{"name": "dram", "capacity": 1048576}]},
             "tail_first": {"tiers": [{"name": "dram", "capacity": 1048576, "policy": "tail_first"}]}},
}  # fmt: skip
MAX_REAL_REQUESTS = 2_000  # sessions x rounds
MAX_MOONCAKE_INTERVAL_S = 1.0
MAX_VLLM_GPU_BLOCKS = 4096  # a real vLLM engine's prefix cache, in blocks (its KV cache is reserved up front)


def accept(scenario: Scenario) -> Scenario:
    """Refuse trace workloads and file paths (over HTTP a scenario must not name files on the server), and
    scenarios whose simulation or real-bytes tiers would exhaust the service."""
    problems = []
    workload = scenario.workload
    if workload.kind == "trace":
        problems.append(("workload", "kind", "trace workloads read a file on the server: use the CLI for traces"))
    else:
        problems += _too_much_work(scenario)
    for arm_name, arm in scenario.arms.items():
        problems += _tier_bounds(arm_name, arm)
        for tier in arm.tiers + arm.attached:
            if tier.path is not None:
                problems.append(
                    ("arms", arm_name, "tiers", tier.name, "path", "file backends use the service's workdir")
                )
    if (held := real_bytes(scenario)) > MAX_REAL_BYTES:
        arm_name, tier = max(
            ((name, tier) for name, arm in scenario.arms.items() for tier in arm.tiers + arm.attached
             if tier.backend != "accounting"),
            key=lambda found: found[1].capacity,
        )  # fmt: skip
        limit = (
            f"the memory and file tiers hold {held:,} B of real bytes in all; at most {MAX_REAL_BYTES:,} B over the API"
        )
        problems.append(("arms", arm_name, "tiers", tier.name, "capacity", limit))
    problems += _real_store_limits(scenario) + _real_components_missing(scenario)
    if problems:
        detail = [{"loc": ["body", "scenario", *p[:-1]], "msg": p[-1], "type": "value_error"} for p in problems]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_CONTENT, detail)
    return scenario


def real_bytes(scenario: Scenario) -> int:
    """The real bytes an A/B of `scenario` may hold at once: the capacities of every arm's memory and file tiers
    (arms run at the same time)."""
    return sum(
        tier.capacity
        for arm in scenario.arms.values()
        for tier in arm.tiers + arm.attached
        if tier.backend != "accounting"
    )


def _tier_bounds(arm_name: str, arm: ArmSpec) -> list[tuple]:
    """At most MAX_TIERS tiers in an arm, attached ones included, each named in at most MAX_TIER_NAME characters."""
    problems: list[tuple] = []
    if (count := len(arm.tiers) + len(arm.attached)) > MAX_TIERS:
        problems.append(
            ("arms", arm_name, "tiers", f"{count} tiers (attached ones included) is more than an arm has over the API "
             f"({MAX_TIERS})")
        )  # fmt: skip
    for kind, tiers in (("tiers", arm.tiers), ("attached", arm.attached)):
        for index, tier in enumerate(tiers):
            if len(tier.name) > MAX_TIER_NAME:
                msg = f"a tier's name is at most {MAX_TIER_NAME} characters over the API"
                problems.append(("arms", arm_name, kind, index, "name", msg))
    return problems


def _real_components_missing(scenario: Scenario) -> list[tuple]:
    """A real Mooncake store or vLLM engine the scenario needs and this service cannot run, named with why."""
    from kvscope.tierstore.mooncake import mooncake_missing
    from kvscope.tierstore.vllm import vllm_missing

    problems: list[tuple] = []
    if any(arm.store == "mooncake" for arm in scenario.arms.values()) and (missing := mooncake_missing()):
        problems.append(("arms", f"a real Mooncake store cannot run on this service: {missing}"))
    if scenario.engine.kind == "vllm" and (missing := vllm_missing()):
        problems.append(("engine", "kind", f"a real vLLM engine cannot run on this service: {missing}"))
    return problems


def _real_store_limits(scenario: Scenario) -> list[tuple]:
    """Mooncake arms and vLLM engines: segment and SSD sizes, GPU blocks, requests and pacing within what the
    service runs."""
    problems: list[tuple] = []
    if scenario.engine.vllm is not None and scenario.engine.vllm.gpu_blocks > MAX_VLLM_GPU_BLOCKS:
        msg = f"a real vLLM engine has at most {MAX_VLLM_GPU_BLOCKS:,} blocks over the API"
        problems.append(("engine", "vllm", "gpu_blocks", msg))
    for name, arm in scenario.arms.items():
        if arm.store != "mooncake":
            continue
        limits = {"dram": MAX_MOONCAKE_SEGMENT, "ssd": MAX_MOONCAKE_SSD}
        for tier in arm.tiers + arm.attached:
            if tier.capacity > limits[tier.name]:
                msg = f"a mooncake {tier.name} tier is at most {limits[tier.name]:,} B over the API"
                problems.append(("arms", name, "tiers", tier.name, "capacity", msg))
        interval = arm.mooncake_settings.request_interval
        if interval > MAX_MOONCAKE_INTERVAL_S:
            msg = f"at most {MAX_MOONCAKE_INTERVAL_S:g} s between requests over the API"
            problems.append(("arms", name, "mooncake", "request_interval", msg))
    w = scenario.workload
    real = any(scenario.served_apart(name) for name in scenario.arms)
    if real and w.kind == "multi_round" and w.sessions * w.rounds > MAX_REAL_REQUESTS:
        requests = w.sessions * w.rounds
        msg = f"{requests:,} requests on a real store or engine; the service runs at most {MAX_REAL_REQUESTS:,}"
        problems.append(("workload", msg))
    return problems


def _too_much_work(scenario: Scenario) -> list[tuple]:
    """The simulation's size from arithmetic alone: requests, and the work in block lookups (at least one per
    request, and a recorded round's worth per round of each arm)."""
    w = scenario.workload
    problems = []
    if w.rounds > MAX_ROUNDS:
        problems.append(("workload", "rounds", f"{w.rounds:,} rounds is more than the service runs ({MAX_ROUNDS:,})"))
    if len(scenario.arms) > MAX_ARMS:
        problems.append(("arms", f"{len(scenario.arms)} arms is more than the service runs ({MAX_ARMS})"))
    requests = w.sessions * w.rounds
    # every session's prompt grows by (output + user) tokens a round: sum over rounds in closed form
    tokens = w.sessions * (
        w.rounds * w.first_prompt_tokens + (w.output_tokens + w.user_tokens) * w.rounds * (w.rounds - 1) // 2
    )
    lookups = (tokens // scenario.block_tokens + requests + w.rounds * ROUND_COST_LOOKUPS) * len(scenario.arms)
    if requests > MAX_REQUESTS:
        problems.append(
            (
                "workload",
                f"{requests:,} requests (sessions x rounds) is more than the service simulates ({MAX_REQUESTS:,})",
            )
        )
    if lookups > MAX_BLOCK_LOOKUPS:
        problems.append(
            (
                "workload",
                f"{lookups:,} block lookups of work (each recorded round counts {ROUND_COST_LOOKUPS:,}) is "
                f"more than the service simulates ({MAX_BLOCK_LOOKUPS:,})",
            )
        )
    return problems
