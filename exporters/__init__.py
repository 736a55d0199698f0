"""Exporters: one module per source behind one interface (`kvscope.exporters.base.Collector`), a mapping per
source onto the KV-tier model (`mappings/<source>.yaml`), the scrape loop and the OpenTelemetry bridge."""
