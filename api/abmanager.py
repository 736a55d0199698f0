"""Live A/B tests on the embedded store: each in a background thread, its arms interleaved round by round.

Every arm's engine is published (so the service's exporter endpoint and Prometheus see it live) and recorded
through the exporters into the verifier database as run `<ab id>/<arm>`, one commit per round. Rounds can be
paced in wall-clock time so people can watch. When every arm has finished, the criteria run and their verdicts
attach to the test; a stopped test keeps everything recorded up to its last round.
"""

from __future__ import annotations

import itertools
import re
import threading
import time
import traceback
from pathlib import Path

from kvscope.api.abhistory import ABHistory, ABTest, ArmState, Deletion
from kvscope.api.alerts import PREDICTED, AlertBook, ArmWatch, evaluate_round
from kvscope.api.scenarios import real_bytes
from kvscope.api.yielding import InFlight, YieldToRequests
from kvscope.tierstore.ab import ArmRun, followed_arm, followers, make_arm, observed_collapse_round
from kvscope.tierstore.live import ENGINES
from kvscope.tierstore.planner import Plan, plan
from kvscope.tierstore.scenario import ArmSpec, Scenario
from kvscope.verifier.criteria import CriteriaError, CriteriaFile, load_criteria
from kvscope.verifier.db import Database
from kvscope.verifier.evidence import Verification
from kvscope.verifier.recorder import ABRecorder


class Busy(RuntimeError):
    """The service runs as many A/Bs of this kind as it allows; the message says how many."""


_ABSOLUTE_PATH = re.compile(r"(?<![\w.~-])(?:/[\w.@+-]+)+/?")
_PYDANTIC_DETAIL = re.compile(r"\s*\[type=[^\]]*\]|\s*For further information visit \S+")


def public_error(error: Exception) -> str:
    """What an A/B's `error` says of its failure: the exception's kind and message, without the server's paths (a
    path shows as its last part) or pydantic's internals (input values, documentation links). The whole trace is
    in the service's log."""
    message = _ABSOLUTE_PATH.sub(lambda path: ".../" + path.group(0).rstrip("/").rsplit("/", 1)[-1], str(error))
    return f"{type(error).__name__}: {_PYDANTIC_DETAIL.sub('', message)}"


def _uses_real_store(scenario: Scenario) -> bool:
    """Whether an arm is served by real processes (a Mooncake store, a vLLM engine)."""
    return any(scenario.served_apart(name) for name in scenario.arms)


