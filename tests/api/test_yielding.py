"""A/B threads yield to the service's requests: an arm pauses after each request it serves, a pause waits for the
requests in flight (bounded), the A/B threads share one slice of work, the middleware counts every request in and
out, and an A/B ends even while the service is never idle."""

from __future__ import annotations

import threading
import time

from fastapi.testclient import TestClient
from support.realservers import wait_for
from support.scenarios import SMALL

from kvscope.api.yielding import InFlight, YieldToRequests
from kvscope.tierstore.ab import make_arm
from kvscope.tierstore.planner import plan
from kvscope.tierstore.scenario import Scenario

AUTH = {"Authorization": "Bearer test-token"}


def test_an_arm_pauses_after_each_request_it_serves():
    scenario = Scenario.model_validate(SMALL)
    pauses = []
    arm = make_arm(scenario, "a", plan(scenario), pause=lambda: pauses.append(1))
    try:
        while arm.step() is not None:
            pass
    finally:
        arm.close()
    assert len(pauses) == sum(row["requests"] for row in arm.rows) == 4 * 6


def test_a_pause_waits_for_the_requests_in_flight_at_most_max_wait():
    requests = InFlight()
    pause = YieldToRequests(requests, slice_s=0.0, max_wait_s=0.05)
    started = time.perf_counter()
    pause()
    assert time.perf_counter() - started < 0.01, "an idle service is not waited for"

    requests.started()
    started = time.perf_counter()
    pause()
    assert 0.05 <= time.perf_counter() - started < 1, "a request in flight is waited for, up to max_wait_s"

    requests.started()
    requests.ended()
    assert not requests.idle.is_set(), "one of two still in flight"
    requests.ended()
    assert requests.idle.is_set() and requests.count == 0


def test_a_pause_within_the_slice_does_not_wait():
    requests = InFlight()
    requests.started()
    pause = YieldToRequests(requests, slice_s=60.0, max_wait_s=5.0)
    started = time.perf_counter()
    for _ in range(1000):
        pause()
    assert time.perf_counter() - started < 1


def test_the_slice_is_shared_by_every_ab_thread():
    """A thread that did no work still waits once the slice, which other A/B threads used, has passed; the wait
    starts a new slice for all of them."""
    requests = InFlight()
    requests.started()
    pause = YieldToRequests(requests, slice_s=0.2, max_wait_s=0.05)
    time.sleep(0.25)  # another A/B thread's work
    waited = []

    def other_thread() -> None:
        started = time.perf_counter()
        pause()
        waited.append(time.perf_counter() - started)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    started = time.perf_counter()
    pause()
    assert waited[0] >= 0.05 and time.perf_counter() - started < 0.05


def test_the_middleware_counts_every_request_in_and_out(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path, max_body_bytes=4096)) as client:
        requests = client.app.state.services.ab.yield_to_requests.requests
        assert client.get("/healthz").status_code == 200
        assert client.get("/api/v1/ab/ab-999").status_code == 404
        assert client.post("/api/v1/predict", content=b"x" * 5000).status_code == 413
        assert client.get("/api/v1/runs/1/samples").status_code == 422
        assert requests.count == 0 and requests.idle.is_set()


def test_an_ab_ends_while_the_service_is_never_idle(app_factory, tmp_path):
    with TestClient(app_factory(tmp_path)) as client:
        requests = client.app.state.services.ab.yield_to_requests.requests
        requests.started()  # a request that stays in flight: every pause waits its longest
        try:
            ab_id = client.post("/api/v1/ab", json={"scenario": SMALL}, headers=AUTH).json()["id"]
            ended = wait_for(
                lambda: (t := client.get(f"/api/v1/ab/{ab_id}").json())["status"] != "running" and t, "the A/B", 60
            )
        finally:
            requests.ended()
    assert ended["status"] == "finished" and len(ended["arms"]["a"]["rows"]) == 6
