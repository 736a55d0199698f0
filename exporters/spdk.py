"""SPDK targets (nvmf_tgt, spdk_tgt) over their JSON-RPC server, through the `spdk` package's own client.

One `spdk.rpc.client.JSONRPCClient` per target, on a Unix socket (`socket:`) or TCP (`address:` + `port:`), kept
across scrapes and reopened after any failure. The client blocks, so each scrape runs its calls in one worker thread
(`asyncio.to_thread`), one request in flight at a time as SPDK's own rpc.py does; the scrape's budget is
`timeout_s`. A JSON-RPC error answer (a method an older target lacks, an unknown bdev, a rejected parameter) does
not fail the scrape: that call is skipped and counted in `spdk_rpc_errors`; only the transport failing (nothing
listening, a closed connection, an answer that is not JSON-RPC, no answer in time) raises CollectError.

Calls per scrape: `bdev_get_iostat`, `bdev_get_bdevs`, `nvmf_get_subsystems`, `nvmf_get_stats`,
`bdev_lvol_get_lvstores`, `thread_get_stats`, `framework_get_reactors`, and with `histograms: true`
`bdev_get_histogram` per bdev; `spdk_get_version` once per connection.

Version-aware parameters: without `bdevs:` iostat is asked with no parameters (valid on every version). With
`bdevs:` a target of v26.01 or later is asked `{"names": [...]}`; an older one `{"name": ...}` per bdev (the single
`name` was removed in v26.05). If the version is unknown or the guess is rejected (-32602, or -32603
"spdk_json_decode_object failed") the other form is tried and remembered for the connection. When `names` fails
with -19 (an unknown bdev) the names are asked one by one, so the others are still reported.

Raw naming scheme: `spdk_<area>_<field>`, the field as SPDK spells it, the value as SPDK reports it, except that
values in TSC ticks are turned into seconds with the same response's `tick_rate` (`tsc_rate` for histograms) and
named `_seconds` (`read_latency_ticks` -> `spdk_bdev_read_latency_seconds`, reactor `busy` ->
`spdk_reactor_busy_seconds`). Unknown numeric fields of a known object are kept (kind "unknown").

Areas (method: names; labels):
- bdev (bdev_get_iostat): every field of every bdev: spdk_bdev_bytes_read, spdk_bdev_num_read_ops,
  spdk_bdev_read_latency_seconds, spdk_bdev_max_read_latency_seconds, spdk_bdev_queue_depth, spdk_bdev_io_time
  (µs of sampling periods, as SPDK counts it), ...; spdk_bdev_io_error (+ status); spdk_bdev_driver_specific
  (numeric leaves, + field = dotted path); spdk_bdev_iostat_tick_rate, spdk_bdev_iostat_ticks; rates
  spdk_bdev_<bytes_*|num_*>_per_second over spdk_bdev_iostat_window_seconds. Labels: bdev, subsystem, role.
- bdev (bdev_get_bdevs): spdk_bdev_capacity_bytes = block_size x num_blocks, spdk_bdev_block_size,
  spdk_bdev_num_blocks, spdk_bdev_info (+ product_name, uuid, aliases). Labels: bdev, subsystem, role.
- bdev (bdev_get_histogram): spdk_bdev_histogram_bucket, cumulative, `le` in seconds at the end of each
  power-of-two range (exact bucket boundaries), spdk_bdev_histogram_count. Labels: bdev, subsystem, role (+ le).
- nvmf_subsystem (nvmf_get_subsystems joined to iostat): spdk_nvmf_subsystem_bytes_read, ..._num_read_ops,
  ..._read_latency_seconds, ... (sums over its namespaces), spdk_nvmf_subsystem_namespaces,
  spdk_nvmf_subsystem_namespaces_unresolved, spdk_nvmf_subsystem_namespace (info: nsid, bdev, ref). Label: subsystem.
- nvmf_poll_group, nvmf_transport, nvmf_transport_device (nvmf_get_stats): spdk_nvmf_poll_group_io_qpairs,
  ..._completed_nvme_io, spdk_nvmf_poll_group_transport (info), spdk_nvmf_transport_pending_data_buffer,
  spdk_nvmf_transport_device_request_latency_seconds, ... Labels: poll_group (+ trtype, + device).
- lvstore (bdev_lvol_get_lvstores): spdk_lvstore_<field>, spdk_lvstore_allocated_bytes =
  (total_data_clusters - free_clusters) x cluster_size, spdk_lvstore_capacity_bytes, spdk_lvstore_free_bytes.
  Labels: lvstore, uuid, base_bdev, tier (`role_by_lvstore` by name or UUID, else the target's `role`).
- thread (thread_get_stats): spdk_thread_busy_seconds, spdk_thread_idle_seconds, spdk_thread_<field>.
  Labels: thread, id.
- reactor (framework_get_reactors): spdk_reactor_busy_seconds, spdk_reactor_idle_seconds, spdk_reactor_irq/sys/usr
  (as SPDK reports them), spdk_reactor_thread_elapsed_seconds (+ thread, id). Label: lcore.
- version (spdk_get_version): spdk_version_info (version, major, minor, patch, suffix).
- rpc: spdk_rpc_errors, failed calls in this scrape (method, code, message); code "malformed" for a result
  of the wrong shape.

Labels of every bdev-area sample: `bdev` (SPDK's bdev name), `subsystem` (the NQN of the NVMe-oF subsystem that
exports it through a namespace, "" when none; several NQNs comma-joined, so the bdev's I/O is still one series),
`role` (`role_by_bdev`, matched by bdev name, alias or UUID; else the target's `role` label; else ""), `tier`
(the KV tier whose media bytes the bdev's I/O is: its `role_by_bdev`; else, for a bdev a subsystem exports, that
subsystem's `role_by_subsystem`, else the target's `role`; else "": a bdev no client addresses, such as an
lvstore's base, backs no tier, so stacked bdevs are not counted twice).
Namespaces are joined to bdevs by `bdev_name`, then `name` (older targets), then the namespace `uuid`, each looked
up among bdev names, aliases and UUIDs. A subsystem's sums are emitted only when every namespace's bdev is in this
scrape's iostat (else `spdk_nvmf_subsystem_namespaces_unresolved` says how many are missing): a partial sum would
be a wrong number. If `nvmf_get_subsystems` fails, the last membership seen is kept, so a bdev's series keep
their labels.

Rates are windowed on the responses' own `ticks` (the target's TSC when it answered), per bdev, against the previous
scrape's answer: Δcounter / (Δticks / tick_rate). No `ticks` (targets before it was added), a changed tick_rate,
ticks not advancing or a counter that went backwards (bdev_reset_iostat, restart) give no rate, never a wall-clock
one.

The `spdk` client (26.9) measures its read timeout in process CPU time (`time.process_time`, every thread of
the process), and if that budget runs out between two reads, `settimeout(<negative>)` raises ValueError, which its
read loop swallows and retries forever, never reading again. A trickling peer (whitespace, never an answer) also
keeps it reading past any timeout. So a scrape that runs out of time shuts the socket down and lifts the client's
timeout (1e9 s, positive again whatever CPU time passed), so the worker thread reads EOF and ends.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import ipaddress
import logging
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from pydantic import Field, model_validator
from spdk.rpc.client import JSONRPCClient, JSONRPCException

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.samples import Kind, Sample, labels_of

log = logging.getLogger(__name__)

NAMES_PARAM_SINCE = (26, 1)  # bdev_get_iostat takes "names" from v26.01; "name" was removed in v26.05
WORKER_SHARE = 0.85  # of timeout_s: the worker thread's deadline (its socket timeouts)
HARD_STOP_SHARE = 0.95  # of timeout_s: the scrape gives up on the thread and aborts its socket
METHODS = (
    "bdev_get_bdevs",
    "nvmf_get_subsystems",
    "nvmf_get_stats",
    "bdev_lvol_get_lvstores",
    "thread_get_stats",
    "framework_get_reactors",
)


class SpdkTargetConfig(TargetConfig):
    socket: str | None = Field(None, description="Unix socket of the target's RPC server, e.g. /var/tmp/spdk.sock")
    address: str | None = Field(None, description="TCP host of the RPC server (the target's -r host:port)")
    port: int = Field(5260, ge=1, le=65535, description="TCP port, with address")
    bdevs: list[str] | None = Field(
        None, min_length=1, description="ask iostat (and histograms) for these bdevs only; default: every bdev"
    )
    role_by_bdev: dict[str, str] = Field(
        default_factory=dict,
        description="role per bdev (by name, alias or UUID): its role label and the KV tier it backs; default: "
        "the target's role",
    )
    role_by_subsystem: dict[str, str] = Field(
        default_factory=dict,
        description="role per NVMe-oF subsystem (NQN): the KV tier its namespaces' bdevs back, unless role_by_bdev "
        "names one",
    )
    role_by_lvstore: dict[str, str] = Field(
        default_factory=dict,
        description="role per lvstore (by name or UUID): the KV tier whose allocation it is; default: the target's "
        "role",
    )
    histograms: bool = Field(
        False,
        description="read bdev_get_histogram for each bdev (`bdevs`, else all); enable it on the target first, "
        "bdevs without it are counted in spdk_rpc_errors",
    )

    @model_validator(mode="after")
    def _one_endpoint(self) -> SpdkTargetConfig:
        if (self.socket is None) == (self.address is None):
            raise ValueError("set exactly one of socket (a Unix socket path) or address (a TCP host, with port)")
        return self


@dataclass(frozen=True, slots=True)
class RpcFailure:
    """A JSON-RPC error answer (code as SPDK sent it), or a result of the wrong shape (code "malformed")."""

    method: str
    code: str
    message: str


class _TransportError(Exception):
    """The conversation itself failed; `stale` when a kept connection turned out closed before any answer."""

    def __init__(self, message: str, stale: bool = False) -> None:
        super().__init__(message)
        self.stale = stale


@dataclass
class Answers:
    """What one scrape got back: results by method, every iostat answer, histograms by bdev, and the failures."""

    version: dict | None = None
    iostat: list[Any] = field(default_factory=list)
    results: dict[str, Any] = field(default_factory=dict)
    histograms: dict[str, Any] = field(default_factory=dict)
    failures: list[RpcFailure] = field(default_factory=list)


class _Session:
    """Calls on one client, one at a time, each bounded by what is left of the scrape's deadline."""

    def __init__(self, client: JSONRPCClient, deadline: float, aborted: threading.Event) -> None:
        self.client = client
        self.deadline = deadline
        self.aborted = aborted
        self.answered = 0

    def call(self, method: str, params: dict | None = None) -> Any:
        if self.aborted.is_set():
            raise _TransportError(f"{method}: the scrape was abandoned")
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise _TransportError(f"{method}: the scrape's time budget was spent before asking")
        client = self.client
        if client.sock is None:
            raise _TransportError(f"{method}: connection closed", stale=True)
        client.timeout = remaining
        try:
            request_id = client.send(method, params)
            response = client.recv()
        except JSONRPCException as error:
            text = _squash(error.message)
            raise _TransportError(f"{method}: {text}", stale=text.startswith("Connection closed")) from None
        except OSError as error:
            raise _TransportError(f"{method}: {error!r}", stale=True) from None
        if (
            not isinstance(response, dict)
            or response.get("id") != request_id
            or ("result" in response) == ("error" in response)
        ):
            raise _TransportError(f"{method}: not a JSON-RPC answer to request {request_id}: {_snippet(response)}")
        self.answered += 1
        if "error" in response:
            error = response["error"]
            if not isinstance(error, dict):
                return RpcFailure(method, "malformed", _snippet(error))
            return RpcFailure(method, str(error.get("code", "")), str(error.get("message", "")))
        return response["result"]