class ABManager:
    def __init__(
        self,
        db: Database,
        alerts: AlertBook,
        workdir: Path,
        criteria_files: list[Path] | None = None,
        retain_s: float = 300.0,
        max_real_store: int = 1,
        max_running: int = 8,
        max_real_bytes: int = 4 * 1024**3,
        requests: InFlight | None = None,
    ) -> None:
        self.db, self.alerts, self.workdir = db, alerts, workdir
        self.max_real_store = max_real_store  # A/Bs with real-store arms at once: each starts processes
        self.max_running = max_running  # A/Bs at once: each is a thread and its engines' memory
        self.max_real_bytes = max_real_bytes  # memory and file tiers of the running A/Bs, together
        self.retain_s = retain_s  # a finished test's engines stay exported this long, then are withdrawn
        self.yield_to_requests = YieldToRequests(requests or InFlight())  # one slice of A/B work for every test
        self._withdrawals: list[threading.Timer] = []
        # bad files fail at start-up; a test binds their params again for its own store (see _criteria_for)
        self.criteria = {path: load_criteria(path) for path in criteria_files or []}
        self.history = ABHistory()
        self._tests = {test.id: test for test in self.history.load(db)}
        for test in self._tests.values():
            if test.status == "running":  # the service that ran it stopped without ending it
                self.history.interrupt(db, test)
        self.history.finish_deletions(db)
        self._lock = threading.Lock()
        self._ids = itertools.count(self._first_free_id())

    def _first_free_id(self) -> int:
        """A/B ids continue after every test and run already in the database (deleted tests included), so a
        restarted service never reuses one."""
        runs = [run.name.split("/", 1)[0] for run in self.db.runs() if run.origin == "ab" and "/" in run.name]
        taken = runs + self.history.taken_ids(self.db)
        numbers = [int(name[3:]) for name in taken if name.startswith("ab-") and name[3:].isdigit()]
        return max(numbers, default=0) + 1

    def start(self, scenario: Scenario, rounds_per_minute: float | None = None) -> ABTest:
        """Plan the test, record its arms' round 0, and run the rest in a background thread."""
        the_plan = plan(scenario)
        with self._lock:
            running = [t for t in self._tests.values() if t.status == "running"]
            if len(running) >= self.max_running:
                raise Busy(
                    f"{len(running)} A/B tests already running (the service runs {self.max_running} at a time); "
                    "try again when one has ended"
                )
            held = sum(real_bytes(t.scenario) for t in running)
            if held + real_bytes(scenario) > self.max_real_bytes:
                raise Busy(
                    f"the running A/B tests hold {held:,} B in memory and file tiers and this one would add "
                    f"{real_bytes(scenario):,} B: more than the service holds at once ({self.max_real_bytes:,} B)"
                )
            if _uses_real_store(scenario):
                real = sum(1 for t in running if _uses_real_store(t.scenario))
                if real >= self.max_real_store:
                    raise Busy(
                        f"{real} A/B test(s) with real-store arms already running (the service runs "
                        f"{self.max_real_store} at a time); try again when it has ended"
                    )
            test = ABTest(f"ab-{next(self._ids)}", scenario, rounds_per_minute, len(the_plan.rounds))
            self._tests[test.id] = test
        for name, arm in scenario.runnable_arms.items():
            test.arms[name] = ArmState(f"{test.id}/{name}", the_plan.arm_json(name), _store_of(name, arm, scenario),
                                       _engine_of(name, scenario), _layout(arm), arm.placement)  # fmt: skip
        with self.db.cursor() as db:
            self.history.insert(db, test)
        test.thread = threading.Thread(target=self._run, args=(test, the_plan), name=test.id, daemon=True)
        test.thread.start()
        return test

    def get(self, test_id: str) -> ABTest | None:
        return self._tests.get(test_id)

    def list(self) -> list[ABTest]:
        with self._lock:
            return list(self._tests.values())

    def rows(
        self, db: Database, test: ABTest, since_round: int = -1, until_round: int = 2**31 - 1
    ) -> dict[str, list[dict]]:
        """Each arm's rows of rounds after `since_round` up to `until_round`: a running test's from memory, an
        ended one's from the database (an ended test keeps none in memory)."""
        if test.status == "running":
            held = {
                name: [row for row in arm.rows if since_round < row["round"] <= until_round]
                for name, arm in test.arms.items()
            }
            if test.status == "running":  # still: its rows were not dropped meanwhile (they are once it has ended)
                return held
        stored = self.history.rows(db, test.id, since_round, until_round)
        return {name: stored.get(name, []) for name in test.arms}

    def deleted(self, db: Database, test_id: str) -> float | None:
        """When test `test_id` was deleted, if it was."""
        return self.history.deleted(db, test_id)

    def delete(self, db: Database, test_id: str) -> Deletion | None:
        """Delete an ended test: its record, its rows, its alerts, its engines on /metrics, and its runs that no
        verdict was judged on (a verdict's evidence stays re-checkable). None if there is no ended test `test_id`."""
        with self._lock:
            test = self._tests.get(test_id)
            if test is None or test.status == "running":
                return None
            del self._tests[test_id]
        self.alerts.end(ab=test_id)
        for arm in test.arms:
            ENGINES.withdraw(f"{test_id}/{arm}")
        return self.history.delete(db, test)

    def stop(self, test_id: str, timeout_s: float = 30.0) -> ABTest | None:
        """Ask the test to stop after the round in progress, and wait for it to close its runs."""
        test = self._tests.get(test_id)
        if test is None:
            return None
        test.stop.set()
        if test.thread:
            test.thread.join(timeout_s)
        return test

    def shutdown(self) -> None:
        for test in self.list():
            self.stop(test.id)
        for timer in self._withdrawals:
            timer.cancel()

    def _withdraw_later(self, test: ABTest) -> None:
        """Keep the ended test's engines on /metrics for `retain_s` (Prometheus scrapes their final values), then
        withdraw them so a long-running service does not hold every past store; the database keeps the record."""
        names = [f"{test.id}/{arm}" for arm in test.arms]
        timer = threading.Timer(self.retain_s, lambda: [ENGINES.withdraw(name) for name in names])
        timer.daemon = True
        self._withdrawals = [t for t in self._withdrawals if t.is_alive()] + [timer]
        timer.start()

    # ------------------------------------------------------------------------------------------------ worker

    def _run(self, test: ABTest, the_plan: Plan) -> None:
        db = self.db.cursor()
        arms: dict[str, ArmRun] = {}
        recorder = None
        try:
            recorder = ABRecorder(db, test.scenario, prefix=f"{test.id}/", store_names=lambda arm: f"{test.id}/{arm}")
            workdir = self.workdir / test.id  # the arms' file-backed tiers, `<arm>-<tier>.blocks`
            workdir.mkdir(parents=True, exist_ok=True)
            for name in test.scenario.runnable_arms:
                if followed_arm(test.scenario, name) is None:  # a follower starts when its real arm is done
                    arms[name] = make_arm(
                        test.scenario, name, the_plan, workdir, f"{test.id}/{name}", pause=self.yield_to_requests
                    )
                    recorder.arm_started(arms[name])
            self._predicted(test, the_plan, firing=True)
            self._serve(db, test, the_plan, arms, recorder)
        except Exception as error:  # a failed test reports why; the service keeps running (and logs the trace)
            test.status, test.error = "failed", public_error(error)
            traceback.print_exc()
        finally:
            if recorder:
                recorder.finish()
            for arm in arms.values():
                arm.close()
            self._predicted(test, the_plan, firing=False)
            self.alerts.end(ab=test.id)  # a collapse of an A/B that ended is over: it resolves, it does not page on
            test.ended_at = time.time()
            self._withdraw_later(test)
        if test.status == "running" and not test.stop.is_set():
            test.verdicts = self._judge(db, test)  # before the status says finished: a poller sees both at once
        if test.status == "running":
            test.status = "stopped" if test.stop.is_set() else "finished"
        self.history.update(db, test)
        for arm in test.arms.values():  # the database has the rows now
            arm.rows = []
        db.con.close()

    def _serve(self, db: Database, test: ABTest, the_plan: Plan, arms: dict[str, ArmRun], recorder: ABRecorder) -> None:
        """Step the arms round by round, pausing for the service's requests between the steps (and the arms between
        their requests); a mirror that follows a real arm (kvscope.tierstore.ab.followed_arm) joins, into `arms`,
        once that arm is done."""
        pause = 60.0 / test.rounds_per_minute if test.rounds_per_minute else 0.0
        scenario = test.scenario
        watches = {name: ArmWatch() for name in scenario.runnable_arms}
        following = followers(scenario)
        tolerance = scenario.prediction.collapse_tolerance
        active = dict(arms)
        while active and not test.stop.is_set():
            for name, arm in list(active.items()):
                self.yield_to_requests()
                row = arm.step()
                if row is None:
                    del active[name]
                    arm.finish()
                    recorder.arm_ended(arm)
                    if mirror := following.get(name):
                        follower = make_arm(scenario, mirror, the_plan, self.workdir / test.id, f"{test.id}/{mirror}",
                                            arm.rows, self.yield_to_requests)  # fmt: skip
                        arms[mirror] = active[mirror] = follower
                        recorder.arm_started(arms[mirror])
                    continue
                self.yield_to_requests()
                recorder.round_done(arm, row)
                state = test.arms[name]
                state.rows.append(row)
                state.rounds_done = len(state.rows)
                state.observed_collapse_round = observed_collapse_round(state.rows, tolerance)
                self.yield_to_requests()
                self.history.add_row(db, test, name, row)
                top = arm.spec.tiers[0]
                labels = {"ab": test.id, "arm": name, "scenario": test.scenario.name, "tier": top.name}
                evaluate_round(self.alerts, labels, watches[name], row, top.name, top.capacity, 1 - tolerance)
            if active and pause:
                test.stop.wait(pause)

    def _predicted(self, test: ABTest, the_plan: Plan, firing: bool) -> None:
        for name, prediction in the_plan.arms.items():
            if prediction.collapse_round is None:
                continue
            labels = {"ab": test.id, "arm": name, "scenario": test.scenario.name}
            summary = f"the planner predicts arm {name} collapses at round {prediction.collapse_round}"
            self.alerts.set(
                PREDICTED,
                labels,
                "firing" if firing else None,
                summary,
                value=float(prediction.collapse_round),
                description=" ".join(prediction.explanation),
            )

    def _judge(self, db: Database, test: ABTest) -> list[dict]:
        """Verdicts of the criteria whose roles are all arms of this test: no_collapse per arm, plus the
        configured files (e.g. criteria/media.yaml when the arms are dram_only and tiered)."""
        files = [(_no_collapse_per_arm(test), None), *self._criteria_for(test)]
        verdicts = []
        for spec, path in files:
            runs = spec.bind(db, [test.arms[role].run for role in spec.runs])
            verification = Verification(db, spec, runs, path)
            for criterion in spec.criteria:
                try:
                    verdict = verification.judge(criterion)
                except CriteriaError as error:
                    unjudged = {"criterion": criterion.name, "kind": criterion.kind, "passed": None}
                    verdicts.append({**unjudged, "description": criterion.description, "error": str(error)})
                    continue
                verdicts.append(
                    {
                        "verdict_id": verdict.verdict_id,
                        "criterion": verdict.criterion,
                        "kind": criterion.kind,
                        "passed": verdict.passed,
                        "description": criterion.description,
                        "summary": verdict.summary,
                        "threshold": verdict.document["threshold"],
                        "digest": verdict.digest,
                    }
                )
            verification.finish()
        return verdicts

    def _criteria_for(self, test: ABTest) -> list[tuple[CriteriaFile, Path]]:
        """The configured files whose roles are all arms of the test; on real Mooncake arms the lower tier a file
        names by `lower_tier` is Mooncake's SSD tier, which offloads part of the puts (`lower_tier_scope`)."""
        real = any(arm.store == "mooncake" for arm in test.scenario.arms.values())
        chosen = []
        for path, spec in self.criteria.items():
            if not set(spec.runs) <= set(test.arms):
                continue
            mooncake = {name: value for name, value in MOONCAKE_LOWER_TIER.items() if name in spec.params}
            chosen.append((load_criteria(path, mooncake) if real and mooncake else spec, path))
        return chosen


