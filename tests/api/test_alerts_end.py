"""An A/B's alerts end with it, however it ends: run to the end, stopped part way, or deleted after. The service's
alerts are resolved in /api/v1/alerts, and what the service forwards to a real Alertmanager (Debian
prometheus-alertmanager on 127.0.0.1, the shipped alertmanager.yml, receivers pointed at a webhook here) ends too:
every alert's last post carries an endsAt that has passed, no post after it pushes endsAt forward again, and
Alertmanager holds no active alert of the A/B. Every post the service makes is recorded on its way to Alertmanager
(`Recorder`, a forwarding proxy), with when it arrived."""

from __future__ import annotations

import json
import threading
import time
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
import yaml
from support.realservers import (
    HOST,
    TOKEN,
    Service,
    Webhook,
    shipped_alertmanager_config,
    start_alertmanager,
    wait_for,
)

from kvscope.api.alertmanager import payload
from kvscope.api.alerts import COLLAPSE, PREDICTED, AlertBook

ROOT = Path(__file__).resolve().parents[2]
LONG_OUTPUT = yaml.safe_load((ROOT / "examples" / "long_output.yaml").read_text())
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RESEND_S = 0.2  # the service re-sends active alerts this often here (30 s by default)


class Recorder:
    """A proxy on a free port of 127.0.0.1 in front of Alertmanager: every POST is kept in `posts` as (when it
    arrived, path, JSON body), then forwarded, and Alertmanager's answer returned."""

    def __init__(self, upstream: str) -> None:
        self.posts: list[tuple[float, str, list[dict]]] = []
        posts, client = self.posts, httpx.Client(base_url=upstream, timeout=5)

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                posts.append((time.time(), self.path, json.loads(body)))
                answer = client.post(self.path, content=body, headers={"Content-Type": "application/json"})
                self.send_response(answer.status_code)
                self.send_header("Content-Length", str(len(answer.content)))
                self.end_headers()
                self.wfile.write(answer.content)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer((HOST, 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://{HOST}:{self.server.server_port}"
        self._client = client

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._client.close()

    def of(self, ab: str) -> dict[tuple, list[tuple[float, float]]]:
        """The alerts of A/B `ab` that were posted, by (alertname, arm): (arrived, endsAt) of each post, in order."""
        found: dict[tuple, list[tuple[float, float]]] = {}
        for arrived, _, alerts in list(self.posts):
            for alert in alerts:
                labels = alert["labels"]
                if labels.get("ab") == ab:
                    ends = datetime.fromisoformat(alert["endsAt"]).timestamp()
                    found.setdefault((labels["alertname"], labels["arm"]), []).append((arrived, ends))
        return found


@pytest.fixture
def stack(tmp_path, real_binary):
    """A real Alertmanager with the shipped routes (receivers: `hook`), the recording proxy in front of it, and the
    service forwarding its alerts to the proxy every RESEND_S."""
    binary = real_binary("alertmanager")
    hook = Webhook()
    config = tmp_path / "alertmanager.yml"
    config.write_text(yaml.safe_dump(shipped_alertmanager_config(hook)))
    alertmanager = start_alertmanager(binary, config, tmp_path / "am-data", tmp_path / "alertmanager.log")
    recorder = service = None
    try:
        alertmanager.wait_ready("Alertmanager", 20)
        recorder = Recorder(alertmanager.url)
        service = Service(tmp_path, alertmanager_url=recorder.url, alert_resend_s=RESEND_S)
        yield service, recorder, alertmanager.url, hook
    finally:
        if service is not None:
            service.stop()
        if recorder is not None:
            recorder.stop()
        alertmanager.stop()
        hook.stop()


def start(service: Service, rounds_per_minute: float | None = None) -> str:
    started = service.client.post(
        "/api/v1/ab", json={"scenario": LONG_OUTPUT, "rounds_per_minute": rounds_per_minute}, headers=AUTH
    )
    assert started.status_code == 201, started.text
    return started.json()["id"]


def ended(service: Service, ab: str) -> dict:
    return wait_for(
        lambda: (t := service.client.get(f"/api/v1/ab/{ab}").json())["status"] != "running" and t, f"{ab} to end", 60
    )


def collapse_firing(service: Service, ab: str) -> dict | None:
    for alert in service.client.get("/api/v1/alerts", params={"state": "firing"}).json():
        if alert["name"] == COLLAPSE and alert["labels"].get("ab") == ab and alert["labels"]["arm"] == "dram_only":
            return alert
    return None


def assert_ended(service: Service, recorder: Recorder, alertmanager: str, ab: str) -> dict[str, dict]:
    """Every alert of `ab` is resolved in the service, its last post (after a few resend periods more) ended at its
    resolution, in the past, with no later post pushing endsAt forward; Alertmanager holds none of them active.
    Returns the service's alerts of `ab` by name and arm."""
    ours = {
        f"{a['name']}/{a['labels']['arm']}": a
        for a in service.client.get("/api/v1/alerts").json()
        if a["labels"].get("ab") == ab
    }
    assert ours and {a["state"] for a in ours.values()} == {"resolved"}, ours
    time.sleep(5 * RESEND_S)  # time for the forwarder to post again: it must not revive them
    now = time.time()
    posted = recorder.of(ab)
    assert {f"{name}/{arm}" for name, arm in posted} == {k for k, a in ours.items() if a["fired_at"]}
    for (name, arm), posts in posted.items():
        resolved_at = ours[f"{name}/{arm}"]["resolved_at"]
        final = [i for i, (arrived, ends) in enumerate(posts) if ends <= arrived]
        assert final, f"{name}/{arm} was never posted as ended: {posts}"
        after = posts[final[0] :]
        assert all(ends == pytest.approx(resolved_at, abs=1e-3) for _, ends in after), (name, arm, after)
        assert posts[-1][1] <= now
        assert len(after) >= 2, "the resolved alert is re-sent (a lost post must not leave it firing), unchanged"
    active = httpx.get(f"{alertmanager}/api/v2/alerts", params={"filter": f'ab="{ab}"'}).json()
    assert active == [], active
    return ours


def test_a_stopped_abs_collapse_resolves_and_is_not_re_sent_as_firing(stack):
    service, recorder, alertmanager, hook = stack
    ab = start(service, rounds_per_minute=300)  # a round every 0.2 s: the collapse comes in round 8 of 20
    fired = wait_for(lambda: collapse_firing(service, ab), "the dram_only arm's collapse to fire", 30)
    wait_for(lambda: [a for _, a in hook.firing(COLLAPSE) if a["labels"]["ab"] == ab], "the page", 20)

    stopped = service.client.delete(f"/api/v1/ab/{ab}", headers=AUTH)
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped", stopped.text
    assert stopped.json()["arms"]["dram_only"]["rounds_done"] < 20, "stopped part way"

    ours = assert_ended(service, recorder, alertmanager, ab)
    collapse = ours[f"{COLLAPSE}/dram_only"]
    assert collapse["fired_at"] == fired["fired_at"]
    assert collapse["resolved_at"] <= stopped.json()["ended_at"]
    assert ours[f"{PREDICTED}/dram_only"]["state"] == "resolved"
    assert service.client.get("/healthz").json()["alerts_active"] == 0

    def paged_resolved() -> list[dict]:
        return [
            a
            for n in hook.notifications
            if n["receiver"] == "kvscope-pager"
            for a in n["alerts"]
            if a["labels"].get("ab") == ab and a["labels"]["alertname"] == COLLAPSE and a["status"] == "resolved"
        ]

    (resolved, *_) = wait_for(paged_resolved, "the page's resolution at the receiver", 20)
    assert datetime.fromisoformat(resolved["endsAt"]).timestamp() == pytest.approx(collapse["resolved_at"], abs=1e-3)
    time.sleep(2)  # Alertmanager's group interval here is a second: nothing fires again after the resolution
    last = [n for n in hook.notifications if any(a["labels"].get("ab") == ab for a in n["alerts"])][-1]
    assert last["status"] == "resolved", last


def test_a_deleted_abs_alerts_stay_resolved(stack):
    service, recorder, alertmanager, _ = stack
    ab = start(service)
    assert ended(service, ab)["status"] == "finished"
    assert_ended(service, recorder, alertmanager, ab)
    posts_before = len(recorder.posts)

    deleted = service.client.delete(f"/api/v1/ab/{ab}", headers=AUTH)
    assert deleted.status_code == 200 and deleted.json()["id"] == ab, deleted.text
    assert service.client.get(f"/api/v1/ab/{ab}").status_code == 410
    ours = assert_ended(service, recorder, alertmanager, ab)
    assert ours[f"{COLLAPSE}/dram_only"]["fired_at"] is not None
    assert len(recorder.posts) > posts_before  # still re-sent as resolved, with the same endsAt


def test_after_many_abs_ended_every_way_none_of_their_alerts_is_active(stack):
    service, recorder, alertmanager, _ = stack
    ids = []
    for n in range(6):
        if n % 3 == 2:  # stopped once its collapse fired
            ab = start(service, rounds_per_minute=600)
            wait_for(lambda ab=ab: collapse_firing(service, ab), f"{ab}'s collapse to fire", 30)
            assert service.client.delete(f"/api/v1/ab/{ab}", headers=AUTH).json()["status"] == "stopped"
        else:
            ab = start(service)
        ids.append(ab)
    two_at_once = [start(service, rounds_per_minute=1200), start(service, rounds_per_minute=1200)]
    ids += two_at_once
    for ab in ids:
        ended(service, ab)
    deleted = service.client.delete(f"/api/v1/ab/{ids[0]}", headers=AUTH)
    assert deleted.status_code == 200, deleted.text

    assert service.client.get("/api/v1/alerts", params={"state": "firing"}).json() == []
    assert service.client.get("/api/v1/alerts", params={"state": "pending"}).json() == []
    assert service.client.get("/healthz").json()["alerts_active"] == 0
    for ab in ids:
        assert f"{COLLAPSE}/dram_only" in assert_ended(service, recorder, alertmanager, ab), ab
    assert httpx.get(f"{alertmanager}/api/v2/alerts", params={"active": "true"}).json() == []


def test_the_forwarder_reads_each_alert_as_of_one_moment():
    """What the book lists is a copy taken under its lock: the forwarder builds a post from it on its own thread
    while an A/B's thread resolves the alert, and a half-changed alert (resolved, resolved_at not yet stamped) would
    be posted as resolved with endsAt pushed forward."""
    book = AlertBook()
    labels = {"ab": "ab-1", "arm": "dram_only", "tier": "dram"}
    book.set(COLLAPSE, labels, "firing", "round 8: hit ratio 0.69 < 0.99 x its ideal 0.89")
    (listed,) = book.list()
    book.end(ab="ab-1")
    assert (listed.state, listed.resolved_at) == ("firing", None)  # as it was listed
    (resolved,) = book.list()
    assert resolved.state == "resolved" and resolved.resolved_at is not None
    post = payload(resolved, now=resolved.resolved_at + 60, resend_s=30, generator_url="")
    assert datetime.fromisoformat(post["endsAt"]).timestamp() == pytest.approx(resolved.resolved_at, abs=1e-3)