class SpdkCollector(Collector):
    source: ClassVar[str] = "spdk"
    Config = SpdkTargetConfig

    def __init__(self, config: SpdkTargetConfig) -> None:
        super().__init__(config)
        self.config: SpdkTargetConfig = config
        self._lock = threading.Lock()  # guards _client between the worker thread and an abort from the loop
        self._client: JSONRPCClient | None = None
        self._worker: asyncio.Future | None = None
        self._aborted = threading.Event()  # set when the scrape gave up on the current worker
        self._version: dict | RpcFailure | None = None  # spdk_get_version of the current connection
        self._iostat_form: str | None = None  # "names" or "name" once known for the current connection
        self._previous: dict[str, tuple[float, float, dict[str, float]]] = {}  # bdev -> (ticks, tick_rate, counters)
        self._membership: dict[str, list[str]] = {}  # bdev -> NQNs, from the last nvmf_get_subsystems that answered
        self._warned: set[tuple[str, str]] = set()  # (method, code) already logged at warning level
        if config.socket is not None:
            self._where = f"unix:{config.socket}"
        else:
            self._where = f"tcp:{config.address}:{config.port}"

    # -- the scrape ------------------------------------------------------------------------------------------

    async def collect(self) -> list[Sample]:
        await self._settle_previous()
        timeout = self.config.timeout_s
        deadline = time.monotonic() + timeout * WORKER_SHARE
        aborted = threading.Event()
        worker = asyncio.ensure_future(asyncio.to_thread(self._exchange, deadline, aborted))
        self._worker, self._aborted = worker, aborted
        try:
            answers = await asyncio.wait_for(asyncio.shield(worker), timeout * HARD_STOP_SHARE)
        except TimeoutError:
            self._abort(worker, aborted)
            raise CollectError(self._say(f"no complete answer within {timeout:g} s")) from None
        except asyncio.CancelledError:
            self._abort(worker, aborted)
            raise
        except _TransportError as error:
            raise CollectError(self._say(str(error))) from None
        return self._samples(answers)

    async def close(self) -> None:
        worker = self._worker
        if worker is not None and not worker.done():
            self._abort(worker, self._aborted)
            with contextlib.suppress(Exception, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(worker), 1.0)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            _close_quietly(client)

    def _say(self, what: str) -> str:
        return f"{self.config.name} ({self._where}): {what}"

    async def _settle_previous(self) -> None:
        """A scrape that was aborted leaves its thread unwinding; never run two against one target."""
        worker = self._worker
        if worker is None or worker.done():
            return
        done, _ = await asyncio.wait({worker}, timeout=self.config.timeout_s * 0.25)
        if not done:  # its own failure was reported by the scrape that started it
            raise CollectError(self._say("the previous scrape's RPC call has not returned; not starting another"))

    def _abort(self, worker: asyncio.Future, aborted: threading.Event) -> None:
        """Unblock the worker thread: shut its socket (recv returns), lift the client's CPU-time timeout, and
        tell it not to reconnect."""
        aborted.set()
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.timeout = 1e9
            sock = client.sock
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

        def reap(future: asyncio.Future) -> None:
            if not future.cancelled():
                future.exception()
            if client is not None:
                _close_quietly(client)

        worker.add_done_callback(reap)

    # -- the worker thread -----------------------------------------------------------------------------------

    def _exchange(self, deadline: float, aborted: threading.Event) -> Answers:
        """Every call of one scrape. A kept connection found closed before any answer is reopened once."""
        for attempt in range(2):
            client, fresh = self._connection(deadline, aborted)
            session = _Session(client, deadline, aborted)
            try:
                return self._ask(session)
            except _TransportError as error:
                self._drop(client)
                if fresh or attempt or session.answered or not error.stale or aborted.is_set():
                    raise
                log.info("%s: kept connection was closed (%s); reconnecting", self.config.name, error)
        raise AssertionError("unreachable")

    def _connection(self, deadline: float, aborted: threading.Event) -> tuple[JSONRPCClient, bool]:
        with self._lock:
            if self._client is not None:
                return self._client, False
        client = self._connect(deadline)
        with self._lock:  # kept from now on, so that an abort can reach its socket
            if aborted.is_set():  # the scrape gave up while this connection was being opened
                _close_quietly(client)
                raise _TransportError("the scrape was abandoned while connecting")
            self._client = client
        session = _Session(client, deadline, aborted)
        try:
            version = session.call("spdk_get_version")
        except _TransportError:
            self._drop(client)
            raise
        self._version = version
        self._iostat_form = None
        numbers = _version_numbers(version) if isinstance(version, dict) else None
        if numbers is not None:
            self._iostat_form = "names" if numbers >= NAMES_PARAM_SINCE else "name"
        return client, True

    def _connect(self, deadline: float) -> JSONRPCClient:
        remaining = max(deadline - time.monotonic(), 0.001)
        if self.config.socket is not None:
            addr, port = self.config.socket, None
        else:
            addr, port = _resolve(self.config.address or "", self.config.port), self.config.port
        try:
            client = JSONRPCClient(addr, port, timeout=remaining)
        except JSONRPCException as error:
            raise _TransportError(f"cannot connect: {_squash(error.message)}") from None
        # The client adds a handler to its per-address logger each time it is built; keep one across reconnects.
        logger = client.get_logger()
        for handler in logger.handlers[:-1]:
            logger.removeHandler(handler)
        return client

    def _drop(self, client: JSONRPCClient) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        _close_quietly(client)

    def _ask(self, session: _Session) -> Answers:
        answers = Answers()
        if isinstance(self._version, RpcFailure):
            answers.failures.append(self._version)
        elif isinstance(self._version, dict):
            answers.version = self._version
        self._ask_iostat(session, answers)
        for method in METHODS:
            _keep(answers, method, session.call(method))
        if self.config.histograms:
            wanted = self.config.bdevs or [name for name, _, _ in _iostat_entries(answers.iostat)]
            for name in wanted:
                outcome = session.call("bdev_get_histogram", {"name": name})
                if isinstance(outcome, RpcFailure):
                    answers.failures.append(RpcFailure(outcome.method, outcome.code, f"{name}: {outcome.message}"))
                else:
                    answers.histograms[name] = outcome
        return answers

    def _ask_iostat(self, session: _Session, answers: Answers) -> None:
        wanted = self.config.bdevs
        if not wanted:
            _keep(answers, "bdev_get_iostat", session.call("bdev_get_iostat"))
            return
        forms = ["name", "names"] if self._iostat_form == "name" else ["names", "name"]
        rejected: list[RpcFailure] = []
        for form in forms:
            if form == "names":
                outcomes = [session.call("bdev_get_iostat", {"names": list(wanted)})]
                if _code(outcomes[0]) == "-19" and len(wanted) > 1:
                    # One unknown bdev fails the whole call: ask one by one, so the others are still reported.
                    outcomes = [session.call("bdev_get_iostat", {"names": [name]}) for name in wanted]
                    outcomes = [_named(o, name) for o, name in zip(outcomes, wanted, strict=True)]
            else:
                outcomes = [_named(session.call("bdev_get_iostat", {"name": name}), name) for name in wanted]
            refused = [o for o in outcomes if _param_rejected(o)]
            if refused:
                log.info("%s: bdev_get_iostat refused %r: %s", self.config.name, form, refused[0].message)
                rejected += refused
                continue
            self._iostat_form = form
            for outcome in outcomes:
                _keep(answers, "bdev_get_iostat", outcome)
            return
        answers.failures += rejected  # neither form was accepted

    # -- samples ---------------------------------------------------------------------------------------------

    def _samples(self, answers: Answers) -> list[Sample]:
        out = _Out()
        results = answers.results
        bdevs = results.get("bdev_get_bdevs")
        if bdevs is not None and not isinstance(bdevs, list):
            answers.failures.append(RpcFailure("bdev_get_bdevs", "malformed", _snippet(bdevs)))
        bdevs = bdevs if isinstance(bdevs, list) else []
        iostat = _iostat_entries(answers.iostat, answers.failures)
        present = {name for name, _, _ in iostat}
        resolve = _resolver(bdevs, present)

        # Which subsystem exports each bdev (kept from the last answer when nvmf_get_subsystems fails).
        subsystems = results.get("nvmf_get_subsystems")
        namespaces: dict[str, list[tuple[str, str, str | None]]] = {}  # nqn -> [(nsid, ref, bdev or None)]
        if isinstance(subsystems, list):
            membership: dict[str, list[str]] = {}
            for subsystem in subsystems:
                if not isinstance(subsystem, dict) or "nqn" not in subsystem:
                    continue
                nqn = str(subsystem["nqn"])
                if subsystem.get("subtype") == "Discovery":
                    continue
                rows = namespaces.setdefault(nqn, [])
                for ns in subsystem.get("namespaces") or []:
                    ref, bdev = _namespace_bdev(ns, resolve)
                    rows.append((str(ns.get("nsid", "")) if isinstance(ns, dict) else "", ref, bdev))
                    if bdev is not None:
                        membership.setdefault(bdev, []).append(nqn)
            self._membership = membership
        elif subsystems is not None:
            answers.failures.append(RpcFailure("nvmf_get_subsystems", "malformed", _snippet(subsystems)))

        default_role = self.config.labels.get("role", "")
        roles = {resolve.get(_key(key)): role for key, role in self.config.role_by_bdev.items()}
        by_subsystem = self.config.role_by_subsystem

        def bdev_labels(name: str) -> dict[str, str]:
            nqns = sorted(set(self._membership.get(name, [])))
            exported = next((by_subsystem[nqn] for nqn in nqns if nqn in by_subsystem), default_role if nqns else "")
            return {
                "bdev": name,
                "subsystem": ",".join(nqns),
                "role": roles.get(name, default_role),
                "tier": roles.get(name, exported),
            }

        # bdev_get_iostat: every field, ticks to seconds, rates on the answers' own ticks.
        previous, self._previous = self._previous, {}
        for name, entry, top in iostat:
            labels = bdev_labels(name)
            tick_rate = _number(top.get("tick_rate"))
            ticks = _number(top.get("ticks"))
            if tick_rate is not None:
                out.add("spdk_bdev_iostat_tick_rate", labels, tick_rate, "gauge")
            if ticks is not None:
                out.add("spdk_bdev_iostat_ticks", labels, ticks, "counter")
            counters = _iostat_samples(out, entry, labels, tick_rate, answers.failures)
            if ticks is not None and tick_rate:
                self._previous[name] = (ticks, tick_rate, counters)
                before = previous.get(name)
                if before is not None and before[1] == tick_rate and ticks > before[0]:
                    window = (ticks - before[0]) / tick_rate
                    out.add("spdk_bdev_iostat_window_seconds", labels, window, "gauge")
                    for key, value in counters.items():
                        earlier = before[2].get(key)
                        if earlier is not None and value >= earlier and _rated(key):
                            out.add(f"spdk_bdev_{key}_per_second", labels, (value - earlier) / window, "gauge")

        # Per subsystem: sums of its namespaces' counters, only when every namespace's bdev answered.
        by_name = {name: entry for name, entry, _ in iostat}
        rates = {name: _number(top.get("tick_rate")) for name, _, top in iostat}
        for nqn, rows in namespaces.items():
            out.add("spdk_nvmf_subsystem_namespaces", {"subsystem": nqn}, len(rows), "gauge")
            missing = [row for row in rows if row[2] not in by_name]
            out.add("spdk_nvmf_subsystem_namespaces_unresolved", {"subsystem": nqn}, len(missing), "gauge")
            for nsid, ref, bdev in rows:
                info = {"subsystem": nqn, "nsid": nsid, "bdev": bdev or "", "ref": ref}
                out.add("spdk_nvmf_subsystem_namespace", info, 1, "info")
            if missing:
                log.info(
                    "%s: %s: no iostat for namespace(s) %s; its sums are not reported",
                    self.config.name,
                    nqn,
                    ", ".join(f"{nsid} ({ref})" for nsid, ref, _ in missing),
                )
                continue
            sums: dict[str, float] = {}
            for _, _, bdev in rows:
                assert bdev is not None
                for key, value in _summable(by_name[bdev], rates[bdev]).items():
                    sums[key] = sums.get(key, 0.0) + value
            for key, value in sums.items():
                out.add(f"spdk_nvmf_subsystem_{key}", {"subsystem": nqn}, value, "counter")

        # bdev_get_bdevs: capacity.
        for bdev in bdevs:
            if not isinstance(bdev, dict) or "name" not in bdev:
                continue
            name = str(bdev["name"])
            labels = bdev_labels(name)
            block_size, num_blocks = _number(bdev.get("block_size")), _number(bdev.get("num_blocks"))
            if block_size is not None and num_blocks is not None:
                out.add("spdk_bdev_capacity_bytes", labels, block_size * num_blocks, "gauge")
                out.add("spdk_bdev_block_size", labels, block_size, "gauge")
                out.add("spdk_bdev_num_blocks", labels, num_blocks, "gauge")
            info = {
                **labels,
                "product_name": str(bdev.get("product_name", "")),
                "uuid": str(bdev.get("uuid", "")),
                "aliases": ",".join(str(a) for a in bdev.get("aliases") or []),
            }
            out.add("spdk_bdev_info", info, 1, "info")

        # bdev_get_histogram.
        for name, result in answers.histograms.items():
            _histogram_samples(out, result, bdev_labels(resolve.get(_key(name), name)), name, answers.failures)

        _nvmf_stats_samples(out, results.get("nvmf_get_stats"), answers.failures)
        by_lvstore = self.config.role_by_lvstore

        def lvstore_tier(lvs: dict[str, str]) -> str:
            return by_lvstore.get(lvs["lvstore"], by_lvstore.get(lvs["uuid"], default_role))

        _lvstore_samples(out, results.get("bdev_lvol_get_lvstores"), answers.failures, lvstore_tier)
        _thread_samples(out, results.get("thread_get_stats"), answers.failures)
        _reactor_samples(out, results.get("framework_get_reactors"), answers.failures)

        if answers.version is not None:
            fields = answers.version.get("fields") or {}
            info = {"version": str(answers.version.get("version", ""))}
            info.update({key: str(fields.get(key, "")) for key in ("major", "minor", "patch", "suffix")})
            out.add("spdk_version_info", info, 1, "info")

        counts: dict[tuple[str, str, str], int] = {}
        for failure in answers.failures:
            key = (failure.method, failure.code, failure.message)
            counts[key] = counts.get(key, 0) + 1
        for (method, code, message), count in counts.items():
            level = logging.DEBUG if (method, code) in self._warned else logging.WARNING
            self._warned.add((method, code))  # once per method and code; the sample says it every scrape
            log.log(level, "%s: %s failed: %s %s", self.config.name, method, code, message)
            out.add("spdk_rpc_errors", {"method": method, "code": code, "message": message}, count, "gauge")
        return out.samples