MOONCAKE_LOWER_TIER = {"lower_tier": "ssd", "lower_tier_scope": "group"}  # criteria params for a real Mooncake arm


def _store_of(name: str, arm: ArmSpec, scenario: Scenario) -> str:
    if not arm.tiers:
        return "none"
    return arm.store if name in scenario.arms else f"embedded (mirror of {name.removesuffix('_sim')})"


def _layout(arm: ArmSpec) -> list[dict]:
    """The arm's tiers, top first, then those attached to its cluster but outside its store's path."""
    fields = {"name", "capacity", "policy", "backend", "read_bandwidth"}
    return [
        {**tier.model_dump(mode="json", include=fields), "attached": attached}
        for tiers, attached in ((arm.tiers, False), (arm.attached, True))
        for tier in tiers
    ]


def _engine_of(name: str, scenario: Scenario) -> str:
    if scenario.engine.kind != "vllm":
        return "emulator"
    return "vllm" if name in scenario.arms else "emulator (vLLM's prefix cache modelled)"


def _no_collapse_per_arm(test: ABTest) -> CriteriaFile:
    fraction = 1 - test.scenario.prediction.collapse_tolerance
    return CriteriaFile.model_validate(
        {
            "runs": list(test.arms),
            "criteria": [
                {
                    "name": f"{arm}_no_collapse",
                    "kind": "no_collapse",
                    "description": f"arm {arm}'s hit ratio stays at or above {fraction:g} x its ideal in every round",
                    "run": arm,
                    "fraction": fraction,
                }
                for arm in test.arms
            ],
        }
    )
