"""A/B arms served by a real vLLM engine (`engine.kind: vllm`) in front of a real Mooncake store.

Per arm: the arm's Mooncake processes (kvscope.tierstore.mooncake: metadata server, master, and kvscope's store
client holding the global segment and the SSD tier) and one vLLM server whose own Mooncake connector
(`MooncakeStoreConnector`, `kv_role: kv_both`, Mooncake's `standalone-store` mode: it contributes no memory of its
own) saves to and loads from that store. The GPU tier is vLLM's prefix cache of `engine.vllm.gpu_blocks` blocks.
An arm without tiers is vLLM alone: its prefix cache, no connector, no store.

The multi-round workload becomes chat requests with exactly the spec's token counts (the tiny model's word-level
tokenizer: a word is a token): a system message of `shared_prefix_tokens` words shared by every session, a first
user message completing `first_prompt_tokens`, then each round the previous answer (exactly `output_tokens`, via
`max_tokens`, `min_tokens` and `ignore_eos`) and `user_tokens` new words. Requests go one at a time, in the
workload's order, paced by the arm's `mooncake.request_interval` as the Mooncake arms are: the lease a request's
lookups grant runs out by the time its session comes round again, whatever the machine's speed (a request that
could not start on time is reported as the round's `late_s`).

A round's figures come from what the engine and the store did, scraped between rounds with kvscope's own `vllm`
and `mooncake` sources: prompt tokens by where they came from (vLLM's prefix cache, the external store, recomputed),
TTFT from vLLM's histogram, preemptions, the connector's saves and loads, Mooncake's bytes per medium and evictions.
The responses' `cached_tokens` are held against the counters every round and a disagreement is reported in the row.
Each request's missed tokens get a cause from the engine's KV events and the store's existence check
(kvscope.tierstore.vllm_misses).
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import httpx

from kvscope.exporters.scrape import Scraper, TargetState
from kvscope.exporters.vllm import VllmTargetConfig
from kvscope.processes import owned_directory
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.engine import EngineCounters
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.misses import causes_between
from kvscope.tierstore.mooncake import ERROR_NAMES, MooncakeError, MooncakeStore, Pacer, connector_key_prefix
from kvscope.tierstore.planner import Plan, RoundPlan
from kvscope.tierstore.store import NoStore
from kvscope.tierstore.vllm import TinyModel, VllmServer, cpu_share, words
from kvscope.tierstore.vllm_misses import EventMissLedger, KvEventFollower, RequestMisses
from kvscope.tierstore.workloads import make_workload

_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "fp32": "float32", "float32": "float32"}  # fmt: skip
_SOURCES = {"local_cache_hit": "gpu", "external_kv_transfer": "external", "local_compute": "computed"}
_SESSION_STRIDE, _ROUND_STRIDE = 211, 3119  # where each session's and round's words start in the vocabulary
# the connector's warnings: "Failed to get N Mooncake keys ... first_failures=[('key', -707), ...]" and
# "batch_put failed: N/M keys failed (codes={-200}, ...)"
_LOAD_CODES = re.compile(r"', (-\d+)\)")
_PUT_CODES = re.compile(r"codes=\{([-\d, ]+)\}")


def tiny_model(scenario: spec.Scenario) -> TinyModel:
    """The model kvscope makes for the scenario's engine: `kv.model`'s shape, so its KV bytes per token are the
    scenario's."""
    model, settings = scenario.kv.model, scenario.engine.vllm
    assert model is not None and model.kv_heads and model.head_dim and settings is not None
    made = TinyModel(
        vocab=settings.vocab,
        hidden=settings.heads * model.head_dim,
        layers=model.layers,
        heads=settings.heads,
        kv_heads=model.kv_heads,
        max_model_len=scenario.vllm_max_model_len,
        dtype=_DTYPES[model.dtype],
    )
    assert made.bytes_per_token == scenario.kv.token_bytes, (made, scenario.kv.token_bytes)
    return made


class _Bookkeeping:
    """What the `tierstore` source publishes of a vLLM arm: the round counter, the planner's bound and the miss
    causes, so a recording can be cut into rounds and held against the ideal (the engine's own counters come from
    vLLM)."""

    gpu_cache = None

    def __init__(self, misses: EventMissLedger) -> None:
        self.misses = misses
        self.counters = EngineCounters()
        self.store = self  # the tierstore source reads engine.store.tiers and .attached: none here
        self.tiers: list = []
        self.attached: list = []


