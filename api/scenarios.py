"""Scenarios as the API accepts them: the YAML schema as JSON, minus what would touch the server's files."""

from __future__ import annotations

from fastapi import HTTPException, status

from kvscope.tierstore.scenario import Scenario


def accept(scenario: Scenario) -> Scenario:
    """Refuse trace workloads and file paths: over HTTP a scenario must not name files on the server."""
    problems = []
    if scenario.workload.kind == "trace":
        problems.append(("workload", "kind", "trace workloads read a file on the server: use the CLI for traces"))
    for arm_name, arm in scenario.arms.items():
        for tier in arm.tiers + arm.attached:
            if tier.path is not None:
                problems.append(
                    ("arms", arm_name, "tiers", tier.name, "path", "file backends use the service's workdir")
                )
    if problems:
        detail = [{"loc": ["body", "scenario", *p[:-1]], "msg": p[-1], "type": "value_error"} for p in problems]
        raise HTTPException(status.HTTP_422_UNPROCESSABLE_ENTITY, detail)
    return scenario
