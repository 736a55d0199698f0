"""The API docs with no network: Swagger UI at /docs and Redoc at /redoc load every script, style sheet and icon
from the service itself, so they render on a machine that reaches nothing but the service.

The service runs under uvicorn on 127.0.0.1. The HTML of each docs page and what it references are fetched over
HTTP; then a real headless Chromium, whose every host name but 127.0.0.1 fails to resolve, loads /docs and
/redoc and dumps the DOM that Swagger UI and Redoc built from /openapi.json.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from support.realservers import Uvicorn

from kvscope.api.app import create_app
from kvscope.api.settings import Settings
from kvscope.processes import free_port

DOCS = ("/docs", "/redoc")


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[str]:
    """The real service under uvicorn on a free port of 127.0.0.1 (one for the module: a second app's lifespan
    would register its collector twice); yields its base URL."""
    folder = tmp_path_factory.mktemp("docs")
    app = create_app(Settings(db=folder / "kvscope.duckdb", workdir=folder / "ab", dashboards_dir=folder / "dash"))
    running = Uvicorn(app, free_port())
    yield running.url
    running.stop()


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=10) as running:
        yield running


class _Refs(HTMLParser):
    """The URLs a page loads: scripts, style sheets, icons (`<script src>`, `<link href>`), and the spec."""

    def __init__(self) -> None:
        super().__init__()
        self.scripts: list[str] = []
        self.links: dict[str, str] = {}  # href -> rel
        self.spec: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        attrs = dict(attrs)
        if tag == "script" and attrs.get("src"):
            self.scripts.append(attrs["src"])
        if tag == "link" and attrs.get("href"):
            self.links[attrs["href"]] = attrs.get("rel") or ""
        if tag == "redoc" and attrs.get("spec-url"):
            self.spec.append(attrs["spec-url"])


def refs(html: str) -> _Refs:
    parsed = _Refs()
    parsed.feed(html)
    parsed.close()
    return parsed


@pytest.mark.parametrize("page", DOCS)
def test_docs_reference_nothing_but_the_service(client, page):
    answer = client.get(page)
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
    html = answer.text
    assert not re.findall(r"(?:https?:)?//[a-z0-9.-]+", html, re.IGNORECASE), "a URL of another host"
    found = refs(html)
    assert found.scripts, "no script: the docs page renders nothing"
    assert any("stylesheet" in rel or "icon" in rel for rel in found.links.values())
    for url in [*found.scripts, *found.links]:
        assert url.startswith("/") and not url.startswith("//"), url
        asset = client.get(url)
        assert asset.status_code == 200, url
        if url in found.scripts:
            assert "javascript" in asset.headers["content-type"] and len(asset.content) > 100_000, url
        elif "stylesheet" in found.links[url]:
            assert asset.headers["content-type"].startswith("text/css") and len(asset.content) > 10_000, url
        else:
            assert asset.headers["content-type"].startswith("image/") and len(asset.content) > 100, url
    spec = found.spec or re.findall(r"url: '(/[^']*)'", html)
    assert spec == ["/openapi.json"]


def test_openapi_and_the_oauth2_redirect_are_served(client):
    openapi = client.get("/openapi.json")
    assert openapi.status_code == 200 and "/api/v1/ab" in openapi.json()["paths"]
    assert not {"/docs", "/redoc"} & set(openapi.json()["paths"])
    redirect = client.get("/docs/oauth2-redirect")
    assert redirect.status_code == 200 and "oauth2" in redirect.text


def test_docs_pages_have_their_own_policy_and_the_page_keeps_its_strict_one(client):
    for page in DOCS:
        policy = client.get(page).headers["content-security-policy"]
        assert "default-src 'self'" in policy and "frame-ancestors 'none'" in policy, policy
    assert "'unsafe-inline'" not in client.get("/").headers["content-security-policy"]


@pytest.mark.parametrize(
    "path",
    [
        "/ui/%2e%2e/settings.py",
        "/ui/..%2fsettings.py",
        "/ui/%2e%2e/%2e%2e/pyproject.toml",
        "/ui/",
        "/ui/nope.js",
        "/docs/assets/%2e%2e/core.py",
        "/docs/assets/nope.js",
    ],
)
def test_static_folders_serve_nothing_else(client, path):
    assert client.get(path).status_code == 404


def test_static_files_are_counted_by_their_mount(client):
    client.get("/ui/app.js")
    client.get("/docs/assets/swagger-ui.css")
    metrics = client.get("/metrics").text
    assert 'route="/ui/{path}",status="200"' in metrics and 'route="/docs/assets/{path}",status="200"' in metrics


# ------------------------------------------------------------------------------------- a real browser


def dump_dom(require_real, profile: Path, url: str) -> str:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    require_real(chromium is not None, "headless Chromium is not installed (Debian: apt-get install chromium)")
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        # no host but the service's resolves: a CDN reference fails here even on a machine with a network
        "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
        "--virtual-time-budget=5000",
        "--dump-dom",
        url,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


class _Elements(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.elements: list[dict[str, str]] = []

    def handle_starttag(self, tag, attrs) -> None:
        self.elements.append({"tag": tag, **{k: v or "" for k, v in attrs}})


def elements(html: str) -> list[dict[str, str]]:
    parsed = _Elements()
    parsed.feed(html)
    parsed.close()
    return parsed.elements


def test_swagger_ui_renders_the_operations_offline(server, tmp_path, require_real):
    dom = elements(dump_dom(require_real, tmp_path / "profile", server + "/docs"))
    blocks = [e for e in dom if "opblock" in e.get("class", "").split()]
    paths = {e["data-path"] for e in dom if "opblock-summary-path" in e.get("class", "").split()}
    assert blocks, "Swagger UI rendered no operation"
    assert {"/api/v1/ab", "/api/v1/ab/{ab_id}", "/api/v1/alerts"} <= paths, sorted(paths)
    spec = httpx.get(server + "/openapi.json").json()
    assert len(blocks) == sum(len(operations) for operations in spec["paths"].values()), "one block an operation"


def test_redoc_renders_the_operations_offline(server, tmp_path, require_real):
    dom = elements(dump_dom(require_real, tmp_path / "profile", server + "/redoc"))
    sections = {e["data-section-id"] for e in dom if e.get("data-section-id", "").startswith("operation/")}
    operations = httpx.get(server + "/openapi.json").json()["paths"]["/api/v1/ab"].values()
    assert {f"operation/{operation['operationId']}" for operation in operations} <= sections, sorted(sections)
