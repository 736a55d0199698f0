"""The vendor-neutral KV-tier model (docs/design.md, 'The KV-tier model'): the instruments every source maps into.

OpenTelemetry instrument names; the Prometheus exporter turns dots into underscores, adds `_total` to counters
and keeps the unit (`By` gives `_bytes`, annotations such as `{token}` add nothing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True)
class Instrument:
    name: str
    kind: Literal["counter", "gauge"]
    unit: str
    labels: tuple[str, ...]
    description: str


_TIER = ("system", "tier")
_NIC = ("host", "device", "port", "netdev", "role")
_BDEV = ("bdev", "subsystem", "role")

INSTRUMENTS: dict[str, Instrument] = {
    i.name: i
    for i in (
        Instrument(
            "kv.prefix.query.tokens",
            "counter",
            "{token}",
            ("engine", "layer"),
            "prompt tokens looked up in the prefix cache",
        ),
        Instrument(
            "kv.prefix.hit.tokens", "counter", "{token}", ("engine", "layer"), "prompt tokens found in the prefix cache"
        ),
        Instrument(
            "kv.prefix.bound.hit.tokens",
            "counter",
            "{token}",
            ("engine",),
            "prompt tokens an infinite cache would have found: the analytic bound of the hit ratio (where known)",
        ),
        Instrument(
            "kv.prefix.capacity.tokens",
            "gauge",
            "{token}",
            ("engine", "layer"),
            "tokens the prefix cache layer can hold (the engine's GPU cache: its blocks x the block size)",
        ),
        Instrument(
            "kv.prompt.tokens",
            "counter",
            "{token}",
            ("engine", "source"),
            "prompt tokens by where their KV came from: computed (prefilled), gpu (the engine's own prefix cache), "
            "host (the engine's host-memory tier), storage (a store tier behind it), external (loaded through a KV "
            "connector), cached (a cache hit the engine does not attribute); the sources add up to "
            "kv.engine.prompt.tokens",
        ),
        Instrument(
            "kv.miss.tokens",
            "counter",
            "{token}",
            ("engine", "cause", "tier"),
            "prompt tokens the engine recomputed, by why they missed: cold (never stored), evicted (by `tier`, the "
            "one that evicted the block last), chain_broken (stored, behind a block that is gone), not_admitted (a "
            "refused put), elsewhere (held by another engine); the causes add up to the computed prompt tokens",
        ),
        Instrument(
            "kv.engine.prompt.tokens",
            "counter",
            "{token}",
            ("engine",),
            "prompt tokens the engine served, its own count: the total the sources of kv.prompt.tokens add up to",
        ),
        Instrument(
            "kv.prompt.cached.tokens",
            "counter",
            "{token}",
            ("engine", "medium"),
            "prompt tokens served from a cache, by the medium that held them (gpu, host, peer, disk, external)",
        ),
        Instrument(
            "kv.engine.preemptions",
            "counter",
            "{preemption}",
            ("engine",),
            "requests the engine preempted (their KV freed, to be recomputed or reloaded): its cache was too small",
        ),
        # An engine's request histograms, bucket by bucket (`upper_bound`, the bucket's `le` as the engine writes it,
        # +Inf counting every request; `le` itself is reserved for histogram types): histogram_quantile reads them
        # once label_replace names the bound `le` (kvscope-recording.yml). `role` is the target's `role` label, the
        # fabric role of the NICs its KV loads cross ("" when none is configured).
        Instrument(
            "kv.engine.ttft.requests",
            "counter",
            "{request}",
            ("engine", "role", "upper_bound"),
            "requests whose time to first token was at most `upper_bound` seconds (the engine's cumulative TTFT "
            "histogram buckets; upper_bound +Inf counts every request)",
        ),
        Instrument(
            "kv.engine.prompt.requests",
            "counter",
            "{request}",
            ("engine", "role", "upper_bound"),
            "requests whose prompt had at most `upper_bound` tokens (the engine's cumulative prompt-length "
            "histogram buckets; upper_bound +Inf counts every request)",
        ),
        Instrument(
            "kv.events.blocks",
            "counter",
            "{block}",
            ("engine", "medium", "event"),
            "blocks an engine's KV-event stream reported stored or removed (event), by the medium that holds them "
            "(gpu: the prefix cache; cpu: what a KV connector saved)",
        ),
        Instrument(
            "kv.events.cleared",
            "counter",
            "{event}",
            ("engine",),
            "times an engine's KV-event stream reported its whole prefix cache cleared",
        ),
        Instrument(
            "kv.events.gaps",
            "counter",
            "{gap}",
            ("engine",),
            "jumps in an engine's KV-event sequence numbers (batches the subscriber did not receive live)",
        ),
        Instrument(
            "kv.events.lost.batches",
            "counter",
            "{batch}",
            ("engine", "phase"),
            "KV-event batches neither received nor replayed: published before the subscription (phase history) "
            "or dropped while subscribed (phase live)",
        ),
        Instrument(
            "kv.events.lag",
            "gauge",
            "s",
            ("engine",),
            "how long the newest live KV-event batch took from the engine's clock to the subscriber",
        ),
        # NVIDIA Dynamo: its frontend's view (per model), its KV router's (per router: the frontend's instance id;
        # the router's counters are not split per worker) and its workers' engines (`worker_id`: Dynamo's instance
        # id of the worker, as the frontend writes it; `engine`: the engine's data-parallel rank).
        Instrument(
            "kv.frontend.prompt.tokens",
            "counter",
            "{token}",
            ("model",),
            "prompt tokens of the requests a Dynamo frontend served, per model",
        ),
        Instrument(
            "kv.frontend.cached.tokens",
            "counter",
            "{token}",
            ("model",),
            "prompt tokens the workers served from their prefix caches, as the frontend's responses report them "
            "(usage cached_tokens), per model",
        ),
        Instrument(
            "kv.router.prompt.tokens",
            "counter",
            "{token}",
            ("router", "model", "phase"),
            "prompt tokens a KV router routed, counted when it routes them",
        ),
        Instrument(
            "kv.router.prefix.tokens",
            "counter",
            "{token}",
            ("router", "model", "phase", "choice"),
            "cached prefix tokens a KV router expected at each routing decision: on the worker it chose "
            "(choice=selected) and on the best eligible worker (choice=best_eligible); what the workers then served "
            "is kv.frontend.cached.tokens",
        ),
        Instrument(
            "kv.router.events",
            "counter",
            "{event}",
            ("router", "event", "status"),
            "KV events from the workers a KV router applied to its index, by event (stored, removed, cleared) and "
            "status (ok, or why the index rejected it)",
        ),
        Instrument(
            "kv.model.blocks",
            "gauge",
            "{block}",
            ("model",),
            "KV cache blocks of a worker serving the model, from the worker's runtime configuration (Dynamo)",
        ),
        Instrument(
            "kv.model.block.tokens",
            "gauge",
            "{token}",
            ("model",),
            "tokens in one KV cache block of the model's workers (Dynamo)",
        ),
        Instrument(
            "kv.engine.cache.usage",
            "gauge",
            "1",
            ("engine", "worker_id"),
            "fraction of the engine's KV cache blocks in use (0 when idle)",
        ),
        Instrument(
            "kv.engine.blocks",
            "gauge",
            "{block}",
            ("engine", "worker_id"),
            "KV cache blocks the engine has (Dynamo's vLLM worker reports them per data-parallel rank)",
        ),
        Instrument(
            "kv.engine.active.blocks",
            "gauge",
            "{block}",
            ("engine", "worker_id"),
            "KV blocks the requests running on the engine hold, as the Dynamo KV router tracks them (its estimate; "
            "it can exceed the engine's blocks)",
        ),
        Instrument("kv.store.put.bytes", "counter", "By", _TIER, "bytes of KV blocks clients saved (logical puts)"),
        Instrument("kv.store.put.ops", "counter", "{operation}", _TIER, "KV save operations"),
        Instrument("kv.store.get.bytes", "counter", "By", _TIER, "bytes of KV blocks clients loaded (logical gets)"),
        Instrument("kv.store.get.ops", "counter", "{operation}", _TIER, "KV load operations"),
        Instrument("kv.tier.written.bytes", "counter", "By", _TIER, "bytes written to the medium"),
        Instrument("kv.tier.read.bytes", "counter", "By", _TIER, "bytes read from the medium"),
        Instrument("kv.tier.allocated.bytes", "gauge", "By", _TIER, "bytes allocated on the medium"),
        Instrument("kv.tier.capacity.bytes", "gauge", "By", _TIER, "capacity of the medium"),
        Instrument("kv.tier.evictions", "counter", "{block}", _TIER, "blocks or objects evicted from the medium"),
        Instrument("kv.tier.evicted.bytes", "counter", "By", _TIER, "bytes evicted from the medium"),
        Instrument("kv.tier.hits", "counter", "{lookup}", _TIER, "lookups served by the medium"),
        Instrument(
            "kv.tier.hit.ratio",
            "gauge",
            "1",
            _TIER,
            "fraction of lookups the medium served over the system's own recent window (0-1), for a system that "
            "exports a ratio and no counts (Dynamo's KV block manager); kv.tier.hits gives it over any window",
        ),
        Instrument(
            "kv.tier.transferred.blocks",
            "counter",
            "{block}",
            ("system", "from_tier", "to_tier"),
            "blocks (or chunks) a tiered KV cache copied from one tier to another: offloads (gpu to host, host to "
            "disk, ...) and onboards back towards the engine, by the tier they left and the tier they entered",
        ),
        # A tier's block lifecycle, with the meaning vLLM's --kv-cache-metrics gives it, bucket by bucket as the
        # engine histograms above (`upper_bound` in seconds, +Inf counting every observation), each with its sum
        # for a mean. The sources follow a sample of the blocks (vLLM's --kv-cache-metrics-sample, LMCache's
        # --metrics-sample-rate, one chain position in 256 in the embedded store), so the counts are the sample's.
        Instrument(
            "kv.block.lifetime.blocks",
            "counter",
            "{block}",
            (*_TIER, "upper_bound"),
            "evicted blocks whose lifetime, from their store in the tier (vLLM: their allocation) to their eviction, "
            "was at most `upper_bound` seconds",
        ),
        Instrument("kv.block.lifetime", "counter", "s", _TIER, "the lifetimes of kv.block.lifetime.blocks, summed"),
        Instrument(
            "kv.block.idle.blocks",
            "counter",
            "{block}",
            (*_TIER, "upper_bound"),
            "evicted blocks that sat idle at most `upper_bound` seconds before their eviction: from their last "
            "access (their store, when never accessed) to the eviction",
        ),
        Instrument("kv.block.idle", "counter", "s", _TIER, "the idle times of kv.block.idle.blocks, summed"),
        Instrument(
            "kv.block.reuse.accesses",
            "counter",
            "{access}",
            (*_TIER, "upper_bound"),
            "accesses of a block at most `upper_bound` seconds after its previous access: vLLM's reuse gap, where "
            "an access is a prefix-cache hit and the allocation is none (LMCache's L1 counts its write as one)",
        ),
        Instrument("kv.block.reuse.gap", "counter", "s", _TIER, "the gaps of kv.block.reuse.accesses, summed"),
        Instrument("rdma.port.tx.bytes", "counter", "By", _NIC, "bytes sent by the RDMA port"),
        Instrument("rdma.port.rx.bytes", "counter", "By", _NIC, "bytes received by the RDMA port"),
        Instrument(
            "rdma.port.congestion",
            "counter",
            "{packet}",
            (*_NIC, "event"),
            "RoCE congestion-control packets of the RDMA port by event: CNPs sent (cnp_sent) as the notification "
            "point, CNPs handled or ignored (cnp_handled, cnp_ignored) as the reaction point, ECN-marked packets "
            "received (ecn_marked)",
        ),
        Instrument(
            "rdma.port.errors",
            "counter",
            "{error}",
            (*_NIC, "error"),
            "errors counted by the RDMA port (link and PMA error counters, the driver's transport error counters), "
            "by error",
        ),
        # node_exporter's infiniband series under the model's names (README.md, "RDMA series"); direction is tx or rx.
        Instrument(
            "rdma.port.data",
            "counter",
            "By",
            (*_NIC, "direction"),
            "bytes the port's PMA data counter (counters/port_xmit_data, port_rcv_data) counted, by direction "
            "(node_exporter's port_data_*_bytes); rdma.port.tx.bytes / rx.bytes pick the best file per port",
        ),
        Instrument(
            "rdma.port.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "packets the RDMA port sent (tx) or received (rx) on all VLs, errors included",
        ),
        Instrument(
            "rdma.port.unicast.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "unicast packets the RDMA port sent or received, errors included",
        ),
        Instrument(
            "rdma.port.multicast.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "multicast packets the RDMA port sent or received, errors included",
        ),
        Instrument(
            "rdma.port.legacy.data",
            "counter",
            "By",
            (*_NIC, "direction"),
            "bytes counted by the legacy MLNX_OFED 64-bit data counters (counters_ext/port_*_data_64)",
        ),
        Instrument(
            "rdma.port.legacy.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "packets counted by the legacy MLNX_OFED 64-bit packet counters (counters_ext/port_*_packets_64)",
        ),
        Instrument(
            "rdma.port.legacy.unicast.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "unicast packets counted by the legacy MLNX_OFED counters (counters_ext/port_unicast_*_packets)",
        ),
        Instrument(
            "rdma.port.legacy.multicast.packets",
            "counter",
            "{packet}",
            (*_NIC, "direction"),
            "multicast packets counted by the legacy MLNX_OFED counters (counters_ext/port_multicast_*_packets)",
        ),
        Instrument(
            "rdma.port.transmit.wait",
            "counter",
            "{tick}",
            _NIC,
            "ticks during which the RDMA port had data to send but sent none (PortXmitWait: back-pressure)",
        ),
        Instrument(
            "rdma.port.completion.errors",
            "counter",
            "{completion}",
            (*_NIC, "error"),
            "work completions with an error the driver counted (mlx5 req_/resp_ cqe, flush, access and length "
            "errors), by error; flushes also count the work of every QP torn down with work outstanding",
        ),
        Instrument(
            "rdma.port.transport.events",
            "counter",
            "{event}",
            (*_NIC, "event"),
            "transport events the driver counted that are not errors: duplicate requests, implied NAKs, RoCE "
            "adaptive retransmissions and slow restarts, by event (the hw counter's name)",
        ),
        Instrument(
            "rdma.port.received.requests",
            "counter",
            "{request}",
            (*_NIC, "op"),
            "RDMA requests the port's QPs received, by op: read, write, atomic, dct_connect",
        ),
        Instrument(
            "rdma.port.counters.lifespan",
            "gauge",
            "s",
            _NIC,
            "how long the kernel caches the port's hw counter values (hw_counters/lifespan: a setting)",
        ),
        Instrument(
            "rdma.port.state",
            "gauge",
            "{state}",
            _NIC,
            "logical state of the RDMA port (1 down, 2 init, 3 armed, 4 active, 5 active defer)",
        ),
        Instrument(
            "rdma.port.physical.state",
            "gauge",
            "{state}",
            _NIC,
            "physical state of the RDMA port (1 sleep, 2 polling, 3 disabled, 4 port configuration training, "
            "5 link up, 6 link error recovery, 7 phy test)",
        ),
        Instrument("rdma.port.rate", "gauge", "By/s", _NIC, "signalling rate of the RDMA port's link"),
        Instrument(
            "rdma.port.saturated",
            "gauge",
            "{counter}",
            (*_NIC, "counter"),
            "1 when a fixed-width PMA counter of the port reads its maximum (stuck: it no longer counts), else 0",
        ),
        Instrument(
            "rdma.port.info",
            "gauge",
            "{info}",
            (*_NIC, "state", "phys_state", "link_layer", "rate"),
            "the RDMA port's state, physical state, link layer and rate as sysfs writes them; always 1",
        ),
        Instrument(
            "rdma.device.info",
            "gauge",
            "{info}",
            ("host", "device", "role", "board_id", "firmware_version", "hca_type", "node_type", "node_guid"),
            "the RDMA device's board, firmware, HCA type, node type and GUID; always 1",
        ),
        Instrument("storage.bdev.read.bytes", "counter", "By", _BDEV, "bytes read from the block device"),
        Instrument("storage.bdev.written.bytes", "counter", "By", _BDEV, "bytes written to the block device"),
        Instrument("storage.bdev.ops", "counter", "{operation}", (*_BDEV, "op"), "I/O operations on the block device"),
        Instrument("storage.bdev.latency", "counter", "s", (*_BDEV, "op"), "time spent in I/O on the block device"),
        Instrument(
            "storage.reactor.busy",
            "counter",
            "s",
            ("lcore", "role"),
            "time the storage target's reactor on this core spent running pollers that did work",
        ),
        Instrument(
            "storage.reactor.idle",
            "counter",
            "s",
            ("lcore", "role"),
            "time the storage target's reactor on this core spent polling without finding work",
        ),
    )
}

# The units INSTRUMENTS use, as the OpenTelemetry Prometheus exporter spells them in a metric name (it follows the
# OpenTelemetry spec's table); an annotation such as `{token}` adds nothing, and so does "1" (a ratio).
_PROMETHEUS_UNITS = {"By": "bytes", "s": "seconds", "By/s": "bytes_per_second", "1": ""}


def prometheus_name(instrument: Instrument) -> str:
    """The name of `instrument`'s samples in Prometheus (kv.store.put.bytes -> kv_store_put_bytes_total)."""
    name = instrument.name.replace(".", "_")
    if instrument.unit.startswith("{") and instrument.unit.endswith("}"):
        unit = ""
    elif instrument.unit in _PROMETHEUS_UNITS:
        unit = _PROMETHEUS_UNITS[instrument.unit]
    else:
        raise ValueError(f"{instrument.name}: no Prometheus spelling for unit {instrument.unit!r}; add it here")
    if unit and not name.endswith(f"_{unit}"):
        name = f"{name}_{unit}"
    return f"{name}_total" if instrument.kind == "counter" else name


_BY_PROMETHEUS_NAME = {prometheus_name(instrument): instrument for instrument in INSTRUMENTS.values()}


def instrument_for_prometheus_name(name: str) -> Instrument | None:
    """The model instrument whose Prometheus samples are called `name`, or None for any other series."""
    return _BY_PROMETHEUS_NAME.get(name)