# -- helpers: the answers --------------------------------------------------------------------------------------


def _keep(answers: Answers, method: str, outcome: Any) -> None:
    if isinstance(outcome, RpcFailure):
        answers.failures.append(outcome)
    elif method == "bdev_get_iostat":
        answers.iostat.append(outcome)
    else:
        answers.results[method] = outcome


def _code(outcome: Any) -> str | None:
    return outcome.code if isinstance(outcome, RpcFailure) else None


def _named(outcome: Any, name: str) -> Any:
    """A failure of a per-bdev call says which bdev it was about."""
    if isinstance(outcome, RpcFailure) and not _param_rejected(outcome):
        return RpcFailure(outcome.method, outcome.code, f"{name}: {outcome.message}")
    return outcome


def _param_rejected(outcome: Any) -> bool:
    """The target did not take the parameter form (as v26.05+ answers {"name": ...})."""
    if not isinstance(outcome, RpcFailure):
        return False
    return outcome.code == "-32602" or (outcome.code == "-32603" and "decode" in outcome.message.lower())


def _version_numbers(version: dict) -> tuple[int, int] | None:
    fields = version.get("fields")
    if isinstance(fields, dict):
        major, minor = fields.get("major"), fields.get("minor")
        if isinstance(major, int) and isinstance(minor, int):
            return major, minor
    match = re.search(r"(\d+)\.(\d+)", str(version.get("version", "")))
    return (int(match[1]), int(match[2])) if match else None


