"""The Grafana dashboards: up to date, valid against Grafana's schemas, built by the rules every kvscope dashboard
follows (dashboards/common.py), and every query answered by a real Prometheus that scrapes kvscope while an A/B runs.

Static checks read the JSON the builders make (the committed files are checked to be exactly that). The live test
starts the kvscope service (an embedded A/B of the long-output example runs in it), `kvscope scrape` over an SPDK
target, RDMA NICs, a vLLM engine's request histograms and a Dynamo frontend and its two workers replayed from
fixtures with moving counters, and a real Prometheus loading deploy/prometheus/rules/*.yml; then it resolves each
dashboard's variables the way Grafana does and runs every panel query, annotation and REST table.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from support.grafana import datasource_references
from support.realservers import TOKEN, Service, start_prometheus

from kvscope.dashboards import media
from kvscope.dashboards.build import BUILDERS, FOLDER, render, stale, write_all
from kvscope.model import INSTRUMENTS, prometheus_name
from kvscope.processes import free_port
from kvscope.tierstore.live import ENGINES

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = ROOT / "tests" / "fixtures" / "grafana-schema"
RULES = ROOT / "deploy" / "prometheus" / "rules"
DASHBOARDS = {uid: json.loads(render(uid)) for uid in BUILDERS}

# Series the dashboards may read besides the model's instruments and the recording rules: the service's alert gauge
# (kvscope.api.metrics) and Prometheus' own ALERTS.
OTHER_SERIES = {"kvscope_alerts", "ALERTS"}
RANGE_FUNCTIONS = {"rate", "increase", "irate"}
PROMQL_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
PROMQL_KEYWORDS |= {"offset", "inf", "nan"}


# ------------------------------------------------------------------------------------------- reading dashboards


def panels(dashboard: dict) -> Iterator[dict]:
    """Every panel, rows included, and the panels inside collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def data_panels(dashboard: dict) -> list[dict]:
    return [panel for panel in panels(dashboard) if panel["type"] != "row"]


def is_prometheus(target: dict) -> bool:
    return target["datasource"]["type"] == "prometheus"


def prometheus_expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and annotation."""
    found = [
        (f"{panel['title']} / {target['refId']}", target["expr"])
        for panel in data_panels(dashboard)
        for target in panel.get("targets", [])
        if is_prometheus(target)
    ]
    found += [(f"annotation {a['name']}", a["expr"]) for a in dashboard["annotations"]["list"] if "expr" in a]
    return found


def variable_queries(dashboard: dict) -> list[tuple[str, str, str]]:
    """(name, series selector, label) of every `label_values(selector, label)` variable."""
    found = []
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]).groups()
            found.append((variable["name"], selector, label))
    return found


def interpolate(text: str, values: Mapping[str, str]) -> str:
    """Grafana's variable interpolation for the variables in `values` (`$name`, `${name}`); anything else, such as
    label_replace's `$1`, is left as it is, as Grafana leaves unknown variables."""

    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, text)


def placeholders(dashboard: dict) -> dict[str, str]:
    """Values that make every expression of `dashboard` plain PromQL (for parsing): durations for Grafana's own
    interval variables, a label value for the dashboard's variables (they only appear inside quotes)."""
    values = {"__rate_interval": "1m", "__range": "1h", "__interval": "1m"}
    values |= {variable["name"]: "x" for variable in dashboard["templating"]["list"]}
    return values


