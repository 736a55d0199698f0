"""The published stack with nothing simulated: `engine.kind: vllm` arms, a real vLLM engine each, through Mooncake's
own vLLM connector into a real Mooncake store: the collapse example (examples/vllm_mooncake_dram_vs_ssd.yaml), the
media criteria on the recorded series of the parity example (examples/vllm_mooncake_media_parity.yaml), and what a
killed kvscope leaves behind.

Needs the vLLM virtualenv (`make vllm-env`) and the real Mooncake: skipped without them, failed under
KVSCOPE_REQUIRE_REAL=1. Each example takes 2-3 minutes here, more than half of it the two servers' start-up.
"""

from __future__ import annotations

import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
import yaml
from support.criteria import MEDIA_CRITERIA
from support.proctree import alive, cmdline, descendants
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.processes import listening_sockets, port_listens
from kvscope.tierstore.misses import CAUSES
from kvscope.tierstore.mooncake import mooncake_missing
from kvscope.tierstore.vllm import vllm_missing

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "vllm_mooncake_dram_vs_ssd.yaml"
PARITY = ROOT / "examples" / "vllm_mooncake_media_parity.yaml"
# What the 0.3.13 Mooncake client inside vLLM's worker binds on every interface: its transfer engine's TCP listener
# and its handshake port (the same as kvscope's own store client does, README)
CONNECTOR_WILDCARD_LISTENERS = 2


@pytest.fixture
def real_stack(require_real):
    for missing in (mooncake_missing(), vllm_missing()):
        require_real(missing is None, missing or "")


def _ab_run(scenario: Path, *args: str) -> None:
    result = CliRunner().invoke(app, ["ab", "run", str(scenario), *args])
    assert result.exit_code == 0, result.output


def _conserved_and_agreeing(arm: dict) -> None:
    """Every prompt token came from exactly one place (vLLM's cache, the store, recomputed), every round, and the
    engine's responses say the same."""
    assert arm["engine"]["kind"] == "vllm" and arm["engine"]["cached_tokens_disagreements"] == 0
    for row in arm["rounds"]:
        recomputed = round(row["recompute_tokens_per_request"] * row["requests"])
        assert row["gpu_hit_tokens"] + row["external_hit_tokens"] + recomputed == row["query_tokens"], row
        assert row["cached_tokens_agree"], row
        # the engine says when each request's prefill was done (and its blocks saved): within the request
        timings = zip(row["request_first_token_s"], row["request_s"], strict=True)
        assert all(first is not None and 0 < first <= wall for first, wall in timings), row
    listening = arm["engine"]["listening"]
    wildcard = [listener for listener in listening if not listener.startswith("127.0.0.1:")]
    # the connector's Mooncake transfer engine binds every interface whatever MC_TCP_BIND_ADDRESS says (README)
    allowed = CONNECTOR_WILDCARD_LISTENERS if arm["store"]["kind"] == "mooncake" else 0
    assert listening and len(wildcard) <= allowed, listening


def _own_ipc_sockets(data: dict) -> None:
    """Each server's IPC sockets are in its own directory: the Mooncake connector's lookup socket among them, and
    no path in two arms (vLLM names the lookup socket alike in every server of a host; in one directory the engine
    that started last answered both engines' lookups)."""
    paths = {name: set(arm["engine"]["ipc_listening"]) for name, arm in data["arms"].items()
             if arm.get("engine", {}).get("kind") == "vllm"}  # fmt: skip
    assert len(paths) == 2, paths
    for name, own in paths.items():
        assert any(Path(path).name.startswith("lookup_rpc_port") for path in own), (name, own)
    assert not set.intersection(*paths.values()), paths


