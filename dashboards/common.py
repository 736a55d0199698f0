"""What every kvscope dashboard is made of: datasource variables, queries, the panel kinds and their layout.

The dashboards go through these helpers so that the rules the tests check hold by construction:
- every panel and every query reads a datasource chosen in a dashboard variable (no datasource uid is fixed, so
  the same JSON loads in any Grafana);
- panels are numbered from 1 in the order they are added and their queries get refIds A, B, ... in order;
- every panel has a unit and a description (they are required arguments);
- metric names come from the KV-tier model (`metric("kv.tier.written.bytes")`), so renaming an instrument breaks
  the build instead of leaving a panel silently empty. Recording rules are referred to by their names in
  deploy/prometheus/rules/kvscope-recording.yml (a test checks each one exists).
- engines and store systems are told apart by `target` as well as by name, as the recording rules do: every vLLM
  server calls its first engine "0" and its CPU offload "vllm_offload:0".
"""

from __future__ import annotations

import itertools
import string
from collections.abc import Sequence
from dataclasses import dataclass, field

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard as dashboard_builders
from grafana_foundation_sdk.builders import prometheus, stat, table, timeseries
from grafana_foundation_sdk.cog import variants
from grafana_foundation_sdk.models import common, dashboard

from kvscope.model import INSTRUMENTS, prometheus_name

PROMETHEUS = common.DataSourceRef(type_val="prometheus", uid="${datasource}")
INFINITY_PLUGIN = "yesoreyeram-infinity-datasource"

# The instrument that would carry the planner's analytic bound (an infinite cache's hits) onto /metrics. It is not
# part of the model yet: hit-ratio panels draw the ideal only once it is (see `ideal_hit_ratio`).
BOUND_INSTRUMENT = "kv.prefix.bound.hit.tokens"

# The watermark of the KVCacheCollapseImminent alert (kvscope.api.clusterwatch): occupancy panels draw it.
COLLAPSE_WATERMARK = 0.95


def metric(instrument: str) -> str:
    """The Prometheus name of a KV-tier model instrument (a KeyError for a name the model does not have)."""
    return prometheus_name(INSTRUMENTS[instrument])


@dataclass(frozen=True, slots=True)
class Query:
    """One PromQL target: `instant` for a value at the end of the range (stat panels), else a range query."""

    expr: str
    legend: str = "__auto"
    instant: bool = False


def ideal_hit_ratio(engines: str, legend: str) -> list[Query]:
    """The analytic bound of the hit ratio per engine of each target (`engines` a label matcher such as
    `engine=~"$engine"`), where the model knows it: an empty list until BOUND_INSTRUMENT is an instrument of
    kvscope.model. Per target, as the recording rules: every vLLM server calls its first engine "0"."""
    if BOUND_INSTRUMENT not in INSTRUMENTS:
        return []
    bound, queries = metric(BOUND_INSTRUMENT), metric("kv.prefix.query.tokens")
    return [
        Query(
            f"sum by (target, engine) (rate({bound}{{{engines}}}[5m]))"
            f' / sum by (target, engine) (rate({queries}{{{engines}, layer="gpu"}}[5m]))',
            legend,
        )
    ]


def hit_ratio_by_layer(engines: str, legend: str = "") -> list[Query]:
    """The prefix-cache hit ratio of each engine of `engines` (a label matcher) per layer, overall, and against its
    ideal where the model knows it (`ideal_hit_ratio`), from the recording rules; their legends are `legend`
    followed by the layer, "overall" and "ideal"."""
    prefix = f"{legend} " if legend else ""
    return [
        Query(f"target_engine_layer:kv_prefix_hit_ratio:rate5m{{{engines}}}", prefix + "{{layer}}"),
        Query(f"target_engine:kv_prefix_hit_ratio:rate5m{{{engines}}}", f"{prefix}overall"),
        *ideal_hit_ratio(engines, f"{prefix}ideal"),
    ]


# ------------------------------------------------------------------------------------------------------- variables


def datasource_variable(name: str, plugin: str, label: str, description: str) -> dashboard_builders.DatasourceVariable:
    return dashboard_builders.DatasourceVariable(name).label(label).description(description).type(plugin)


