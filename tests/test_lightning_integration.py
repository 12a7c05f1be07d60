"""Lightning features that depend on how the strategy mirrors state: reduce_fx, epoch-end metrics, clipping by
value with replicas, weights-only checkpoints, and reusing a Trainer or a module."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lightning_avgpipe import AvgPipeStrategy
from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.lit import PipeNet, evaluate, loader, reference


def _trainer(**kwargs: object) -> pl.Trainer:
    options = dict(
        accelerator="cpu",
        devices=1,
        strategy=AvgPipeStrategy(num_microbatches=4, partition=[6]),
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
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
    from lightning_avgpipe.plugin.split.placeholders import Elsewhere, Guard

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
    results = run_lightning(
        tmp_path,
        2,
        {"num_microbatches": 3, "partition": [2, 4]},
        steps=4,
        limit_val_batches=1.0,
        model={"epoch_metric": True},
    )
    _, ref_state = reference(4, 3)
    _, acc, _ = evaluate(ref_state)
    assert results[0]["metrics"]["val_acc"] == pytest.approx(acc) == results[1]["metrics"]["val_acc"]


@pytest.mark.slow
def test_clipping_by_value_reaches_the_replicas(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2}
    run_lightning(tmp_path / "plain", 2, strategy, steps=2)
    run_lightning(
        tmp_path / "clipped",
        2,
        strategy,
        steps=2,
        trainer={"gradient_clip_val": 1e-3, "gradient_clip_algorithm": "value"},
    )
    plain, clipped = final_state(tmp_path / "plain"), final_state(tmp_path / "clipped")
    assert any(not torch.equal(plain[k], clipped[k]) for k in plain)


def test_divergence_is_measured_on_the_steps_lightning_writes_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """N = 2 on one process: the divergence costs N passes over the weights and an all-reduce, so it is measured
    only on the steps whose logs Lightning writes (every log_every_n_steps), and then it is logged."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_avgpipe.algorithms.elastic import ElasticAveraging

    trainer = _trainer(
        strategy=AvgPipeStrategy(num_microbatches=2, num_pipelines=2, partition=[6]),
        max_steps=6,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path, name="", version=""),
    )
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


