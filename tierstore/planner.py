"""The analytic model: footprint per round, the ideal hit ratio, and the round where the hit ratio collapses.

Everything here is arithmetic on the scenario, done before (and without) a simulation. For a multi-round chat:

- each session's cached blocks after round r are B_r = floor(T_r / block_tokens), where T_r is its prompt (plus
  its output when output is cached); the working set is (shared blocks + sessions x own blocks) x block bytes;
- an infinite cache serves, in round r, min(B_{r-1}, floor((P_r - 1) / block_tokens)) blocks per session
  (vLLM always computes the prompt's last token): this ideal hit ratio is the bound every arm is measured against;
- an arm holds one copy of the working set in its largest tier (replicate) or in all tiers together (demote);
- in the first round whose working set exceeds that capacity, a recency policy (lru, tail_first) evicts the
  blocks used longest ago: those of the sessions still waiting for their turn, which then miss. FIFO evicts the
  blocks written first, the heads of sessions already served, so the misses start a round later;
- a miss recomputes the prompt and rewrites the missing blocks, which evicts more chains: the collapse feeds
  itself and the hit ratio falls to zero within a few rounds. The collapse round is the first that loses hits;
- how deep it falls, the hit ratio of the collapse round and of the round after, follows from the order the tier's
  policy keeps its blocks in, followed over runs of blocks (kvscope.tierstore.depth);
- the miss cause expected to dominate each round (kvscope.tierstore.misses): `cold` for what an infinite cache
  misses too (the tokens no earlier request stored), and from the collapse on, of the hits lost, the blocks the
  followed tier still held past a request's hit run (`chain_broken`), those a put had refused (`not_admitted`) and
  the rest (`evicted`).

For a trace the ideal hit ratio and the footprint come from one pass over its hash_ids with an infinite cache;
whether an overflow collapses depends on reuse distances, so only the overflow round is predicted, and a miss cause
only for the rounds before it (an infinite cache's: `cold`, or `chain_broken` behind a block no request had).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.tierstore import scenario as spec
from kvscope.tierstore.depth import FollowedRound, follow_rounds
from kvscope.tierstore.misses import CAUSES, dominant_cause, lost_hit_causes
from kvscope.tierstore.workloads import MultiRoundWorkload, TraceWorkload, make_workload
from kvscope.units import format_bytes


@dataclass(slots=True)
class RoundPlan:
    round: int
    requests: int
    query_tokens: int
    ideal_hit_tokens: int
    footprint_bytes: int  # working set an infinite cache holds at the end of the round
    ideal_chain_broken_tokens: int = 0  # an infinite cache's misses on blocks it holds, behind one it lacks

    @property
    def ideal_hit_ratio(self) -> float:
        return self.ideal_hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class ArmPrediction:
    capacity_bytes: int  # what the arm can hold of one chain set: largest tier (replicate) or sum (demote)
    holding_policy: str
    overflow_round: int | None
    collapse_round: int | None
    explanation: list[str] = field(default_factory=list)
    # (round, predicted hit ratio) of the collapse round and the round after, when there is one
    collapse_depth: list[tuple[int, float]] = field(default_factory=list)
    # per round, the miss cause expected to dominate (kvscope.tierstore.misses.CAUSES); None: no misses expected,
    # or no prediction (a trace past its overflow)
    dominant_miss_causes: list[str | None] = field(default_factory=list)
    # per round, the cause expected to dominate the hits lost against the ideal; None: none expected to be lost, or
    # no prediction (a trace past its overflow)
    dominant_lost_hit_causes: list[str | None] = field(default_factory=list)


@dataclass(slots=True)
class Plan:
    block_tokens: int
    bytes_per_token: int
    block_bytes: int
    rounds: list[RoundPlan]
    arms: dict[str, ArmPrediction]
    explanation: list[str]

    def arm_json(self, arm: str) -> dict:
        """The `prediction` object of the simulation contract for one arm."""
        prediction = self.arms[arm]
        return {
            "collapse_round": prediction.collapse_round,
            "collapse_depth": [{"round": number, "hit_ratio": ratio} for number, ratio in prediction.collapse_depth],
            "overflow_round": prediction.overflow_round,
            "capacity_bytes": prediction.capacity_bytes,
            "footprint_bytes_by_round": [r.footprint_bytes for r in self.rounds],
            "ideal_hit_ratio_by_round": [r.ideal_hit_ratio for r in self.rounds],
            "dominant_miss_cause_by_round": prediction.dominant_miss_causes,
            "dominant_lost_hit_cause_by_round": prediction.dominant_lost_hit_causes,
            "explanation": self.explanation + prediction.explanation,
        }


def plan(scenario: spec.Scenario) -> Plan:
    workload = make_workload(scenario)
    block_bytes = scenario.block_bytes
    if isinstance(workload, MultiRoundWorkload):
        rounds = _multi_round(workload, block_bytes)
    else:
        rounds = _trace(workload, block_bytes)
    explanation = _geometry_explanation(scenario)
    if isinstance(workload, MultiRoundWorkload):
        explanation += _workload_explanation(workload, scenario.block_bytes)
    result = Plan(
        scenario.block_tokens,
        scenario.kv.token_bytes,
        scenario.block_bytes,
        rounds,
        {},
        explanation,
    )
    for name, arm in scenario.runnable_arms.items():
        result.arms[name] = _predict_arm(scenario, workload, result, arm)
    return result


def _multi_round(workload: MultiRoundWorkload, block_bytes: int) -> list[RoundPlan]:
    w, block = workload.spec, workload.block_tokens
    shared = w.shared_prefix_tokens // block
    rounds: list[RoundPlan] = []
    cached_before = 0  # blocks each session has cached before this round
    for number in range(1, w.rounds + 1):
        prompt = workload.prompt_tokens(number)
        hittable = (prompt - 1) // block
        own_hits = min(cached_before, hittable)
        # in round 1 only the shared prefix is cached, and only once the first session has written it
        ideal_blocks = (w.sessions - 1) * min(shared, hittable) if number == 1 else w.sessions * own_hits
        cached_after = _cached_blocks(w, prompt, block)
        footprint = (shared + w.sessions * (cached_after - shared)) * block_bytes
        rounds.append(RoundPlan(number, w.sessions, w.sessions * prompt, ideal_blocks * block, footprint))
        cached_before = cached_after
    return rounds


def _cached_blocks(w: spec.MultiRoundWorkload, prompt: int, block: int) -> int:
    return (prompt + (w.output_tokens if w.output_cached else 0)) // block


def _trace(workload: TraceWorkload, block_bytes: int) -> list[RoundPlan]:
    seen: set[int] = set()
    rounds: list[RoundPlan] = []
    block = workload.block_tokens
    for number, requests in enumerate(workload.rounds(), start=1):
        query = hits = broken = 0
        for request in requests:
            hittable = min(len(request.keys), (request.prompt_tokens - 1) // block)
            run = 0
            while run < hittable and request.keys[run] in seen:
                run += 1
            hits += run * block
            broken += sum(key in seen for key in request.keys[run:hittable]) * block
            query += request.prompt_tokens
            seen.update(request.keys)
        rounds.append(RoundPlan(number, len(requests), query, hits, len(seen) * block_bytes, broken))
    return rounds


def _predict_arm(
    scenario: spec.Scenario, workload: MultiRoundWorkload | TraceWorkload, result: Plan, arm: spec.ArmSpec
) -> ArmPrediction:
    if not arm.tiers:  # a vLLM engine alone: its prefix cache holds what there is, freed tail first
        blocks = scenario.engine.vllm.gpu_blocks - 1  # type: ignore[union-attr]
        holding = spec.TierSpec(name="gpu", capacity=blocks * scenario.block_bytes, policy="tail_first")
        capacity = _holds(arm, holding)
        how = f"vLLM's own prefix cache ({blocks} blocks: it keeps one back), no store behind it"
    elif len(arm.tiers) == 1:
        holding = arm.tiers[0]
        capacity = _holds(arm, holding)
        how = f"the {holding.name} tier"
    elif arm.placement == "replicate":
        holding = max(arm.tiers, key=lambda tier: _holds(arm, tier))
        capacity = _holds(arm, holding)
        how = f"replicate: every block lands in every tier, so the largest tier ({holding.name}) bounds it"
    else:
        holding = arm.tiers[-1]
        capacity = sum(_holds(arm, tier) for tier in arm.tiers)
        how = "demote: tiers are exclusive, so their capacities add up"
    policy, evicts = holding.policy, holding.policy
    if arm.store == "mooncake" or (arm.tiers and arm.tiers[0].policy == "mooncake"):
        watermark = arm.mooncake_settings.eviction_high_watermark
        how += f"; Mooncake evicts once its segment is above {watermark:g} of its size"
        # the objects whose lease (granted by every exist and get) ran out first: the least recently used
        policy, evicts = "lru", "Mooncake (oldest lease first, as lru)"
    overflow = next((r.round for r in result.rounds if r.footprint_bytes > capacity), None)
    explanation = [f"capacity {format_bytes(capacity)} ({how}); evictions by {evicts}"]
    ideal_causes = [_dominant_ideal_cause(r) for r in result.rounds]
    none_lost: list[str | None] = [None] * len(result.rounds)

    def without_collapse(overflow_round: int | None, causes: list[str | None]) -> ArmPrediction:
        return ArmPrediction(capacity, policy, overflow_round, None, explanation, dominant_miss_causes=causes,
                             dominant_lost_hit_causes=none_lost)  # fmt: skip

    if overflow is None:
        explanation.append("the working set never exceeds it: every round can reach its ideal, no collapse")
        return without_collapse(None, ideal_causes)
    footprint = result.rounds[overflow - 1].footprint_bytes
    explanation.append(f"round {overflow} is the first whose working set ({format_bytes(footprint)}) exceeds it")
    if not isinstance(workload, MultiRoundWorkload):
        explanation.append("for a trace, whether the overflow collapses depends on reuse: run the A/B to see")
        causes = ideal_causes[: overflow - 1] + [None] * (len(result.rounds) - overflow + 1)
        return without_collapse(overflow, causes)
    collapse, reason = _collapse_round(workload, result, capacity, policy, overflow)
    explanation.append(reason)
    if len(arm.tiers) > 1:
        explanation.append("several tiers are modelled as one of that capacity: the collapse round is approximate")
    if workload.spec.order != "round_robin":
        explanation.append("the model assumes round-robin order: with shuffled order treat it as approximate")
    if collapse is None:
        return without_collapse(overflow, ideal_causes)
    segment = _is_segment(arm, holding)
    followed = follow_rounds(workload, "mooncake" if segment else holding.policy,
                             holding.capacity if segment else capacity, scenario.block_bytes, workload.round_count,
                             arm.mooncake_settings)  # fmt: skip
    depth = _collapse_depth(followed, "mooncake" if segment else holding.policy, collapse)
    explanation.append(depth[1])
    followed_causes = [
        _followed_causes(planned, round_)
        for planned, round_ in zip(result.rounds[collapse - 1 :], followed[collapse - 1 :], strict=True)
    ]
    causes = ideal_causes[: collapse - 1] + [dominant_cause(round_causes) for round_causes in followed_causes]
    lost = none_lost[: collapse - 1] + [dominant_cause(lost_hit_causes(found)) for found in followed_causes]
    explanation.append(f"the miss cause expected to dominate from round {collapse}: {cause_runs(causes, collapse)}")
    explanation.append(f"the cause expected to dominate the hits lost against the ideal: {cause_runs(lost, collapse)}")
    return ArmPrediction(capacity, policy, overflow, collapse, explanation, depth[0], causes, lost)


def _dominant_ideal_cause(planned: RoundPlan) -> str | None:
    """What an infinite cache's misses are: never stored (`cold`), or held behind a block never stored."""
    broken = planned.ideal_chain_broken_tokens
    return dominant_cause(
        dict.fromkeys(CAUSES, 0) | {"cold": planned.query_tokens - planned.ideal_hit_tokens - broken,
                                    "chain_broken": broken}
    )  # fmt: skip


