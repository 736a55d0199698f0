"""An A/B on real-bytes backends must behave exactly like the accounting simulation it stands in for."""

from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.scenario import parse_scenario


def _scenario(tmp_path, backend: str) -> dict:
    def tier(name: str, capacity: str, **extra) -> dict:
        return {"name": name, "capacity": capacity, "policy": "lru", "backend": backend, **extra}

    return {
        "name": f"tiny_{backend}",
        "workload": {
            "kind": "multi_round",
            "sessions": 6,
            "rounds": 6,
            "first_prompt_tokens": 70,
            "output_tokens": 40,
            "shared_prefix_tokens": 32,
        },
        "kv": {"block_tokens": 16, "bytes_per_token": 64},  # 1 KiB blocks
        "arms": {
            "small": {"tiers": [tier("dram", "40KiB")]},
            "replicate": {"tiers": [tier("dram", "12KiB"), tier("nof", "1MiB")]},
            "demote": {
                "placement": "demote",
                "promote_on_hit": True,
                "tiers": [tier("dram", "12KiB"), tier("nof", "30KiB")],
            },
        },
    }


def _figures(result: dict) -> dict:
    return {
        name: ([r["hit_tokens"] for r in arm["rounds"]], arm["totals"]["tiers"], arm["observed_collapse_round"])
        for name, arm in result["arms"].items()
    }


def test_memory_and_file_backends_match_the_accounting_run(tmp_path):
    expected = _figures(run_ab(parse_scenario(_scenario(tmp_path, "accounting"))))
    assert expected["small"][2] is not None, "the small arm must overflow for this test to mean anything"
    assert expected["demote"][1]["nof"]["written_bytes"] > 0
    for backend in ("memory", "file"):
        result = run_ab(parse_scenario(_scenario(tmp_path, backend)), workdir=tmp_path)
        assert _figures(result) == expected, backend
    assert sorted(p.name for p in tmp_path.glob("*.blocks")) == [
        "demote-dram.blocks", "demote-nof.blocks", "replicate-dram.blocks", "replicate-nof.blocks", "small-dram.blocks",
    ]  # fmt: skip