def recording_rules() -> dict[str, str]:
    """record name -> expr of deploy/prometheus/rules/kvscope-recording.yml."""
    groups = yaml.safe_load((RULES / "kvscope-recording.yml").read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"] if "record" in rule}


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def lifetime_counters(expr: str) -> list[str]:
    """Counters (`*_total`) that `expr` reads other than as a range inside rate(), increase() or irate(): a lifetime
    counter value, which a ratio would turn into a ratio of lifetime counters."""
    code = _STRING.sub('""', expr)  # a label value can neither hide nor fake a selector
    found = []
    for match in re.finditer(r"(?<![\w:])([A-Za-z_:][\w:]*_total)\b", code):
        after = re.sub(r"^\s*\{[^}]*\}", "", code[match.end() :])
        if not re.match(r"\s*\[", after) or _enclosing_function(code, match.start()) not in RANGE_FUNCTIONS:
            found.append(match.group(1))
    return found


def _enclosing_function(code: str, position: int) -> str | None:
    """The function whose argument list holds `position`, if any."""
    depth = 0
    for index in range(position - 1, -1, -1):
        if code[index] == ")":
            depth += 1
        elif code[index] == "(":
            if depth == 0:
                name = re.search(r"([A-Za-z_]\w*)\s*$", code[:index])
                return name.group(1) if name else None
            depth -= 1
    return None


def series_names(expr: str) -> set[str]:
    """The metric names an expression selects (not functions, keywords, label names or values)."""
    code = _STRING.sub('""', expr)
    code = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", code)
    code = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", code)
    names = re.findall(r"(?<![\w:.])([A-Za-z_:][\w:]*)\b(?!\s*\()", code)
    return {name for name in names if name.lower() not in PROMQL_KEYWORDS}


def schema(name: str, definition: str | None = None) -> jsonschema.Draft7Validator:
    """A validator for a schema file, or for one of its definitions (whose $refs stay resolvable)."""
    document = json.loads((SCHEMAS / f"{name}.jsonschema.json").read_text())
    if definition is not None:
        document = {"$ref": f"#/definitions/{definition}", "definitions": document["definitions"]}
    return jsonschema.Draft7Validator(document)


def errors(validator: jsonschema.Draft7Validator, document: object) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message[:300]}" for e in validator.iter_errors(document)]


# ------------------------------------------------------------------------------------------------ static checks


def test_the_committed_json_is_what_the_builders_make(tmp_path):
    written = write_all(tmp_path)
    assert sorted(path.name for path in written) == sorted(f"{uid}.json" for uid in BUILDERS)
    for path in written:
        committed = FOLDER / path.name
        assert committed.exists(), f"{committed} is missing: run `kvscope dashboards build`"
        assert committed.read_bytes() == path.read_bytes(), f"{committed} is stale: run `kvscope dashboards build`"
    assert stale() == []


def test_stale_names_what_differs(tmp_path):
    write_all(tmp_path)
    (tmp_path / "kvscope-media.json").write_text("{}\n")
    (tmp_path / "kvscope-kv-tiers.json").unlink()
    (tmp_path / "kvscope-retired.json").write_text("{}\n")
    assert [problem.split(": ", 1)[1] for problem in stale(tmp_path)] == [
        "missing",
        "differs from what the builders make",
        "no builder makes it",
    ]


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_each_dashboard_is_valid_against_grafanas_schema(uid):
    assert errors(schema("dashboard"), DASHBOARDS[uid]) == []


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_panel_options_targets_and_units_are_valid_against_their_schemas(uid):
    units = {d["const"] for d in json.loads((SCHEMAS / "units.jsonschema.json").read_text())["definitions"].values()}
    target_schema = schema("prometheus")
    problems = []
    for panel in data_panels(DASHBOARDS[uid]):
        where = f"{uid} / {panel['title']}"
        assert (SCHEMAS / f"{panel['type']}.jsonschema.json").exists(), f"{where}: no schema for {panel['type']}"
        problems += [f"{where} options: {e}" for e in errors(schema(panel["type"], "Options"), panel["options"])]
        custom = panel["fieldConfig"]["defaults"].get("custom")
        if custom is not None:
            problems += [f"{where} custom: {e}" for e in errors(schema(panel["type"], "FieldConfig"), custom)]
        unit = panel["fieldConfig"]["defaults"].get("unit")
        if unit not in units:
            problems.append(f"{where}: unit {unit!r} is not a Grafana unit")
        for target in panel.get("targets", []):
            if is_prometheus(target):
                problems += [f"{where} {target['refId']}: {e}" for e in errors(target_schema, target)]
            else:  # the plugin publishes no schema: the fields its query model requires
                assert target["datasource"]["type"] == "yesoreyeram-infinity-datasource", where
                required = {"refId", "type", "source", "parser", "format", "url", "url_options", "root_selector"}
                assert required <= set(target) and target["columns"], where
    assert problems == []


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_every_panel_has_a_unit_a_description_and_unique_ids(uid):
    dashboard = DASHBOARDS[uid]
    ids = [panel["id"] for panel in panels(dashboard)]
    assert len(ids) == len(set(ids)) and 0 not in ids, f"panel ids {ids}"
    for panel in data_panels(dashboard):
        assert panel["description"].strip(), panel["title"]
        assert panel["fieldConfig"]["defaults"].get("unit"), panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), f"{panel['title']}: refIds {ref_ids}"
    assert len({d["uid"] for d in DASHBOARDS.values()}) == len(DASHBOARDS)


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_every_datasource_is_a_dashboard_variable(uid):
    dashboard = DASHBOARDS[uid]
    variables = {v["name"]: v["query"] for v in dashboard["templating"]["list"] if v["type"] == "datasource"}
    assert variables.get("datasource") == "prometheus"

    variables_using_one = [v for v in dashboard["templating"]["list"] if v["type"] != "datasource"]
    references = list(datasource_references([dashboard["panels"], dashboard["annotations"], variables_using_one]))
    assert references
    for reference in references:
        name = re.fullmatch(r"\$\{(\w+)\}", reference["uid"])
        assert name and name.group(1) in variables, f"datasource uid {reference['uid']!r} is fixed"
        assert variables[name.group(1)] == reference["type"], reference


