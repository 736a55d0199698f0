"""The built-in page, driven by a real headless Chromium against the real service on 127.0.0.1.

An A/B of examples/long_output.yaml runs over HTTP until its DRAM-only arm's KVCacheHitRateCollapse alert fires;
then Chromium loads `/`, lets the page poll the API, takes a screenshot and dumps the DOM it built.

The tests after it share one service (`site`) holding ended A/Bs of one, two and three arms and a cluster alert. They
load the page as the service serves it, plus tests/api/page_measure.js (served from a route only the tests add), which
writes into the DOM what a DOM dump cannot show: the rendered size of each chart text, the page's scroll width and where
each arm's points are drawn; the screenshot of the same load is then read pixel by pixel at those places.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import struct
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml
from fastapi import FastAPI, Request, Response
from matplotlib import image
from pydantic import SecretStr
from support.realservers import Uvicorn, wait_for

from kvscope.api.app import create_app
from kvscope.api.routers import page
from kvscope.api.settings import Settings
from kvscope.processes import free_port

ROOT = Path(__file__).parents[2]
SCENARIO = ROOT / "examples" / "long_output.yaml"
POLICIES = ROOT / "examples" / "policies.yaml"
CRITERIA = ROOT / "criteria" / "media.yaml"
MEASURE = Path(__file__).with_name("page_measure.js")
STATIC = Path(page.__file__).parents[1] / "static"
AUTH = {"Authorization": "Bearer t"}


@pytest.fixture
def server(tmp_path) -> Iterator[str]:
    """The real service under uvicorn in a thread, on a free port of 127.0.0.1; yields its base URL."""
    app = create_app(
        Settings(db=tmp_path / "kvscope.duckdb", token=SecretStr("t"), workdir=tmp_path / "ab", scrape_interval_s=1)
    )
    if not any(getattr(route, "path", None) == "/" for route in app.routes):
        app.include_router(page.router)
    running = Uvicorn(app, free_port())
    yield running.url
    running.stop()


def test_page_is_served_without_network(server):
    with httpx.Client(base_url=server) as client:
        html = client.get("/")
        assert html.status_code == 200 and html.headers["content-type"].startswith("text/html")
        assert "default-src 'self'" in html.headers["content-security-policy"]
        assert client.get("/ui/app.js").headers["content-type"].startswith("text/javascript")
        assert client.get("/ui/style.css").headers["content-type"].startswith("text/css")
        assert client.get("/ui/secrets.txt").status_code == 404
        assert "/" not in client.get("/openapi.json").json()["paths"]
    for asset in STATIC.iterdir():  # offline: nothing but the service itself (the SVG namespace is a name)
        assert not re.findall(r"https?://(?!www\.w3\.org/2000/svg)", asset.read_text()), asset.name
        assert not re.findall(r"\.(inner|outer)HTML|insertAdjacentHTML|document\.write", asset.read_text()), asset.name


def test_page_shows_the_ab_chart_and_its_collapse_alert(server, tmp_path, require_real):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require_real(chromium is not None, "headless Chromium is not installed (Debian: apt-get install chromium)")
    with httpx.Client(base_url=server, timeout=10) as client:
        started = client.post("/api/v1/ab", json={"scenario": yaml.safe_load(SCENARIO.read_text())}, headers=AUTH)
        assert started.status_code == 201, started.text
        ab = started.json()["id"]
        firing = wait_for(lambda: collapse_alert(client, ab), "the dram_only arm's collapse alert to fire", 30)
        finished = wait_for(lambda: finished_ab(client, ab), f"{ab} to finish", 30)
    assert firing["summary"]

    screenshot = tmp_path / "page.png"
    chrome(chromium, tmp_path / "profile-shot", f"--screenshot={screenshot}", server + "/")
    print(f"screenshot: {screenshot}")
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", screenshot.read_bytes()[16:24]) == (1400, 1000)
    assert screenshot.stat().st_size > 30_000, "a blank page compresses to a few kB"

    dom = parse(chrome(chromium, tmp_path / "profile-dom", "--dump-dom", server + "/"))
    assert "ok" in dom.by_id("live").classes, dom.by_id("live").text()
    chart = dom.by_id("ab-chart").find("svg")
    assert len(chart) == 1
    lines = chart[0].find("polyline", "hit-line")
    assert sorted(line.attrs["data-arm"] for line in lines) == ["dram_only", "tiered"]
    assert all(len(line.attrs["points"].split()) == finished["rounds"] for line in lines), "a point per round"
    assert chart[0].find("polyline", "ideal-line"), "the ideal is drawn"
    bytes_charts = dom.by_id("bytes-chart").find("svg", "bytes-svg")
    assert [svg.attrs["data-arm"] for svg in bytes_charts] == ["dram_only", "tiered"]
    assert all(svg.find("rect", "bar") for svg in bytes_charts)

    cards = {card.attrs["data-arm"]: card.text() for card in dom.find_all() if "card" in card.classes}
    assert "excess recompute, last round" in cards["dram_only"] and "tokens/request" in cards["dram_only"], cards
    figures = {figure.attrs["data-arm"]: figure for figure in dom.by_id("arm-cards").find("figure", "miss-causes")}
    assert sorted(figures) == ["dram_only", "tiered"], "each arm's miss causes"
    assert all(len(figure.find("g", "miss-round")) == finished["rounds"] for figure in figures.values())
    causes = {rect.attrs["data-cause"] for rect in figures["dram_only"].find("rect", "miss-cause")}
    assert {"cold", "evicted"} <= causes, causes  # new tokens every round, then the collapse's
    lost = [g.attrs.get("data-lost") for g in figures["dram_only"].find("g", "miss-round")]
    assert set(lost) - {None} <= {"chain_broken", "evicted"} and lost[-1] == "evicted", lost  # never cold
    assert not any(g.attrs.get("data-lost") for g in figures["tiered"].find("g", "miss-round"))  # at its ideal

    # it fired while the A/B ran (above) and resolved when the A/B ended: listed under its A/B as resolved
    groups = [g for g in dom.by_id("alerts").find("details", "alert-group") if g.attrs.get("data-ab") == ab]
    assert len(groups) == 1, dom.by_id("alerts").text()
    rows = groups[0].find("tr", "alert")
    assert rows and all("resolved" in row.classes and "firing" not in row.classes for row in rows)
    resolved = re.search(r"(\d+) resolved", dom.by_id("alerts-counts").text())
    assert resolved and int(resolved.group(1)) >= 2, dom.by_id("alerts-counts").text()  # the collapse, the prediction

    links = {a.attrs.get("href") for a in dom.by_id("ab-verdicts").find("a")}
    evidence = [f"/api/v1/verdicts/{v['verdict_id']}" for v in finished["verdicts"]]
    assert evidence and {*evidence, *(f"{href}/bundle" for href in evidence)} <= links
    if has_verdict_list(server):  # the evidence API's list, when the service has it
        assert "hidden" not in dom.by_id("verdicts").attrs
        assert len(dom.by_id("verdicts").find("tr", "verdict")) == len(dom.by_id("ab-verdicts").find("tr", "verdict"))


def test_page_draws_every_round_of_a_detail_served_in_pages(server, tmp_path, require_real):
    """300 rounds of one arm come in two answers (256 rows a page, then `next_since_round`): the page follows the
    cursor and draws a point of its hit-ratio line per round."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require_real(chromium is not None, "headless Chromium is not installed (Debian: apt-get install chromium)")
    scenario = {
        "name": "three_hundred_rounds",
        "workload": {"kind": "multi_round", "sessions": 1, "rounds": 300, "first_prompt_tokens": 32,
                     "output_tokens": 16},
        "kv": {"block_tokens": 16, "bytes_per_token": 1024},
        "arms": {"lru": {"tiers": [{"name": "dram", "capacity": "64KiB"}]}},
    }  # fmt: skip
    with httpx.Client(base_url=server, timeout=10) as client:
        started = client.post("/api/v1/ab", json={"scenario": scenario}, headers=AUTH)
        assert started.status_code == 201, started.text
        ab = started.json()["id"]
        wait_for(lambda: finished_ab(client, ab), f"{ab} to finish", 60)
        assert client.get(f"/api/v1/ab/{ab}").json()["next_since_round"] == 256

    dom = parse(chrome(chromium, tmp_path / "profile", "--dump-dom", f"{server}/#ab={ab}"))
    (line,) = dom.by_id("ab-chart").find("svg")[0].find("polyline", "hit-line")
    assert len(line.attrs["points"].split()) == 300, "a point per round, the second page's too"


