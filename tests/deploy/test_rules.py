"""deploy/prometheus and deploy/alertmanager as their own tools judge them (promtool check rules / check config /
test rules, amtool check-config), and what those tools do not check: every alert documented, annotated and
tested both ways, every series a rule reads published by someone."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvscope.api.alerts import (
    COLLAPSE,
    FABRIC_SATURATED,
    IMMINENT,
    OFFLOAD_NOT_PAYING,
    ROUTER_OVERESTIMATES,
    RULES,
)
from kvscope.model import INSTRUMENTS, prometheus_name

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULE_FILES = sorted((PROMETHEUS_DIR / "rules").glob("*.yml"))
ALERTS_FILE = PROMETHEUS_DIR / "rules" / "kvscope-alerts.yml"
RECORDING_FILE = PROMETHEUS_DIR / "rules" / "kvscope-recording.yml"
UNIT_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
ALERTMANAGER_CONFIG = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOK = ROOT / "docs" / "runbook.md"
EXPECTED_ALERTS = {
    "KVCacheHitRateCollapse",
    "KVCacheCollapseImminent",
    "NoFWritesInDramOnlyArm",
    "TierWritesMissing",
    "KVScopeTargetDown",
    "KVFabricSaturated",
    "KVOffloadNotPayingOff",
    "KVRouterOverestimates",
}
# Series kvscope publishes besides the KV-tier model (exporters/otel.py) and what Prometheus makes itself.
SELF_METRICS = {
    "kvscope_target_up",
    "kvscope_scrape_duration_seconds",
    "kvscope_scrape_errors_total",
    "kvscope_source_resets_total",
}
PROMETHEUS_METRICS = {"up", "ALERTS"}


def _rules(path: Path) -> list[dict]:
    return [rule for group in yaml.safe_load(path.read_text())["groups"] for rule in group["rules"]]


ALERTS = {rule["alert"]: rule for rule in _rules(ALERTS_FILE) if "alert" in rule}
RECORDED = {rule["record"] for path in RULE_FILES for rule in _rules(path) if "record" in rule}


def run(require_real, tool: str, *args: str | Path) -> None:
    binary = shutil.which(tool)
    require_real(binary is not None, f"{tool} is not installed (Debian packages prometheus, prometheus-alertmanager)")
    done = subprocess.run([binary, *map(str, args)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, f"{tool} {' '.join(map(str, args))}:\n{done.stdout}\n{done.stderr}"


# ---------------------------------------------------------------------------------------------- the tools' word


def test_promtool_check_rules(require_real):
    run(require_real, "promtool", "check", "rules", *RULE_FILES)


def test_promtool_check_config(require_real):
    run(require_real, "promtool", "check", "config", PROMETHEUS_DIR / "prometheus.yml")


def test_promtool_test_rules(require_real):
    run(require_real, "promtool", "test", "rules", *UNIT_TESTS)


def test_amtool_check_config(require_real):
    run(require_real, "amtool", "check-config", ALERTMANAGER_CONFIG)


# ------------------------------------------------------------------------------------------- what they don't check


def test_the_eight_alerts_are_there_with_the_service_s_names():
    assert set(ALERTS) == EXPECTED_ALERTS
    # The service raises the same names in-process (api/alerts.py, api/clusterwatch.py): one meaning, one name.
    assert {COLLAPSE, IMMINENT, FABRIC_SATURATED, OFFLOAD_NOT_PAYING, ROUTER_OVERESTIMATES} <= set(ALERTS)


def test_prometheus_loads_both_rule_files():
    config = yaml.safe_load((PROMETHEUS_DIR / "prometheus.yml").read_text())
    loaded = {(PROMETHEUS_DIR / path).resolve() for path in config["rule_files"]}
    assert loaded == {path.resolve() for path in RULE_FILES}


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_every_alert_has_severity_summary_description_and_a_runbook_section(name):
    rule = ALERTS[name]
    assert rule["labels"]["severity"] in {"critical", "warning"}
    annotations = rule["annotations"]
    assert annotations["summary"].strip() and annotations["description"].strip()
    page, _, anchor = annotations["runbook_url"].partition("#")
    assert (ROOT / page).resolve() == RUNBOOK.resolve()
    sections = _runbook_sections()
    assert anchor in sections, f"{name}: docs/runbook.md has no section #{anchor} ({', '.join(sections)})"
    section = sections[anchor]
    assert section["title"] == name
    for part in ("**What it means.**", "**How to confirm.**", "**What to do.**"):
        assert part in section["text"], f"{name}: the runbook section lacks {part}"


def _runbook_sections() -> dict[str, dict]:
    """The `## ` sections of the runbook by their GitHub anchor (lower case, punctuation dropped, spaces to -)."""
    sections: dict[str, dict] = {}
    current = None
    for line in RUNBOOK.read_text().splitlines():
        if line.startswith("## "):
            title = line[3:].strip()
            anchor = re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")
            current = sections[anchor] = {"title": title, "text": ""}
        elif current is not None:
            current["text"] += line + "\n"
    return sections


@pytest.mark.parametrize("name", sorted(EXPECTED_ALERTS))
def test_every_alert_has_a_promtool_case_where_it_fires_and_one_where_it_must_not(name):
    fires, must_not = [], []
    for path in UNIT_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            expectations = [t["exp_alerts"] for t in case.get("alert_rule_test", []) if t["alertname"] == name]
            if any(expectations):
                fires.append(case["name"])
            elif expectations:  # a case whose every evaluation of this alert expects nothing
                must_not.append(case["name"])
    assert fires, f"{name}: no promtool case where it fires"
    assert must_not, f"{name}: no promtool case where it must not fire"


def test_every_series_a_rule_reads_is_published_or_recorded():
    """A name in an expression is a recording rule's, a KV-tier model instrument's as the exporter spells it, one of
    kvscope's own, or Prometheus' (up, ALERTS): a renamed rule or instrument breaks this, not a 3 a.m. page."""
    published = {prometheus_name(instrument) for instrument in INSTRUMENTS.values()}
    known = RECORDED | published | SELF_METRICS | PROMETHEUS_METRICS
    unknown = set()
    for path in RULE_FILES:
        for rule in _rules(path):
            unknown |= _series_names(rule["expr"]) - known
    assert not unknown, f"rules read series nobody publishes: {sorted(unknown)}"


_GROUPING = re.compile(r"\b(by|without)\s*\([^)]*\)")  # sum by (...) (x): sum stays a call
_MATCHING = re.compile(r"\b(on|ignoring|group_left|group_right)\s*\([^)]*\)")  # x on (...) (y): x stays a name
_KEYWORDS = re.compile(r"\b(and|or|unless|offset|bool)\b")
_NUMBERS = re.compile(r"\b\d+(\.\d+)?([eE][+-]?\d+)?(ms|s|m|h|d|w|y)?\b")


def _series_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers not called as functions, outside strings, label matchers,
    ranges and modifiers' label lists."""
    expr = re.sub(r'"[^"]*"', '""', expr)  # strings (label values, regexes)
    expr = re.sub(r"\{[^}]*\}", "", expr)  # label matchers
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges
    expr = _GROUPING.sub("", expr)
    expr = _KEYWORDS.sub(" ; ", _MATCHING.sub(" ; ", expr))  # a name before them is no call
    expr = _NUMBERS.sub(" ; ", expr)  # 0.95, 1800, offset durations
    names = re.findall(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\()?", expr)
    return {name for name, call in names if not call}


def test_the_series_name_parser_sees_names_and_only_names():
    expr = (
        'sum by (system, tier) (rate(kv_tier_written_bytes_total{tier="nof"}[5m])) / on (system) group_left () '
        'label_replace(up{job=~"kvscope-.*"}, "target", "$1", "job", "(.*)") > 0.95 and ab_arm:x:rate5m offset 5m '
        "or (max without (otel_scope_name) (kvscope_target_up)) == 1e3"
    )
    assert _series_names(expr) == {"kv_tier_written_bytes_total", "up", "ab_arm:x:rate5m", "kvscope_target_up"}


def test_alertmanager_routes_every_alert_to_a_receiver_that_exists():
    config = yaml.safe_load(ALERTMANAGER_CONFIG.read_text())
    names = {receiver["name"] for receiver in config["receivers"]}
    routes = [config["route"]]
    while routes:
        route = routes.pop()
        assert route.get("receiver", config["route"]["receiver"]) in names
        routes.extend(route.get("routes", []))
    # The collapse pages; the guard goes to the test's owner.
    by_matcher = {tuple(route["matchers"]): route["receiver"] for route in config["route"]["routes"]}
    assert by_matcher[('severity="critical"',)] == "kvscope-pager"
    assert by_matcher[('alertname="NoFWritesInDramOnlyArm"',)] == "kvscope-verification"
    assert ALERTS["KVCacheHitRateCollapse"]["labels"]["severity"] == "critical"


def _prometheus_duration(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds % 3600 == 0 else f"{seconds / 60:g}m"


def _spoken(seconds: float) -> str:
    if seconds == 3600:
        return "1 hour"
    return f"{seconds / 60:g} minutes"


def test_the_collapse_rules_use_the_numbers_of_the_alert_definitions():
    """One definition per alert (kvscope.api.alerts.RULES): the shipped Prometheus rules and the runbook state the
    thresholds the service evaluates."""
    collapse, imminent = RULES[COLLAPSE].thresholds, RULES[IMMINENT].thresholds
    expr = " ".join(ALERTS[COLLAPSE]["expr"].split())
    rate, peak = _prometheus_duration(collapse["rate_window_s"]), _prometheus_duration(collapse["peak_window_s"])
    # Both branches, the engines' and a KV router's where no engine exports prefix-cache counters.
    for ratio, writes in (
        ("ab_arm_target_engine:kv_prefix_hit_ratio", "ab_arm:kv_tier_written_bytes"),
        ("target_router_phase:kv_router_prefix_hit_ratio", "target_router:kv_router_stored_events"),
    ):
        fallen = f"{ratio}:rate{rate} < {collapse['fraction_of_peak']:g} * max_over_time({ratio}:rate{rate}[{peak}])"
        assert fallen in expr
        assert f"{writes}:rate{rate} >= {collapse['writes_floor']:g} * {writes}:rate{rate} offset {rate}" in expr
    assert ALERTS[COLLAPSE]["for"] == _prometheus_duration(collapse["for_s"])
    expr = " ".join(ALERTS[IMMINENT]["expr"].split())
    fit = _prometheus_duration(imminent["fit_window_s"])
    assert f"[{fit}], {imminent['horizon_s']:g})" in expr and f"> {imminent['watermark']:g} )" in expr
    assert ALERTS[IMMINENT]["for"] == _prometheus_duration(imminent["for_s"])
    saturated = RULES[FABRIC_SATURATED].thresholds
    expr = " ".join(ALERTS[FABRIC_SATURATED]["expr"].split())
    rate = _prometheus_duration(saturated["rate_window_s"])
    assert f'role:rdma_port_utilization:ratio_rate{rate}{{role!=""}} > {saturated["utilization"]:g} )' in expr
    assert (
        f"role:kv_engine_ttft_seconds:p90_rate{rate} > {saturated['ttft_rise_factor']:g} * "
        f"role:kv_engine_ttft_seconds:p90_rate{rate} offset {_prometheus_duration(saturated['ttft_rise_window_s'])} )"
    ) in expr
    assert ALERTS[FABRIC_SATURATED]["for"] == _prometheus_duration(saturated["for_s"])
    offload = RULES[OFFLOAD_NOT_PAYING].thresholds
    expr = " ".join(ALERTS[OFFLOAD_NOT_PAYING]["expr"].split())
    rate = _prometheus_duration(offload["rate_window_s"])
    assert "system_tier:kv_tier_read_over_written_bytes:ratio_rate" + rate in expr
    assert f'ratio_rate{rate}{{tier!="gpu"}} < {offload["read_share"]:g} )' in expr
    floor = round(offload["written_floor_mib_per_s"] * 2**20)  # MiB/s in RULES, bytes/s in the rule
    assert f"system_tier:kv_tier_written_bytes:rate{rate} > {floor} )" in expr
    assert ALERTS[OFFLOAD_NOT_PAYING]["for"] == _prometheus_duration(offload["for_s"])
    router = RULES[ROUTER_OVERESTIMATES].thresholds
    expr = " ".join(ALERTS[ROUTER_OVERESTIMATES]["expr"].split())
    rate = _prometheus_duration(router["rate_window_s"])
    assert f"target_model_phase:kv_router_prefix_served:ratio_rate{rate} < {router['served_over_expected']:g} )" in expr
    assert (
        f"target_model_phase:kv_router_selected_prefix_tokens:rate{rate} > {router['min_expected_tokens_per_s']:g} )"
    ) in expr
    assert ALERTS[ROUTER_OVERESTIMATES]["for"] == _prometheus_duration(router["for_s"])
    sections = _runbook_sections()
    for name, numbers in (
        (COLLAPSE, collapse),
        (IMMINENT, imminent),
        (FABRIC_SATURATED, saturated),
        (OFFLOAD_NOT_PAYING, offload),
        (ROUTER_OVERESTIMATES, router),
    ):
        assert ALERTS[name]["labels"]["severity"] == RULES[name].severity
        assert ALERTS[name]["annotations"]["runbook_url"] == RULES[name].runbook_url
        text = " ".join(sections[RULES[name].runbook_url.partition("#")[2]]["text"].split())
        fires_when = text.partition("**Fires when**")[2].partition("**What it means.**")[0]
        for key, value in numbers.items():
            duration = key.endswith("_s") and not key.endswith("_per_s")  # a rate per second is no duration
            spelled = _spoken(value) if duration else f"{value:g}"
            assert spelled in fires_when, f"{name}: the runbook's 'Fires when' does not say {key} = {spelled}"