def _resolve(host: str, port: int) -> str:
    """The spdk client takes IP literals only: resolve a host name first."""
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(host))
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise _TransportError(f"cannot resolve {host!r}: {error}") from None
    return str(infos[0][4][0])


def _close_quietly(client: JSONRPCClient) -> None:
    sock, client.sock = client.sock, None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()


def _squash(text: Any) -> str:
    return _snippet(" ".join(str(text).split()))


def _snippet(value: Any, limit: int = 200) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _key(ref: str) -> str:
    """Lookup key of a bdev reference: UUIDs compare case-insensitively."""
    return ref.lower() if _UUID.fullmatch(ref) else ref


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _resolver(bdevs: list, iostat_names: Iterable[str]) -> dict[str, str]:
    """Bdev name, each alias and the UUID -> the bdev's name (names win over aliases of other bdevs)."""
    index: dict[str, str] = {}
    for name in iostat_names:
        index[_key(name)] = name
    for bdev in bdevs:
        if isinstance(bdev, dict) and "name" in bdev:
            index[_key(str(bdev["name"]))] = str(bdev["name"])
    for bdev in bdevs:
        if isinstance(bdev, dict) and "name" in bdev:
            for ref in [*(bdev.get("aliases") or []), bdev.get("uuid")]:
                if ref:
                    index.setdefault(_key(str(ref)), str(bdev["name"]))
    return index