def has_verdict_list(server: str) -> bool:
    return httpx.get(f"{server}/api/v1/verdicts").status_code == 200


def collapse_alert(client: httpx.Client, ab: str) -> dict | None:
    for alert in client.get("/api/v1/alerts", params={"state": "firing"}).json():
        labels = alert["labels"]
        if alert["name"] == "KVCacheHitRateCollapse" and (labels.get("ab"), labels.get("arm")) == (ab, "dram_only"):
            return alert
    return None


def finished_ab(client: httpx.Client, ab: str) -> dict | None:
    test = client.get(f"/api/v1/ab/{ab}").json()
    return test if test["status"] == "finished" else None


# --------------------------------------------------------- one service for the tests below: ended A/Bs, a cluster

CLUSTER_ALERT = "KVCacheCollapseImminent"  # as the cluster watch raises it: labels without `ab`
CLUSTER_LABELS = {"system": "mooncake-prod", "tier": "dram"}
UNJUDGEABLE = {  # a criterion on a metric no run has: it cannot be judged (passed null, with the error)
    "runs": ["dram_only", "tiered"],
    "criteria": [
        {
            "name": "gpu_bytes_parity",
            "kind": "parity",
            "description": "both arms wrote the same bytes to a GPU tier",
            "metric": "kv.gpu.absent.bytes",
            "runs": ["dram_only", "tiered"],
            "tolerance": 0.001,
        }
    ],
}
HEIGHT = {1024: 1800, 1440: 1400}  # window heights at which the hit-ratio chart is on the screenshot


