"""Loading a checkpoint runs no code from it: the strategy loads with ``weights_only=True`` unless told otherwise."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_avgpipe import AvgPipeStrategy
from lightning_avgpipe.plugin.checkpoint.resume import checkpoint_layout
from tests.helpers.lit import PipeNet, loader


class _Touch:
    """Unpickled in full, it creates the marker file: what a malicious checkpoint would do instead."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return (Path.touch, (self.marker,))


def _trainer(tmp_path: Path, steps: int, trusted: bool = False) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
        strategy=AvgPipeStrategy(num_microbatches=2, partition=[6], trusted_checkpoints=trusted),
    )


def _saved(tmp_path: Path) -> Path:
    trainer = _trainer(tmp_path, 2)
    trainer.fit(PipeNet(), loader())
    path = tmp_path / "good.ckpt"
    trainer.save_checkpoint(path)
    return path


def test_a_checkpoint_that_would_run_code_is_refused_and_runs_none(tmp_path: Path) -> None:
    good = _saved(tmp_path)
    marker = tmp_path / "marker"
    crafted = torch.load(good, weights_only=True)
    crafted["callbacks"] = {"evil": _Touch(marker)}
    path = tmp_path / "crafted.ckpt"
    torch.save(crafted, path)
    assert checkpoint_layout(path) is None and not marker.exists()  # the resume layout read runs nothing either
    with pytest.raises(ValueError, match="trusted_checkpoints=True") as info:
        _trainer(tmp_path, 3).fit(PipeNet(), loader(), ckpt_path=path)
    assert "Refusing to load" in str(info.value) and str(path) in str(info.value)
    assert not marker.exists()
    # a file the user trusts: trusted_checkpoints=True lets it through (and then the code in it runs)
    _trainer(tmp_path, 3, trusted=True).fit(PipeNet(), loader(), ckpt_path=path)
    assert marker.exists()


def test_the_strategys_checkpoints_load_with_weights_only(tmp_path: Path) -> None:
    good = _saved(tmp_path)
    assert torch.load(good, weights_only=True)["optimizer_states"][0]["avgpipe_layout"]["stages"] == 1
    assert checkpoint_layout(good) == {"stages": 1, "groups": 1, "pipelines": 1, "partition": [6]}
    trainer = _trainer(tmp_path, 3)
    trainer.fit(PipeNet(), loader(), ckpt_path=good)  # resumes with the default, weights_only=True
    assert trainer.global_step == 3
