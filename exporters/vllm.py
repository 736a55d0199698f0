"""vLLM's /metrics (versions 0.8.5 to 0.33): prefix-cache queries and hits on the GPU and through a KV connector,
and the offloading connector's bytes. One scrape may hold several engines (the `engine` label)."""

from __future__ import annotations

from kvscope.exporters.promtext import PrometheusTextCollector


class VllmCollector(PrometheusTextCollector):
    source = "vllm"