@dataclass
class Site:
    url: str
    tests: dict[str, dict]  # "single", "policies", "long": the detail of each (ended) A/B
    requests: list[str]  # the path and query of every request the service answered, in order
    folder: Path


@dataclass
class View:
    dom: Node
    measured: dict  # what tests/api/page_measure.js wrote into the page
    png: np.ndarray  # the screenshot, (height, width, RGB) in 0..1
    screenshot: Path


def add_measured_page(app: FastAPI) -> None:
    """Routes only these tests add: the page exactly as `/` serves it (HTML and headers, its CSP included) with
    the measuring script added to its head, and the script."""

    @app.get("/test-measured", include_in_schema=False)
    def measured() -> Response:
        served = page.page()
        html = served.body.replace(b"</head>", b'<script src="/test-measure.js" defer></script>\n</head>', 1)
        assert html != served.body
        headers = {k: v for k, v in served.headers.items() if k not in ("content-length", "content-type")}
        return Response(html, media_type="text/html; charset=utf-8", headers=headers)

    @app.get("/test-measure.js", include_in_schema=False)
    def script() -> Response:
        return Response(MEASURE.read_bytes(), media_type="text/javascript; charset=utf-8")


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[Site]:
    """The service with the media criteria (and one that cannot be judged), a firing cluster alert, and three ended
    A/Bs: policies (three arms, equal hit ratios up to round 4), a single-arm one, long_output (newest)."""
    folder = tmp_path_factory.mktemp("page")
    unjudgeable = folder / "unjudgeable.yaml"
    unjudgeable.write_text(yaml.safe_dump(UNJUDGEABLE))

    def cluster_alert(services) -> None:
        summary = "dram of mooncake-prod reaches 90% of capacity in 42 s at 1,200,000,000 B/s"
        services.alerts.set(CLUSTER_ALERT, CLUSTER_LABELS, "firing", summary, value=42.0)

    settings = Settings(
        db=folder / "kvscope.duckdb",
        token=SecretStr("t"),
        workdir=folder / "ab",
        scrape_interval_s=1,
        criteria=[CRITERIA, unjudgeable],
    )
    app = create_app(settings, on_started=cluster_alert)
    requests: list[str] = []

    @app.middleware("http")
    async def log(request: Request, call_next):
        requests.append(request.url.path + (f"?{request.url.query}" if request.url.query else ""))
        return await call_next(request)

    add_measured_page(app)
    running = Uvicorn(app, free_port())
    policies = yaml.safe_load(POLICIES.read_text())
    scenarios = {
        "policies": policies,
        "single": {**policies, "name": "single_lru", "arms": {"lru": policies["arms"]["lru"]}},
        "long": yaml.safe_load(SCENARIO.read_text()),
    }
    tests = {}
    try:
        with httpx.Client(base_url=running.url, timeout=10) as client:
            for key, scenario in scenarios.items():
                started = client.post("/api/v1/ab", json={"scenario": scenario}, headers=AUTH)
                assert started.status_code == 201, started.text
                ab = started.json()["id"]
                tests[key] = wait_for(lambda ab=ab: finished_ab(client, ab), f"{ab} to finish", 60)
        yield Site(running.url, tests, requests, folder)
    finally:
        running.stop()


