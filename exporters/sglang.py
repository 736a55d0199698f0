"""SGLang's /metrics (rendered from 0.5.23's metric definitions): prompt tokens by where their KV came from (the
scheduler's prefill split: computed, the device cache, HiCache's host memory and its L3 storage), the tokenizer's
prompt tokens and cached tokens by source, and the host tier's capacity.

SGLang's tokenizer counts a server's requests whatever their data-parallel rank, and its schedulers count per rank:
one SGLang server is one engine of the KV-tier model, named by the target's `engine` label (default "0"), and its
ranks' series add up into it. What is mapped and what is not is in `mappings/sglang.yaml`.
"""

from __future__ import annotations

from pydantic import Field, field_validator

from kvscope.exporters.promtext import HttpTargetConfig, PrometheusTextCollector


class SglangTargetConfig(HttpTargetConfig):
    """An SGLang server started with --enable-metrics: `http://host:port/metrics`."""

    labels: dict[str, str] = Field(
        default_factory=lambda: {"engine": "0"},
        description="labels for the mapping; `engine` names the server in the KV-tier model (default 0)",
    )

    @field_validator("labels")
    @classmethod
    def _default_engine(cls, labels: dict[str, str]) -> dict[str, str]:
        return {"engine": "0", **labels}


class SglangCollector(PrometheusTextCollector):
    source = "sglang"
    Config = SglangTargetConfig