def _followed_causes(planned: RoundPlan, followed: FollowedRound) -> dict[str, float]:
    """The expected causes of a round the tier model followed: the infinite cache's misses are `cold`; of the hits
    lost, those held past a request's hit run are `chain_broken`, those a put refused `not_admitted`, the rest
    `evicted`."""
    lost = max(0.0, planned.ideal_hit_tokens - followed.hit_tokens)
    broken = min(followed.held_past_hit_tokens, lost)
    refused = min(followed.refused_tokens, lost - broken)
    return dict.fromkeys(CAUSES, 0) | {
        "cold": planned.query_tokens - planned.ideal_hit_tokens, "chain_broken": broken, "not_admitted": refused,
        "evicted": lost - broken - refused,
    }  # fmt: skip


def cause_runs(causes: list[str | None], first: int) -> str:
    """Rounds from `first` on grouped by their expected cause: 'chain_broken in rounds 8-9, evicted in 10-20'."""
    runs: list[tuple[str | None, int, int]] = []
    for number, cause in enumerate(causes[first - 1 :], start=first):
        if runs and runs[-1][0] == cause:
            runs[-1] = (cause, runs[-1][1], number)
        else:
            runs.append((cause, number, number))
    return ", ".join(
        f"{cause or 'no misses'} in round{'s' if lo != hi else ''} {lo}{f'-{hi}' if lo != hi else ''}"
        for cause, lo, hi in runs
    )


