"""The vLLM KV-event source against vLLM's own publisher (`ZmqEventPublisher`, run by the vLLM virtualenv's
interpreter: tests/support/vllm_kv_publisher.py): a subscriber that joins late has the history filled from the replay
buffer as far as it reaches and the rest counted lost, live batches are counted once, a restarted publisher is seen.
The source against a whole engine: tests/exporters/test_vllm_real.py. Needs the vLLM virtualenv (`make vllm-env`)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
from support.scrape import CollectorThread

from kvscope.exporters.vllm_kv_events import VllmKvEventsCollector
from kvscope.processes import free_port
from kvscope.tierstore.vllm import vllm_missing, vllm_python

PUBLISHER = Path(__file__).parents[1] / "support" / "vllm_kv_publisher.py"
BUFFER_STEPS = 5


@pytest.fixture
def publisher(require_real):
    missing = vllm_missing()
    require_real(missing is None, missing or "")
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [str(vllm_python()), str(PUBLISHER), endpoint, replay, str(BUFFER_STEPS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert process.stdout.readline().strip() == "ready"

        def publish(line: str) -> int:
            process.stdin.write(f"{line}\n")
            process.stdin.flush()
            answer = process.stdout.readline().split()
            assert answer[0] == "sent", answer
            return int(answer[1])

        yield endpoint, replay, publish
    finally:
        process.kill()
        process.wait(10)


def counts(thread: CollectorThread) -> dict[tuple[str, str], float]:
    return {(s.name.removeprefix("vllm_kv_events_"), ",".join(dict(s.labels).values())): s.value
            for s in thread.collect()}  # fmt: skip


def until(thread: CollectorThread, publish, done, attempts: int = 20) -> dict:
    """Publish one batch at a time until the subscriber's counts satisfy `done` (a connecting publisher drops what
    it sends before the subscription reached it)."""
    for _ in range(attempts):
        publish("1")
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            if done(seen := counts(thread)):
                return seen
            time.sleep(0.05)
    raise AssertionError(f"never seen: {seen}")


def test_a_late_subscriber_gets_the_history_the_replay_buffer_holds_then_every_batch_live(publisher):
    endpoint, replay, publish = publisher
    assert publish("10") == 10  # nobody subscribed: the publisher drops all ten
    config = VllmKvEventsCollector.Config(name="engine", source="vllm_kv_events", endpoint=endpoint, bind=True,
                                          replay_endpoint=replay)  # fmt: skip
    thread = CollectorThread(VllmKvEventsCollector(config))
    try:
        seen = until(thread, publish, lambda c: c[("batches_total", "live")] > 0)
        first = int(seen[("next_sequence", "")]) - 1  # the sequence number of the first live batch
        assert first >= 10 and seen[("batches_total", "live")] == 1 and seen[("gaps_total", "")] == 1
        # the buffer held the last five batches: the first live one and the four before it
        assert seen[("batches_total", "replay")] == BUFFER_STEPS - 1
        assert seen[("lost_batches_total", "history")] == first - (BUFFER_STEPS - 1)
        assert seen[("blocks_stored_total", "gpu")] == 2 * BUFFER_STEPS

        total = publish("40")
        seen = until(thread, lambda _: total, lambda c: c[("next_sequence", "")] == total, attempts=1)
        assert seen[("batches_total", "live")] == 1 + total - first - 1
        assert seen[("lost_batches_total", "live")] == 0 and seen[("gaps_total", "")] == 1
        assert seen[("blocks_stored_total", "gpu")] == 2 * (BUFFER_STEPS + total - first - 1)
        assert 0 <= seen[("lag_seconds", "")] < 5

        publish("restart")  # a new publisher on the same endpoints: its sequence numbers start over
        seen = until(thread, publish, lambda c: c[("restarts_total", "")] == 1)
        assert seen[("lost_batches_total", "live")] == 0  # what the new publisher sent first came from its buffer
        assert seen[("blocks_stored_total", "gpu")] == 2 * (
            seen[("batches_total", "live")] + seen[("batches_total", "replay")]
        )
        assert seen[("undecodable_batches_total", "")] == 0
    finally:
        thread.close()