def _mirrors_agree(data: dict, name: str) -> None:
    """The embedded store's model of the arm (vLLM's blocks freed tail first, then Mooncake's policy, on the real
    arm's request and save times and its master's eviction passes) collapses in the same round as the real arm and
    is within 0.05 of it in every round up to the round after the collapse (the collapse's depth): of the range its
    seeds span (`hit_ratio_range`; which chains survive a collapse turns on the master's random shard order, a
    single point before it). Later rounds are held on average, within 0.05 of the mean of the seeds' lows and
    highs: what little survives there also turns on tenths of a second between a save and other chains' lease
    timeouts (README "The mirror runs on the real arm's clock")."""
    real, model = data["arms"][name]["rounds"], data["arms"][f"{name}_sim"]["rounds"]
    assert [r["query_tokens"] for r in model] == [r["query_tokens"] for r in real]
    ranges = [[round(bound, 3) for bound in r["hit_ratio_range"]] for r in model]
    requests = [(r["request_hit_tokens"], m["request_hit_tokens"]) for r, m in zip(real, model, strict=True)]
    slow = [p for r in real for p in r.get("store_eviction_passes") or () if p[1] - p[0] > 0.02]
    curves = (
        f"real {[round(r['hit_ratio'], 3) for r in real]}, model {ranges}; per request, real against the model's "
        f"first seed: {requests}; the master's passes over 20 ms: {slow}"
    )
    collapse = data["arms"][name]["observed_collapse_round"]
    assert data["arms"][f"{name}_sim"]["observed_collapse_round"] == collapse, curves
    held = len(real) if collapse is None else collapse + 1
    for a, (low, high) in zip(real[:held], ranges[:held], strict=True):
        assert low - 0.05 <= a["hit_ratio"] <= high + 0.05, f"{name} round {a['round']}: {curves}"
    if tail := [(a["hit_ratio"], bounds) for a, bounds in zip(real[held:], ranges[held:], strict=True)]:
        mean = statistics.fmean(ratio for ratio, _ in tail)
        low, high = (statistics.fmean(bounds[i] for _, bounds in tail) for i in (0, 1))
        assert low - 0.05 <= mean <= high + 0.05, f"{name} after round {held}: mean {mean:.3f}; {curves}"


def _misses_explained(arm: dict) -> None:
    """Every missed token of every round has one cause, from the engine's KV events and the store's existence
    check, and nothing the engine once stored is taken for cold: the cold tokens are the round's new ones (what the
    ideal misses), every hit lost is a block stored once. The classification waited for every request's events
    and none were lost."""
    for row in [*arm["rounds"], arm["totals"]]:
        causes = row["miss_causes"]
        assert sum(causes[cause] for cause in CAUSES) == row["query_tokens"] - row["hit_tokens"], row
        assert sum(causes["evicted_by_tier"].values()) == causes["evicted"], row
    for row in arm["rounds"]:
        assert row["miss_causes"]["cold"] == row["query_tokens"] - row["ideal_hit_tokens"], row
    events = arm["engine"]["kv_events"]
    assert events["lost_batches"] == events["unsettled_requests"] == events["undecodable_batches"] == 0, events


def _mirror_causes_agree(data: dict, name: str, first_round: int) -> None:
    """The real arm's causes against its mirror's (the embedded model of vLLM's cache and Mooncake's policy on
    the real arm's clock, its first seed) from `first_round` on, summed over those rounds: each cause within 0.05
    of the tokens those rounds prompted, and the hits lost (evicted + chain_broken) within that and the spread of
    the model's seeds over those rounds (a hit lost is a hit the one seed may have made: which chains outlive a
    collapse turns on the master's random shard order). The split of the lost hits between evicted and
    chain_broken is not held: it moves with the same random order."""
    real, model = (data["arms"][arm]["rounds"][first_round - 1 :] for arm in (name, f"{name}_sim"))
    prompted = sum(row["query_tokens"] for row in real)
    spread = sum((row["hit_ratio_range"][1] - row["hit_ratio_range"][0]) * row["query_tokens"] for row in model)
    groups = {"lost": ("evicted", "chain_broken")} | {cause: (cause,) for cause in CAUSES if cause not in
                                                       ("evicted", "chain_broken")}  # fmt: skip
    for group, causes in groups.items():
        ours, theirs = (sum(row["miss_causes"][c] for row in rows for c in causes) for rows in (real, model))
        allowed = 0.05 * prompted + (spread if group == "lost" else 0)
        assert abs(ours - theirs) <= allowed, (name, group, ours, theirs, prompted, round(spread))


