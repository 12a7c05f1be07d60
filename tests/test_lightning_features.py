"""Lightning features under AvgPipeStrategy: validation metrics, predict, ModelCheckpoint, exact resume, bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.lit import PipeNet, evaluate, reference

pytestmark = pytest.mark.slow


def test_validation_predict_and_model_checkpoint(tmp_path: Path) -> None:
    """Metrics logged on the last stage reach every rank; predictions come back whole; the best checkpoint loads."""
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 3, "partition": [2, 4]},
        steps=4,
        sanity=2,
        limit_val_batches=1.0,
        predict=True,
        monitor="val_acc",
    )
    _, ref_state = reference(4, 3)
    val_loss, val_acc, logits = evaluate(ref_state)
    for r in results:
        assert set(r["metrics"]) >= {"train_loss", "val_loss", "val_acc"}
        assert r["metrics"]["val_loss"] == pytest.approx(val_loss, rel=1e-5)
        assert r["metrics"]["val_acc"] == pytest.approx(val_acc, abs=1e-6)
        torch.testing.assert_close(torch.tensor(r["preds"]), logits)

    # each rank times its own steps and counts its own memory (memory/*_mib); everything else is mirrored exactly
    def mirrored(k: str) -> bool:
        return k != "avgpipe/samples_per_sec" and not k.startswith("memory/")

    assert {k: v for k, v in results[0]["metrics"].items() if mirrored(k)} == {
        k: v for k, v in results[1]["metrics"].items() if mirrored(k)
    }
    assert any(k.startswith("memory/") for k in results[0]["metrics"])
    best = list((tmp_path / "ckpts").glob("*.ckpt"))
    assert len(best) == 1, best
    model = PipeNet.load_from_checkpoint(best[0])
    for key, value in ref_state.items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_resume_continues_exactly(tmp_path: Path) -> None:
    """Resume from a ModelCheckpoint file with ckpt_path: losses and final weights are bit-identical.

    (A file written by ``trainer.save_checkpoint`` after ``fit`` stopped at ``max_steps`` does not resume
    exactly even on one device without this strategy: Lightning then restarts the next epoch's sampler one
    epoch ahead. ModelCheckpoint's files are the ones to resume from.)
    """
    model = {"optimizer": "adam", "lr": 0.01}
    strategy = {"num_microbatches": 2, "partition": [3, 3]}
    straight = tmp_path / "straight"
    full = run_lightning(straight, 2, strategy, steps=8, model=model, every_n_train_steps=4)
    midway = straight / "every" / "epoch=0-step=4.ckpt"
    assert midway.exists(), list((straight / "every").iterdir())
    resumed = tmp_path / "resumed"
    rest = run_lightning(resumed, 2, strategy, steps=8, model=model, ckpt_path=str(midway))
    assert rest[0]["losses"] == full[0]["losses"][4:]
    a, b = final_state(straight), final_state(resumed)
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ckpt = torch.load(resumed / "final.ckpt", weights_only=False)
    assert ckpt["global_step"] == 8


def test_bf16_mixed_matches_autocast_reference(tmp_path: Path) -> None:
    results = run_lightning(
        tmp_path, 2, {"num_microbatches": 2, "partition": [3, 3]}, steps=3, trainer={"precision": "bf16-mixed"}
    )
    ref_losses, ref_state = reference(3, 2, bf16=True)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key in ref_state:
        torch.testing.assert_close(state[key], ref_state[key])
