"""The dynamo source against a real NVIDIA Dynamo stack (`make dynamo-env`; skipped without it, failed under
KVSCOPE_REQUIRE_REAL=1): a frontend with its KV router and two mocker workers on 127.0.0.1, kvscope's multi-round
chat workload through the OpenAI endpoint, scraped by `kvscope scrape --once`, and the mapped values held against
the stack's own answers: the responses' usage, the requests each worker's engine saw, the workers the frontend
registered. A second stack with small KV caches is scraped mid-load (caches in use) and at the end (blocks evicted,
requests preempted, the router expecting more cached prefix than the workers served). A third's mockers imitate
SGLang (`--engine-type sglang`): their TTFT buckets are counted per worker."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import httpx
import pytest
import yaml

from kvscope.exporters.normalizer import mapping_for
from kvscope.tierstore import scenario as spec
from kvscope.tierstore.dynamo import Conversations, DynamoStack, MockerSettings, dynamo_missing, dynamo_python

WORKLOAD = {"kind": "multi_round", "sessions": 8, "rounds": 4, "first_prompt_tokens": 96, "user_tokens": 32}
ROUTED = MockerSettings(gpu_blocks=256, block_tokens=16, speedup=1000)
# 56 blocks of 16 tokens hold about two and a half of a session's last prompts: a round's 8 requests at once evict
# blocks and preempt requests; slower (speedup 2: the last round takes seconds) so that a scrape lands while it runs.
SMALL = MockerSettings(gpu_blocks=56, block_tokens=16, max_num_seqs=8, speedup=2)
# The mockers imitating SGLang: sglang:* series on their system ports instead of vllm:*.
SGLANG = MockerSettings(gpu_blocks=256, block_tokens=16, speedup=1000, engine_type="sglang")


@pytest.fixture
def stack_factory(require_real, tmp_path):
    missing = dynamo_missing()
    require_real(missing is None, missing or "")
    stacks: list[DynamoStack] = []

    def start(name: str, mocker: MockerSettings) -> DynamoStack:
        stack = DynamoStack(tmp_path / name, workers=2, mocker=mocker)
        stacks.append(stack)
        stack.wait_ready()
        return stack

    yield start
    for stack in stacks:
        stack.stop()
    for stack in stacks:  # SIGTERM, not SIGKILL: every process ended and took its discovery entry with it
        assert all(process.popen.returncode == 0 for process in stack.processes), [
            (process.name, process.popen.returncode, process.tail(5)) for process in stack.processes
        ]
        assert not [path for path in stack.discovery.rglob("*") if path.is_file()]


def kvscope_scrape(stack: DynamoStack, folder: Path) -> tuple[list[dict], list[dict]]:
    """`kvscope scrape --config targets.yaml --once --format json` of the frontend and both workers: the raw and
    the normalized samples it printed."""
    targets = [{"name": "dynamo-frontend", "source": "dynamo", "url": f"{stack.url}/metrics"}] + [
        {"name": f"dynamo-worker-{index}", "source": "dynamo", "url": url}
        for index, url in enumerate(stack.worker_metrics_urls)
    ]
    config = folder / "targets.yaml"
    config.write_text(yaml.safe_dump({"exporter": {"listen_port": 0}, "targets": targets}))
    done = subprocess.run([sys.executable, "-m", "kvscope", "scrape", "--config", str(config), "--once", "--format",
                           "json"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    samples = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return [s for s in samples if not s["normalized"]], [s for s in samples if s["normalized"]]


def total(normalized: list[dict], name: str, **labels: str) -> float:
    return sum(s["value"] for s in normalized if s["name"] == name and labels.items() <= s["labels"].items())


def by(normalized: list[dict], name: str, label: str) -> dict[str, float]:
    found: Counter = Counter()
    for sample in normalized:
        if sample["name"] == name:
            found[sample["labels"][label]] += sample["value"]
    return dict(found)


def check_against_the_stack(stack: DynamoStack, raw: list[dict], normalized: list[dict], served) -> None:
    """What holds in any run, once every request has completed: the frontend's tokens are the responses' usage,
    summed; the router routed every prompt token; each worker is named by the id the frontend registered it under,
    and its engine's TTFT count is the requests it answered."""
    assert total(normalized, "kv.frontend.prompt.tokens", model="tiny") == served.prompt_tokens
    assert total(normalized, "kv.frontend.cached.tokens", model="tiny") == served.cached_tokens
    assert total(normalized, "kv.router.prompt.tokens") == served.prompt_tokens
    workers = stack.registered_workers()
    assert set(by(normalized, "kv.engine.preemptions", "worker_id")) == workers
    assert set(by(normalized, "kv.engine.active.blocks", "worker_id")) == workers
    requests_by_worker = by([s for s in normalized if s["labels"].get("upper_bound") == "+Inf"],
                            "kv.engine.ttft.requests", "worker_id")  # fmt: skip
    assert sum(requests_by_worker.values()) == served.requests
    # the router's counters are the frontend's: one router, whose id is the frontend's instance id
    routers = {s["labels"]["router"] for s in normalized if s["name"].startswith("kv.router.")}
    frontend_ids = {s["labels"]["dynamo_instance_id"] for s in raw if s["name"].startswith("dynamo_frontend_")}
    assert len(routers) == 1 and routers == frontend_ids
    assert by(normalized, "kv.model.blocks", "model") == {"tiny": stack.mocker.gpu_blocks}
    assert by(normalized, "kv.model.block.tokens", "model") == {"tiny": stack.mocker.block_tokens}
    assert not [s for s in normalized if s["name"] == "kv.router.events" and s["labels"]["status"] != "ok"
                and s["value"]]  # fmt: skip


