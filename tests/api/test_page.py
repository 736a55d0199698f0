"""The built-in page, driven by a real headless Chromium against the real service on 127.0.0.1.

An A/B of examples/long_output.yaml runs over HTTP until its DRAM-only arm's KVCacheHitRateCollapse alert fires;
then Chromium loads `/`, lets the page poll the API, takes a screenshot and dumps the DOM it built.
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
import yaml
from pydantic import SecretStr
from support.realservers import Uvicorn, wait_for

from kvscope.api.app import create_app
from kvscope.api.routers import page
from kvscope.api.settings import Settings
from kvscope.processes import free_port

SCENARIO = Path(__file__).parents[2] / "examples" / "long_output.yaml"
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

    # it fired while the A/B ran (above) and resolved when the A/B ended: counted, not listed with what is firing
    assert not [row for row in dom.by_id("alerts").find("tr", "alert") if ab in row.text()]
    resolved = re.search(r"(\d+) resolved", dom.by_id("alerts-counts").text())
    assert resolved and int(resolved.group(1)) >= 2, dom.by_id("alerts-counts").text()  # the collapse, the prediction

    links = {a.attrs.get("href") for a in dom.by_id("ab-verdicts").find("a")}
    evidence = [f"/api/v1/verdicts/{v['verdict_id']}" for v in finished["verdicts"]]
    assert evidence and {*evidence, *(f"{href}/bundle" for href in evidence)} <= links
    if has_verdict_list(server):  # the evidence API's list, when the service has it
        assert "hidden" not in dom.by_id("verdicts").attrs
        assert len(dom.by_id("verdicts").find("tr", "verdict")) == len(dom.by_id("ab-verdicts").find("tr", "verdict"))


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


def chrome(binary: str, profile: Path, *args: str) -> str:
    """Run headless Chromium once (the page polls every 2 s: eight seconds of virtual time see a few polls)."""
    command = [
        binary,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        "--window-size=1400,1000",
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