def _namespace_bdev(ns: Any, resolve: dict[str, str]) -> tuple[str, str | None]:
    """(the reference the namespace gives, the bdev it names or None): bdev_name, then name, then uuid."""
    if not isinstance(ns, dict):
        return _snippet(ns), None
    refs = [str(ns[key]) for key in ("bdev_name", "name", "uuid") if ns.get(key)]
    for ref in refs:
        if _key(ref) in resolve:
            return ref, resolve[_key(ref)]
    return (refs[0] if refs else ""), None


def _iostat_entries(results: list[Any], failures: list[RpcFailure] | None = None) -> list[tuple[str, dict, dict]]:
    """(bdev, stats, the answer's top level) for every bdev of every iostat answer, in both shapes SPDK used."""
    entries: list[tuple[str, dict, dict]] = []
    seen: set[str] = set()
    for result in results:
        if isinstance(result, dict) and isinstance(result.get("bdevs"), list):
            top, items = result, result["bdevs"]
        elif isinstance(result, list):  # before v20: [{"tick_rate": N}, {bdev}, ...]
            top = next((i for i in result if isinstance(i, dict) and "tick_rate" in i), {})
            items = [i for i in result if isinstance(i, dict) and "name" in i]
        else:
            if failures is not None:
                failures.append(RpcFailure("bdev_get_iostat", "malformed", _snippet(result)))
            continue
        for item in items:
            if isinstance(item, dict) and "name" in item and str(item["name"]) not in seen:
                seen.add(str(item["name"]))  # a bdev asked twice (by name and by alias) is counted once
                entries.append((str(item["name"]), item, top))
    return entries