def test_a_routed_multi_round_chat_is_counted_as_the_stack_answered(stack_factory, tmp_path):
    """Nothing evicted (256 blocks a worker): the cached prefix the router chose on each decision, the best any
    worker had and the cached tokens the workers served are the same number, the one the responses reported."""
    stack = stack_factory("routed", ROUTED)
    workload = spec.MultiRoundWorkload(**WORKLOAD, output_tokens=32)
    with httpx.Client(timeout=60) as client:
        served = Conversations(stack, workload).run(client)
    raw, normalized = kvscope_scrape(stack, tmp_path)
    check_against_the_stack(stack, raw, normalized, served)
    prefix = by(normalized, "kv.router.prefix.tokens", "choice")
    assert prefix == {"selected": served.cached_tokens, "best_eligible": served.cached_tokens}
    # round r hits every full block of round r-1's prompt: the mocker keeps a prompt's blocks, not its answer's
    previous_prompts = (96 + (r - 1) * 64 for r in range(1, workload.rounds))
    assert served.cached_tokens == sum(prompt // 16 * 16 for prompt in previous_prompts) * workload.sessions
    events = by(normalized, "kv.router.events", "event")
    assert events["stored"] > 0 and events["removed"] == 0
    assert total(normalized, "kv.engine.preemptions") == 0
    assert len(by(normalized, "kv.engine.preemptions", "worker_id")) == 2  # both workers served requests


def test_small_caches_evict_preempt_and_the_router_expects_more_than_was_served(stack_factory, tmp_path):
    """A round's 8 requests at once on 56-block workers, scraped while the last round runs: the workers' caches are
    in use and the router tracks active blocks on them. At the end: blocks removed from the router's index,
    requests preempted, and the cached prefix the router chose above what the workers then served."""
    stack = stack_factory("small", SMALL)
    workload = spec.MultiRoundWorkload(**WORKLOAD, output_tokens=64)
    conversations = Conversations(stack, workload)
    last_round_started, outcome = threading.Event(), {}

    def drive() -> None:
        try:
            with httpx.Client(timeout=120) as client:
                outcome["served"] = conversations.run(client, parallel=8, after_round=lambda number: (
                    last_round_started.set() if number == workload.rounds - 1 else None))  # fmt: skip
        except BaseException as error:  # handed to the test's thread
            outcome["error"] = error
            last_round_started.set()

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        assert last_round_started.wait(120)
        _, midload = kvscope_scrape(stack, tmp_path)
    finally:
        driver.join(120)
    if "error" in outcome:
        raise outcome["error"]
    assert "served" in outcome and not driver.is_alive()
    assert max(by(midload, "kv.engine.cache.usage", "worker_id").values()) > 0
    assert sum(by(midload, "kv.engine.active.blocks", "worker_id").values()) > 0
    for name in ("kv.frontend.prompt.tokens", "kv.frontend.cached.tokens", "kv.router.prefix.tokens"):
        assert total(midload, name) > 0

    raw, normalized = kvscope_scrape(stack, tmp_path)
    served = outcome["served"]
    check_against_the_stack(stack, raw, normalized, served)
    assert set(by(normalized, "kv.engine.cache.usage", "worker_id").values()) == {0}  # idle again
    events = by(normalized, "kv.router.events", "event")
    assert events["removed"] > 0 and events["stored"] > 0
    assert total(normalized, "kv.engine.preemptions") > 0
    prefix = by(normalized, "kv.router.prefix.tokens", "choice")
    assert prefix["best_eligible"] >= prefix["selected"] > served.cached_tokens > 0


def test_sglang_imitating_workers_are_counted_by_their_ttft_buckets(stack_factory, tmp_path):
    """Mockers under --engine-type sglang: their TTFT buckets are mapped under the ids the frontend registered (no
    rank: engine ""), and count every request; nothing else of theirs is. Their responses report no cached tokens,
    so the frontend counts none, while the router counts the cached prefix it routed to."""
    stack = stack_factory("sglang", SGLANG)
    workload = spec.MultiRoundWorkload(kind="multi_round", sessions=2, rounds=3, first_prompt_tokens=96,
                                       user_tokens=32, output_tokens=8)  # fmt: skip
    with httpx.Client(timeout=60) as client:
        served = Conversations(stack, workload).run(client)
    raw, normalized = kvscope_scrape(stack, tmp_path)
    assert any(s["name"].startswith("sglang:") for s in raw) and not any(s["name"].startswith("vllm:") for s in raw)
    served_first = [s for s in normalized if s["name"] == "kv.engine.ttft.requests"]
    assert {s["labels"]["engine"] for s in served_first} == {""}
    requests_by_worker = by([s for s in served_first if s["labels"]["upper_bound"] == "+Inf"],
                            "kv.engine.ttft.requests", "worker_id")  # fmt: skip
    assert set(requests_by_worker) <= stack.registered_workers()
    assert sum(requests_by_worker.values()) == served.requests
    assert {s["name"] for s in normalized if s["name"].startswith("kv.engine.")} == {
        "kv.engine.ttft.requests",
        "kv.engine.active.blocks",  # the frontend's count, per worker
    }
    assert total(normalized, "kv.frontend.prompt.tokens", model="tiny") == served.prompt_tokens
    assert total(normalized, "kv.frontend.cached.tokens", model="tiny") == served.cached_tokens == 0
    assert total(normalized, "kv.router.prefix.tokens", choice="selected") > 0


def test_the_stack_listens_on_loopback_only(stack_factory):
    """Every TCP socket the frontend and the workers listen on is 127.0.0.1 (their event publishers connect to the
    relay, which kvscope binds on 127.0.0.1)."""
    stack = stack_factory("loopback", ROUTED)
    listeners = [listener for process in stack.processes for listener in process.listening()]
    assert len(listeners) >= 3 and all(listener.loopback_only for listener in listeners), listeners
    assert stack.relay.xsub.startswith("tcp://127.0.0.1:") and stack.relay.xpub.startswith("tcp://127.0.0.1:")


# Every string constant of the installed Dynamo's metric names (dynamo.prometheus_names, generated from its Rust
# sources): prefixes (dynamo_frontend, dynamo_component) and names.
NAME_CONSTANTS = """
import inspect, json
from dynamo import prometheus_names
found = set()
def walk(holder):
    for value in vars(holder).values():
        if isinstance(value, str):
            found.add(value)
        elif inspect.isclass(value):
            walk(value)
walk(prometheus_names)
print(json.dumps(sorted(found)))
"""


def test_every_dynamo_name_the_mapping_reads_is_one_of_dynamo_s_own(require_real):
    """The mapping's dynamo_* names, the ones not seen live (a real vLLM worker's gauges) included, are a prefix and
    a name of the installed Dynamo's constants (a histogram's _sum or _bucket after it)."""
    missing = dynamo_missing()
    require_real(missing is None, missing or "")
    listed = subprocess.run([str(dynamo_python()), "-c", NAME_CONSTANTS], capture_output=True, text=True, timeout=120,
                            check=True)  # fmt: skip
    constants = set(json.loads(listed.stdout))
    prefixes = {value for value in constants if value.startswith("dynamo_") and "_" in value}
    read = {name for rule in mapping_for("dynamo").rules for name in rule.match if name.startswith("dynamo_")}
    assert "dynamo_component_gpu_cache_usage_percent" in read and "dynamo_component_total_blocks" in read
    for name in read:
        base = name.removesuffix("_sum").removesuffix("_bucket")
        assert any(base.startswith(f"{prefix}_") and base[len(prefix) + 1 :] in constants for prefix in prefixes), name
