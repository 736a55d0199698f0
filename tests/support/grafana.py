"""Walking generated Grafana dashboard JSON, shared by the dashboard and deployment tests."""

from __future__ import annotations

from collections.abc import Iterator


def datasource_references(node: object) -> Iterator[object]:
    """Every `datasource` value anywhere under `node` (panels, targets, annotations, variables), in document order."""
    if isinstance(node, dict):
        if "datasource" in node:
            yield node["datasource"]
        for value in node.values():
            yield from datasource_references(value)
    elif isinstance(node, list):
        for value in node:
            yield from datasource_references(value)