class VllmArm:
    """One arm on a real vLLM engine and a real Mooncake store, served a round at a time (as ArmRun)."""

    def __init__(
        self,
        scenario: spec.Scenario,
        name: str,
        the_plan: Plan,
        workdir: Path | None = None,
        published_as: str | None = None,
    ) -> None:
        started = time.monotonic()
        self.scenario, self.name, self.plan = scenario, name, the_plan
        self.spec = scenario.runnable_arms[name]
        self.system = published_as or f"{scenario.name}/{name}"
        settings = scenario.engine.vllm
        assert settings is not None
        self._dir = owned_directory("kvscope-vllm-")
        self._loop = asyncio.new_event_loop()
        self._client = httpx.Client(timeout=settings.request_timeout)
        self.server: VllmServer | None = None
        self.events: KvEventFollower | None = None
        # vLLM alone (an arm without tiers): no store, no connector, requests as fast as the engine takes them
        self.store: MooncakeStore | NoStore = NoStore()
        self.pacer = Pacer(self.spec.mooncake_settings.request_interval if self.spec.tiers else 0.0)
        try:
            extra_args, env = (), {}
            if self.spec.tiers:
                self.store = MooncakeStore(self.spec, scenario.block_bytes, self.system)
                extra_args, env = self._connector()
            self.events = KvEventFollower(f"kv-events-{self.system}".replace("/", "-"), self._loop)
            event_args, event_env = self.events.server_args()
            extra_args, env = (*extra_args, *event_args), {**env, **event_env}
            model = tiny_model(scenario).build(self._dir / "model")
            self.server = VllmServer(
                model, self._dir, settings.gpu_blocks, scenario.block_tokens, scenario.vllm_max_model_len,
                extra_args=extra_args, env=env, label=f"arm {name}",
                cpus=cpu_share(list(scenario.arms).index(name), len(scenario.arms)),  # the arms run at once
            )  # fmt: skip
            self.server.wait_ready(settings.start_timeout)
            self.version = self.server.version()
            # what the server and its engine processes listen on, as the kernel showed it once it was ready
            self.listening = [str(socket) for socket in self.server.process.listening()]
            self.ipc_listening = self.server.ipc_listening
            target = VllmTargetConfig(
                name=f"vllm-{self.system}".replace("/", "-"), source="vllm", url=f"{self.server.url}/metrics",
                labels={"system": self.system, "engine": self.system},
            )  # fmt: skip
            self._scraper = Scraper([target])
            store = self.store if isinstance(self.store, MooncakeStore) else None
            self.misses = RequestMisses(
                self.events, scenario.block_tokens, store, store.write_path[-1] if store else None,
                connector_key_prefix(model.name),  # the connector names a model by its directory's name
            )  # fmt: skip
            self.engine = _Bookkeeping(self.misses.ledger)
            if published_as:
                ENGINES.publish(published_as, self.engine)  # type: ignore[arg-type]
            self._rounds = enumerate(make_workload(scenario).rounds())
            self._conversations: dict[int, list[dict]] = {}
            self._vllm_state: TargetState | None = None
            self._last = self._snapshot(self.store.counters())
            self._first_misses = self._last_misses = self.misses.ledger.snapshot()
        except BaseException:
            self.close()
            raise
        self.rows: list[dict] = []
        self.failure_codes: dict[str, int] = {}
        self.peak_rss: dict[str, int] = {}  # the server's processes' peak resident memory, at the end
        self.disagreements = 0
        self.seconds = {"start": time.monotonic() - started, "rounds": 0.0}

    def _connector(self) -> tuple[tuple[str, ...], dict[str, str]]:
        """vLLM's arguments and environment for Mooncake's connector to the arm's store."""
        assert isinstance(self.store, MooncakeStore)
        ports = self.store.processes.ports
        connector = {
            "metadata_server": f"http://127.0.0.1:{ports['metadata']}/metadata",
            "master_server_address": f"127.0.0.1:{ports['rpc']}",
            "protocol": "tcp",
            "device_name": "",
            "mode": "standalone-store",  # the pool is kvscope's store client's: segment and SSD
            "global_segment_size": 0,
            "local_buffer_size": 64 * 1024**2,
        }
        (self._dir / "mooncake.json").write_text(json.dumps(connector))
        # save_decode_cache: the blocks the engine generated are saved too, as vLLM's own prefix cache keeps them;
        # a load that fails (a lease that ran out, -707) is recomputed rather than failing the request: the miss
        # is counted (connector_failed_keys) and the run goes on
        transfer = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                               "kv_load_failure_policy": "recompute",
                               "kv_connector_extra_config": {"save_decode_cache": True}})  # fmt: skip
        env = {"MOONCAKE_CONFIG_PATH": str(self._dir / "mooncake.json"), "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        return ("--kv-transfer-config", transfer), env

    @property
    def observed(self) -> list[TargetState]:
        return [*self.store.observed, *([self._vllm_state] if self._vllm_state else [])]

    def step(self) -> dict | None:
        index, requests = next(self._rounds, (None, None))
        if index is None:
            return None
        started = time.monotonic()
        planned = self.plan.rounds[index]
        reported = Counter()
        first, request_hits, request_seconds, first_tokens, saves = len(self.pacer.starts), [], [], [], []
        assert self.server is not None
        for request in requests:
            messages = self._turn(request.session, index + 1)
            token_ids = self.server.tokenize(self._client, messages)
            self.pacer.wait()
            lookup = self.misses.look_up(token_ids)  # what the engine's own lookup finds a few ms later
            sent = time.monotonic()
            usage, metrics = self._answer(messages, request.session, index + 1, request.prompt_tokens)
            request_seconds.append(round(time.monotonic() - sent, 4))
            first_tokens.append(_first_token_s(metrics))
            hit = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            if len(token_ids) != usage["prompt_tokens"]:
                raise MooncakeError(f"arm {self.name}: /tokenize gave {len(token_ids)} tokens, the engine was "
                                    f"prompted with {usage['prompt_tokens']}")  # fmt: skip
            self.misses.ledger.classify(lookup, hit, usage["prompt_tokens"])
            reported["prompt"] += usage["prompt_tokens"]
            request_hits.append(hit)
            self.misses.settle()  # its events, before the next request is looked up
            saves.append(self.misses.saved_after_s())
        reported["cached"] = sum(request_hits)
        self.server.process.check_alive()  # the answers were its own, and what is scraped next will be
        self.engine.counters.rounds += 1
        self.engine.counters.bound_hit_tokens += planned.ideal_hit_tokens
        after = self._snapshot(self.store.counters())
        row = self._row(index + 1, len(requests), planned, reported, self._last, after)
        row["late_s"] = self.pacer.take_late_s()
        row["request_start_s"] = [round(start, 4) for start in self.pacer.starts[first:]]
        row["request_s"] = request_seconds
        row["request_first_token_s"] = first_tokens
        row["request_saved_s"] = saves
        if isinstance(self.store, MooncakeStore):
            row["store_eviction_passes"] = self._new_eviction_passes()
        row["request_hit_tokens"] = request_hits  # each response's cached tokens, in the workload's order
        misses = self.misses.ledger.snapshot()
        row["miss_causes"] = causes_between(self._last_misses, misses)
        self._last_misses = misses
        self._last = after
        self.rows.append(row)
        self.seconds["rounds"] += time.monotonic() - started
        return row

    def finish(self) -> None:
        self._last = self._snapshot(self.store.settled_counters())
        self.failure_codes = self._failure_codes()
        if self.server is not None:  # read before it stops
            self.peak_rss = self.server.process.peak_rss_by_process()

    def result(self) -> dict:
        from kvscope.tierstore.ab import arm_totals, observed_collapse_round

        tiers = {tier: counters for tier, counters in self._last.items() if tier != "vllm"}
        totals = arm_totals(self.rows, tiers)
        totals["written_bytes"] = {tier: sum(r["written_bytes"][tier] for r in self.rows) for tier in tiers}
        totals["miss_causes"] = causes_between(self._first_misses, self._last_misses)
        failed: Counter = Counter()
        for row in self.rows:
            failed.update(row["connector_failed_keys"])
        return {
            "engine": {"kind": "vllm", "version": self.version, "gpu_blocks": self.scenario.engine.vllm.gpu_blocks,  # type: ignore[union-attr]
                       "cached_tokens_disagreements": self.disagreements,
                       "connector_failed_keys": dict(failed),
                       "connector_failure_codes": self.failure_codes,
                       "kv_events": self.events.report() if self.events else None,
                       "listening": self.listening, "ipc_listening": self.ipc_listening,
                       "peak_rss_bytes": self.peak_rss},
            "store": self.store.report(),
            "wall_s": dict(self.seconds),
            "rounds": self.rows,
            "totals": totals,
            "prediction": self.plan.arm_json(self.name),
            "observed_collapse_round": observed_collapse_round(self.rows, self.scenario.prediction.collapse_tolerance),
        }  # fmt: skip

    def _new_eviction_passes(self) -> list[list[float]]:
        """The Mooncake master's eviction passes since the last round's row: [began, ended] in seconds from the arm's
        first request, and the objects evicted."""
        assert isinstance(self.store, MooncakeStore) and self.pacer.first_wall is not None
        first = self.pacer.first_wall
        passes = self.store.processes.new_eviction_passes()
        return [[round(p.began - first, 4), round(p.ended - first, 4), p.evicted] for p in passes]

    def _failure_codes(self) -> dict[str, int]:
        """Mooncake's return codes of the connector's failed operations, as its warnings in the server's log name
        them (the metrics count failed keys, not why): `load_get -707 LEASE_EXPIRED` etc., by log line."""
        if self.server is None or not self.server.process.log.exists():
            return {}
        codes: Counter[str] = Counter()
        for line in self.server.process.log.read_text(errors="replace").splitlines():
            if "Failed to get" in line and "first_failures=" in line:
                found = {int(code) for code in _LOAD_CODES.findall(line)}
                codes.update(f"load_get {code} {ERROR_NAMES.get(code, '')}".strip() for code in found)
            elif "batch_put failed" in line and (match := _PUT_CODES.search(line)):
                found = {int(code) for code in match.group(1).split(",")}
                codes.update(f"save_put {code} {ERROR_NAMES.get(code, '')}".strip() for code in found)
        return dict(codes)

    def close(self) -> None:
        self._client.close()
        if getattr(self, "_scraper", None) is not None:
            self._loop.run_until_complete(self._scraper.close())
        if self.events is not None:
            self.events.close()
        self._loop.close()
        if self.server is not None:
            self.server.stop()
        self.store.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    # ------------------------------------------------------------------------------------------------ requests

    def _turn(self, session: int, round_number: int) -> list[dict]:
        """The session's next turn: its conversation so far plus this round's new words."""
        w, vocab = self.scenario.workload, self.scenario.engine.vllm.vocab  # type: ignore[union-attr]
        assert isinstance(w, spec.MultiRoundWorkload)
        messages = self._conversations.setdefault(session, [])
        start = (session * _SESSION_STRIDE + round_number * _ROUND_STRIDE) % vocab
        if not messages:
            if w.shared_prefix_tokens:
                messages.append({"role": "system", "content": words(0, w.shared_prefix_tokens, vocab)})
            messages.append({"role": "user", "content": words(start, w.first_prompt_tokens - w.shared_prefix_tokens,
                                                              vocab)})  # fmt: skip
        elif w.user_tokens:
            messages.append({"role": "user", "content": words(start, w.user_tokens, vocab)})
        return messages

    def _answer(self, messages: list[dict], session: int, round_number: int, prompt_tokens: int) -> tuple[dict, dict]:
        """The engine's answer to the turn, kept in the conversation: the response's usage and its per-request
        metrics."""
        w = self.scenario.workload
        assert isinstance(w, spec.MultiRoundWorkload) and self.server is not None
        answer = self.server.chat(self._client, messages, w.output_tokens) if w.output_tokens else None
        if answer is None:  # no output: a one-token request keeps the turn (vLLM needs max_tokens >= 1)
            answer = self.server.chat(self._client, messages, 1)
        usage, choice = answer["usage"], answer["choices"][0]
        content = choice["message"]["content"] or ""
        if usage["prompt_tokens"] != prompt_tokens or (w.output_tokens and len(content.split()) != w.output_tokens):
            raise MooncakeError(
                f"arm {self.name}: session {session} round {round_number}: {usage['prompt_tokens']} prompt tokens "
                f"(the workload says {prompt_tokens}), {usage['completion_tokens']} generated, "
                f"{len(content.split())} words back, finish_reason {choice.get('finish_reason')!r}"
            )
        if w.output_tokens:
            messages.append({"role": "assistant", "content": content})
        return usage, answer.get("metrics") or {}

    # ------------------------------------------------------------------------------------------------ counters

    def _snapshot(self, store_counters: dict[str, dict[str, int]]) -> dict[str, dict]:
        """The store's media counters and the engine's: one scrape of vLLM's /metrics through the vllm source."""
        state = self._loop.run_until_complete(self._scraper.scrape_all())[0]
        if not state.up:
            raise MooncakeError(f"scraping vLLM failed: {state.last_error}")
        self._vllm_state = state
        engine: Counter = Counter()
        for sample in state.raw:
            labels = sample.label_map
            if sample.name == "vllm:prompt_tokens_by_source_total":
                engine[_SOURCES.get(labels.get("source", ""), "other")] += sample.value
            elif sample.name in ("vllm:num_preemptions_total", "vllm:time_to_first_token_seconds_count",
                                 "vllm:time_to_first_token_seconds_sum"):  # fmt: skip
                engine[sample.name] += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_bucket":
                engine[("ttft", float(labels["le"]))] += sample.value
            elif sample.name == "vllm:mooncake_store_operation_bytes_total" and labels.get("status") == "ok":
                engine[("connector", labels.get("operation"))] += sample.value
            elif sample.name == "vllm:mooncake_store_operation_failed_keys_total":
                engine[("failed", labels.get("operation"))] += sample.value
        return {**store_counters, "vllm": dict(engine)}

    def _row(
        self, number: int, requests: int, planned: RoundPlan, reported: Counter, before: dict, after: dict
    ) -> dict:
        from kvscope.tierstore.ab import excess_recompute_per_request, tier_delta

        e0, e1 = before["vllm"], after["vllm"]

        def d(key) -> float:
            return e1.get(key, 0) - e0.get(key, 0)

        gpu, external, computed = int(d("gpu")), int(d("external")), int(d("computed"))
        query = gpu + external + computed
        tiers_before = {t: c for t, c in before.items() if t != "vllm"}
        tiers_after = {t: c for t, c in after.items() if t != "vllm"}
        agrees = reported["cached"] == gpu + external and reported["prompt"] == query
        self.disagreements += not agrees
        return {
            "round": number,
            "requests": requests,
            "query_tokens": query,
            "hit_tokens": gpu + external,
            "gpu_hit_tokens": gpu,
            "external_hit_tokens": external,
            "hit_ratio": (gpu + external) / query if query else 0.0,
            "ideal_hit_tokens": planned.ideal_hit_tokens,
            "ideal_hit_ratio": planned.ideal_hit_ratio,
            "recompute_tokens_per_request": computed / requests if requests else 0.0,
            "excess_recompute_tokens_per_request": excess_recompute_per_request(
                planned.ideal_hit_tokens, gpu + external, requests
            ),
            "put_bytes": int(d(("connector", "save_put"))),
            "loaded_bytes": int(d(("connector", "load_get"))),
            "preemptions": int(d("vllm:num_preemptions_total")),
            # keys the connector's operations failed on (a put refused while every object is leased, a get whose
            # lease ran out): vLLM recomputes or does not save them
            "connector_failed_keys": {
                key[1]: int(d(key)) for key in sorted(set(e0) | set(e1), key=str) if key[0:1] == ("failed",) and d(key)
            },
            "cached_tokens_reported": reported["cached"],
            "cached_tokens_agree": agrees,
            # a connector's put always lands in Mooncake's memory pool (one replica): the engine's client moves the
            # bytes, so the pool's own client counts none of them (the vllm mapping counts them the same way)
            "written_bytes": {
                tier: written + (int(d(("connector", "save_put"))) if tier == "dram" else 0)
                for tier, written in tier_delta(tiers_before, tiers_after, "written_bytes").items()
            },
            "read_bytes": tier_delta(tiers_before, tiers_after, "read_bytes"),
            "evictions": tier_delta(tiers_before, tiers_after, "evictions"),
            "allocated_bytes": {tier: counters["allocated_bytes"] for tier, counters in tiers_after.items()},
            "ttft_s": _ttft(e0, e1, requests),
        }


def _first_token_s(metrics: dict) -> float | None:
    """Seconds from the engine queueing the request to its first token (vLLM's per-request metrics: queue time,
    then scheduled to first token); None where the response does not say."""
    queued, first = metrics.get("queue_time_ms"), metrics.get("time_to_first_token_ms")
    return None if queued is None or first is None else round((queued + first) / 1000, 4)


def _ttft(before: dict, after: dict, requests: int) -> dict:
    """Mean, p50, p90 and p99 of the round's TTFT from vLLM's histogram: the upper bound of the bucket where the
    quantile falls (Prometheus' histogram_quantile without its interpolation)."""
    count = after.get("vllm:time_to_first_token_seconds_count", 0) - before.get(
        "vllm:time_to_first_token_seconds_count", 0
    )
    total = after.get("vllm:time_to_first_token_seconds_sum", 0) - before.get("vllm:time_to_first_token_seconds_sum", 0)
    buckets = sorted((key[1], after[key] - before.get(key, 0)) for key in after if isinstance(key, tuple) and
                     key[0] == "ttft")  # fmt: skip

    def quantile(q: float) -> float:
        for bound, cumulative in buckets:
            if count and cumulative >= q * count:
                return bound if bound != float("inf") else (buckets[-2][0] if len(buckets) > 1 else 0.0)
        return 0.0

    return {"mean": total / count if count else 0.0, "p50": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99)}