def _holds(arm: spec.ArmSpec, tier: spec.TierSpec) -> int:
    """What a tier holds before it starts evicting: a Mooncake segment evicts above its high watermark."""
    if _is_segment(arm, tier):
        return int(tier.capacity * arm.mooncake_settings.eviction_high_watermark)
    return tier.capacity


def _is_segment(arm: spec.ArmSpec, tier: spec.TierSpec) -> bool:
    """Whether `tier` is a Mooncake segment: a real Mooncake arm's DRAM, or the embedded model of one."""
    return (arm.store == "mooncake" and tier.name == "dram") or tier.policy == "mooncake"


def _collapse_depth(followed: list[FollowedRound], policy: str, collapse: int) -> tuple[list[tuple[int, float]], str]:
    """The predicted hit ratio of the collapse round and the round after (if any), and why, from the rounds the
    holding tier's model followed (a Mooncake segment at its full size: its eviction thread keeps the watermark,
    any other holding tier at the capacity)."""
    last = min(collapse + 1, len(followed))
    depth = [(number, followed[number - 1].hit_ratio) for number in range(collapse, last + 1)]
    figures = " and ".join(f"{ratio:.3f} in round {number}" for number, ratio in depth)
    expected = " (expected over the random order of a batch's leases)" if policy == "mooncake" else ""
    return depth, f"{policy}'s eviction order, followed over runs of blocks, leaves hit ratio {figures}{expected}"


