"""NVIDIA Dynamo's /metrics (tested against 1.6.1): a frontend's (its HTTP port: the frontend's and its KV router's
series) and a worker's (its system port, `DYN_SYSTEM_PORT`: the engine's `vllm:*` series, or `sglang:*` from a
mocker started with `--engine-type sglang`, beside Dynamo's own `dynamo_component_*`). One source for both; each is
a target of its own.

Who says what, as Dynamo 1.6.1 labels it:

- The frontend's `dynamo_frontend_*` series are per model; its per-worker gauges (`dynamo_frontend_worker_*`) name
  the worker by its instance id in decimal (`worker_id="16043297272919392144"`).
- The KV router's counters (`dynamo_component_router_kv_*`, `dynamo_component_kv_cache_events_applied`) are per
  router, never per worker: they carry the router's own id (`router_id`, and as `worker_id` the frontend's own
  instance id in hex), not the id of the worker a request went to.
- A worker's engine series (`vllm:*`, the mocker's imitation of vLLM's names) carry only `engine` (the
  data-parallel rank) and the model's name (`sglang:*`: the model's name, `engine_type` and, on the scheduler's
  gauges only, `tp_rank`, `pp_rank`, `moe_ep_rank`, all 0 in the mocker); its instance id is the hex `worker_id`
  of the `dynamo_component_*` series on the same port, the frontend's decimal one written in hex.

So the collector attaches the process's instance id, in decimal as the frontend writes it, to every sample of the
scrape as `dynamo_instance_id` (`instance_id_samples`, a pure function of the parsed exposition): a worker's
engine series then join the frontend's per-worker ones, and the router's events name their router. An exposition
holding several instance ids (several workers in one process, `--num-workers`) cannot say whose engine series are
whose: nothing is attached and the scrape counts an `unparseable` read error; run one worker per process.

Series appear only after a target's first request (a worker's `vllm:*` or `sglang:*`, the router's counters); an
absent series means "nothing served yet". What is mapped and what is not is in `mappings/dynamo.yaml`.
"""

from __future__ import annotations

from kvscope.exporters.promtext import HttpTargetConfig, PrometheusTextCollector
from kvscope.samples import Sample, labels_of

INSTANCE_LABEL = "dynamo_instance_id"
_OWN_SERIES = "dynamo_component_"  # Dynamo's series of the process itself: their `worker_id` is its instance id


class DynamoTargetConfig(HttpTargetConfig):
    """A Dynamo frontend's `http://host:port/metrics` or a worker's `http://host:DYN_SYSTEM_PORT/metrics`."""


class DynamoCollector(PrometheusTextCollector):
    source = "dynamo"
    Config = DynamoTargetConfig

    async def collect(self) -> list[Sample]:
        samples, problem = instance_id_samples(await super().collect())
        if problem is not None:
            self.read_error("unparseable", "worker_id", problem)
        return samples


def instance_ids(samples: list[Sample]) -> set[str]:
    """The hex instance ids on the process's own `dynamo_component_*` series."""
    return {
        worker
        for sample in samples
        if sample.name.startswith(_OWN_SERIES) and (worker := sample.label_map.get("worker_id"))
    }


def instance_id_samples(samples: list[Sample]) -> tuple[list[Sample], str | None]:
    """The samples with the process's instance id attached (decimal, `dynamo_instance_id`), and None; or the
    samples unchanged and why nothing was attached (several ids, or one that is not hex)."""
    found = instance_ids(samples)
    if not found:
        return samples, None
    if len(found) > 1:
        return samples, (
            f"several Dynamo instance ids in one exposition ({', '.join(sorted(found))}): whose engine series are "
            "whose cannot be told; run one worker per process"
        )
    (hex_id,) = found
    try:
        decimal = str(int(hex_id, 16))
    except ValueError:
        return samples, f"instance id {hex_id!r} is not hexadecimal"
    attached = []
    for sample in samples:
        labels = labels_of({**sample.label_map, INSTANCE_LABEL: decimal})
        attached.append(Sample(sample.source, sample.name, labels, sample.value, sample.kind))
    return attached, None
