"""`kvscope whatif` through the CLI, on the shipped fabric and PD examples; the A/B rows' TTFT figures."""

import json
import subprocess
import sys
from importlib import resources
from pathlib import Path

import jsonschema
import pytest
from typer.testing import CliRunner

from kvscope.cli import app
from kvscope.tierstore.ab import run_ab
from kvscope.tierstore.scenario import load_scenario
from kvscope.tierstore.whatif import Vary, sweep
from kvscope.validation import read_yaml

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
runner = CliRunner()


def test_whatif_prints_ttft_per_setting_and_draws_it(tmp_path):
    plot = tmp_path / "whatif.png"
    result = runner.invoke(app, [
        "whatif", str(EXAMPLES / "fabric_400g_vs_1600g.yaml"), "--from-round", "2", "--arm", "dram_tier",
        "--vary", "fabric.east_west=400Gb/s,1.6Tb/s", "--vary", "workload.first_prompt_tokens=10000,100000",
        "--plot", str(plot),
    ])  # fmt: skip
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for heading in ("TTFT p50", "TTFT p90", "compute", "load", "PD transfer", "overhead"):
        assert heading in text
    # 400G at 100K: 195.5 ms overhead + 27.0 ms compute + 140.3 ms loading = 362.9 ms; 1.6T: 257.7 ms (-29%)
    assert "362.9 ms" in text and "257.7 ms" in text
    assert "storage_tier" not in text
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_sweep_reproduces_the_published_east_west_gain():
    data = read_yaml(EXAMPLES / "fabric_400g_vs_1600g.yaml", "scenario", ValueError)
    points = sweep(data, [Vary.parse("fabric.east_west=400Gb/s,1.6Tb/s")], from_round=2, arms=["dram_tier"])
    slow, fast = (point.quantile(0.5) for point in points)
    assert abs((1 - fast / slow) - 0.29) < 0.03
    assert sum(points[0].share.values()) == pytest.approx(1.0)


def test_the_pd_example_spends_ttft_on_the_transfer():
    data = read_yaml(EXAMPLES / "pd_disaggregated.yaml", "scenario", ValueError)
    (point,) = sweep(data, [Vary.parse("fabric.east_west=400Gb/s")], from_round=2)
    # 40,000 tokens x 192,512 B over 50e9 B/s: 154.0 ms, as long as the load of the 39,936 hit tokens (153.8 ms)
    assert point.parts["pd_transfer"] / len(point.ttft_s) == pytest.approx(40_000 * 192_512 / 50e9)
    assert point.share["pd_transfer"] == pytest.approx(point.share["load"], rel=0.01)


@pytest.mark.parametrize(
    ("vary", "message"),
    [
        ("fabric.east_west", "write KEY=VALUE"),
        ("fabric.east_west=fast", "fabric.east_west: invalid"),
        ("engine.gpu.class=h999", "class 'h999' is not one of"),
    ],
)
def test_a_bad_vary_is_an_input_error(vary, message):
    result = runner.invoke(app, ["whatif", str(EXAMPLES / "pd_disaggregated.yaml"), "--vary", vary])
    assert result.exit_code == 2
    assert message in " ".join(result.output.split())


def test_ab_rows_carry_ttft_p90_and_its_shares():
    schema = json.loads(resources.files("kvscope.tierstore").joinpath("ab_result.schema.json").read_text())
    result = json.loads(json.dumps(run_ab(load_scenario(EXAMPLES / "pd_disaggregated.yaml"))))
    jsonschema.validate(result, schema)
    row = result["arms"]["dram_tier"]["rounds"][1]
    assert row["ttft_s"]["p50"] <= row["ttft_s"]["p90"] <= row["ttft_s"]["p99"]
    assert set(row["ttft_share"]) == {"compute", "load", "pd_transfer", "overhead"}
    assert sum(row["ttft_share"].values()) == pytest.approx(1.0)
    assert row["ttft_share"]["pd_transfer"] > 0


def test_help_imports_neither_matplotlib_nor_the_service():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from kvscope.cli import app\n"
        "for args in (['--help'], ['whatif', '--help']):\n"
        "    assert CliRunner().invoke(app, args).exit_code == 0\n"
        "print(sorted(m for m in sys.modules if m.startswith(('matplotlib', 'kvscope.api.app', 'fastapi'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