def test_the_counter_check_rejects_ratios_of_lifetime_counters():
    assert lifetime_counters("sum(kv_prefix_hit_tokens_total) / sum(kv_prefix_query_tokens_total)") == [
        "kv_prefix_hit_tokens_total",
        "kv_prefix_query_tokens_total",
    ]
    assert lifetime_counters('kv_a_total{x="rate(y_total[5m])"} / 2') == ["kv_a_total"]
    assert lifetime_counters("max_over_time(kv_a_total[5m])") == ["kv_a_total"]
    assert (
        lifetime_counters('sum by (a) (rate(kv_a_total{b=~"$c"}[$__rate_interval])) / sum(increase(d_total[1h]))') == []
    )


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_no_expression_reads_a_lifetime_counter(uid):
    bad = {where: lifetime_counters(expr) for where, expr in prometheus_expressions(DASHBOARDS[uid])}
    assert {where: names for where, names in bad.items() if names} == {}


@pytest.mark.parametrize("uid", DASHBOARDS)
def test_every_series_read_exists_in_the_model_or_the_recording_rules(uid):
    known = {prometheus_name(instrument) for instrument in INSTRUMENTS.values()} | set(recording_rules()) | OTHER_SERIES
    dashboard = DASHBOARDS[uid]
    read = {where: series_names(expr) for where, expr in prometheus_expressions(dashboard)}
    for name, selector, _ in variable_queries(dashboard):
        read[f"variable {name}"] = series_names(selector)
        if by_name := re.search(r'__name__=~"([^"]+)"', selector):  # a selector by name pattern: what it matches
            read[f"variable {name}"] |= {series for series in known if re.fullmatch(by_name.group(1), series)}
    assert all(read.values()), {where: names for where, names in read.items() if not names}
    assert {where: names - known for where, names in read.items() if names - known} == {}


def test_every_expression_parses_with_promtool(tmp_path, real_binary):
    """Each panel, annotation and variable expression as a recording rule: `promtool check rules` parses them all."""
    promtool = real_binary("promtool")
    rules = []
    for uid, dashboard in DASHBOARDS.items():
        values = placeholders(dashboard)
        for where, expr in prometheus_expressions(dashboard):
            rules.append({"record": f"dashboard_expr_{len(rules)}", "expr": interpolate(expr, values), "labels": {}})
            rules[-1]["labels"]["where"] = f"{uid} / {where}"
        for name, selector, label in variable_queries(dashboard):
            expr = f"group by ({label}) ({interpolate(selector, values)})"
            rules.append(
                {"record": f"dashboard_expr_{len(rules)}", "expr": expr, "labels": {"where": f"{uid} ${name}"}}
            )
    path = tmp_path / "dashboard-expressions.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}, sort_keys=False))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"SUCCESS: {len(rules)} rules found" in checked.stdout


