"""criteria/media.yaml's NoF checks on a recording of a real SPDK target: `kvscope record` scrapes a peer that
answers with the live nvmf_tgt captures (tests/fixtures/spdk/live/), through the spdk collector, its mapping and
the recorder, and `kvscope verify` judges what was recorded.

The captures hold one target, so the criteria are the NoF halves of media.yaml's: `nof_delta_zero` as the file
has it, and `both_tiers_written` asked of the NoF tier alone (the capture has no DRAM tier, and no store's puts).
Answers that are not captures are built here and say so (DERIVED).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml
from support.spdkpeer import SpdkPeer, capture
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.verifier.criteria import load_criteria

ROOT = Path(__file__).resolve().parents[2]
FULL = capture("live/bdev_get_iostat.json")
LATER = "live/bdev_get_iostat.names.json"  # Malloc0 9,739,608 ticks after FULL: 104 writes, 425,984 B
CLUSTER = 4 * 1024 * 1024  # the lvstore's cluster_size
runner = CliRunner()


def target(moves: bool, grows: bool):
    """The live target. Its iostat for Malloc0: FULL's entry (DERIVED: the full answer cut to Malloc0, as the target
    answers `names: [Malloc0]` at that tick), then the later capture when `moves`. Its lvstore: as captured, then
    (DERIVED, `grows`) with two more clusters allocated."""
    calls = {"bdev_get_iostat": 0, "bdev_lvol_get_lvstores": 0}

    def answer(method: str, params):
        if method in calls:
            calls[method] += 1
        if method == "bdev_get_iostat":
            if moves and calls[method] > 1:
                return LATER
            result = FULL["result"]
            return {"result": {**result, "bdevs": [b for b in result["bdevs"] if b["name"] == "Malloc0"]}}
        if method == "bdev_lvol_get_lvstores" and grows and calls[method] > 1:
            lvstores = copy.deepcopy(capture("live/bdev_lvol_get_lvstores.json")["result"])
            lvstores[0]["free_clusters"] -= 2
            return {"result": lvstores}
        return f"live/{method}.json"

    return answer


@pytest.fixture
def record(tmp_path):
    """`record(run, arm, moves=..., grows=...)`: `kvscope record` of the peer for 1.5 s, 4 scrapes a second."""
    peers: list[SpdkPeer] = []
    db = tmp_path / "cluster.duckdb"

    def run(name: str, arm: str, *, moves: bool = False, grows: bool = False) -> Path:
        socket = tmp_path / f"spdk{len(peers)}.sock"
        peers.append(SpdkPeer(target(moves, grows), socket))
        config = tmp_path / f"targets{len(peers)}.yaml"
        spdk = {"name": "spdk-nof", "source": "spdk", "socket": str(socket), "interval_s": 0.25,
                "bdevs": ["Malloc0"], "labels": {"role": "nof"}}  # fmt: skip
        config.write_text(yaml.safe_dump({"exporter": {"listen_port": 0}, "targets": [spdk]}))
        result = runner.invoke(app, ["record", "--config", str(config), "--db", str(db), "--run", name,
                                     "--arm", arm, "--for", "1.5s"])  # fmt: skip
        assert result.exit_code == 0, result.output
        return db

    yield run
    for peer in peers:
        peer.close()


def nof_criteria(tmp_path: Path, role: str) -> Path:
    """media.yaml's criteria on the NoF tier, for one run of role `role`: nof_delta_zero as written, or
    both_tiers_written with the NoF tier its only expected one."""
    media = load_criteria(ROOT / "criteria" / "media.yaml")
    chosen = {c.name: c.model_dump(mode="json", by_alias=True, exclude_defaults=True) for c in media.criteria}
    if role == "dram_only":
        criteria = [chosen["nof_delta_zero"]]
    else:
        written = chosen["both_tiers_written"]
        written.pop("consistent_with")
        written.pop("consistent_scope")
        criteria = [{**written, "expect": ["nof"]}]
    path = tmp_path / f"nof-{role}.yaml"
    path.write_text(yaml.safe_dump({"runs": [role], "arms": {role: role}, "criteria": criteria}))
    return path


def verify(db: Path, criteria: Path, run: str, out: Path) -> tuple[int, dict]:
    result = runner.invoke(app, ["verify", "--db", str(db), "--criteria", str(criteria), "--run", run,
                                 "--json", str(out)])  # fmt: skip
    assert result.exit_code in (0, 1), result.output
    return result.exit_code, json.loads(out.read_text())["verdicts"][0]["document"]


def test_an_idle_nof_target_proves_a_zero_delta_and_one_whose_lvstore_grew_fails_naming_the_bytes(record, tmp_path):
    db = record("cluster/dram_only", "dram_only")
    code, document = verify(db, nof_criteria(tmp_path, "dram_only"), "cluster/dram_only", tmp_path / "idle.json")
    (row,) = document["observed"]
    # the live lvstore: 31 clusters of 4 MiB, 23 free, at every scrape
    assert code == 0 and (row["labels"], row["delta"], row["first_value"]) == (
        {"system": "", "tier": "nof"},
        0,
        8 * CLUSTER,
    )
    assert row["samples"] >= 4

    record("cluster/planted", "dram_only", grows=True)
    code, document = verify(db, nof_criteria(tmp_path, "dram_only"), "cluster/planted", tmp_path / "grew.json")
    (row,) = document["observed"]
    assert code == 1 and row["delta"] == 2 * CLUSTER and f"delta={2 * CLUSTER:,} B" in document["summary"]


def test_the_nof_tiers_writes_are_the_exported_bdevs_bytes_between_two_captures(record, tmp_path):
    """Malloc0, exported by nqn.2016-06.io.spdk:kvcache1, backs the target's tier: 951,992,320 - 951,566,336 B."""
    db = record("cluster/tiered", "tiered", moves=True)
    code, document = verify(db, nof_criteria(tmp_path, "tiered"), "cluster/tiered", tmp_path / "written.json")
    (row,) = document["observed"]
    assert code == 0 and (row["tier"], row["written"], row["resets"], row["wraps"]) == ("nof", 425_984, 0, 0)
