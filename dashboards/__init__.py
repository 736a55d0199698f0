"""Grafana dashboards as code (kvscope.dashboards): one builder module per dashboard, the generated JSON beside them.

The committed JSON is what ships (the service lists and provisions it, Grafana loads it); `build.write_all`
regenerates it from the builders, and a test fails when the two differ.
"""
