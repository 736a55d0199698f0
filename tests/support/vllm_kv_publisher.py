"""vLLM's own KV-event publisher (`ZmqEventPublisher`), run by the vLLM virtualenv's interpreter and driven by lines
on stdin: a number N publishes N batches of one `BlockStored` of 2 blocks each; `restart` shuts the publisher down
and starts a new one on the same endpoints (its sequence numbers start over, as a restarted engine's do). After
each line it prints `sent <batches published since the last restart>` once the publisher's thread has sent them.

    python vllm_kv_publisher.py ENDPOINT REPLAY_ENDPOINT BUFFER_STEPS
"""

import sys
import time

import zmq
from vllm.distributed.kv_events import BlockStored, KVEventBatch, ZmqEventPublisher


def main(endpoint: str, replay_endpoint: str, buffer_steps: int) -> None:
    def start() -> ZmqEventPublisher:
        for _ in range(50):  # the replay port is free again once the old socket's close went through
            try:
                return ZmqEventPublisher(0, endpoint, replay_endpoint, buffer_steps=buffer_steps, topic="kv")
            except zmq.ZMQError:
                time.sleep(0.1)
        raise RuntimeError(f"cannot bind {replay_endpoint} again")

    publisher, sequence = start(), 0
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "restart":
            publisher.shutdown()
            publisher, sequence = start(), 0
        else:
            for _ in range(int(line)):
                hashes = [2 * sequence, 2 * sequence + 1]
                stored = BlockStored(hashes, None, [], 32, None, medium="GPU", lora_name=None)
                publisher.publish(KVEventBatch(ts=time.time(), events=[stored]))
                sequence += 1
            publisher._event_queue.join()  # its thread marks each batch done once it is sent
        print(f"sent {sequence}", flush=True)
    publisher.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
