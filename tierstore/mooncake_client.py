"""A Mooncake store client in a process of its own, driven as a KV connector drives it (one A/B arm per process:
Mooncake's SSD offload settings are process-wide environment variables, and a crash in the C++ client must not
take kvscope down).

Run as `python -m kvscope.tierstore.mooncake_client CONFIG_JSON` by kvscope.tierstore.mooncake. It reads one JSON
command per line on stdin and answers one JSON line on its original stdout; everything Mooncake prints goes to
stderr (the arm's log). Commands:

- `read {keys}`: `batch_is_exist` over the chain's keys, the longest run present from its head, a real
  `batch_get_into` of that run into a registered buffer, and every block's bytes checked against the bytes its key
  was stored with. The run ends at the first block that is missing, fails its get, or comes back wrong. The answer
  names the blocks the store did not hold (`absent`: the check did not find them, or their get failed), which
  explains the misses after the run.
- `put {keys}`: `batch_is_exist`, then `batch_put_from` of the keys not present (a put of an existing key is a
  no-op in Mooncake). `-200` (no available handle: the segment is full and eviction has not caught up, or every
  object is leased) is retried with a bounded backoff; a key still refused then is not admitted (`refused`: its
  index in the command's keys).
- `exist {keys}`: `batch_is_exist` alone, no get, no put: which keys the store holds (`held`). Like every
  existence check it leases the objects it finds for the master's lease time.
- `quit`: close the store and exit.

Payloads are real bytes derived from the key (`synthetic_payload`), so a block served for the wrong key fails.
Every return code other than success is counted per operation and reported with each answer.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import sys
import time
from collections import Counter
from typing import Any

from kvscope.tierstore.store import synthetic_payload

NO_AVAILABLE_HANDLE = -200
OBJECT_ALREADY_EXISTS = -705


class Connector:
    """The client side of one arm: the store, one registered buffer of `max_blocks` blocks, the counters."""

    def __init__(self, config: dict[str, Any]) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.block_bytes = int(config["block_bytes"])
        self.max_blocks = int(config["max_blocks"])
        self.retry_budget_s = float(config["retry_budget_s"])
        self.store = MooncakeDistributedStore()
        ssd_path = config.get("ssd_path")
        self.setup_code = self.store.setup(
            config["host"],
            config["metadata"],
            int(config["segment_bytes"]),
            int(config["local_buffer_bytes"]),
            "tcp",
            "",
            config["master"],
            None,
            ssd_path is not None,
            ssd_path or "",
            "default",
            True,
            int(config["http_port"]),
        )
        self.buffer = mmap.mmap(-1, self.max_blocks * self.block_bytes)
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self.buffer))
        self.register_code = self.store.register_buffer(self.address, len(self.buffer)) if self.setup_code == 0 else 0

    def read(self, keys: list[str]) -> dict:
        codes: Counter[str] = Counter()
        started = time.perf_counter()
        exists = self.store.batch_is_exist(keys)
        present = _present_run(exists, codes, "exist")
        blocks = 0
        while blocks < present:
            chunk = keys[blocks : min(present, blocks + self.max_blocks)]
            sizes = [self.block_bytes] * len(chunk)
            results = self.store.batch_get_into(chunk, self._slots(len(chunk)), sizes)
            good = 0
            for index, (key, result) in enumerate(zip(chunk, results, strict=True)):
                if result < 0:
                    codes[f"get {result}"] += 1
                    break
                offset = index * self.block_bytes
                if result != self.block_bytes or self.buffer[offset : offset + result] != synthetic_payload(
                    key, self.block_bytes
                ):
                    codes["get wrong bytes"] += 1
                    break
                good += 1
            blocks += good
            if good < len(chunk):
                break
        absent = [index for index, exist in enumerate(exists) if exist != 1 or index == blocks]
        return {"blocks": blocks, "seconds": time.perf_counter() - started, "codes": codes, "absent": absent}

    def exist(self, keys: list[str]) -> dict:
        codes: Counter[str] = Counter()
        return {"held": self._held(keys, codes), "codes": codes}

    def put(self, keys: list[str]) -> dict:
        codes: Counter[str] = Counter()
        missing = [key for key, held in zip(keys, self._held(keys, codes), strict=True) if not held]
        stored = retries = not_admitted = 0
        unstored: list[str] = []  # refused with -200 after the retries, or failed with another code
        for start in range(0, len(missing), self.max_blocks):
            chunk = missing[start : start + self.max_blocks]
            for index, key in enumerate(chunk):
                offset = index * self.block_bytes
                self.buffer[offset : offset + self.block_bytes] = synthetic_payload(key, self.block_bytes)
            done, tries, no_handle, failed = self._put_with_retries(chunk, codes)
            stored, retries, not_admitted = stored + done, retries + tries, not_admitted + len(no_handle)
            unstored += no_handle + failed
        unstored_keys = set(unstored)
        return {
            "stored": stored,
            "present": len(keys) - len(missing),
            "retries": retries,
            "not_admitted": not_admitted,
            "refused": [index for index, key in enumerate(keys) if key in unstored_keys],
            "codes": codes,
        }

    def _put_with_retries(self, keys: list[str], codes: Counter[str]) -> tuple[int, int, list[str], list[str]]:
        """(stored, retries, the keys still refused with -200, the keys failed with another code): -200 is retried,
        backing off from 5 ms to 100 ms, for `retry_budget_s`."""
        slots = dict(zip(keys, self._slots(len(keys)), strict=True))
        pending, stored, retries, failed = keys, 0, 0, []
        deadline, delay = time.monotonic() + self.retry_budget_s, 0.005
        while True:
            results = self.store.batch_put_from(pending, [slots[k] for k in pending], [self.block_bytes] * len(pending))
            again = []
            for key, result in zip(pending, results, strict=True):
                if result == 0 or result == OBJECT_ALREADY_EXISTS:  # the latter: put meanwhile, still a present key
                    stored += result == 0
                    if result:
                        codes[f"put {result}"] += 1
                elif result == NO_AVAILABLE_HANDLE:
                    again.append(key)
                else:
                    codes[f"put {result}"] += 1
                    failed.append(key)
            if not again:
                return stored, retries, [], failed
            codes[f"put {NO_AVAILABLE_HANDLE}"] += len(again)
            if time.monotonic() + delay > deadline:
                return stored, retries, again, failed
            time.sleep(delay)
            retries += len(again)
            pending, delay = again, min(delay * 2, 0.1)

    def _held(self, keys: list[str], codes: Counter[str]) -> list[bool]:
        """`batch_is_exist`: whether the store holds each key (an error code counts as not held, and is counted)."""
        exists = self.store.batch_is_exist(keys)
        codes.update(f"exist {exist}" for exist in exists if exist < 0)
        return [exist == 1 for exist in exists]

    def _slots(self, count: int) -> list[int]:
        return [self.address + index * self.block_bytes for index in range(count)]

    def close(self) -> None:
        if self.setup_code == 0:
            self.store.unregister_buffer(self.address)
        self.store.close()


def _present_run(exists: list[int], codes: Counter[str], operation: str) -> int:
    """How many keys from the head are present: the run ends at the first 0 (absent) or error."""
    run = 0
    for exist in exists:
        if exist != 1:
            if exist < 0:
                codes[f"{operation} {exist}"] += 1
            break
        run += 1
    return run


def main(config: dict[str, Any]) -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the C++ client prints to stdout goes to the log, not into the protocol

    def answer(message: dict) -> None:
        protocol.write(json.dumps(message) + "\n")

    connector = Connector(config)
    answer({"setup": connector.setup_code, "register": connector.register_code})
    if connector.setup_code != 0 or connector.register_code != 0:
        return
    for line in sys.stdin:
        command = json.loads(line)
        op = command.get("op")
        if op == "read":
            answer(connector.read(command["keys"]))
        elif op == "put":
            answer(connector.put(command["keys"]))
        elif op == "exist":
            answer(connector.exist(command["keys"]))
        elif op == "quit":
            connector.close()
            answer({"closed": True})
            return
        else:
            answer({"error": f"unknown command {op!r}"})


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
