"""Every way a user starts a run: Lightning's own launcher, torchrun, and LightningCLI (flags and config)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.launch import ROOT, run_command

pytestmark = pytest.mark.slow


def test_plain_script_uses_lightnings_launcher(tmp_path: Path) -> None:
    """`python examples/digits.py`: Lightning starts rank 1 itself; torchmetrics accuracy comes back on rank 0."""
    out = run_command([sys.executable, str(ROOT / "examples" / "digits.py"), "--epochs", "2"], tmp_path)
    assert "AvgPipe: 2 stages" in out
    accuracy = float(re.search(r"test accuracy ([0-9.]+)", out).group(1))  # type: ignore[union-attr]
    assert accuracy > 0.7, out[-2000:]


def test_torchrun(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).with_name("torchrun")
    out = run_command(
        [
            str(torchrun),
            "--nproc_per_node",
            "2",
            str(ROOT / "examples" / "char_gpt.py"),
            "--max-steps",
            "20",
            "--n-layer",
            "2",
        ],
        tmp_path,
    )
    match = re.search(r"final val_loss ([0-9.]+) \(uniform guess: ([0-9.]+)\)", out)
    assert match, out[-2000:]
    assert float(match.group(1)) < float(match.group(2))


CLI = [
    "-m",
    "lightning_avgpipe",
    "fit",
    "--config",
    str(ROOT / "examples" / "char_gpt.yaml"),
    "--trainer.max_steps",
    "3",
    "--trainer.limit_val_batches",
    "2",
    "--trainer.val_check_interval",
    "3",
    "--trainer.enable_progress_bar",
    "false",
    "--model.init_args.n_layer",
    "2",
    "--data.init_args.max_chars",
    "200000",
]


def test_cli_class_path_flags(tmp_path: Path) -> None:
    out = run_command(
        [
            sys.executable,
            *CLI,
            "--trainer.default_root_dir",
            str(tmp_path),
            "--trainer.strategy.init_args.num_microbatches",
            "8",
            "--trainer.strategy.init_args.schedule",
            "afab",
        ],
        tmp_path,
    )
    assert "schedule=afab, num_microbatches=8" in out, out[-2000:]
    saved = yaml.safe_load(next(tmp_path.rglob("config.yaml")).read_text())
    assert saved["trainer"]["strategy"]["init_args"]["num_microbatches"] == 8


def test_cli_strategy_name(tmp_path: Path) -> None:
    out = run_command(
        [sys.executable, *CLI, "--trainer.default_root_dir", str(tmp_path), "--trainer.strategy", "avgpipe"], tmp_path
    )
    assert "schedule=1f1b, num_microbatches=4" in out, out[-2000:]  # the registered defaults: 2 x stages