# -- helpers: samples ------------------------------------------------------------------------------------------


class _Out:
    def __init__(self) -> None:
        self.samples: list[Sample] = []

    def add(self, name: str, labels: dict[str, str], value: float, kind: Kind) -> None:
        self.samples.append(Sample("spdk", name, labels_of(labels), float(value), kind))


def _iostat_kind(key: str) -> Kind:
    if key.startswith(("max_", "min_")) or key.startswith("queue_depth"):
        return "gauge"
    if key.startswith(("bytes_", "num_")) or key.endswith("_latency_ticks") or key in ("io_time", "weighted_io_time"):
        return "counter"
    return "unknown"


def _rated(key: str) -> bool:
    return key.startswith(("bytes_", "num_"))


def _iostat_samples(
    out: _Out, entry: dict, labels: dict[str, str], tick_rate: float | None, failures: list[RpcFailure]
) -> dict[str, float]:
    """Every field of one bdev's iostat; returns its counters by raw name suffix (for rates)."""
    counters: dict[str, float] = {}
    for key, value in entry.items():
        if key == "name":
            continue
        if key == "io_error" and isinstance(value, dict):
            for status, count in value.items():
                number = _number(count)
                if number is not None:
                    out.add("spdk_bdev_io_error", {**labels, "status": str(status)}, number, "counter")
            continue
        if key == "driver_specific" and isinstance(value, dict):
            for path, number in _leaves(value):
                out.add("spdk_bdev_driver_specific", {**labels, "field": path}, number, "unknown")
            continue
        number = _number(value)
        if number is None:
            continue
        kind = _iostat_kind(key)
        if key.endswith("_ticks"):
            if not tick_rate:
                failures.append(RpcFailure("bdev_get_iostat", "malformed", f"{key} without a tick_rate"))
                continue
            key, number = key[: -len("_ticks")] + "_seconds", number / tick_rate
        out.add(f"spdk_bdev_{key}", labels, number, kind)
        if kind == "counter":
            counters[key] = number
    return counters


