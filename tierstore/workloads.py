"""Request streams the engine emulator serves, grouped into rounds.

- `MultiRoundWorkload`: the multi-round chat of docs/design.md, 'Workloads'. A session's token stream only grows
  (the previous prompt, then its output, then new user tokens), so block j of a session never changes once full and
  its chained key can be computed once: an integer chain, or with `keys: vllm` vLLM's own keys over synthetic token
  ids (`token_ids`), 32 bytes each.
- `TraceWorkload`: Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
  fixed-size prefix blocks); the trace's own hash_ids are the keys, rounds are windows of arrival time.
"""

from __future__ import annotations

import json
import random
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvscope.tierstore import scenario as spec
from kvscope.tierstore.blockhash import INT_CHAIN_ROOT, BlockHasher, integer_chain_keys

Key = Hashable
SHARED_SESSION = -1  # the content id used for blocks that lie wholly inside the shared prefix
SYNTHETIC_VOCAB = 32_000  # token ids of `keys: vllm` blocks lie below this (a Llama-sized vocabulary)


def token_ids(owner: int, index: int, block_tokens: int) -> list[int]:
    """The synthetic token ids of block `index` of `owner` (a session, or SHARED_SESSION for the shared prefix):
    distinct per owner, the same on every run."""
    first = index * block_tokens
    return [((first + offset) * 7 + (owner + 2) * 7919) % SYNTHETIC_VOCAB for offset in range(block_tokens)]


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file, the line and the field."""


@dataclass(slots=True)
class Request:
    round: int
    session: int
    prompt_tokens: int
    keys: Sequence[Key]  # keys of the prompt's full blocks, head first
    output_keys: Sequence[Key] = ()  # blocks the generated tokens complete, stored when the request ends


class MultiRoundWorkload:
    def __init__(self, workload: spec.MultiRoundWorkload, block_tokens: int) -> None:
        self.spec = workload
        self.block_tokens = block_tokens
        self.round_count = workload.rounds
        self._keys: list[list[Key]] = [[] for _ in range(workload.sessions)]
        self._hasher = BlockHasher(block_tokens, seed=0) if workload.keys == "vllm" else None

    def prompt_tokens(self, round_number: int) -> int:
        """Tokens in every session's prompt in round `round_number` (1-based)."""
        w = self.spec
        return w.first_prompt_tokens + (round_number - 1) * (w.output_tokens + w.user_tokens)

    def session_orders(self) -> Iterator[list[int]]:
        """The order the sessions take their turns in, round after round (the planner follows it too)."""
        w = self.spec
        order = list(range(w.sessions))
        shuffler = random.Random(w.seed)
        for _ in range(w.rounds):
            if w.order == "shuffled":
                shuffler.shuffle(order)
            yield list(order)

    def rounds(self) -> Iterator[list[Request]]:
        w, block = self.spec, self.block_tokens
        for round_number, order in enumerate(self.session_orders(), start=1):
            prompt = self.prompt_tokens(round_number)
            prompt_blocks = prompt // block
            stored_blocks = (prompt + w.output_tokens) // block if w.output_cached else prompt_blocks
            requests = []
            for session in order:
                keys = self._session_keys(session, stored_blocks)
                requests.append(
                    Request(round_number, session, prompt, keys[:prompt_blocks], keys[prompt_blocks:stored_blocks])
                )
            yield requests

    def _session_keys(self, session: int, blocks: int) -> list[Key]:
        """The session's chained block keys, extended to `blocks`; shared-prefix blocks are equal everywhere."""
        keys = self._keys[session]
        if len(keys) < blocks:
            shared_blocks = self.spec.shared_prefix_tokens // self.block_tokens
            contents = [
                (SHARED_SESSION if index < shared_blocks else session, index) for index in range(len(keys), blocks)
            ]
            if self._hasher is None:
                keys.extend(integer_chain_keys(keys[-1] if keys else INT_CHAIN_ROOT, contents))
            else:
                parent = keys[-1] if keys else None
                for owner, index in contents:
                    parent = self._hasher.hash_block(parent, token_ids(owner, index, self.block_tokens))
                    keys.append(parent)
        return keys


class TraceWorkload:
    def __init__(self, workload: spec.TraceWorkload) -> None:
        self.spec = workload
        self.block_tokens = workload.block_tokens
        self.records = read_trace(workload.path, workload.block_tokens, workload.limit)
        last = self.records[-1][0] if self.records else 0
        self.round_count = int(last // (workload.round_seconds * 1000)) + 1

    def rounds(self) -> Iterator[list[Request]]:
        window_ms = self.spec.round_seconds * 1000
        requests: list[Request] = []
        round_number = 1
        for index, (timestamp, input_length, hash_ids) in enumerate(self.records):
            while timestamp >= round_number * window_ms:
                yield requests
                requests, round_number = [], round_number + 1
            full_blocks = input_length // self.block_tokens
            requests.append(Request(round_number, index, input_length, hash_ids[:full_blocks]))
        yield requests


def read_trace(path: Path, block_tokens: int, limit: int | None = None) -> list[tuple[float, int, list[int]]]:
    """(timestamp ms, input tokens, hash_ids) per request, each line checked; errors name file and line."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as error:
        raise TraceError(f"{path}: cannot read trace: {error.strerror}") from None
    records: list[tuple[float, int, list[int]]] = []
    previous = 0.0
    for line_number, line in enumerate(lines, start=1):
        if limit is not None and len(records) >= limit:
            break
        if line.strip():
            record = _trace_record(line, f"{path}:{line_number}", block_tokens, previous)
            records.append(record)
            previous = record[0]
    if not records:
        raise TraceError(f"{path}: the trace holds no requests")
    return records


def _trace_record(line: str, where: str, block_tokens: int, previous: float) -> tuple[float, int, list[int]]:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise TraceError(f"{where}: not valid JSON: {error.msg}") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object")
    timestamp, input_length, hash_ids = (record.get(k) for k in ("timestamp", "input_length", "hash_ids"))
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or timestamp < 0:
        raise TraceError(f"{where}: timestamp must be a non-negative number of ms, got {timestamp!r}")
    if timestamp < previous:
        raise TraceError(f"{where}: timestamp {timestamp} goes back in time (previous {previous})")
    if not isinstance(input_length, int) or isinstance(input_length, bool) or input_length <= 0:
        raise TraceError(f"{where}: input_length must be a positive integer, got {input_length!r}")
    if not isinstance(hash_ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in hash_ids):
        raise TraceError(f"{where}: hash_ids must be a list of integers")
    if len(hash_ids) < input_length // block_tokens:
        raise TraceError(
            f"{where}: hash_ids has {len(hash_ids)} blocks, fewer than the {input_length // block_tokens} full "
            f"{block_tokens}-token blocks of input_length {input_length}"
        )
    return timestamp, input_length, hash_ids


def make_workload(scenario: spec.Scenario) -> MultiRoundWorkload | TraceWorkload:
    if isinstance(scenario.workload, spec.TraceWorkload):
        return TraceWorkload(scenario.workload)
    return MultiRoundWorkload(scenario.workload, scenario.block_tokens)
