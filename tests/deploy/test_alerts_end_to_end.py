"""The shipped alerting path end to end, with real binaries on 127.0.0.1: the service runs the long-output A/B, a real
Prometheus scrapes it and evaluates deploy/prometheus's rules, a real Alertmanager routes what fires with
deploy/alertmanager's tree to a webhook receiver inside this test.

Only the clock is compressed. The shipped rules are loaded as they are except for one mechanical substitution,
`scaled_rules`: every duration is divided by TIME_SCALE (60), wherever a rule may hold one: range selectors
`[5m]`, `offset 5m`, `for: 5m` and predict_linear's horizon in seconds. A 5-minute rate becomes a 5-second one,
the 1-hour peak a 1-minute one. Prometheus scrapes and evaluates every second, and the A/B runs a round every
second and a half, so one round of the test stands for a minute and a half of a real cluster. Alertmanager's
waits are cut to a second. The service does not forward its own alerts here: what reaches the receiver came from
Prometheus.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from support.realservers import (
    TOKEN,
    Service,
    Webhook,
    shipped_alertmanager_config,
    start_alertmanager,
    start_prometheus,
    wait_for,
)

from kvscope.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
RULE_FILES = sorted((DEPLOY / "prometheus" / "rules").glob("*.yml"))
LONG_OUTPUT = yaml.safe_load((ROOT / "examples" / "long_output.yaml").read_text())

TIME_SCALE = 60
# Paced so that Prometheus has a baseline: the DRAM-only arm's hit ratio climbs for 7 rounds (its 1-minute peak,
# scaled), collapses from round 8 and sits at 0 from round 11 to 20 while its writes keep rising.
ROUNDS_PER_MINUTE = 40

_UNIT_SECONDS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = r"(\d+)(ms|s|m|h|d)"


def _scaled(count: str, unit: str) -> str:
    return f"{round(int(count) * _UNIT_SECONDS[unit] * 1000 / TIME_SCALE)}ms"


def scaled_rules(text: str) -> str:
    """A rules file with every duration divided by TIME_SCALE (see the module's docstring)."""
    rules = yaml.safe_load(text)
    for group in rules["groups"]:
        for rule in group["rules"]:
            expr = re.sub(rf"\[{_DURATION}\]", lambda m: f"[{_scaled(m[1], m[2])}]", rule["expr"])
            expr = re.sub(rf"\boffset {_DURATION}\b", lambda m: f"offset {_scaled(m[1], m[2])}", expr)
            expr, horizons = re.subn(  # predict_linear's horizon, in seconds
                r"(predict_linear\([\s\S]*?\],\s*)(\d+)(\s*\))",
                lambda m: f"{m[1]}{int(m[2]) / TIME_SCALE:g}{m[3]}",
                expr,
            )
            assert horizons == expr.count("predict_linear("), f"a predict_linear horizon is not a number: {expr}"
            assert not re.search(r"\b\d+[smhdwy]\b", expr), f"a duration outside a range or an offset: {expr}"
            rule["expr"] = expr
            if "for" in rule:
                rule["for"] = _scaled(*re.fullmatch(_DURATION, rule["for"]).groups())
    return yaml.safe_dump(rules, sort_keys=False)


def prometheus_config(rule_files: list[Path], service_port: int, alertmanager_port: int) -> dict:
    """deploy/prometheus/prometheus.yml pointed at this test's service and Alertmanager, every second. The
    exporter's job goes: this test has no exporter (its absence would only raise KVScopeTargetDown)."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    config["rule_files"] = [str(path) for path in rule_files]
    config["alerting"]["alertmanagers"][0]["static_configs"] = [{"targets": [f"127.0.0.1:{alertmanager_port}"]}]
    (service,) = [job for job in config["scrape_configs"] if job["job_name"] == "kvscope-service"]
    service["static_configs"] = [{"targets": [f"127.0.0.1:{service_port}"]}]
    config["scrape_configs"] = [service]
    return config


@pytest.fixture
def stack(tmp_path, real_binary):
    prometheus_bin, promtool, alertmanager_bin = map(real_binary, ("prometheus", "promtool", "alertmanager"))
    started: list = []
    try:
        hook = Webhook()
        started.append(hook)
        am_config = tmp_path / "alertmanager.yml"
        am_config.write_text(yaml.safe_dump(shipped_alertmanager_config(hook)))
        alertmanager = start_alertmanager(alertmanager_bin, am_config, tmp_path / "am", tmp_path / "alertmanager.log")
        started.append(alertmanager)

        service = Service(tmp_path, scrape_interval_s=0.25)
        started.append(service)

        rules = []
        for path in RULE_FILES:
            rules.append(tmp_path / path.name)
            rules[-1].write_text(scaled_rules(path.read_text()))
        prom_port = free_port()
        prom_config = tmp_path / "prometheus.yml"
        prom_config.write_text(yaml.safe_dump(prometheus_config(rules, service.port, alertmanager.port)))
        checked = subprocess.run([promtool, "check", "config", str(prom_config)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stdout + checked.stderr  # the scaled rules are valid too
        prometheus = start_prometheus(
            prometheus_bin, prom_config, tmp_path / "tsdb", tmp_path / "prometheus.log",
            f"--web.external-url=http://127.0.0.1:{prom_port}/", "--log.level=warn", port=prom_port,
        )  # fmt: skip
        started.append(prometheus)

        alertmanager.wait_ready("Alertmanager", 20)
        prometheus.wait_ready("Prometheus", 20)
        yield {
            "service": service,
            "prometheus": prometheus.url,
            "alertmanager": alertmanager.url,
            "hook": hook,
            "procs": started,
        }
    finally:
        for thing in reversed(started):
            thing.stop()


def query(prometheus: str, promql: str) -> list[dict]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def test_the_dram_only_arm_collapse_goes_from_prometheus_rules_through_alertmanager_to_the_receiver(stack):
    started_at = time.monotonic()
    service, prometheus, hook = stack["service"], stack["prometheus"], stack["hook"]

    # A baseline first: Prometheus has scraped the service before the A/B starts.
    wait_for(lambda: query(prometheus, 'up{job="kvscope-service"} == 1'), "Prometheus to scrape the service", 15)
    response = service.client.post(
        "/api/v1/ab",
        json={"scenario": LONG_OUTPUT, "rounds_per_minute": ROUNDS_PER_MINUTE},
        headers={"Authorization": f"Bearer {TOKEN}"},
    )
    assert response.status_code == 201, response.text
    ab = response.json()["id"]

    try:
        notification, alert = wait_for(
            lambda: hook.firing("KVCacheHitRateCollapse"), "KVCacheHitRateCollapse at the webhook", 60
        )[0]
    except AssertionError:
        state = service.client.get(f"/api/v1/ab/{ab}").json()
        alerts = httpx.get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
        ratios = query(prometheus, "ab_arm_target_engine:kv_prefix_hit_ratio:rate5m")
        raise AssertionError(
            f"A/B {state['status']} ({state['error']}), rounds {[a['rounds_done'] for a in state['arms'].values()]}; "
            f"Prometheus alerts {alerts}; hit ratios {ratios}; notifications {hook.notifications}"
        ) from None
    rounds_done = service.client.get(f"/api/v1/ab/{ab}").json()["arms"]["dram_only"]["rounds_done"]

    # The DRAM-only arm, named by the rules from the engine "<ab>/<arm>" of the service's target "tierstore", routed
    # as a page, raised by Prometheus.
    assert alert["labels"] == {
        "alertname": "KVCacheHitRateCollapse",
        "severity": "critical",
        "target": "tierstore",
        "engine": f"{ab}/dram_only",
        "ab": ab,
        "arm": "dram_only",
    }
    assert notification["receiver"] == "kvscope-pager" and notification["path"] == "/kvscope-pager"
    assert alert["generatorURL"].startswith(prometheus)
    assert alert["annotations"]["runbook_url"] == "docs/runbook.md#kvcachehitratecollapse"
    assert alert["annotations"]["summary"].startswith(f"KV prefix-cache hit ratio of engine {ab}/dram_only (tierstore)")
    assert rounds_done >= 8  # after the collapse the planner predicts (round 8), never before

    # The prediction came first: the DRAM-only arm's DRAM tier, filling round after round, reached the ticket
    # queue before the collapse paged.
    imminent = hook.firing("KVCacheCollapseImminent")
    assert {(a["labels"]["target"], a["labels"]["system"]) for _, a in imminent} == {
        ("tierstore", f"tierstore:{ab}/dram_only")
    }
    assert hook.notifications.index(imminent[0][0]) < hook.notifications.index(notification)
    assert imminent[0][0]["receiver"] == "kvscope-tickets"

    # What must not fire did not, over the whole run: no collapse of the tiered arm, and neither guard (the
    # DRAM-only arm's attached NoF pool stays at 0 B; the tiered arm writes both of its tiers) ...
    assert query(prometheus, 'count_over_time(ALERTS{alertname="KVCacheHitRateCollapse", arm="tiered"}[5m])') == []
    for guard in ("NoFWritesInDramOnlyArm", "TierWritesMissing"):
        assert query(prometheus, f'count_over_time(ALERTS{{alertname="{guard}"}}[5m])') == [], guard
    assert [n for n in hook.notifications if n["receiver"] == "kvscope-verification"] == []
    # ... while the guards' inputs were there to be judged.
    nof = query(prometheus, f'ab_arm_target_system_tier:kv_tier_written_bytes:rate5m{{ab="{ab}", tier="nof"}}')
    assert {s["metric"]["arm"]: float(s["value"][1]) > 0 for s in nof} == {"dram_only": False, "tiered": True}

    assert time.monotonic() - started_at < 90


def test_the_shipped_inhibitions_silence_an_arms_warning_but_never_a_whole_cluster(tmp_path, real_binary):
    """The shipped alertmanager.yml: a collapse silences the same A/B arm's KVCacheCollapseImminent, not another
    arm's; a cluster's collapse, which names no ab or arm, silences nothing (`equal` holds between two alerts
    that both lack the labels, which once let one collapse silence every warning of a cluster)."""
    hook = Webhook()
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(shipped_alertmanager_config(hook)))
    process = start_alertmanager(real_binary("alertmanager"), config, tmp_path / "data", tmp_path / "am.log")
    try:
        process.wait_ready("Alertmanager", 20)
        collapse = {"alertname": "KVCacheHitRateCollapse", "severity": "critical"}
        imminent = {"alertname": "KVCacheCollapseImminent", "severity": "warning"}
        alerts = [
            {**collapse, "target": "vllm-a", "engine": "0"},  # a cluster's: no ab, no arm
            {**imminent, "target": "mooncake-b", "tier": "dram"},
            {**collapse, "ab": "ab-1", "arm": "dram_only"},
            {**imminent, "ab": "ab-1", "arm": "dram_only"},
            {**imminent, "ab": "ab-1", "arm": "tiered"},
        ]
        posted = httpx.post(f"{process.url}/api/v2/alerts", json=[{"labels": labels} for labels in alerts])
        assert posted.status_code == 200, posted.text

        def states() -> dict | None:
            found = httpx.get(f"{process.url}/api/v2/alerts").json()
            warnings = {
                (a["labels"].get("target") or a["labels"]["arm"]): a["status"]["state"]
                for a in found
                if a["labels"]["alertname"] == "KVCacheCollapseImminent"
            }
            return warnings if len(warnings) == 3 and "suppressed" in warnings.values() else None

        assert wait_for(states, "the arm's warning to be inhibited", 20) == {
            "mooncake-b": "active", "dram_only": "suppressed", "tiered": "active"
        }  # fmt: skip
    finally:
        process.stop()
        hook.stop()