def test_real_vllm_and_mooncake_collapse_where_the_planner_says(real_stack, tmp_path):
    out = tmp_path / "result.json"
    _ab_run(EXAMPLE, "--json", str(out))
    data = json.loads(out.read_text())
    jsonschema.validate(data, json.loads((ROOT / "tierstore" / "ab_result.schema.json").read_text()))
    dram_only, tiered = data["arms"]["dram_only"], data["arms"]["tiered"]
    table = (
        "round, ideal, DRAM-only, tiered hit ratio, late s, failed keys:\n"
        + "\n".join(
            f"{r['round']} {r['ideal_hit_ratio']:.3f} {r['hit_ratio']:.3f} {t['hit_ratio']:.3f} {r['late_s']:.2f}/"
            f"{t['late_s']:.2f} {r['connector_failed_keys']}/{t['connector_failed_keys']}"
            for r, t in zip(dram_only["rounds"], tiered["rounds"], strict=True)
        )
        + f"\ntiered connector codes {tiered['engine']['connector_failure_codes']}"
    )  # a string: pytest cuts a list short

    predicted = dram_only["prediction"]["collapse_round"]
    assert predicted is not None and abs(dram_only["observed_collapse_round"] - predicted) <= 1, table
    collapsed = dram_only["observed_collapse_round"]
    assert all(row["hit_ratio"] < row["ideal_hit_ratio"] / 2 for row in dram_only["rounds"][collapsed:]), table
    for row in tiered["rounds"]:
        assert abs(row["hit_ratio"] - row["ideal_hit_ratio"]) <= 0.03, table
    # The collapse explained: the hits the DRAM-only arm lost are blocks the store or vLLM's cache evicted, or
    # held behind a chain's evicted head, but for a few refused puts
    for row in dram_only["rounds"][collapsed:]:
        causes, lost = row["miss_causes"], row["ideal_hit_tokens"] - row["hit_tokens"]
        assert causes["evicted"] + causes["chain_broken"] >= 0.9 * lost, (row["round"], causes, lost)
        assert causes["evicted_by_tier"].keys() <= {"gpu", "dram"}, causes
    for arm in (dram_only, tiered):
        _conserved_and_agreeing(arm)
        # vLLM's own cache holds less than a round: the store serves hits from round 2 on
        assert all(row["external_hit_tokens"] > 0 for row in arm["rounds"][1:6]), table
    assert tiered["totals"]["written_bytes"]["ssd"] > 0
    _own_ipc_sockets(data)
    for name in ("dram_only", "tiered"):
        _mirrors_agree(data, name)
        _misses_explained(data["arms"][name])
        _mirror_causes_agree(data, name, first_round=collapsed)


