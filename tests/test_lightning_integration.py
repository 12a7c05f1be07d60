"""Lightning features that depend on how the strategy mirrors state: reduce_fx, epoch-end metrics, clipping by
value with replicas, weights-only checkpoints, and reusing a Trainer or a module."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_avgpipe import AvgPipeStrategy
from tests.helpers.lit import PipeNet, evaluate, loader, reference
from tests.test_strategy_equivalence import final_state, run_lightning


def _trainer(**kwargs: object) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=1, strategy=AvgPipeStrategy(num_microbatches=4, partition=[6]),
                   max_steps=2, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(**options)  # type: ignore[arg-type]


def test_micro_batches_combine_with_reduce_fx_and_fit_twice_on_one_trainer() -> None:
    trainer = _trainer(enable_model_summary=True)
    model = PipeNet()
    model.example_input_array = torch.zeros(2, 8)
    trainer.fit(model, loader())
    metrics = trainer.validate(model, loader(), verbose=False)[0]
    _, ref_state = reference(2, 4)
    _, acc, _ = evaluate(ref_state)
    assert metrics["val_correct"] == pytest.approx(acc * 48)  # reduce_fx="sum": summed over micro-batches
    assert metrics["val_acc"] == pytest.approx(acc)
    trainer.fit_loop.epoch_loop.max_steps = 4
    trainer.fit(model, loader())  # the same Trainer again: the split model is reused, the summary still skips it
    assert trainer.global_step == 4


def test_a_split_module_in_a_new_trainer_is_refused_with_the_cure() -> None:
    """After a fit on S > 1 stages a rank's module holds placeholders for the other stages' layers."""
    from lightning_avgpipe.plugin.bridge import Elsewhere, Guard

    model = PipeNet()
    model.layers[3] = Elsewhere("layers.3", 1, Guard())  # as rank 0 of a [3, 3] split leaves it
    with pytest.raises(ValueError, match="already split into stages.*load_from_checkpoint"):
        _trainer().validate(model, loader())


def test_weights_only_checkpoint_validates(tmp_path: Path) -> None:
    trainer = _trainer()
    model = PipeNet()
    trainer.fit(model, loader())
    path = tmp_path / "weights.ckpt"
    trainer.save_checkpoint(path, weights_only=True)
    assert "optimizer_states" not in torch.load(path, weights_only=False)
    assert trainer.validate(model, loader(), ckpt_path=str(path), verbose=False)[0]["val_loss"] > 0


@pytest.mark.slow
def test_epoch_end_metric_is_the_same_on_every_stage(tmp_path: Path) -> None:
    """A metric updated on the last stage and computed in on_validation_epoch_end: rank 0 (the logger's) agrees."""
    results = run_lightning(tmp_path, 2, {"num_microbatches": 3, "partition": [2, 4]}, steps=4,
                            limit_val_batches=1.0, model={"epoch_metric": True})
    _, ref_state = reference(4, 3)
    _, acc, _ = evaluate(ref_state)
    assert results[0]["metrics"]["val_acc"] == pytest.approx(acc) == results[1]["metrics"]["val_acc"]


@pytest.mark.slow
def test_clipping_by_value_reaches_the_replicas(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2}
    run_lightning(tmp_path / "plain", 2, strategy, steps=2)
    run_lightning(tmp_path / "clipped", 2, strategy, steps=2,
                  trainer={"gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value"})
    plain, clipped = final_state(tmp_path / "plain"), final_state(tmp_path / "clipped")
    assert any(not torch.equal(plain[k], clipped[k]) for k in plain)


def test_divergence_is_measured_on_the_steps_lightning_writes_logs(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """N = 2 on one process: the divergence costs N passes over the weights and an all-reduce, so it is measured
    only on the steps whose logs Lightning writes (every log_every_n_steps), and then it is logged."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_avgpipe.elastic import ElasticAveraging

    trainer = _trainer(strategy=AvgPipeStrategy(num_microbatches=2, num_pipelines=2, partition=[6]), max_steps=6,
                       log_every_n_steps=3, logger=CSVLogger(tmp_path, name="", version=""))
    measured: list[int] = []
    original = ElasticAveraging.divergence

    def spy(self: ElasticAveraging) -> list[torch.Tensor]:
        measured.append(trainer.global_step)
        return original(self)

    monkeypatch.setattr(ElasticAveraging, "divergence", spy)
    trainer.fit(PipeNet(), loader())
    assert measured == [2, 5]  # the 3rd and 6th steps (global_step before their update), none between
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("avgpipe/divergence")]
    assert [int(r["step"]) for r in rows] == [2, 5]
    assert all(float(r["avgpipe/divergence"]) > 0 for r in rows)