def _summable(entry: dict, tick_rate: float | None) -> dict[str, float]:
    """The counters that add up across a subsystem's namespaces: bytes, ops and latency sums."""
    sums: dict[str, float] = {}
    for key, value in entry.items():
        number = _number(value)
        if number is None or key.startswith(("max_", "min_")):
            continue
        if key.startswith(("bytes_", "num_")):
            sums[key] = number
        elif key.endswith("_latency_ticks") and tick_rate:
            sums[key[: -len("_ticks")] + "_seconds"] = number / tick_rate
    return sums


def _leaves(value: Any, prefix: str = "") -> list[tuple[str, float]]:
    found: list[tuple[str, float]] = []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _leaves(item, f"{prefix}.{key}" if prefix else str(key))
    elif (number := _number(value)) is not None:
        found.append((prefix, number))
    return found


def _scalars(
    out: _Out,
    prefix: str,
    obj: dict,
    labels: dict[str, str],
    *,
    counters: Iterable[str] = (),
    ticks: Iterable[str] = (),
    tick_rate: float | None = None,
    skip: Iterable[str] = (),
    default_kind: Kind = "unknown",
    method: str = "",
    failures: list[RpcFailure] | None = None,
) -> None:
    """The numeric (and boolean) fields of one object: `pending_*`/`current_*`/`*_count`/booleans are gauges,
    `counters` are counters, the rest `default_kind`; `ticks` fields become `<field>_seconds` (counters)."""
    counters, ticks, skip = set(counters), set(ticks), set(skip)
    for key, value in obj.items():
        if key in skip:
            continue
        if isinstance(value, bool):
            out.add(f"{prefix}_{key}", labels, float(value), "gauge")
            continue
        number = _number(value)
        if number is None:
            continue
        kind: Kind = "counter" if key in counters else default_kind
        if key.startswith(("pending_", "current_")) or key.endswith("_count"):
            kind = "gauge"
        if key in ticks:
            if not tick_rate:
                if failures is not None:
                    failures.append(RpcFailure(method, "malformed", f"{key} without a tick_rate"))
                continue
            out.add(f"{prefix}_{key}_seconds", labels, number / tick_rate, "counter")
            continue
        out.add(f"{prefix}_{key}", labels, number, kind)


def _shape(method: str, result: Any, key: str | None, failures: list[RpcFailure]) -> tuple[dict, list] | None:
    """(top level, list under `key`) of a result, or None (and a "malformed" failure) when it is not that shape."""
    if result is None:
        return None
    if key is None:
        if isinstance(result, list):
            return {}, result
    elif isinstance(result, dict) and isinstance(result.get(key, []), list):
        return result, result.get(key, [])
    failures.append(RpcFailure(method, "malformed", _snippet(result)))
    return None


_POLL_GROUP_COUNTERS = ("admin_qpairs", "io_qpairs", "completed_nvme_io")
_DEVICE_COUNTERS = (
    "polls",
    "idle_polls",
    "completions",
    "requests",
    "total_send_wrs",
    "send_doorbell_updates",
    "total_recv_wrs",
    "recv_doorbell_updates",
)


def _nvmf_stats_samples(out: _Out, result: Any, failures: list[RpcFailure]) -> None:
    shaped = _shape("nvmf_get_stats", result, "poll_groups", failures)
    if shaped is None:
        return
    top, groups = shaped
    tick_rate = _number(top.get("tick_rate"))
    for group in groups:
        if not isinstance(group, dict):
            continue
        labels = {"poll_group": str(group.get("name", ""))}
        _scalars(out, "spdk_nvmf_poll_group", group, labels, counters=_POLL_GROUP_COUNTERS)
        for transport in group.get("transports") or []:
            if not isinstance(transport, dict):
                continue
            tlabels = {**labels, "trtype": str(transport.get("trtype", ""))}
            out.add("spdk_nvmf_poll_group_transport", tlabels, 1, "info")
            _scalars(out, "spdk_nvmf_transport", transport, tlabels)
            for device in transport.get("devices") or []:
                if isinstance(device, dict):
                    dlabels = {**tlabels, "device": str(device.get("name", ""))}
                    _scalars(
                        out,
                        "spdk_nvmf_transport_device",
                        device,
                        dlabels,
                        counters=_DEVICE_COUNTERS,
                        ticks=("request_latency",),
                        tick_rate=tick_rate,
                        method="nvmf_get_stats",
                        failures=failures,
                    )