def label_variable(
    name: str,
    label: str,
    description: str,
    query: str,
    *,
    regex: str | None = None,
    every: str | None = ".*",
    sort: dashboard.VariableSort = dashboard.VariableSort.NATURAL_ASC,
) -> dashboard_builders.QueryVariable:
    """A variable over a label's values (`label_values(selector, label)`), refreshed with the time range so that new
    engines, systems or A/B tests show up. `every` is the regex "All" stands for (None: one value at a time)."""
    variable = (
        dashboard_builders.QueryVariable(name)
        .label(label)
        .description(description)
        .datasource(PROMETHEUS)
        .query(query)
        .refresh(dashboard.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(sort)
    )
    if regex is not None:
        variable = variable.regex(regex)
    if every is not None:
        all_selected = dashboard.VariableOption(selected=True, text="All", value="$__all")
        variable = variable.multi(True).include_all(True).all_value(every).current(all_selected)
    return variable


# ---------------------------------------------------------------------------------------------------------- panels


def _targets(queries: Sequence[Query]) -> list[prometheus.Dataquery]:
    """Prometheus targets with refIds A, B, ... in order, each reading the dashboard's datasource."""
    targets = []
    for ref_id, query in zip(string.ascii_uppercase, queries, strict=False):
        target = prometheus.Dataquery().expr(query.expr).legend_format(query.legend).ref_id(ref_id)
        targets.append((target.instant() if query.instant else target.range()).datasource(PROMETHEUS))
    if len(targets) != len(queries):
        raise ValueError(f"a panel takes at most {len(string.ascii_uppercase)} queries")
    return targets


def _prometheus_panel(panel, title: str, description: str, unit: str, queries: Sequence[Query]):
    """A panel builder given its title, description and unit, reading `queries` from the dashboard's Prometheus."""
    return panel.title(title).description(description).unit(unit).datasource(PROMETHEUS).targets(_targets(queries))


def _size(panel, width: int, height: int, repeat: str | None):
    """Width and height; a repeated panel is repeated horizontally, two per row: arms or roles side by side."""
    panel = panel.span(width).height(height)
    if repeat is not None:
        panel = panel.repeat(repeat).repeat_direction("h").max_per_row(2)
    return panel


def timeseries_panel(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 12,
    height: int = 8,
    axis_label: str | None = None,
    bounds: tuple[float, float] | None = None,
    stacked: bool = False,
    watermark: float | None = None,
    repeat: str | None = None,
) -> timeseries.Panel:
    """A time series; `watermark` draws a red threshold line.

    No field overrides: Grafana's JSON schema types their options and values as objects, which the common ones
    (a refId, a transform name) are not, so a dashboard using them would not validate."""
    panel = (
        _prometheus_panel(timeseries.Panel(), title, description, unit, queries)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.TABLE)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
            .calcs(["lastNotNull", "max"])
        )
        .tooltip(
            common_builders.VizTooltipOptions().mode(common.TooltipDisplayMode.MULTI).sort(common.SortOrder.DESCENDING)
        )
        .line_width(1)
        .fill_opacity(30 if stacked else 10)
        .show_points(common.VisibilityMode.NEVER)
    )
    if axis_label:
        panel = panel.axis_label(axis_label)
    if bounds is not None:
        panel = panel.min(bounds[0]).max(bounds[1])
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL))
    if watermark is not None:
        panel = panel.thresholds(thresholds(("green", None), ("red", watermark))).thresholds_style(
            common_builders.GraphThresholdsStyleConfig().mode(common.GraphThresholdsStyleMode.LINE)
        )
    return _size(panel, width, height, repeat)


def stat_panel(
    title: str,
    description: str,
    unit: str,
    queries: Sequence[Query],
    *,
    width: int = 6,
    height: int = 8,
    steps: Sequence[tuple[str, float | None]] = (("blue", None),),
    no_value: str | None = None,
) -> stat.Panel:
    """Big numbers, one per series, coloured by `steps` (colour, from value; the first from -inf)."""
    panel = (
        _prometheus_panel(stat.Panel(), title, description, unit, queries)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .graph_mode(common.BigValueGraphMode.NONE)
        .color_mode(common.BigValueColorMode.BACKGROUND)
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .justify_mode(common.BigValueJustifyMode.AUTO)
        .orientation(common.VizOrientation.HORIZONTAL)
        .thresholds(thresholds(*steps))
    )
    if no_value is not None:
        panel = panel.no_value(no_value)
    return panel.span(width).height(height)


def thresholds(*steps: tuple[str, float | None]) -> dashboard_builders.ThresholdsConfig:
    return (
        dashboard_builders.ThresholdsConfig()
        .mode(dashboard.ThresholdsMode.ABSOLUTE)
        .steps([dashboard.Threshold(color=color, value=value) for color, value in steps])
    )


# ------------------------------------------------------------------------------------------- Infinity (REST as JSON)


@dataclass(frozen=True, slots=True)
class Column:
    """One column an Infinity query takes from each JSON row: `selector` (a key), its title and type."""

    selector: str
    text: str
    type: str = "string"  # string, number, timestamp, timestamp_epoch (ms), timestamp_epoch_s