def test_the_parity_thresholds_are_the_published_tolerances():
    criteria = yaml.safe_load((ROOT / "criteria" / "media.yaml").read_text())["criteria"]
    tolerances = {c["name"]: c["tolerance"] for c in criteria if c["kind"] == "parity"}
    assert tolerances == {"save_parity": media.SAVE_TOLERANCE, "load_parity": media.LOAD_TOLERANCE}


# --------------------------------------------------------------------------------------------------- live test

LONG_OUTPUT = yaml.safe_load((ROOT / "examples" / "long_output.yaml").read_text())
RATE_INTERVAL = "10s"  # what Grafana's $__rate_interval is at a 1 s scrape interval and a short range, with margin
# The annotation over Prometheus' ALERTS has data only once a rule of kvscope-alerts.yml has fired, which takes its
# `for:` (minutes): out of this test's reach. Its expression is parsed and its series checked above.
NEEDS_FIRING_RULES = 'ALERTS{alertname=~"KVCache.*", alertstate="firing"}'


class Prometheus:
    """A real Prometheus on 127.0.0.1 scraping `targets` every second and evaluating the rules of `RULES`."""

    def __init__(self, binary: str, tmp_path: Path, targets: dict[str, str]) -> None:
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(RULES / "*.yml")],
            "scrape_configs": [
                {"job_name": job, "static_configs": [{"targets": [address]}]} for job, address in targets.items()
            ],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = start_prometheus(
            binary, tmp_path / "prometheus.yml", tmp_path / "tsdb", tmp_path / "prometheus.log"
        )
        self.client = httpx.Client(base_url=f"{self.process.url}/api/v1", timeout=10)

    def get(self, path: str, **params) -> object:
        answer = self.client.get(path, params=params)
        assert answer.status_code == 200, f"{path} {params}: {answer.status_code} {answer.text}"
        return answer.json()["data"]

    def wait_ready(self, jobs: set[str]) -> None:
        deadline = time.monotonic() + 30
        while True:
            assert self.process.popen.poll() is None, f"Prometheus exited: {self.process.tail()}"
            try:
                answer = self.client.get("/targets")  # 503 while it starts
                targets = answer.json()["data"]["activeTargets"] if answer.status_code == 200 else []
            except httpx.TransportError:
                targets = []
            up = {target["labels"]["job"] for target in targets if target["health"] == "up"}
            if up >= jobs:
                return
            assert time.monotonic() < deadline, f"Prometheus targets up: {up}, wanted {jobs}"
            time.sleep(0.25)

    def stop(self) -> None:
        self.process.stop()
        self.client.close()


def _start_exporter(
    tmp_path: Path, spdk_socket: Path, sysfs: Path, vllm_url: str, dynamo: Mapping[str, str]
) -> tuple[subprocess.Popen, int]:
    """`kvscope scrape` over the SPDK target, the RDMA tree, the vLLM engine (its KV loads cross the NoF role's
    NICs) and the Dynamo processes (target name -> URL), its Prometheus endpoint on a free port."""
    port = free_port()
    config = {
        "exporter": {"listen_host": "127.0.0.1", "listen_port": port},
        "targets": [
            {
                "name": "spdk-nof",
                "source": "spdk",
                "socket": str(spdk_socket),
                "interval_s": 0.5,
                "labels": {"role": "nof"},
            },
            {
                "name": "nics",
                "source": "rdma",
                "sysfs": str(sysfs),
                "host": "node-a",
                "interval_s": 0.5,
                "roles": {"mlx5_0": "dram", "mlx5_1": "nof", "mlx4_0": "nof", "hfi1_0": "nof"},
            },
            {"name": "vllm-0", "source": "vllm", "url": vllm_url, "interval_s": 0.5, "labels": {"role": "nof"}},
            *({"name": name, "source": "dynamo", "url": url, "interval_s": 0.5} for name, url in dynamo.items()),
        ],
    }
    (tmp_path / "targets.yaml").write_text(yaml.safe_dump(config))
    kvscope = Path(sys.executable).parent / "kvscope"
    process = subprocess.Popen(
        [str(kvscope), "scrape", "--config", str(tmp_path / "targets.yaml")],
        stdout=subprocess.DEVNULL,
        stderr=(tmp_path / "exporter.log").open("w"),
    )
    return process, port