def test_media_criteria_pass_on_the_recorded_real_vllm_and_mooncake_series(real_stack, tmp_path):
    db, out = tmp_path / "runs.duckdb", tmp_path / "result.json"
    _ab_run(PARITY, "--db", str(db), "--json", str(out))
    data = json.loads(out.read_text())
    _own_ipc_sockets(data)
    for name in ("dram_only", "tiered"):
        arm = data["arms"][name]
        _conserved_and_agreeing(arm)
        for row in arm["rounds"]:  # the regime of the published test: neither arm loses a hit
            assert abs(row["hit_ratio"] - row["ideal_hit_ratio"]) <= 0.01, (name, row)
    arguments = ["verify", "--db", str(db), "--criteria", str(ROOT / "criteria" / "media.yaml"), "--param",
                 "lower_tier=ssd", "--param", "lower_tier_scope=group", "--run",
                 "vllm_mooncake_media_parity/dram_only", "--run", "vllm_mooncake_media_parity/tiered", "--json",
                 str(tmp_path / "verdicts.json")]  # fmt: skip
    verified = CliRunner().invoke(app, arguments)
    assert verified.exit_code == 0, verified.output
    verdicts = json.loads((tmp_path / "verdicts.json").read_text())["verdicts"]
    documents = {v["document"]["criterion"]["name"]: v["document"] for v in verdicts}
    assert set(documents) == MEDIA_CRITERIA
    assert all(document["passed"] for document in documents.values())
    written = {row["tier"]: row["written"] for row in documents["both_tiers_written"]["observed"]}
    assert written["dram"] > 0 and written["ssd"] > 0
    # Token accounting on the same recordings: each arm's vLLM engine, its prompt tokens served through Mooncake,
    # has every prompt token from exactly one source (computed, its prefix cache, the store through the connector).
    for name in ("dram_only", "tiered"):
        run, verdict_file = f"vllm_mooncake_media_parity/{name}", tmp_path / f"tokens_{name}.json"
        arguments = ["verify", "--db", str(db), "--criteria", str(ROOT / "criteria" / "tokens.yaml"), "--run", run,
                     "--json", str(verdict_file)]  # fmt: skip
        verified = CliRunner().invoke(app, arguments)
        assert verified.exit_code == 0, verified.output
        answer = json.loads(verdict_file.read_text())
        assert answer["errors"] == []
        (verdict,) = answer["verdicts"]
        document = verdict["document"]
        assert document["criterion"]["name"] == "tokens_conserved" and document["passed"], document
        (row,) = document["observed"]  # the arm's one vLLM engine: the only group with kv.engine.prompt.tokens
        assert row["group"] == "0" and row["total"] > 0 and row["difference"] == 0, row
        assert all(f"{source}=" in row["sources"] for source in ("computed", "external", "gpu")), row


def test_sigkill_of_ab_run_mid_run_leaves_no_vllm_or_mooncake_process_and_no_port(real_stack, tmp_path):
    """kvscope killed with SIGKILL once its arm's Mooncake store serves and its vLLM server has started its engine
    core and worker (the processes a killed kvscope once left running): every one of those processes goes, and
    nothing they listened on still listens. The example's DRAM-only arm alone: one server starts faster than two."""
    scenario = yaml.safe_load(EXAMPLE.read_text())
    scenario["arms"] = {"dram_only": {**scenario["arms"]["dram_only"], "mirror": False}}
    (tmp_path / "one_arm.yaml").write_text(yaml.safe_dump(scenario))
    script = Path(sys.executable).with_name("kvscope")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from kvscope.cli import app; app()"]
    kvscope = subprocess.Popen([*command, "ab", "run", str(tmp_path / "one_arm.yaml")], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    try:
        deadline, working = time.monotonic() + 240, []
        while time.monotonic() < deadline and not working:  # the server has its engine core and its worker
            servers = [pid for pid in descendants(kvscope.pid) if b"vllm_side/serve.py" in cmdline(pid)]
            working = [pid for pid in servers if any(b"VLLM::Worker" in cmdline(d) for d in descendants(pid))]
            time.sleep(0.5)
        assert working, "the vLLM server did not start its engine"
        time.sleep(3)
        processes = {pid: listening_sockets(pid) for pid in descendants(kvscope.pid)}
        assert any(b"mooncake_master" in cmdline(pid) for pid in processes)
        ports = {listener.port for sockets in processes.values() for listener in sockets}
        kvscope.send_signal(signal.SIGKILL)
        kvscope.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (
            any(alive(pid) for pid in processes) or any(port_listens(port) for port in ports)
        ):
            time.sleep(0.2)
        assert not [(pid, cmdline(pid)[:80]) for pid in processes if alive(pid)], "processes outlived kvscope"
        assert not [port for port in ports if port_listens(port)], "ports still listening"
    finally:
        if kvscope.poll() is None:
            kvscope.kill()
            kvscope.wait(10)