def _lvstore_samples(
    out: _Out, result: Any, failures: list[RpcFailure], tier_of: Callable[[dict[str, str]], str]
) -> None:
    shaped = _shape("bdev_lvol_get_lvstores", result, None, failures)
    if shaped is None:
        return
    for lvs in shaped[1]:
        if not isinstance(lvs, dict):
            continue
        labels = {
            "lvstore": str(lvs.get("name", "")),
            "uuid": str(lvs.get("uuid", "")),
            "base_bdev": str(lvs.get("base_bdev", "")),
        }
        labels["tier"] = tier_of(labels)
        _scalars(out, "spdk_lvstore", lvs, labels, default_kind="gauge")
        total, free = _number(lvs.get("total_data_clusters")), _number(lvs.get("free_clusters"))
        cluster = _number(lvs.get("cluster_size"))
        if total is None or free is None or cluster is None:
            failures.append(RpcFailure("bdev_lvol_get_lvstores", "malformed", f"{labels['lvstore']}: no clusters"))
            continue
        out.add("spdk_lvstore_allocated_bytes", labels, (total - free) * cluster, "gauge")
        out.add("spdk_lvstore_capacity_bytes", labels, total * cluster, "gauge")
        out.add("spdk_lvstore_free_bytes", labels, free * cluster, "gauge")


def _thread_samples(out: _Out, result: Any, failures: list[RpcFailure]) -> None:
    shaped = _shape("thread_get_stats", result, "threads", failures)
    if shaped is None:
        return
    top, threads = shaped
    tick_rate = _number(top.get("tick_rate"))
    for thread in threads:
        if isinstance(thread, dict):
            labels = {"thread": str(thread.get("name", "")), "id": str(thread.get("id", ""))}
            _scalars(
                out,
                "spdk_thread",
                thread,
                labels,
                ticks=("busy", "idle"),
                tick_rate=tick_rate,
                skip=("id",),
                method="thread_get_stats",
                failures=failures,
            )


def _reactor_samples(out: _Out, result: Any, failures: list[RpcFailure]) -> None:
    shaped = _shape("framework_get_reactors", result, "reactors", failures)
    if shaped is None:
        return
    top, reactors = shaped
    tick_rate = _number(top.get("tick_rate"))
    for reactor in reactors:
        if not isinstance(reactor, dict):
            continue
        labels = {"lcore": str(reactor.get("lcore", ""))}
        _scalars(
            out,
            "spdk_reactor",
            reactor,
            labels,
            counters=("irq", "sys", "usr"),
            ticks=("busy", "idle"),
            tick_rate=tick_rate,
            skip=("lcore", "tid", "numa_id"),
            method="framework_get_reactors",
            failures=failures,
        )
        for thread in reactor.get("lw_threads") or []:
            elapsed = _number(thread.get("elapsed")) if isinstance(thread, dict) else None
            if elapsed is not None and tick_rate:
                tlabels = {**labels, "thread": str(thread.get("name", "")), "id": str(thread.get("id", ""))}
                out.add("spdk_reactor_thread_elapsed_seconds", tlabels, elapsed / tick_rate, "counter")


def _histogram_samples(out: _Out, result: Any, labels: dict[str, str], name: str, failures: list[RpcFailure]) -> None:
    """Cumulative counts at the end of each power-of-two range of SPDK's histogram (exact bucket boundaries:
    range r ends at 2^(r + granularity) ticks); the last range also holds everything above it, so it is +Inf."""
    try:
        granularity = int(result.get("granularity", result.get("bucket_shift")))
        min_range = int(result.get("min_range", 0))
        max_range = int(result.get("max_range", 64 - granularity))
        tsc_rate = float(result["tsc_rate"])
        data = base64.b64decode(result["histogram"], validate=True)
        per_range = 1 << granularity
        count = (max_range - min_range + 1) * per_range
        if len(data) != 8 * count or tsc_rate <= 0:
            raise ValueError(f"{len(data)} bytes for {count} buckets")
    except (AttributeError, KeyError, TypeError, ValueError, binascii.Error) as error:
        failures.append(RpcFailure("bdev_get_histogram", "malformed", f"{name}: {_snippet(str(error))}"))
        return
    buckets = struct.unpack(f"<{count}Q", data)  # host order of the target (x86/ARM: little-endian)
    running = 0
    for index, r in enumerate(range(min_range, max_range + 1)):
        running += sum(buckets[index * per_range : (index + 1) * per_range])
        le = "+Inf" if r == max_range else repr((1 << (r + granularity)) / tsc_rate)
        out.add("spdk_bdev_histogram_bucket", {**labels, "le": le}, running, "histogram")
    out.add("spdk_bdev_histogram_count", labels, running, "histogram")