@dataclass
class InfinityQuery(variants.Dataquery):
    """A query of the Infinity datasource plugin: GET `url` (JSON), rows under `root_selector`, the `columns` kept.
    A `url` that does not start with the datasource's URL is appended to it, so a path ("/api/v1/...") reads from
    the service the datasource is configured for, the one host its allowedHosts lets it reach.

    Grafana reads Prometheus only; kvscope's verdicts live in its verifier database and are served over REST
    (GET /api/v1/verdicts), so a table of them goes through Infinity, which fetches JSON server side. The SDK has
    no builder for this plugin: this class gives the JSON its query model documents."""

    ref_id: str
    url: str
    root_selector: str
    columns: Sequence[Column]
    datasource: common.DataSourceRef = field(
        default_factory=lambda: common.DataSourceRef(type_val=INFINITY_PLUGIN, uid="${infinity}")
    )

    def to_json(self) -> dict[str, object]:
        return {
            "refId": self.ref_id,
            "datasource": self.datasource.to_json(),
            "type": "json",
            "source": "url",
            "parser": "backend",
            "format": "table",
            "url": self.url,
            "url_options": {"method": "GET", "data": ""},
            "root_selector": self.root_selector,
            "columns": [{"selector": c.selector, "text": c.text, "type": c.type} for c in self.columns],
        }

    def build(self) -> InfinityQuery:
        """The query is its own builder (Panel.with_target builds what it is given)."""
        return self


def infinity_table_panel(
    title: str, description: str, query: InfinityQuery, *, width: int = 24, height: int = 10
) -> table.Panel:
    """A table of JSON rows fetched by Infinity; `passed` columns read as PASS (green) or FAIL (red)."""
    passed = dashboard.ValueMap(
        options={
            "true": dashboard.ValueMappingResult(text="PASS", color="green"),
            "false": dashboard.ValueMappingResult(text="FAIL", color="red"),
        }
    )
    sort = common_builders.TableSortByFieldState().display_name(query.columns[0].text).desc(True)
    return (
        table.Panel()
        .title(title)
        .description(description)
        .unit("string")
        .datasource(query.datasource)
        .with_target(query)
        .show_header(True)
        .cell_height(common.TableCellHeight.SM)
        .sort_by([sort])
        .mappings([passed])
        .span(width)
        .height(height)
    )


# -------------------------------------------------------------------------------------------------------- the board


class Board:
    """A dashboard under construction: numbers its rows and panels from 1 in the order added and lays them out left
    to right, a new line when a row is full (the SDK's layout)."""

    def __init__(self, uid: str, title: str, description: str, tags: Sequence[str]) -> None:
        self._ids = itertools.count(1)
        self.dashboard = (
            dashboard_builders.Dashboard(title)
            .uid(uid)
            .description(description)
            .tags(["kvscope", *tags])
            .timezone("browser")
            .time("now-1h", "now")
            .refresh("30s")
            .tooltip(dashboard.DashboardCursorSync.CROSSHAIR)
            .with_variable(
                datasource_variable("datasource", "prometheus", "Prometheus", "the Prometheus that scrapes kvscope")
            )
            .link(
                dashboard_builders.DashboardLink("kvscope dashboards")
                .type(dashboard.DashboardLinkType.DASHBOARDS)
                .tags(["kvscope"])
                .as_dropdown(True)
                .keep_time(True)
                .include_vars(False)
                .target_blank(False)
                .icon("external link")
                .tooltip("")
            )
        )

    def refresh(self, every: str, since: str) -> Board:
        self.dashboard = self.dashboard.refresh(every).time(since, "now")
        return self

    def variable(self, *variables) -> Board:
        for variable in variables:
            self.dashboard = self.dashboard.with_variable(variable)
        return self

    def alert_annotations(self) -> Board:
        """Collapse alerts as annotations: those Prometheus evaluates (deploy/prometheus/rules) and those the kvscope
        service raises for its A/B tests and watched clusters (its `kvscope_alerts` gauge)."""
        for name, color, expr in (
            ("Collapse alerts (Prometheus rules)", "red", 'ALERTS{alertname=~"KVCache.*", alertstate="firing"}'),
            ("Collapse alerts (kvscope service)", "orange", 'sum by (alertname) (kvscope_alerts{state="firing"}) > 0'),
        ):
            self.dashboard = self.dashboard.annotation(
                dashboard_builders.AnnotationQuery()
                .name(name)
                .datasource(PROMETHEUS)
                .enable(True)
                .icon_color(color)
                .expr(expr)
            )
        return self

    def row(self, title: str) -> Board:
        self.dashboard = self.dashboard.with_row(dashboard_builders.Row(title).id(next(self._ids)))
        return self

    def panels(self, *panels) -> Board:
        for panel in panels:
            self.dashboard = self.dashboard.with_panel(panel.id(next(self._ids)))
        return self

    def build(self) -> dashboard.Dashboard:
        return self.dashboard.build()
