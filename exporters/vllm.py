"""vLLM's /metrics (versions 0.8.5 to 0.33): prefix-cache queries and hits on the GPU and through a KV connector,
prompt tokens by where their KV came from, preemptions, the GPU cache's size, the offloading and Mooncake
connectors' bytes, and the TTFT and prompt-length histograms' buckets. One scrape may hold several engines (the
`engine` label).

Tested against a real vLLM 0.32 on the CPU (tests/exporters/test_vllm_real.py) and its captured expositions.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvscope.exporters.promtext import HttpTargetConfig, PrometheusTextCollector


class VllmTargetConfig(HttpTargetConfig):
    labels: dict[str, str] = Field(
        default_factory=lambda: {"system": "mooncake"},
        description="labels for the mapping; `system` names the store its Mooncake connector writes to (default "
        "mooncake, as the mooncake source's); `role` the fabric role of the NICs its KV loads cross (the rdma "
        "targets' role), carried by its TTFT and prompt-length buckets",
    )

    @field_validator("labels")
    @classmethod
    def _default_system(cls, labels: dict[str, str]) -> dict[str, str]:
        return {"system": "mooncake", **labels}


class VllmCollector(PrometheusTextCollector):
    source = "vllm"
    Config = VllmTargetConfig
