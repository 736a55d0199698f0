"""Alerts reach a real Alertmanager (Debian prometheus-alertmanager on 127.0.0.1), run with the shipped
deploy/alertmanager/alertmanager.yml (routes and inhibitions as shipped, receivers pointed at a webhook here)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from support.realservers import Webhook, shipped_alertmanager_config, start_alertmanager, wait_for

from kvscope.api.alertmanager import AlertmanagerForwarder
from kvscope.api.alerts import COLLAPSE, IMMINENT, PREDICTED, AlertBook
from kvscope.processes import free_port


@pytest.fixture
def alertmanager(tmp_path, real_binary):
    binary = real_binary("alertmanager")
    hook = Webhook()
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(shipped_alertmanager_config(hook)))
    process = start_alertmanager(binary, config, tmp_path / "data", tmp_path / "alertmanager.log")
    try:
        process.wait_ready("Alertmanager", 20)
        yield process.url, hook
    finally:
        process.stop()
        hook.stop()


def test_a_firing_then_resolved_collapse_alert_reaches_alertmanager_and_its_receiver(alertmanager):
    url, hook = alertmanager
    book = AlertBook()
    forwarder = AlertmanagerForwarder(url, book, resend_s=0.5, generator_url="http://127.0.0.1:8321/").start()
    labels = {"ab": "ab-1", "arm": "dram_only", "tier": "dram"}
    try:
        book.set(COLLAPSE, labels, "pending", "round 7: dram fills next round")
        time.sleep(1.0)
        assert httpx.get(f"{url}/api/v2/alerts").json() == []  # pending stays in kvscope, as in Prometheus
        book.set(COLLAPSE, labels, "firing", "round 8: hit ratio 0.83 < 0.99 x its ideal 0.89")

        def firing_in_alertmanager():
            alerts = httpx.get(f"{url}/api/v2/alerts").json()
            return [a for a in alerts if a["labels"].get("alertname") == COLLAPSE and a["status"]["state"] == "active"]

        (alert,) = wait_for(firing_in_alertmanager, "the alert in Alertmanager")
        assert alert["labels"] == {"alertname": COLLAPSE, "severity": "critical", **labels}
        assert alert["annotations"]["runbook_url"] == "docs/runbook.md#kvcachehitratecollapse"
        assert alert["annotations"]["summary"].startswith("round 8")
        notified = wait_for(lambda: [n for n in hook.notifications if n["status"] == "firing"], "a firing webhook")
        assert notified[0]["alerts"][0]["labels"]["arm"] == "dram_only"
        assert notified[0]["receiver"] == "kvscope-pager"  # critical: the shipped route pages

        book.set(COLLAPSE, labels, None)
        resolved = wait_for(lambda: [n for n in hook.notifications if n["status"] == "resolved"], "a resolved webhook")
        assert resolved[0]["alerts"][0]["endsAt"] != "0001-01-01T00:00:00Z"
    finally:
        forwarder.stop()


def test_an_unreachable_alertmanager_is_reported_not_raised():
    book = AlertBook()
    forwarder = AlertmanagerForwarder(f"http://127.0.0.1:{free_port()}", book, resend_s=60)
    book.set(COLLAPSE, {"arm": "a"}, "firing", "collapsed")
    assert forwarder.post_once() is False
    forwarder.stop()


def test_the_services_alerts_have_the_severity_and_runbook_of_the_shipped_rules():
    """One meaning per alert name: where the shipped Prometheus rules define an alert the service also raises,
    they agree on its severity and runbook, and every runbook section the service points at exists."""
    import yaml

    from kvscope.api.alerts import RULES

    root = Path(__file__).resolve().parents[2]
    shipped = yaml.safe_load((root / "deploy" / "prometheus" / "rules" / "kvscope-alerts.yml").read_text())
    rules = {rule["alert"]: rule for group in shipped["groups"] for rule in group["rules"] if "alert" in rule}
    assert COLLAPSE in rules
    for name, rule in RULES.items():
        if name in rules:
            assert rules[name]["labels"]["severity"] == rule.severity, name
            assert rules[name]["annotations"]["runbook_url"] == rule.runbook_url, name
        anchor = rule.runbook_url.partition("#")[2]
        assert f"\n## {name}\n" in (root / "docs" / "runbook.md").read_text() and anchor == name.lower()


def test_the_services_warnings_go_to_tickets_and_a_collapse_silences_its_arms(alertmanager):
    """Every alert the service raises has a rule (severity, runbook): an imminent collapse and a prediction are
    forwarded as warnings (they once had none, and the forwarder failed on them), routed to tickets, and the
    shipped inhibitions silence them once the same arm collapses."""
    url, hook = alertmanager
    book = AlertBook()
    forwarder = AlertmanagerForwarder(url, book, resend_s=0.5).start()
    arm = {"ab": "ab-2", "arm": "dram_only"}
    try:
        book.set(IMMINENT, {**arm, "tier": "dram"}, "firing", "round 7: dram passes capacity next round")
        book.set(PREDICTED, arm, "firing", "the planner predicts arm dram_only collapses at round 8")
        tickets = wait_for(
            lambda: {a["labels"]["alertname"] for n in hook.notifications if n["receiver"] == "kvscope-tickets"
                     for a in n["alerts"]} >= {IMMINENT, PREDICTED} or None,
            "both warnings at the tickets receiver",
        )  # fmt: skip
        assert tickets
        book.set(COLLAPSE, {**arm, "tier": "dram"}, "firing", "round 8: hit ratio 0.69 < 0.99 x its ideal 0.89")

        def silenced() -> dict | None:
            states = {a["labels"]["alertname"]: a["status"]["state"] for a in httpx.get(f"{url}/api/v2/alerts").json()}
            return states if states.get(IMMINENT) == states.get(PREDICTED) == "suppressed" else None

        assert wait_for(silenced, "the warnings inhibited by the collapse")[COLLAPSE] == "active"
    finally:
        forwarder.stop()