@pytest.fixture
def chromium(require_real) -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    require_real(binary is not None, "headless Chromium is not installed (Debian: apt-get install chromium)")
    return binary


@pytest.fixture(scope="module")
def views(site) -> Callable[..., View]:
    """`views(chromium, ab, width)`: the measured page showing A/B `ab` in a window `width` px wide, its DOM, what
    it measured and its screenshot; each is loaded once a module."""

    @functools.cache
    def view(binary: str, ab: str, width: int) -> View:
        tag = f"{ab}-{width}"
        shot = site.folder / f"page-{tag}.png"
        url = f"{site.url}/test-measured#ab={ab}"
        out = chrome(
            binary,
            site.folder / f"profile-{tag}",
            f"--screenshot={shot}",
            "--dump-dom",
            url,
            size=(width, HEIGHT[width]),
        )
        print(f"screenshot: {shot}")
        dom = parse(out)
        return View(dom, json.loads(dom.by_id("page-measure").text()), image.imread(shot)[..., :3], shot)

    return view


def colour(css: str) -> np.ndarray:
    """A computed CSS colour, rgb(r, g, b), as RGB in 0..1."""
    match = re.fullmatch(r"rgba?\((\d+), (\d+), (\d+)(?:, [\d.]+)?\)", css)
    assert match, css
    return np.array([int(g) for g in match.groups()]) / 255


def pixels(png: np.ndarray, rgb: np.ndarray, box: tuple[float, float, float, float], tolerance: float = 0.09) -> int:
    """How many pixels of the screenshot in box (left, top, right, bottom) are within `tolerance` of `rgb`."""
    left, top, right, bottom = (round(v) for v in box)
    assert 0 <= left < right <= png.shape[1] and 0 <= top < bottom <= png.shape[0], (box, png.shape)
    region = png[top:bottom, left:right]
    return int((np.abs(region - rgb).max(axis=-1) <= tolerance).sum())


def texts(node: Node, cls: str) -> str:
    """The text of the descendants of `node` of class `cls`, whitespace collapsed."""
    return " ".join(" ".join(n.text() for n in node.find_all() if cls in n.classes).split())


