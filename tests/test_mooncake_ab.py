"""A/B arms on a real Mooncake store (`store: mooncake`), end to end: the shipped examples through `kvscope ab run`,
the media criteria on the recorded Mooncake metrics, and what a killed kvscope leaves behind.

Needs the real Mooncake (PyPI mooncake-transfer-engine-non-cuda, Debian libibverbs1): skipped without it, failed
under KVSCOPE_REQUIRE_REAL=1. The examples' arms run at the same time, each for about 20 s (160 requests 0.1 s apart).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.criteria import MEDIA_CRITERIA
from support.misses import assert_causes_follow
from support.proctree import alive, cmdline, descendants
from typer.testing import CliRunner, Result

from kvscope.cli import app
from kvscope.processes import HOST, ProcessError, listening_sockets, port_listens
from kvscope.tierstore.mooncake import MooncakeArm, MooncakeStore, mooncake_missing
from kvscope.tierstore.scenario import load_scenario

EXAMPLES = Path(__file__).parents[1] / "examples"
CRITERIA = Path(__file__).parents[1] / "criteria" / "media.yaml"
# The Mooncake 0.3.13 store client binds these on every interface, whatever its settings (kvscope's README):
# its transfer engine's TCP listener and handshake port, its RPC service and its HTTP /metrics server.
CLIENT_WILDCARD_LISTENERS = 4


@pytest.fixture
def real_mooncake(require_real):
    missing = mooncake_missing()
    require_real(missing is None, missing or "")


def _ab_run(*args: str) -> Result:
    result = CliRunner().invoke(app, ["ab", "run", *args])
    assert result.exit_code == 0, result.output
    return result


def _arm_directories() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("kvscope-mooncake-*"))


def test_collapse_example_on_real_mooncake(real_mooncake, tmp_path):
    """The DRAM-only arm collapses at the planner's round and ends near 0; the SSD arm stays at its ideal; the only
    errors are retried transient ones; every process kvscope started binds loopback but the client's known ones;
    nothing of the arms is left on disk."""
    out = tmp_path / "result.json"
    before = _arm_directories()
    _ab_run(str(EXAMPLES / "mooncake_dram_vs_ssd.yaml"), "--json", str(out))
    assert _arm_directories() <= before  # SSD files, logs: removed with each arm
    result = json.loads(out.read_text())
    schema = json.loads((Path(__file__).parents[1] / "tierstore" / "ab_result.schema.json").read_text())
    jsonschema.validate(result, schema)  # the same contract as an embedded A/B
    dram_only, tiered = result["arms"]["dram_only"], result["arms"]["tiered"]

    predicted = dram_only["prediction"]["collapse_round"]
    assert predicted is not None
    assert abs(dram_only["observed_collapse_round"] - predicted) <= 1, dram_only["observed_collapse_round"]
    assert dram_only["rounds"][-1]["hit_ratio"] < 0.1
    for row in tiered["rounds"]:
        assert abs(row["hit_ratio"] - row["ideal_hit_ratio"]) <= 0.02, row
    assert tiered["observed_collapse_round"] is None

    for name in ("dram_only", "tiered"):
        store = result["arms"][name]["store"]
        assert store["kind"] == "mooncake"
        assert store["not_admitted"] == 0, store
        assert set(store["codes"]) <= {"put -200 NO_AVAILABLE_HANDLE"}, store["codes"]  # retried, then admitted
        listening = store["listening"]
        assert all(address.startswith("127.0.0.1:") for address in listening["mooncake_master"])
        assert all(address.startswith("127.0.0.1:") for address in listening["mooncake metadata server"])
        wildcard = [a for a in listening["mooncake store client"] if not a.startswith("127.0.0.1:")]
        assert len(wildcard) <= CLIENT_WILDCARD_LISTENERS, listening
        assert all(peak and peak > 0 for peak in store["peak_rss_bytes"].values()), store["peak_rss_bytes"]
    # Bytes really reached both media of the tiered arm, and the DRAM-only arm evicted
    assert tiered["totals"]["written_bytes"]["ssd"] > 0
    assert tiered["totals"]["tiers"]["ssd"]["read_bytes"] > 0  # gets served from the SSD tier
    assert dram_only["totals"]["evictions"]["dram"] > 0
    # The embedded store's model of each arm runs beside it, on the same requests, and agrees with it every round
    assert result["arms"]["dram_only_sim"]["mirror_of"] == "dram_only"
    assert result["arms"]["dram_only_sim"]["store"] == {"kind": "embedded"}
    for name in ("dram_only", "tiered"):
        real, mirror = result["arms"][name]["rounds"], result["arms"][f"{name}_sim"]["rounds"]
        assert [r["query_tokens"] for r in mirror] == [r["query_tokens"] for r in real]
        assert max(abs(a["hit_ratio"] - b["hit_ratio"]) for a, b in zip(real, mirror, strict=True)) <= 0.05, name
        assert_causes_follow(real, mirror, 0.05)  # the misses explained from Mooncake's answers, as the model does
    # the DRAM-only collapse is evictions (Mooncake evicts whole chains by lease age), never a refused put
    lost = [row["miss_causes"] for row in dram_only["rounds"][predicted - 1 :]]
    assert all(causes["evicted_by_tier"].get("dram", 0) > causes["cold"] for causes in lost), lost
    assert not any(causes["not_admitted"] for causes in lost)


def test_media_criteria_pass_on_real_mooncake_metrics_and_catch_a_planted_write(real_mooncake, tmp_path):
    """The parity example's recorded Mooncake series pass every media criterion (lower tier bound to ssd) and
    no_collapse per arm; an arm that wrote its SSD tier, bound as the DRAM-only one, fails nof_delta_zero."""
    scenario = yaml.safe_load((EXAMPLES / "mooncake_media_parity.yaml").read_text())
    planted = {**scenario["arms"]["tiered"]}  # configured as DRAM-only should be, but its SSD is in the write path
    scenario["arms"]["planted"] = planted
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(scenario))
    db = tmp_path / "runs.duckdb"
    _ab_run(str(path), "--db", str(db))
    name = scenario["name"]
    runner = CliRunner()

    def verify(
        criteria: Path,
        *runs: str,
        params: tuple[str, ...] = ("--param", "lower_tier=ssd", "--param", "lower_tier_scope=group"),
    ):
        arguments = ["verify", "--db", str(db), "--criteria", str(criteria), *params]
        for run in runs:
            arguments += ["--run", f"{name}/{run}"]
        return runner.invoke(app, [*arguments, "--json", str(tmp_path / "verdicts.json")])

    passed = verify(CRITERIA, "dram_only", "tiered")
    assert passed.exit_code == 0, passed.output
    verdicts = json.loads((tmp_path / "verdicts.json").read_text())["verdicts"]
    documents = {v["document"]["criterion"]["name"]: v["document"] for v in verdicts}
    assert set(documents) == MEDIA_CRITERIA
    delta = documents["nof_delta_zero"]["observed"]
    assert [row["delta"] for row in delta] == [0] and delta[0]["labels"]["tier"] == "ssd"
    assert delta[0]["target"].startswith("mooncake-master-")  # the master's file-tier allocation, a real series
    written = {row["tier"]: row["written"] for row in documents["both_tiers_written"]["observed"]}
    assert written["dram"] > 0 and written["ssd"] > 0

    no_collapse = tmp_path / "no_collapse.yaml"
    no_collapse.write_text(
        yaml.safe_dump(
            {
                "runs": ["a", "b"],
                "criteria": [{"name": f"{r}_no_collapse", "kind": "no_collapse", "run": r} for r in ("a", "b")],
            }
        )
    )
    assert verify(no_collapse, "dram_only", "tiered", params=()).exit_code == 0

    # Bound as the DRAM-only run, the planted arm is refused by its arm label; a forger who labelled it dram_only
    # (here: the criteria without their arm labels) is caught by what it wrote
    refused = verify(CRITERIA, "planted", "tiered")
    assert refused.exit_code == 2 and "is of arm 'planted'" in " ".join(refused.output.split())
    unlabelled = tmp_path / "media_without_arms.yaml"
    unlabelled.write_text(
        yaml.safe_dump({k: v for k, v in yaml.safe_load(CRITERIA.read_text()).items() if k != "arms"})
    )
    caught = verify(unlabelled, "planted", "tiered")
    assert caught.exit_code == 1, caught.output
    verdicts = json.loads((tmp_path / "verdicts.json").read_text())["verdicts"]
    outcome = {v["document"]["criterion"]["name"]: v["document"]["passed"] for v in verdicts}
    assert outcome == {
        "save_parity": True,
        "load_parity": True,
        "nof_delta_zero": False,
        "both_tiers_written": True,
        "prompt_tokens_conserved": True,
    }

    # Unbound, the lower tier is the published nof: this Mooncake has no NoF segment, its tiered arm wrote none
    unbound = verify(CRITERIA, "dram_only", "tiered", params=())
    assert unbound.exit_code == 1, unbound.output
    verdicts = json.loads((tmp_path / "verdicts.json").read_text())["verdicts"]
    written = next(v["document"] for v in verdicts if v["document"]["criterion"]["name"] == "both_tiers_written")
    assert {row["tier"]: row["passed"] for row in written["observed"]} == {"dram": True, "nof": False}


def test_sigkill_of_ab_run_leaves_no_mooncake_process_and_no_port(real_mooncake, tmp_path):
    """kvscope killed with SIGKILL mid-run: the kernel kills every Mooncake process it started (parent-death
    signal), and nothing they listened on still listens."""
    script = Path(sys.executable).with_name("kvscope")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from kvscope.cli import app; app()"]
    command += ["ab", "run", str(EXAMPLES / "mooncake_dram_vs_ssd.yaml")]
    kvscope = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 60
        processes: dict[int, list] = {}
        while time.monotonic() < deadline:  # both arms up: 2 x (metadata server, master, client)
            processes = {pid: listening_sockets(pid) for pid in descendants(kvscope.pid)}
            masters = [pid for pid in processes if b"mooncake_master" in cmdline(pid)]
            if len(masters) == 2 and sum(1 for sockets in processes.values() if sockets) >= 6:
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"the arms' processes did not come up: {processes}")
        time.sleep(2)  # mid-run: requests are being served
        ports = {listener.port for sockets in processes.values() for listener in sockets}
        kvscope.send_signal(signal.SIGKILL)
        kvscope.wait(10)
        deadline = time.monotonic() + 15  # a killed process's threads exit (and close its sockets) one by one
        while time.monotonic() < deadline and (
            any(alive(pid) for pid in processes) or any(port_listens(port) for port in ports)
        ):
            time.sleep(0.1)
        assert not [pid for pid in processes if alive(pid)], "processes outlived kvscope"
        assert not [port for port in ports if port_listens(port)], "ports still listening"
    finally:
        if kvscope.poll() is None:
            os.kill(kvscope.pid, signal.SIGKILL)
            kvscope.wait(10)


def test_an_arm_whose_master_port_another_process_holds_fails_naming_it(real_mooncake):
    """A master that cannot bind its RPC port serves /metrics for a moment and exits; meanwhile whoever holds the
    port answers there. The arm fails to start, naming the port, rather than hand its client someone else's."""
    arm = load_scenario(EXAMPLES / "mooncake_dram_vs_ssd.yaml").runnable_arms["dram_only"]
    processes = MooncakeArm(arm, block_bytes=256 * 1024, system="held-port")
    with socket.socket() as taken:
        taken.bind((HOST, processes.ports["rpc"]))
        taken.listen()
        try:
            with pytest.raises(ProcessError, match=f"mooncake_master: port {processes.ports['rpc']}, handed out"):
                processes.start()
        finally:
            processes.close()
    assert not [process for process in processes.processes if process.alive()]


def test_the_store_clients_existence_check_finds_what_was_put_and_stores_nothing(real_mooncake):
    """`exist` answers `batch_is_exist` alone (a vLLM arm's look at the store just before each request): the keys
    put are held, the others not, and asking stores nothing."""
    arm = load_scenario(EXAMPLES / "mooncake_dram_vs_ssd.yaml").runnable_arms["dram_only"]
    store = MooncakeStore(arm, 256 * 1024, "exist-check")
    try:
        assert store.put(["a", "b"], 256 * 1024) == 2 * 256 * 1024
        assert store.exist(["a", "x", "b"]) == [True, False, True]
        assert store.exist(["x"]) == [False] and store.exist([]) == []
        assert store.put(["x"], 256 * 1024) == 256 * 1024  # not there before: stored now
    finally:
        store.close()
