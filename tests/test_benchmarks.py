"""Smoke test of benchmarks/throughput.py: it runs end to end and writes every row. No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROWS = {
    "ours-1f1b",
    "ours-afab",
    "ours-zbh1",
    "ours-zbv",
    "ours-zbv-placed",
    "ours-interleaved",
    "torch-1f1b",
    "torch-gpipe",
    "torch-interleaved",
    "torch-interleaved-zb",
    "torch-zbv",
    "single",
    "avgpipe-N1",
    "avgpipe-N2",
}


def run_script(name: str, *args: str, timeout: float = 140) -> subprocess.CompletedProcess[str]:
    """``benchmarks/<name>`` with ``args``, from the repository root with it on ``PYTHONPATH``; it must succeed."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    cmd = [sys.executable, str(ROOT / "benchmarks" / name), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_throughput_benchmark_smoke(tmp_path: Path) -> None:
    out = tmp_path / "throughput.json"
    args = [
        "--steps",
        "2",
        "--warmup",
        "1",
        "--n-layer",
        "2",
        "--n-embd",
        "16",
        "--n-head",
        "2",
        "--block-size",
        "8",
        "--batch-size",
        "4",
        "--microbatches",
        "2",
        "--corpus-chars",
        "20000",
        "--timeout",
        "100",
        "--json",
        str(out),
        "--pipelines",
        "1,2",
    ]
    proc = run_script("throughput.py", *args, timeout=120)
    assert "samples/s" in proc.stdout
    summary = json.loads(out.read_text())
    rows = {row["name"]: row for row in summary["rows"]}
    assert set(rows) == ROWS
    for name, row in rows.items():
        assert row["samples_per_s"] > 0, name
        assert len(row["step_s"]) == 2, name
        assert (row["pipeline_efficiency"] is None) == (name == "single"), name
    assert rows["torch-1f1b"]["ratio_to_torch_1f1b"] == pytest.approx(1.0)
    assert summary["ideal"]["step_s"] > 0
    assert summary["checks"]["ok"], summary["checks"]
    # AvgPipe rows: N batches of B per step, a ratio to torch's 1F1B, their own ideal, and the loss checks
    for n in (1, 2):
        row = rows[f"avgpipe-N{n}"]
        assert row["pipelines"] == n and row["samples_per_step"] == 4 * n
        assert row["samples_per_s"] == pytest.approx(4 * n / row["step_s_median"])
        assert row["ratio_to_torch_1f1b"] > 0 and row["pipeline_efficiency"] > 0
        assert summary["ideal"]["avgpipe"][f"avgpipe-N{n}"]["step_s"] > 0
        assert summary["checks"]["avgpipe_vs_single_process"][f"avgpipe-N{n}"]["ok"]
    assert rows["avgpipe-N1"]["first_step_loss"] == pytest.approx(rows["single"]["first_step_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_group_link_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/group_link.py: D = 2 groups on an emulated slow link, time to target from a convergence JSON."""
    conv = tmp_path / "convergence.json"
    methods = {
        "pipe-NB": {"samples_to_target": {"mean": 640.0}, "samples_per_iteration": 128, "seeds": 3},
        "avgpipe-N": {"samples_to_target": {"mean": 768.0}, "samples_per_iteration": 128, "seeds": 3},
        "period-N": {"samples_to_target": None, "samples_per_iteration": 128, "seeds": 3},
    }
    for entry in methods.values():
        entry["seeds_reaching_target"] = 3 if entry["samples_to_target"] else 0
    conv.write_text(json.dumps({"studies": {"digits": {"methods": methods}}}))
    out = tmp_path / "group_link.json"
    args = ["--studies", "digits", "--links", "loopback", "100 Mbit/s", "--steps", "1", "--warmup", "1"]
    proc = run_script("group_link.py", *args, "--convergence", str(conv), "--json", str(out))
    assert "EMULATED" in proc.stdout  # the output says the link is not a network
    study = json.loads(out.read_text())["studies"]["digits"]
    assert study["steps_to_target"]["exact"] == {"steps": 5.0, "seeds": "3/3"}
    assert study["steps_to_target"]["H=4"]["steps"] is None
    for link, row in study["links"].items():
        assert set(row["step_s"]) == {"exact", "H=1", "H=4"} and all(v > 0 for v in row["step_s"].values()), link
        assert row["time_to_target_s"]["exact"] == pytest.approx(row["step_s"]["exact"] * 5.0)
        assert row["time_to_target_s"]["H=4"] is None and row["fastest_to_target"] in ("exact", "H=1")


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_layouts_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/layouts.py: 1 x 1 and 1 x 2 on a tiny GPT: the same first loss, a smaller static share per rank
    under T = 2, functional labels, and the whatif projection."""
    out = tmp_path / "layouts.json"
    args = ["--layouts", "1x1,1x2", "--steps", "1", "--warmup", "1", "--n-layer", "2", "--n-embd", "32"]
    proc = run_script("layouts.py", *args, "--block-size", "16", "--corpus-chars", "20000", "--json", str(out))
    assert "FUNCTIONAL" in proc.stdout and "not a measurement" in proc.stdout
    one, two = json.loads(out.read_text())["rows"]
    assert one["first_loss"] == pytest.approx(two["first_loss"], rel=1e-5)
    assert two["static_mb"] < one["static_mb"] and len(two["split_modules"]) == 6  # 2 blocks x (attention, MLP pair)
    assert {"1", "1.mlp.0", "1.mlp.2"} <= set(two["split_modules"])
    assert [(p["S"], p["T"]) for p in json.loads(out.read_text())["projection"]][:2] == [(1, 1), (2, 1)]


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_zero_benchmark_smoke(tmp_path: Path) -> None:
    """benchmarks/zero.py: D = 2 on a tiny GPT with elastic replicas: the sharded reference holds less of the outer
    state and of the static memory, trains to the whole run's weights, and says its figures are functional."""
    out = tmp_path / "zero.json"
    args = ["--groups", "2", "--averaging", "elastic", "--steps", "2", "--n-layer", "1", "--n-embd", "32"]
    proc = run_script("zero.py", *args, "--block-size", "16", "--corpus-chars", "20000", "--json", str(out))
    assert "FUNCTIONAL" in proc.stdout
    whole, sharded = json.loads(out.read_text())["rows"]
    assert (whole["sharded"], sharded["sharded"]) == (False, True)
    assert sharded["ratio"]["outer"] == pytest.approx(1 / 3, rel=0.02)  # 2/(3D): the slice and the momentum's
    assert sharded["ratio"]["static"] < 1 and sharded["max_weight_diff"] < 1e-3


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_zero_benchmark_on_the_digits_mlp(tmp_path: Path) -> None:
    """benchmarks/zero.py --model mlp: the digits MLP over 2 stages x D = 2, exact: flat slices keep half the AdamW
    state on each stage; by whole tensors the stage whose 256 x 256 weight is most of it keeps almost all of it."""
    out = tmp_path / "zero.json"
    args = ["--model", "mlp", "--groups", "2", "--averaging", "exact", "--steps", "2", "--json", str(out)]
    run_script("zero.py", *args)
    rows = {(r["sharded"], r["stage"]): r for r in json.loads(out.read_text())["rows"]}
    for stage in (0, 1):
        assert rows[True, stage]["ratio"]["state"] == pytest.approx(0.5, abs=0.01)
        assert rows[True, stage]["max_weight_diff"] == 0.0
    assert rows["tensors", 1]["ratio"]["state"] > 0.9


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_bubble_benchmark_smoke() -> None:
    """benchmarks/bubble.py: every schedule's measured bubble beside the simulator's, and the peaks per rank."""
    out = run_script("bubble.py", "--steps", "1", "--warmup", "1", "--n-layer", "2").stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:] if line.strip()}
    assert set(rows) == {"1f1b", "zbh1", "interleaved", "zbv"}, out
    assert all(0.0 <= float(cells[2]) < 1.0 for cells in rows.values()), out  # the simulated bubble, a fraction


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_big_model_benchmark_smoke() -> None:
    """benchmarks/big_model.py on a small model: one device, then S = 2 built in configure_model saving a file and a
    folder, a row per rank with a figure and a ratio for every phase and both times."""
    proc = run_script(
        "big_model.py", "--width", "256", "--layers", "4", "--steps", "1", "--stages", "2", "--tensor", "1", "--quick"
    )
    rows = [line for line in proc.stdout.splitlines() if line.startswith(("one device", "S=2"))]
    runs = ["S=2, configure_model, file", "S=2, configure_model, folder"]
    expected = ["one device (configure_model)"] + [r for r in runs for _ in (0, 1)]
    assert [row.split("  ")[0] for row in rows] == expected, proc.stdout
    assert all(row.count("x)") == 6 for row in rows), proc.stdout  # four phases, the save and the load times