def js_string(value: object) -> str:
    """How the page writes a threshold's value (JavaScript's String(), lists joined by commas)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, list):
        return ", ".join(js_string(v) for v in value)
    return str(value)


def test_alerts_are_grouped_by_ab_the_shown_one_first_and_open(site, views, chromium):
    ids = {key: test["id"] for key, test in site.tests.items()}
    view = views(chromium, ids["long"], 1440)
    groups = view.dom.by_id("alerts-body").find("details", "alert-group")
    alerts = httpx.get(f"{site.url}/api/v1/alerts").json()
    assert groups and groups[0].attrs.get("data-ab") == ids["long"], [g.attrs for g in groups]
    assert "open" in groups[0].attrs, "the A/B shown: its alerts are open"
    by_ab = {g.attrs["data-ab"]: g for g in groups if "data-ab" in g.attrs}
    assert set(ids.values()) <= set(by_ab), "a group per A/B that raised alerts"
    for key in ("policies", "single"):
        assert "open" not in by_ab[ids[key]].attrs, f"{key} ended and is not shown: collapsed"
    for ab, group in by_ab.items():
        raised = [a for a in alerts if a["labels"].get("ab") == ab]
        rows = group.find("tr", "alert")
        assert len(rows) == len(raised) > 0
        assert re.search(rf"\b{len(raised)} alerts?\b", group.find("summary")[0].text()), "a count on the group"
        assert all("resolved" in row.classes for row in rows), "every A/B ended: its alerts resolved"
        assert all(row.find("span", "badge")[0].text() == "resolved" for row in rows)

    # the cluster's alerts (no `ab` label) are a group of their own, open while one fires
    cluster = [g for g in groups if g.attrs.get("data-group") == "cluster"]
    assert len(cluster) == 1 and "open" in cluster[0].attrs
    rows = cluster[0].find("tr", "alert")
    assert [row.attrs.get("data-alert") for row in rows] == [CLUSTER_ALERT] and "firing" in rows[0].classes
    assert "mooncake-prod" in rows[0].text()

    # on screen: the rows of the open groups only; a resolved alert does not look like a firing one
    shown = len(groups[0].find("tr", "alert")) + len(rows)
    assert view.measured["alert_rows_visible"] == shown
    styles = view.measured["alert_row_styles"]
    assert styles.get("resolved") and styles.get("firing") and styles["resolved"] != styles["firing"], styles


def test_overlapping_arms_are_told_apart_and_the_ideal_drawn_over_them(site, views, chromium):
    for key in ("policies", "long"):
        detail = site.tests[key]
        arms = list(detail["arms"])
        view = views(chromium, detail["id"], 1440)
        chart = view.dom.by_id("ab-chart").find("svg")[0]
        legend = view.dom.by_id("ab-chart-legend").find("li")
        entries = [li for li in legend if li.attrs.get("data-series") == "arm"]
        assert [li.attrs.get("data-arm") for li in entries] == arms, "a legend entry per arm"
        assert len([li for li in legend if li.attrs.get("data-series") == "ideal"]) == 1, "and one for the ideal"

        lines = {g.attrs["data-arm"]: g for g in chart.find("g", "arm")}
        groups = {g.attrs["data-arm"]: g for g in chart.find("g", "arm-points")}
        assert list(lines) == list(groups) == arms
        assert all(len(g.find("polyline", "hit-line")) == 1 for g in lines.values())
        marks = {arm: [p.attrs.get("data-shape") for p in g.find("path", "point")] for arm, g in groups.items()}
        assert all(len(set(m)) == 1 and m[0] for m in marks.values()), marks
        shapes = {arm: m[0] for arm, m in marks.items()}
        assert len(set(shapes.values())) == len(arms), f"a marker shape per arm: {shapes}"
        assert {li.attrs["data-arm"]: li.attrs.get("data-shape") for li in entries} == shapes, "the legend's markers"
        for g in groups.values():
            assert [int(p.attrs["data-round"]) for p in g.find("path", "point")] == list(range(1, detail["rounds"] + 1))

        # a lower line is wider than the lines over it: where curves coincide, each shows as a band of its colour
        widths = [view.measured["arms"][arm]["stroke_width"] for arm in arms]
        assert widths == sorted(widths, reverse=True) and len(set(widths)) == len(widths), widths

        # the ideal: one dashed line of a point per round, drawn over every arm's line (and under their points)
        layers = [c for c in chart.children if isinstance(c, Node) and c.tag == "g"]
        kinds = [next((k for k in ("ideals", "arm", "arm-points") if k in g.classes), "") for g in layers]
        at = kinds.index("ideals")
        assert kinds.count("ideals") == 1 and at > max(i for i, k in enumerate(kinds) if k == "arm"), kinds
        assert at < min(i for i, k in enumerate(kinds) if k == "arm-points"), kinds
        ideal = layers[at].find("polyline", "ideal-line")
        assert len(ideal) == 1 and len(ideal[0].attrs["points"].split()) == detail["rounds"]

    # drawn: in round 3 of policies every arm has the same hit ratio, and every arm's colour shows near it
    policies = site.tests["policies"]
    assert len({arm["rows"][2]["hit_ratio"] for arm in policies["arms"].values()}) == 1
    measured = views(chromium, policies["id"], 1440).measured["arms"]
    at = [next(p for p in arm["points"] if p["round"] == 3) for arm in measured.values()]
    x, y = np.mean([p["x"] for p in at]), np.mean([p["y"] for p in at])
    png = views(chromium, policies["id"], 1440).png
    for name, arm in measured.items():
        assert pixels(png, colour(arm["stroke"]), (x - 14, y - 10, x + 14, y + 10)) >= 8, f"{name} is hidden"

    # long_output's tiered arm tracks its ideal exactly; after round 12 (dram_only is at 0 by then) both show, in a
    # line at least 1.5 px wide, at either window width
    long = site.tests["long"]
    assert all(row["hit_ratio"] == row["ideal_hit_ratio"] for row in long["arms"]["tiered"]["rows"])
    for width in (1024, 1440):
        view = views(chromium, long["id"], width)
        later = [p for p in view.measured["arms"]["tiered"]["points"] if p["round"] >= 12]
        box = (later[0]["x"], min(p["y"] for p in later) - 6, later[-1]["x"], max(p["y"] for p in later) + 6)
        (ideal,) = view.measured["ideal"]
        assert ideal["rendered_width"] >= 1.5, ideal
        assert pixels(view.png, colour(ideal["stroke"]), box) >= 40, f"{width} px: the ideal is hidden under tiered"
        assert pixels(view.png, colour(view.measured["arms"]["tiered"]["stroke"]), box) >= 40, f"{width} px: tiered"


def test_each_arm_shows_its_tiers_capacities_policies_and_store(site, views, chromium):
    expected = {  # capacities as the scenarios write them: 50GiB is binary, 429.5GB and 46.09TB decimal
        "long": {
            "dram_only": [("dram", "429.5 GB", "lru", "accounting"), ("nof attached", "46.09 TB", "lru", "accounting")],
            "tiered": [("dram", "50 GiB", "lru", "accounting"), ("nof", "46.09 TB", "lru", "accounting")],
        },
        "policies": {arm: [("dram", "64 MiB", arm, "accounting")] for arm in ("lru", "mooncake", "lmcache")},
    }
    for key, arms in expected.items():
        detail = site.tests[key]
        dom = views(chromium, detail["id"], 1440).dom
        cards = {card.attrs["data-arm"]: card for card in dom.by_id("arm-cards").find("div", "card")}
        assert list(cards) == list(arms)
        for arm, tiers in arms.items():
            lines = cards[arm].find("li", "tier")
            shown = [
                tuple(texts(line, f"tier-{part}") for part in ("name", "capacity", "policy", "backend"))
                for line in lines
            ]
            assert shown == tiers, arm
            exact = [f"{tier['capacity']:,} B" for tier in detail["arms"][arm]["tiers"]]
            assert [line.find("span", "tier-capacity")[0].attrs.get("title") for line in lines] == exact
            assert "store embedded" in " ".join(cards[arm].text().split())
            assert "placement replicate" in " ".join(cards[arm].text().split())
            attached = [line.attrs.get("data-tier") for line in lines if "attached" in line.attrs["class"].split()]
            assert attached == [tier["name"] for tier in detail["arms"][arm]["tiers"] if tier["attached"]]
        note = " ".join(dom.by_id("sizes-note").text().split())
        assert "1024" in note and "1000" in note, note


def test_each_verdict_shows_what_it_checked_what_was_measured_and_the_threshold(site, views, chromium):
    long = site.tests["long"]
    dom = views(chromium, long["id"], 1440).dom
    rows = dom.by_id("ab-verdicts").find("tr", "verdict")
    assert [row.attrs.get("data-criterion") for row in rows] == [v["criterion"] for v in long["verdicts"]]
    words = {True: "PASS", False: "FAIL", None: "NOT JUDGED"}
    for verdict, row in zip(long["verdicts"], rows, strict=True):
        assert texts(row, "verdict-outcome") == words[verdict["passed"]], verdict
        described = texts(row, "verdict-description")
        assert described == verdict["description"] if verdict["description"] else described, verdict
        measured = " ".join((verdict.get("summary") or verdict.get("error") or "").split())
        assert measured and texts(row, "verdict-summary") == measured
        threshold = texts(row, "verdict-threshold")
        for name, value in (verdict.get("threshold") or {}).items():
            assert f"{name} = {js_string(value)}" in threshold, (name, threshold)
    assert {words[v["passed"]] for v in long["verdicts"]} == set(words.values()), "a pass, a fail and an error"


@pytest.mark.parametrize("width", [1024, 1440])
@pytest.mark.parametrize("key", ["single", "long", "policies"])
def test_chart_text_is_readable_and_the_page_fits_the_window(site, views, chromium, key, width):
    view = views(chromium, site.tests[key]["id"], width)
    measured = view.measured
    assert measured["inner_width"] == width and view.png.shape[1] == width
    assert measured["scroll_width"] <= measured["client_width"], "a horizontal scrollbar"
    assert not measured["panels_overflowing"], "content wider than its panel"
    drawn = measured["chart_texts"]
    assert {t["chart"] for t in drawn} == {"ab-chart", "bytes-chart"}
    assert not [t for t in drawn if t["px"] < 11], "chart text under 11 px"
    assert not [t for t in drawn if t["px"] > 16], "chart text over 16 px"
    assert measured["html_texts_min_px"] >= 11
    for chart in measured["charts"].values():
        right = chart["box"]["left"] + chart["box"]["width"]
        assert chart["svgs"] and all(svg["left"] + svg["width"] <= right + 0.5 for svg in chart["svgs"])
    # the screenshot: each arm's colour is drawn in the hit-ratio chart
    box = measured["charts"]["ab-chart"]["box"]
    box = (box["left"], box["top"], box["left"] + box["width"], box["top"] + box["height"])
    for name, arm in measured["arms"].items():
        assert pixels(view.png, colour(arm["stroke"]), box) >= 60, f"{name}'s line is not drawn"


def test_a_running_ab_is_polled_for_its_new_rows_only(site, chromium, tmp_path):
    long = site.tests["long"]["id"]
    with httpx.Client(base_url=site.url, timeout=10) as client:
        started = client.post(
            "/api/v1/ab",
            json={"scenario": yaml.safe_load(SCENARIO.read_text()), "rounds_per_minute": 60},
            headers=AUTH,
        )
        assert started.status_code == 201, started.text
        ab = started.json()["id"]
        try:

            def rounds() -> int:
                return min(arm["rounds_done"] for arm in client.get(f"/api/v1/ab/{ab}").json()["arms"].values())

            wait_for(lambda: rounds() >= 2, f"{ab} to run two rounds", 30)
            done = rounds()
            before = len(site.requests)  # the page's requests from here on
            running = parse(chrome(chromium, tmp_path / "profile-running", "--dump-dom", site.url + "/"))
            seen = [r for r in site.requests[before:] if re.fullmatch(rf"/api/v1/ab/{ab}(\?.*)?", r)]
            shown = parse(chrome(chromium, tmp_path / "profile-shown", "--dump-dom", f"{site.url}/#ab={long}"))
            assert client.get(f"/api/v1/ab/{ab}").json()["status"] == "running", "ran too fast for this test"
        finally:
            client.delete(f"/api/v1/ab/{ab}", headers=AUTH)

    # every row once, then only the rows after the last round it holds
    assert len(seen) >= 2 and seen[0] == f"/api/v1/ab/{ab}", seen
    since = [int(re.fullmatch(rf"/api/v1/ab/{ab}\?since_round=(\d+)", r).group(1)) for r in seen[1:]]
    assert since == sorted(since) and since[0] >= done, (since, done)
    chart = running.by_id("ab-chart").find("svg")[0]
    for group in chart.find("g", "arm-points"):
        drawn = [int(p.attrs["data-round"]) for p in group.find("path", "point")]
        assert drawn == list(range(1, len(drawn) + 1)) and len(drawn) >= since[-1], (group.attrs, drawn)

    # its alerts: first and open when it is shown; open, after the A/B shown, when another one is
    groups = running.by_id("alerts-body").find("details", "alert-group")
    assert groups[0].attrs.get("data-ab") == ab and "open" in groups[0].attrs
    groups = shown.by_id("alerts-body").find("details", "alert-group")
    assert [g.attrs.get("data-ab") for g in groups[:2]] == [long, ab]
    assert "open" in groups[0].attrs and "open" in groups[1].attrs


def chrome(binary: str, profile: Path, *args: str, size: tuple[int, int] = (1400, 1000)) -> str:
    """Run headless Chromium once (the page polls every 2 s: eight seconds of virtual time see a few polls)."""
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        f"--window-size={size[0]},{size[1]}",
        "--virtual-time-budget=8000",
        *args,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


# ------------------------------------------------------------------------------------- a DOM from the dump

VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}


@dataclass
class Node:
    tag: str
    attrs: dict[str, str]
    children: list[Node | str] = field(default_factory=list)

    @property
    def classes(self) -> list[str]:
        return self.attrs.get("class", "").split()

    def text(self) -> str:
        return " ".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find(self, tag: str, cls: str | None = None) -> list[Node]:
        found = []
        for child in self.children:
            if isinstance(child, Node):
                if child.tag == tag and (cls is None or cls in child.classes):
                    found.append(child)
                found += child.find(tag, cls)
        return found

    def by_id(self, id_: str) -> Node:
        nodes = [n for n in self.find_all() if n.attrs.get("id") == id_]
        assert nodes, f"no element #{id_} on the page"
        return nodes[0]

    def find_all(self) -> Iterator[Node]:
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.find_all()


class _Builder(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack = [Node("#document", {})]

    def handle_starttag(self, tag, attrs) -> None:
        node = Node(tag, {k: v or "" for k, v in attrs})
        self.stack[-1].children.append(node)
        if tag not in VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs) -> None:
        self.stack[-1].children.append(Node(tag, {k: v or "" for k, v in attrs}))

    def handle_endtag(self, tag) -> None:
        while len(self.stack) > 1 and self.stack.pop().tag != tag:
            pass

    def handle_data(self, data) -> None:
        self.stack[-1].children.append(data)


def parse(html: str) -> Node:
    builder = _Builder()
    builder.feed(html)
    builder.close()
    return builder.stack[0]