def _values(result: list[dict]) -> list[float]:
    """Every sample value of an instant (`value`) or range (`values`) query result."""
    return [float(v) for series in result for _, v in series.get("values", [series.get("value", (0, "nan"))])]


def _resolve_variables(
    prometheus: Prometheus, dashboard: dict, chosen: Mapping[str, str], window: tuple[float, float], extra: dict
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Each query variable's values, found as Grafana finds them (label values of the series matching its selector,
    over the time range, through its regex), in the order of the templating list. Returns the value each variable
    stands for in queries ("All" for a multi-value one, else `chosen` or its first value) and all values of each."""
    values = dict(extra)
    options: dict[str, list[str]] = {}
    for variable in dashboard["templating"]["list"]:
        if variable["type"] != "query":
            continue
        selector, label = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", variable["query"]).groups()
        found = prometheus.get(
            f"/label/{label}/values", **{"match[]": interpolate(selector, values)}, start=window[0], end=window[1]
        )
        if variable.get("regex"):
            pattern = re.compile(re.fullmatch(r"/(.*)/", variable["regex"]).group(1))  # Grafana's /regex/
            found = [m.group(1) if m.groups() else m.group(0) for v in found if (m := pattern.search(v))]
        found = sorted(set(found))
        assert found, f"{dashboard['uid']}: variable {variable['name']} has no values"
        options[variable["name"]] = found
        name = variable["name"]
        if name in chosen:
            assert chosen[name] in found, f"{dashboard['uid']}: {name} offers {found}, not {chosen[name]}"
            values[name] = chosen[name]
        elif variable.get("includeAll"):
            values[name] = variable["allValue"]
        else:
            values[name] = found[0]
    return values, options


def _without_data(prometheus: Prometheus, expr: str, instant: bool, window: tuple[float, float]) -> bool:
    """Whether `expr` has no finite value: at the window's end for an instant target (what a stat panel shows),
    anywhere in the window for a range target (what a graph shows)."""
    if instant:
        result = prometheus.get("/query", query=expr, time=window[1])["result"]
    else:
        result = prometheus.get("/query_range", query=expr, start=window[0], end=window[1], step=1)["result"]
    return not any(math.isfinite(value) for value in _values(result))


def _targets(dashboard: dict, options: Mapping[str, list[str]]) -> Iterator[tuple[dict, dict, dict]]:
    """(panel, target, repeat values) of every target, once per value of the panel's repeat variable if it has one."""
    for panel in data_panels(dashboard):
        repeats = [{panel["repeat"]: value} for value in options[panel["repeat"]]] if panel.get("repeat") else [{}]
        for repeat in repeats:
            for target in panel["targets"]:
                yield panel, target, repeat


def _prometheus_queries_without_data(
    prometheus: Prometheus, chosen: Mapping[str, str], window: tuple[float, float]
) -> tuple[int, list[str]]:
    """Run every panel target and annotation of every dashboard over `window`; (how many ran, those without data)."""
    extra = {"__rate_interval": RATE_INTERVAL, "__range": f"{math.ceil(window[1] - window[0])}s"}
    ran, missing = 0, []
    for uid, dashboard in DASHBOARDS.items():
        values, options = _resolve_variables(prometheus, dashboard, chosen, window, extra)
        queries = [
            (f"{interpolate(panel['title'], values | repeat)} / {target['refId']}", target, repeat)
            for panel, target, repeat in _targets(dashboard, options)
            if is_prometheus(target)
        ]
        queries += [
            (f"annotation {annotation['name']}", annotation, {})
            for annotation in dashboard["annotations"]["list"]
            if annotation["expr"] != NEEDS_FIRING_RULES
        ]
        for where, query, repeat in queries:
            ran += 1
            expr = interpolate(query["expr"], values | repeat)
            if _without_data(prometheus, expr, query.get("instant", False), window):
                missing.append(f"{uid} / {where}: {expr}")
    return ran, missing


