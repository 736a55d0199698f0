"""The published stack with nothing simulated: `engine.kind: vllm` arms, a real vLLM engine each, through Mooncake's
own vLLM connector into a real Mooncake store (examples/vllm_mooncake_dram_vs_ssd.yaml).

Needs the vLLM virtualenv (`make vllm-env`) and the real Mooncake: skipped without them, failed under
KVSCOPE_REQUIRE_REAL=1. The example takes about 3 minutes here, half of it the two servers' start-up. Once the
arms' DRAM is full their hit ratios depend on timing (Mooncake's leases against vLLM's lookup-to-load gap): the test
holds what held in every run, the planner's collapse round, the exact ideal before it, every prompt token accounted.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from support.proctree import alive, cmdline, descendants
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.tierstore.mooncake import mooncake_missing
from kvscope.tierstore.vllm import vllm_missing

ROOT = Path(__file__).parents[1]
EXAMPLE = ROOT / "examples" / "vllm_mooncake_dram_vs_ssd.yaml"


@pytest.fixture
def real_stack(require_real):
    for missing in (mooncake_missing(), vllm_missing()):
        require_real(missing is None, missing or "")


def test_real_vllm_and_mooncake_collapse_where_the_planner_says(real_stack, tmp_path):
    out = tmp_path / "result.json"
    result = CliRunner().invoke(app, ["ab", "run", str(EXAMPLE), "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    jsonschema.validate(data, json.loads((ROOT / "tierstore" / "ab_result.schema.json").read_text()))
    dram_only, tiered = data["arms"]["dram_only"], data["arms"]["tiered"]

    table = [(r["round"], r["ideal_hit_ratio"], r["hit_ratio"], t["hit_ratio"], r["connector_failed_keys"])
             for r, t in zip(dram_only["rounds"], tiered["rounds"], strict=True)]  # fmt: skip
    predicted = dram_only["prediction"]["collapse_round"]
    assert predicted is not None and abs(dram_only["observed_collapse_round"] - predicted) <= 1, table
    # How deep the DRAM-only arm falls depends on timing here: with vLLM's lease of seconds, a put finds every recent
    # object leased, is refused (connector_failed_keys) and the older chains stay; alone on the machine the last
    # round hits ~3%, inside the whole suite up to ~60%. What holds either way: it is far from its ideal.
    # The tiered arm keeps its ideal until its DRAM fills; then whether a save finds room depends on the same
    # timing (a leased pool refuses it, offload on evict frees room a heartbeat later): measured 0 to 0.05 below.
    last = dram_only["rounds"][-1]
    assert last["hit_ratio"] < 0.9 * last["ideal_hit_ratio"], table
    for row in tiered["rounds"][:6]:  # nothing is evicted yet: the engine and the store serve exactly the ideal
        assert abs(row["hit_ratio"] - row["ideal_hit_ratio"]) <= 0.01, table
    assert tiered["observed_collapse_round"] is None or tiered["rounds"][-1]["hit_ratio"] > last["hit_ratio"], table
    for arm in (dram_only, tiered):
        assert arm["engine"]["kind"] == "vllm" and arm["engine"]["cached_tokens_disagreements"] == 0
        for row in arm["rounds"]:
            # every prompt token came from exactly one place, and the engine's responses say the same
            assert (
                row["gpu_hit_tokens"]
                + row["external_hit_tokens"]
                + round(row["recompute_tokens_per_request"] * row["requests"])
                == row["query_tokens"]
            )
            assert row["cached_tokens_agree"], row
        assert all(listener.startswith("127.0.0.1:") for listener in arm["engine"]["listening"])
    # the store serves what vLLM's own cache lost: external hits once round 1 was saved
    assert sum(row["external_hit_tokens"] for row in tiered["rounds"][1:]) > 0
    assert tiered["totals"]["written_bytes"]["ssd"] > 0
    # the embedded store's simulation of each arm (a tail-first GPU tier of the same blocks, then the store)
    for name in ("dram_only", "tiered"):
        simulated = data["arms"][f"{name}_sim"]["rounds"]
        for real, model in zip(data["arms"][name]["rounds"], simulated, strict=True):
            assert real["query_tokens"] == model["query_tokens"]


def test_sigkill_of_ab_run_leaves_no_vllm_process(real_stack, tmp_path):
    """kvscope killed with SIGKILL while a vLLM arm starts: its server and the server's own worker processes go."""
    script = Path(sys.executable).with_name("kvscope")
    command = [str(script)] if script.exists() else [sys.executable, "-c", "from kvscope.cli import app; app()"]
    kvscope = subprocess.Popen([*command, "ab", "run", str(EXAMPLE)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, cwd=tmp_path)  # fmt: skip
    try:
        deadline, engine = time.monotonic() + 240, []
        while time.monotonic() < deadline and not engine:  # a vLLM server with its engine core below it
            servers = [pid for pid in descendants(kvscope.pid) if b"vllm_side/serve.py" in cmdline(pid)]
            engine = [pid for pid in servers if descendants(pid)]
            time.sleep(0.5)
        assert engine, "no vLLM server came up"
        time.sleep(3)
        doomed = descendants(kvscope.pid)
        kvscope.send_signal(signal.SIGKILL)
        kvscope.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(alive(pid) for pid in doomed):
            time.sleep(0.2)
        assert not [(pid, cmdline(pid)[:80]) for pid in doomed if alive(pid)], "processes outlived kvscope"
    finally:
        if kvscope.poll() is None:
            kvscope.kill()
            kvscope.wait(10)
