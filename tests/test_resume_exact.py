"""Which resumes continue exactly like the uninterrupted run, compared with what plain Lightning
does on one device: a mid-epoch ``ModelCheckpoint`` with torchdata's ``StatefulDataLoader`` is bit-identical after a
``kill -9``; with a plain ``DataLoader`` neither this strategy nor Lightning is exact (Lightning warns); and a
checkpoint written by ``trainer.save_checkpoint`` after ``fit`` stopped at ``max_steps`` continues as Lightning's
does, which is not as the uninterrupted run (docs/guide.md#resume)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.launch import launch_ranks

MODEL = {"optimizer": "adam", "lr": 0.01}
STRATEGY = {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2, "p2p_timeout": 5}


def killed_and_resumed(tmp_path: Path, resumable: bool) -> tuple[dict[str, Any], dict[str, Any], str]:
    """Final states of 6 steps straight and of a run killed at step 5, resumed from its mid-epoch checkpoint at
    step 3 (2 steps an epoch at N = 2), and what the resumed run printed."""
    extra = {"model": MODEL, "resumable": resumable}
    straight = tmp_path / "straight"
    run_lightning(straight, 2, STRATEGY, steps=6, **extra)
    crashed = tmp_path / "crashed"
    cfg = {
        "out": str(crashed),
        "devices": 2,
        "steps": 6,
        "strategy": STRATEGY,
        "every_n_train_steps": 3,
        "fault": {"rank": 1, "step": 5, "kind": "kill"},
        **extra,
    }
    args = ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)]
    codes = [code for code, _ in launch_ranks(args, 2, preload=True)]  # forked ranks, as run_lightning's
    assert codes[1] == -9 and codes[0] != 0, codes
    saved = sorted((crashed / "every").glob("*.ckpt"))
    assert [p.name for p in saved] == ["epoch=1-step=3.ckpt"], saved  # mid-epoch: one batch of the epoch's two
    resumed = tmp_path / "resumed"
    results = run_lightning(resumed, 2, STRATEGY, steps=6, ckpt_path=str(saved[-1]), **extra)
    return final_state(straight), final_state(resumed), results[0]["output"]


@pytest.mark.slow
def test_a_stateful_loader_resumes_mid_epoch_bit_identical_after_kill_9(tmp_path: Path) -> None:
    pytest.importorskip("torchdata")
    a, b, out = killed_and_resumed(tmp_path, resumable=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "dataloader is not resumable" not in out


@pytest.mark.slow
def test_a_plain_loader_resumed_mid_epoch_is_not_exact_and_lightning_says_so(tmp_path: Path) -> None:
    pytest.importorskip("torchdata")
    a, b, out = killed_and_resumed(tmp_path, resumable=False)
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the epoch's order starts again: other batches
    assert "dataloader is not resumable" in out, out[-3000:]


def plain_lightning(root: Path, steps: int, ckpt: Path | None = None, save: Path | None = None) -> dict[str, Any]:
    """PipeNet on one device, plain Lightning, the worker's data and optimizer: the weights after ``fit``."""
    from tests.helpers.lit import PipeNet, loader, quiet_trainer

    torch.manual_seed(0)
    model = PipeNet()
    trainer = quiet_trainer(root, max_steps=steps, enable_checkpointing=False)
    trainer.fit(model, loader(12), ckpt_path=ckpt)
    if save is not None:
        trainer.save_checkpoint(save)
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_checkpoint_saved_after_fit_continues_as_plain_lightnings_does(tmp_path: Path) -> None:
    """``trainer.save_checkpoint`` after ``fit`` stopped at ``max_steps=4`` (an epoch's end), then ``fit`` to 8 from
    it: plain Lightning itself does not continue as the uninterrupted run does, and the strategy does what it does."""
    straight = plain_lightning(tmp_path / "plain", 8)
    plain_lightning(tmp_path / "plain", 4, save=tmp_path / "plain" / "after_fit.ckpt")
    plain = plain_lightning(tmp_path / "plain", 8, ckpt=tmp_path / "plain" / "after_fit.ckpt")
    assert not all(torch.allclose(straight[k], plain[k]) for k in plain)  # Lightning's own behaviour (documented)
    strategy = {"num_microbatches": 4, "partition": [3, 3]}
    run_lightning(tmp_path / "first", 2, strategy, steps=4)
    run_lightning(tmp_path / "second", 2, strategy, steps=8, ckpt_path=str(tmp_path / "first" / "final.ckpt"))
    ours = final_state(tmp_path / "second")
    for key, value in plain.items():
        torch.testing.assert_close(ours[key], value, msg=lambda msg, key=key: f"{key}: {msg}")