def _rest_tables_without_data(service_url: str) -> tuple[int, list[str]]:
    """Fetch what every Infinity target reads; (how many ran, those with no rows or a column missing)."""
    ran, missing = 0, []
    for uid, dashboard in DASHBOARDS.items():
        for panel, target in [(p, t) for p in data_panels(dashboard) for t in p["targets"] if not is_prometheus(t)]:
            ran += 1
            # Infinity appends a path to its datasource's URL: the service's.
            rows = httpx.get(service_url + target["url"], timeout=10).json()[target["root_selector"]]
            if not rows or any(column["selector"] not in rows[0] for column in target["columns"]):
                missing.append(f"{uid} / {panel['title']} / {target['refId']}: {rows[:1]}")
    return ran, missing


def test_every_dashboard_query_returns_data_from_a_real_prometheus(
    tmp_path, real_binary, spdk_target, rdma_tree, vllm_engine, dynamo_stack
):
    binary = real_binary("prometheus")
    for name in ENGINES.snapshot():  # published by earlier tests in this process, frozen: not this test's A/B
        ENGINES.withdraw(name)
    service = Service(
        tmp_path, criteria=[ROOT / "criteria" / "media.yaml"], scrape_interval_s=0.5, dashboards_dir=FOLDER
    )
    exporter, exporter_port = _start_exporter(
        tmp_path, spdk_target.path, rdma_tree.root, vllm_engine.url, {n: p.url for n, p in dynamo_stack.items()}
    )
    prometheus = Prometheus(
        binary,
        tmp_path,
        {"kvscope-service": f"127.0.0.1:{service.port}", "kvscope-exporter": f"127.0.0.1:{exporter_port}"},
    )
    try:
        prometheus.wait_ready({"kvscope-service", "kvscope-exporter"})
        started = time.time() - 1
        # 20 rounds an arm at one round a second: long enough for the rates, and the DRAM-only arm collapses at 8.
        answer = service.client.post(
            "/api/v1/ab",
            json={"scenario": LONG_OUTPUT, "rounds_per_minute": 60},
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        assert answer.status_code == 201, answer.text
        ab = answer.json()["id"]

        def progress() -> dict:
            return service.client.get(f"/api/v1/ab/{ab}").json()

        deadline = time.monotonic() + 60
        while min(arm["rounds_done"] for arm in progress()["arms"].values()) < 15:
            assert time.monotonic() < deadline, f"the A/B is too slow: {progress()}"
            time.sleep(0.25)
        time.sleep(2)  # that round scraped by the service, then by Prometheus, then through the rules
        window = (started, time.time())  # while the A/B still runs
        chosen = {"ab": ab, "reference": f"tierstore:{ab}/dram_only", "candidate": f"tierstore:{ab}/tiered"}
        ran, missing = _prometheus_queries_without_data(prometheus, chosen, window)
        assert progress()["status"] == "running", "the queries should have seen the A/B running"
        assert ran > 50
        assert missing == [], "queries without data:\n" + "\n".join(missing)
        assert spdk_target.iostat_calls > 5  # the fabric figures came from moving counters
        assert spdk_target.reactor_calls > 5

        def at_end(expr: str) -> list[dict]:
            return prometheus.get("/query", query=expr, time=window[1])["result"]

        # The fabric's congestion, error and reactor panels read the sources' new series: every congestion event of
        # the synthetic RoCE port, its moving errors, and the captured reactor's busy share (its busy and idle ticks
        # grow in the captured proportion, 24639920196 / (24639920196 + 58028910781)).
        congestion = at_end('host_device_port_role_event:rdma_port_congestion:rate5m{device="mlx5_1"}')
        assert {s["metric"]["event"] for s in congestion} == {"cnp_sent", "ecn_marked", "cnp_handled", "cnp_ignored"}
        moving = at_end("host_device_port_role_error:rdma_port_errors:rate5m > 0")
        assert {(s["metric"]["device"], s["metric"]["error"]) for s in moving} == {
            ("mlx5_1", "out_of_sequence"),
            ("mlx5_1", "symbol_error"),
        }
        (busy,) = at_end("target_lcore_role:storage_reactor_busy_ratio:rate5m")
        labels = {key: label for key, label in busy["metric"].items() if key != "__name__"}
        assert labels == {"target": "spdk-nof", "lcore": "0", "role": "nof"}
        assert float(busy["value"][1]) == pytest.approx(24639920196 / (24639920196 + 58028910781), rel=1e-6)
        # The TTFT and prompt-length panels by role: the engine's buckets grow in the captured proportions, so the
        # quantiles are the capture's, linear within a bucket. TTFT, 6 requests: 2 at most 0.1 s, 5 at most 0.25,
        # 6 at most 0.5; the median is the 1st of 3 in (0.1, 0.25], the p90 0.4 of the one in (0.25, 0.5]. Prompts,
        # 3 requests, all in (2000, 5000] tokens: 2000 + 3000 x 0.5 and x 0.9.
        assert vllm_engine.calls > 5
        for rule, expected in (
            ("kv_engine_ttft_seconds:p50_rate5m", 0.1 + 0.15 / 3),
            ("kv_engine_ttft_seconds:p90_rate5m", 0.25 + 0.25 * 0.4),
            ("kv_engine_prompt_tokens:p50_rate5m", 3500),
            ("kv_engine_prompt_tokens:p90_rate5m", 4700),
        ):
            (quantile,) = at_end(f"role:{rule}")
            assert quantile["metric"]["role"] == "nof", quantile
            assert float(quantile["value"][1]) == pytest.approx(expected, rel=1e-6), rule
        # The router row: the Dynamo captures' counters grow in their captured proportions (small-cache run, mid-load):
        # the router routed 7680 prompt tokens and expected 2720 cached on the workers it chose (3296 on the best
        # eligible ones), the workers served 1088 (0.4 of what it expected) and stored 112 KV events to 80 removed;
        # each worker's usage gauge is the capture's (54 and 56 of its 56 blocks), each preempted 2 requests.
        assert all(process.calls > 5 for process in dynamo_stack.values())
        frontend = {"target": "dynamo-frontend", "router": "1883717788244607475", "phase": "aggregated"}

        def by_labels(expr: str) -> dict[frozenset, float]:
            """Each series' value at the window's end by its labels, less Prometheus' own (name, job, instance)."""
            added = {"__name__", "job", "instance"}
            return {
                frozenset((k, v) for k, v in s["metric"].items() if k not in added): float(s["value"][1])
                for s in at_end(expr)
            }

        def key(**labels: str) -> frozenset:
            return frozenset(labels.items())

        assert by_labels("target_router_phase:kv_router_prefix_hit_ratio:rate5m") == {
            key(**frontend): pytest.approx(2720 / 7680, rel=1e-6)
        }
        chosen = by_labels("target_router_phase_choice:kv_router_prefix_tokens:rate5m")
        assert chosen[key(**frontend, choice="selected")] / chosen[key(**frontend, choice="best_eligible")] == (
            pytest.approx(2720 / 3296, rel=1e-6)
        )
        assert by_labels("target_model_phase:kv_router_prefix_served:ratio_rate5m") == {
            key(target="dynamo-frontend", model="tiny", phase="aggregated"): pytest.approx(0.4, rel=1e-6)
        }
        events = by_labels('target_router_event_status:kv_router_events:rate5m{status="ok"}')
        stored, removed = (
            events[key(target="dynamo-frontend", router=frontend["router"], event=event, status="ok")]
            for event in ("stored", "removed")
        )
        assert stored / removed == pytest.approx(112 / 80, rel=1e-6)
        assert by_labels("kv_engine_cache_usage") == {
            key(target="dynamo-worker-0", worker_id="16043297272919392144", engine="0"): 54 / 56,
            key(target="dynamo-worker-1", worker_id="60841864120844382", engine="0"): 1.0,
        }
        preempted = by_labels('sum by (target, worker_id) (rate(kv_engine_preemptions_total{worker_id!=""}[5m]))')
        assert preempted.keys() == {
            key(target="dynamo-worker-0", worker_id="16043297272919392144"),
            key(target="dynamo-worker-1", worker_id="60841864120844382"),
        }
        assert all(rate > 0 for rate in preempted.values()), preempted

        # Where the arms' prompt tokens came from and why they missed, as the new panels read them (the service
        # publishes every cause from the first scrape, 0 included; evicted ones name the tier). The counters of one
        # scrape (rates extrapolate each series' window edges apart): the sources add up to the tokens each engine
        # looked up (its gpu layer's queries) and the causes to its computed source, within a request's tokens (the
        # A/B runs while they are read); the DRAM-only arm, collapsed by now, missed tokens it had stored.
        for arm in ("dram_only", "tiered"):
            engine = f'target="tierstore", engine="{ab}/{arm}"'
            rates = by_labels(f"target_engine_source:kv_prompt_tokens:rate5m{{{engine}}}")
            assert {dict(labels)["source"] for labels in rates} >= {"computed", "gpu"}, rates
            causes = by_labels(f"target_engine_cause_tier:kv_miss_tokens:rate5m{{{engine}}}")
            assert {dict(labels)["cause"] for labels in causes} >= {"cold", "chain_broken", "not_admitted"}, causes
            assert all(dict(labels).get("tier") for labels in causes if dict(labels)["cause"] == "evicted"), causes

            def total(expr: str) -> float:
                (sample,) = at_end(expr)
                return float(sample["value"][1])

            sources = total(f"sum(kv_prompt_tokens_total{{{engine}}})")
            looked_up = total(f'sum(kv_prefix_query_tokens_total{{{engine}, layer="gpu"}})')
            assert sources == pytest.approx(looked_up, rel=0.01), arm
            computed = total(f'sum(kv_prompt_tokens_total{{{engine}, source="computed"}})')
            assert total(f"sum(kv_miss_tokens_total{{{engine}}})") == pytest.approx(computed, rel=0.01), arm
            if arm == "dram_only":
                stored_once = total(f'sum(kv_miss_tokens_total{{{engine}, cause=~"evicted|chain_broken"}})')
                assert stored_once > 0, causes

        # The lifecycle panel's medians for the collapsed DRAM tier, as the panel asks for them: a block sits idle
        # at most as long as it lived, so the median idle time is at most the median lifetime, and both are times.
        lifecycle = next(p for p in data_panels(DASHBOARDS["kvscope-kv-tiers"]) if p["title"].startswith("Block life"))
        dram_only = {"system": f"tierstore:{ab}/dram_only", "tier": "dram", "__rate_interval": RATE_INTERVAL}
        medians = {}
        for target in lifecycle["targets"]:
            (sample,) = at_end(interpolate(target["expr"], dram_only))
            medians[target["legendFormat"].rsplit("}} ", 1)[1]] = float(sample["value"][1])
        assert medians.keys() == {"lifetime", "idle", "reuse gap"}
        assert 0 < medians["idle"] <= medians["lifetime"] < math.inf, medians
        assert 0 < medians["reuse gap"] < math.inf, medians

        while (test := progress())["status"] == "running":  # verdicts come when it ends
            assert time.monotonic() < deadline, "the A/B did not finish"
            time.sleep(0.25)
        assert test["status"] == "finished" and test["verdicts"], test
        ran, missing = _rest_tables_without_data(service.url)
        assert ran == 1 and missing == [], missing
    finally:
        prometheus.stop()
        exporter.terminate()
        exporter.wait(10)
        service.stop()