@pytest.mark.parametrize(("m", "n"), [(4, 1), (2, 2)], ids=["one-pipeline-halves", "two-pipelines"])
def test_noise_scale_is_measured_and_logged_on_the_steps_lightning_writes_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, m: int, n: int
) -> None:
    """The gradient noise scale is measured only where a log is written, and logged as avgpipe/noise_scale."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_avgpipe.runtime.sync.gradient_probe import GradientProbe

    trainer = _trainer(
        strategy=AvgPipeStrategy(num_microbatches=m, num_pipelines=n, partition=[6]),
        max_steps=6,
        log_every_n_steps=2,
        logger=CSVLogger(tmp_path, name="", version=""),
    )
    measured: list[int] = []
    original = GradientProbe.finish

    def spy(self: GradientProbe, *args: object, **kwargs: object) -> object:
        measured.append(trainer.global_step)
        return original(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(GradientProbe, "finish", spy)
    from torch.utils.data import DataLoader, DistributedSampler

    from tests.helpers.lit import dataset

    data = dataset()  # in the shuffled order the seeds below were chosen for (one replica, seed 0)
    order = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    trainer.fit(PipeNet(), DataLoader(data, batch_size=12, sampler=order))
    assert measured == [1, 3, 5]
    strategy = trainer.strategy
    assert isinstance(strategy, AvgPipeStrategy)
    noise = strategy.controller.noise_scale
    assert noise.measurements == 3
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("avgpipe/noise_scale")]
    assert {int(r["step"]) for r in rows} <= {1, 3, 5}
    assert all(float(r["avgpipe/noise_scale"]) > 0 for r in rows)
    if m == 4:  # with these seeds the estimate turns positive by the 2nd measurement, and is logged from then on
        assert [int(r["step"]) for r in rows] == [3, 5]
        assert float(rows[-1]["avgpipe/noise_scale"]) == pytest.approx(noise.value, rel=1e-5)
    else:  # this tiny model is noise-dominated: |G|² averages below 0 over 3 steps, so nothing is logged yet
        assert noise.value is None and not rows


def test_step_figures_are_measured_only_on_the_steps_lightning_writes_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The figures' all-gather and the activation meter's saved-tensor hooks cost every step they run on: they run
    on log steps only (and the figures are then written), never on the steps between; the meter also on the first
    step, for the memory breakdown (logged then, with no figures; written with the first logs)."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_avgpipe.runtime.controller import StepController
    from lightning_avgpipe.runtime.trace import ActivationMeter

    trainer = _trainer(
        strategy=AvgPipeStrategy(num_microbatches=2, partition=[6]),
        max_steps=6,
        log_every_n_steps=3,
        logger=CSVLogger(tmp_path, name="", version=""),
    )
    gathered: list[int] = []
    metered: list[int] = []
    figures, unit = StepController.figures, ActivationMeter.unit

    def spy_figures(self: StepController, *args: object) -> torch.Tensor:
        gathered.append(trainer.global_step)
        return figures(self, *args)  # type: ignore[arg-type]

    def spy_unit(self: ActivationMeter, u: int) -> object:
        metered.append(trainer.global_step)
        return unit(self, u)

    monkeypatch.setattr(StepController, "figures", spy_figures)
    monkeypatch.setattr(ActivationMeter, "unit", spy_unit)
    trainer.fit(PipeNet(), loader())
    assert gathered == [2, 5]
    assert sorted(set(metered)) == [0, 2, 5]  # every unit of those steps, no unit of the others
    with open(tmp_path / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("avgpipe/bubble_fraction")]
    assert [int(r["step"]) for r in rows] == [2, 5]
    assert all(float(r["avgpipe/peak_memory_mb/stage0"]) > 0 for r in rows)
    with open(tmp_path / "metrics.csv") as f:
        memory = [r for r in csv.DictReader(f) if r.get("memory/weights_mib")]
    # logged at step 0, written once, where Lightning writes logs first
    assert [int(r["step"]) for r in memory] == [2] and float(memory[0]["memory/activations_mib"]) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resuming_a_balanced_partition_cuts_as_the_checkpoint(tmp_path: Path) -> None:
    """partition="balanced" times the layers, and noise gives other cuts; a resumed fit takes the checkpoint's cut,
    so the replicas' optimizer states are restored instead of dropped as another layout's."""
    strategy = {"num_microbatches": 2, "num_pipelines": 2, "partition": "balanced"}
    run_lightning(tmp_path / "first", 2, strategy, steps=2, example_input=True, model={"optimizer": "adam", "lr": 0.01})
    saved = torch.load(tmp_path / "first" / "final.ckpt", weights_only=False)["optimizer_states"][0]["avgpipe_layout"]
    resumed = run_lightning(
        tmp_path / "resumed",
        2,
        strategy,
        steps=4,
        example_input=True,
        model={"optimizer": "adam", "lr": 0.01},
        ckpt_path=str(tmp_path / "first" / "final.ckpt"),
    )
    out = resumed[0]["output"]
    assert f"cutting the model as the checkpoint was cut, partition={saved['partition']}" in out
    assert "differs from" not in out  # the layout matched: optimizer states and replicas were restored
    assert len(resumed[0]["losses"]) == 2


def test_checkpoint_layout_reads_what_the_strategy_saved(tmp_path: Path) -> None:
    from lightning_avgpipe.plugin.checkpoint.resume import checkpoint_layout

    layout = {"stages": 2, "groups": 1, "pipelines": 2, "partition": [2, 4]}
    torch.save({"optimizer_states": [{"avgpipe_layout": layout}]}, tmp_path / "a.ckpt")
    torch.save({"optimizer_states": [{"state": {}}]}, tmp_path / "plain.ckpt")
    (tmp_path / "bad.ckpt").write_bytes(b"not a checkpoint")
    assert checkpoint_layout(tmp_path / "a.ckpt") == layout
    assert checkpoint_layout(tmp_path / "plain.ckpt") is None
    assert checkpoint_layout(tmp_path / "bad.ckpt") is None  # the real load names the problem
    assert checkpoint_layout(tmp_path / "missing.ckpt") is None


def test_remote_checkpoint_paths_go_to_the_checkpoint_io(tmp_path: Path) -> None:
    """An fsspec URL is not renamed locally: the checkpoint lands on that filesystem (here fsspec's memory://)."""
    import fsspec

    trainer = _trainer()
    trainer.fit(PipeNet(), loader())
    trainer.save_checkpoint("memory://avgpipe-test/remote.ckpt")
    fs = fsspec.filesystem("memory")
    assert fs.exists("/avgpipe-test/remote.ckpt") and fs.size("/avgpipe-test/remote.ckpt") > 0
    assert not list(Path.cwd().glob("memory:*"))  # nothing written to a local folder named after the scheme


def test_a_metric_reset_and_updated_again_is_mirrored() -> None:
    """A metric updated in validation_step and computed at epoch end: after reset(), the next epoch's single update
    brings its count back to 1, the count last sent; its state must still reach the other stages."""
    import torchmetrics
    from torch import nn

    from lightning_avgpipe.plugin.split.placeholders import Guard
    from lightning_avgpipe.plugin.steps.bridge import StepBridge

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.total = torchmetrics.SumMetric()

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
            x, y = batch
            self.total.update(self(x).sum())

    net = Net()
    bridge = StepBridge(net, Guard())
    batch = (torch.ones(2, 3), torch.zeros(2))
    sent = []
    for epoch in range(2):  # one validation batch per epoch, then compute() and reset() at epoch end
        bridge.call_step("validation_step", torch.full((2, 3), float(epoch + 1)), batch, 1.0)
        states = [payload for _, kind, payload, _ in bridge.take_logs() if kind == "state"]
        sent.append(states)
        net.total.reset()
    assert len(sent[0]) == 1 and len(sent[1]) == 1  # the second epoch sends too
    assert float(sent[1][0][1]["sum_value"]) == pytest.approx(12.0)  # epoch 2's output: 2 x 3 twos
