"""SPDK targets (nvmf_tgt, spdk_tgt) over their JSON-RPC server, through the `spdk` package's own client.

One `spdk.rpc.client.JSONRPCClient` per target, on a Unix socket (`socket:`) or TCP (`address:` + `port:`), kept
across scrapes and reopened after any failure. The client blocks, so each scrape runs its calls in one worker thread
of its own (`Collector.blocking`), one request in flight at a time as SPDK's own rpc.py does; the scrape's budget is
`timeout_s`. A JSON-RPC error answer (a method an older target lacks, an unknown bdev, a rejected parameter) does
not fail the scrape: that call is skipped and counted in `spdk_rpc_errors`; only the transport failing (nothing
listening, a closed connection, an answer that is not JSON-RPC, no answer in time) raises CollectError.

Three modules: this one (the target's configuration, what to ask and when: the collector), exporters/spdk_rpc.py
(the JSON-RPC transport: the client, one call at a time under the scrape's deadline, the connection) and
exporters/spdk_answers.py (the parsers: one scrape's answers to raw samples and read errors, pure functions tested
from captures alone).

Calls per scrape: `bdev_get_iostat`, `bdev_get_bdevs`, `nvmf_get_subsystems`, `nvmf_get_stats`,
`bdev_lvol_get_lvstores`, `thread_get_stats`, `framework_get_reactors`, and with `histograms: true`
`bdev_get_histogram` per bdev; `spdk_get_version` once per connection.

Version-aware parameters: without `bdevs:` iostat is asked with no parameters (valid on every version). With
`bdevs:` a target of v26.01 or later is asked `{"names": [...]}`; an older one `{"name": ...}` per bdev (the single
`name` was removed in v26.05). If the version is unknown or the guess is rejected (-32602, or -32603
"spdk_json_decode_object failed") the other form is tried and remembered for the connection. When `names` fails
with -19 (an unknown bdev) the names are asked one by one, so the others are still reported.

What fails the scrape, what is a read error, what is neither:
- The conversation failing fails the whole scrape (CollectError, `kvscope_scrape_errors_total`): nothing listening,
  a closed connection, an answer that is not JSON-RPC or not to the request asked, no answer within the deadline.
  The calls share one stream, in order, so after any of these no later answer can be trusted to be its call's.
- A JSON-RPC error answer is the target declining one call: counted in `spdk_rpc_errors` (method, code, message),
  logged at warning once per method and code; the rest of the scrape stands.
- An answer SPDK would not write is a read error of that method (`Collector.read_error`, what = the RPC method,
  counted in `kvscope_source_read_errors_total{reason}` by the scrape loop and logged when it starts and ends);
  only the series it would have given are missing, the rest of the target is exported:
  `unparseable`: a result of the wrong shape, an object missing a field SPDK always writes (a bdev's name,
  block_size, num_blocks; an lvstore's clusters; a thread's or reactor's busy and idle; an lw_thread's elapsed; the
  tick_rate of an answer with fields in ticks), a counter that is not a number (a string, null, a boolean, NaN);
  `out_of_range`: a counter (SPDK's uint64 fields: every iostat field, ticks, tick_rate, the counters and ticks of
  the other objects, clusters, sizes) that is negative, above 2^64-1, infinite, or written with more than 20 digits
  (decoded without int(), see exporters/spdk_answers.py), an lvstore with more free clusters than it has.
  A tier's sum is never partial: a field one bdev could not read is withheld from its tier this scrape (the other
  bdevs' samples of it carry tier ""), an lvstore that could not be read withholds its tier's occupancy, and a
  subsystem's sum of a field needs it from every namespace. Numeric fields of no fixed type (gauges SPDK adds,
  strings such as names or cpumasks) are kept when they are numbers and skipped when not, as before.

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
- rpc: spdk_rpc_errors, JSON-RPC error answers in this scrape (method, code, message); code "malformed" for an
  error answer whose error member is not an object.

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

Each read waits what is left of the worker's deadline in wall time (exporters/spdk_rpc.py's Client: the `spdk`
client's own recv, in 26.9, counts process CPU time of every thread, and once that budget is spent its loop
retries a negative socket timeout forever, never reading again). A scrape that runs out of time shuts the socket
down, so the worker thread reads EOF and ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import threading
import time
from typing import Any, ClassVar

from pydantic import Field, model_validator
from spdk.rpc.client import JSONRPCClient

from kvscope.exporters.base import CollectError, Collector, TargetConfig
from kvscope.exporters.spdk_answers import Answers, Memory, Roles, RpcFailure, iostat_entries
from kvscope.exporters.spdk_answers import samples as answer_samples
from kvscope.exporters.spdk_rpc import Session, TransportError, close_quietly, connect, unblock
from kvscope.samples import Sample

__all__ = ["Answers", "RpcFailure", "SpdkCollector", "SpdkTargetConfig"]

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
        self._version: Any = None  # spdk_get_version of the current connection (a result or an RpcFailure)
        self._iostat_form: str | None = None  # "names" or "name" once known for the current connection
        self._memory = Memory()  # the parsers' state between scrapes: last counters (rates), subsystem membership
        self._roles = Roles(
            default=config.labels.get("role", ""),
            by_bdev=dict(config.role_by_bdev),
            by_subsystem=dict(config.role_by_subsystem),
            by_lvstore=dict(config.role_by_lvstore),
        )
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
        worker = asyncio.ensure_future(self.blocking(self._exchange, deadline, aborted, what=self._where))
        self._worker, self._aborted = worker, aborted
        try:
            answers = await asyncio.wait_for(asyncio.shield(worker), timeout * HARD_STOP_SHARE)
        except TimeoutError:
            self._abort(worker, aborted)
            raise CollectError(self._say(f"no complete answer within {timeout:g} s")) from None
        except asyncio.CancelledError:
            self._abort(worker, aborted)
            raise
        except TransportError as error:
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
            close_quietly(client)

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
            unblock(client)

        def reap(future: asyncio.Future) -> None:
            if not future.cancelled():
                future.exception()
            if client is not None:
                close_quietly(client)

        worker.add_done_callback(reap)

    # -- the worker thread: what to ask ----------------------------------------------------------------------

    def _exchange(self, deadline: float, aborted: threading.Event) -> Answers:
        """Every call of one scrape. A kept connection found closed before any answer is reopened once."""
        for attempt in range(2):
            client, fresh = self._connection(deadline, aborted)
            session = Session(client, deadline, aborted)
            try:
                return self._ask(session)
            except TransportError as error:
                self._drop(client)
                if fresh or attempt or session.answered or not error.stale or aborted.is_set():
                    raise
                log.info("%s: kept connection was closed (%s); reconnecting", self.config.name, error)
        raise AssertionError("unreachable")

    def _connection(self, deadline: float, aborted: threading.Event) -> tuple[JSONRPCClient, bool]:
        with self._lock:
            if self._client is not None:
                return self._client, False
        client = connect(self.config.socket, self.config.address, self.config.port, deadline)
        with self._lock:  # kept from now on, so that an abort can reach its socket
            if aborted.is_set():  # the scrape gave up while this connection was being opened
                close_quietly(client)
                raise TransportError("the scrape was abandoned while connecting")
            self._client = client
        session = Session(client, deadline, aborted)
        try:
            version = session.call("spdk_get_version")
        except TransportError:
            self._drop(client)
            raise
        self._version = version
        self._iostat_form = None
        numbers = _version_numbers(version) if isinstance(version, dict) else None
        if numbers is not None:
            self._iostat_form = "names" if numbers >= NAMES_PARAM_SINCE else "name"
        return client, True

    def _drop(self, client: JSONRPCClient) -> None:
        with self._lock:
            if self._client is client:
                self._client = None
        close_quietly(client)

    def _ask(self, session: Session) -> Answers:
        answers = Answers()
        if isinstance(self._version, RpcFailure):
            answers.failures.append(self._version)
        else:
            answers.version = self._version
        self._ask_iostat(session, answers)
        for method in METHODS:
            _keep(answers, method, session.call(method))
        if self.config.histograms:
            wanted = self.config.bdevs or [name for name, _, _ in iostat_entries(answers.iostat)[0]]
            for name in wanted:
                outcome = session.call("bdev_get_histogram", {"name": name})
                if isinstance(outcome, RpcFailure):
                    answers.failures.append(RpcFailure(outcome.method, outcome.code, f"{name}: {outcome.message}"))
                else:
                    answers.histograms[name] = outcome
        return answers

    def _ask_iostat(self, session: Session, answers: Answers) -> None:
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
        """The parsers' samples; their read errors go to the scrape loop, the error answers to the log."""
        samples, errors = answer_samples(answers, self._roles, self._memory)
        for error in errors:
            self.read_error(error.reason, error.what, error.detail)
        logged: set[tuple[str, str, str]] = set()
        for failure in answers.failures:
            key = (failure.method, failure.code, failure.message)
            if key in logged:
                continue
            logged.add(key)
            level = logging.DEBUG if key[:2] in self._warned else logging.WARNING
            self._warned.add(key[:2])  # once per method and code; the sample says it every scrape
            log.log(level, "%s: %s failed: %s %s", self.config.name, *key)
        return samples


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