def _collapse_round(
    workload: MultiRoundWorkload, result: Plan, capacity: int, policy: str, overflow: int
) -> tuple[int | None, str]:
    """The first round that loses hits, given the round whose working set first exceeds `capacity`."""
    if overflow == 1:
        loses_now, why = _round_one_loses(workload, result, capacity, policy)
    else:
        loses_now, why = _overflow_round_loses(workload, result, capacity, policy, overflow)
    collapse = overflow if loses_now else overflow + 1
    if collapse > len(result.rounds):
        return None, f"{why}; the first round to lose hits would come after the last round"
    return collapse, (
        f"{why}: round {collapse} is the first to lose hits; each miss recomputes and rewrites its chain, "
        "evicting more chains (the collapse feeds itself)"
    )


def _round_one_loses(workload: MultiRoundWorkload, result: Plan, capacity: int, policy: str) -> tuple[bool, str]:
    """Round 1 can only lose hits on the shared prefix, when it is evicted before a later session reads it."""
    w, block = workload.spec, result.block_tokens
    shared = min(w.shared_prefix_tokens // block, (workload.prompt_tokens(1) - 1) // block)
    if shared == 0 or w.sessions == 1:
        return False, "round 1 reuses nothing"
    session_bytes = _cached_blocks(w, workload.prompt_tokens(1), block) * result.block_bytes
    if policy == "fifo":
        # the shared blocks were written first, so they go first: lost once all but the last session have written
        written_before_last = session_bytes + (w.sessions - 2) * (session_bytes - shared * result.block_bytes)
        return written_before_last > capacity, "fifo evicts the shared prefix first: it was written first"
    return session_bytes > capacity, f"{policy} keeps the shared prefix hot unless one session outgrows the tier"


def _overflow_round_loses(
    workload: MultiRoundWorkload, result: Plan, capacity: int, policy: str, overflow: int
) -> tuple[bool, str]:
    """Whether eviction reaches a block some session still needs before that session's turn in this round."""
    w, rounds = workload.spec, result.rounds
    shared = w.shared_prefix_tokens // result.block_tokens
    before = rounds[overflow - 2].footprint_bytes
    growth = (rounds[overflow - 1].footprint_bytes - before) / w.sessions  # bytes each session adds
    room = capacity - before
    if policy == "fifo" and shared == 0:
        # FIFO gives up blocks in the order they were first written: the round-1 blocks of the sessions served
        # first. The next session loses its head once eviction has eaten every served session's round-1 blocks.
        first_written = rounds[0].footprint_bytes / w.sessions
        loses = any(served * growth - room > served * first_written for served in range(1, w.sessions))
        return loses, "fifo evicts the oldest-written blocks: the heads of sessions already served this round"
    if policy == "fifo":
        # the shared prefix was written first of all: once eviction starts every later session loses its head
        return (w.sessions - 1) * growth > room, "fifo evicts the shared prefix first: it was written first"
    # Recency policies evict the blocks used longest ago: the own blocks of sessions still waiting for their turn.
    # The shared prefix stays hot, unless a single session's chain outgrows the tier and evicts its own head.
    own_before = _cached_blocks(w, workload.prompt_tokens(overflow - 1), result.block_tokens) - shared
    chain_bytes = _cached_blocks(w, workload.prompt_tokens(overflow), result.block_tokens) * result.block_bytes
    if shared and w.sessions > 1 and chain_bytes > capacity:
        return True, f"one session's chain ({format_bytes(chain_bytes)}) outgrows the tier and evicts the shared prefix"
    loses = own_before > 0 and (w.sessions - 1) * growth > room
    return loses, (
        f"{policy} evicts the blocks used longest ago, those of sessions still waiting their turn: "
        f"room for {max(0.0, room / growth):.1f} sessions' new blocks out of {w.sessions}"
    )


def _workload_explanation(workload: MultiRoundWorkload, block_bytes: int) -> list[str]:
    w, block = workload.spec, workload.block_tokens
    shared = w.shared_prefix_tokens // block
    cached = " + its output" if w.output_cached else ""
    return [
        f"prompt of each session in round r: {w.first_prompt_tokens:,} + (r - 1) x ({w.output_tokens:,} output + "
        f"{w.user_tokens:,} user) tokens; cached after the round: the full {block}-token blocks of it{cached}",
        f"working set after round r: ({shared} shared blocks + {w.sessions} sessions x own blocks) x "
        f"{format_bytes(block_bytes)}",
    ]


def _geometry_explanation(scenario: spec.Scenario) -> list[str]:
    kv = scenario.kv
    if kv.model is not None:
        m = kv.model
        if m.kv_lora_rank is not None:
            source = f"MLA: {m.layers} layers x ({m.kv_lora_rank} + {m.qk_rope_head_dim or 0}) x {m.dtype}"
        else:
            source = f"2 (K,V) x {m.layers} layers x {m.kv_heads} KV heads x {m.head_dim} head dim x {m.dtype}"
    else:
        source = "given"
    return [
        f"KV bytes per token: {kv.token_bytes:,} B ({source})",
        f"block: {scenario.block_tokens} tokens x {kv.token_bytes:,} B = {format_bytes(scenario.block_bytes)}",
    ]
