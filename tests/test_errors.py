"""Bad input fails before training with a message that names the argument, the value and the fix."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe import AvgPipeStrategy, PipelineContractError
from tests.helpers.lit import PipeNet, loader


def fit(model: pl.LightningModule, batch_size: int = 12, **strategy: Any) -> pl.Trainer:
    plugins = strategy.pop("plugins", None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=AvgPipeStrategy(**strategy),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=plugins,
    )
    trainer.fit(model, loader(batch_size))
    return trainer


class NoContract(PipeNet):
    configure_pipeline = None  # type: ignore[assignment]


class StrayLayers(PipeNet):
    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(nn.Linear(8, 4))


class ExtraParameter(PipeNet):
    def __init__(self) -> None:
        super().__init__()
        self.temperature = nn.Parameter(torch.ones(()))


class CallsLayersDirectly(PipeNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.layers(x), y)


class NeverCallsSelf(PipeNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return torch.zeros((), requires_grad=True)


class TransformsInput(PipeNet):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x * 2), y)


class Manual(PipeNet):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


@pytest.mark.parametrize(
    ("model", "error", "match"),
    [
        (NoContract, PipelineContractError, "configure_pipeline"),
        (StrayLayers, PipelineContractError, "not submodules"),
        (ExtraParameter, PipelineContractError, "temperature"),
        (CallsLayersDirectly, PipelineContractError, "called the pipelined layer 'layers.0' directly"),
        (NeverCallsSelf, PipelineContractError, "never called self"),
        (TransformsInput, PipelineContractError, "differs from pipeline_inputs"),
        (Manual, PipelineContractError, "manual optimization"),
    ],
)
def test_contract_errors(model: type, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        fit(model())


def test_partition_list_wrong_sum() -> None:
    with pytest.raises(ValueError, match=r"partition=\[4\] sums to 4 layers but configure_pipeline\(\) returns 6"):
        fit(PipeNet(), partition=[4])


def test_more_microbatches_than_samples() -> None:
    with pytest.raises(ValueError, match="The batch has 12 samples but num_microbatches=16"):
        fit(PipeNet(), num_microbatches=16)


def test_unknown_schedule_lists_valid_ones() -> None:
    with pytest.raises(
        ValueError, match=r"schedule='zigzag'.*\['afab', '1f1b', 'advance', 'zbh1', 'zbadvance', 'interleaved', 'zbv'\]"
    ):
        AvgPipeStrategy(schedule="zigzag")


def test_bad_microbatch_count() -> None:
    with pytest.raises(ValueError, match="num_microbatches=0 must be an int >= 1"):
        AvgPipeStrategy(num_microbatches=0)


def test_16_mixed_with_replicas_is_refused() -> None:
    """The scaler unscales one model per stage; elastic replicas would be left scaled (on CPU, Lightning maps
    precision="16-mixed" to bf16, so the plugin is given explicitly)."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    with pytest.raises(ValueError, match="precision='16-mixed' with replicas .* not supported.*averaging='exact'"):
        fit(PipeNet(), plugins=[MixedPrecision("16-mixed", "cpu")], num_pipelines=2)


def test_dict_batch_needs_pipeline_inputs() -> None:
    from lightning_avgpipe.plugin.contract import default_pipeline_inputs

    with pytest.raises(PipelineContractError, match="Implement `pipeline_inputs"):
        default_pipeline_inputs({"x": torch.zeros(2, 8)})


def test_single_stage_equals_plain_training() -> None:
    """S = 1: the strategy is plain training with accumulation over micro-batches (here 4 of 3 samples)."""
    from tests.helpers.lit import reference

    trainer = fit(PipeNet(), num_microbatches=4)
    _, ref_state = reference(1, 4)
    state = trainer.lightning_module.state_dict()
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value)


def test_truncated_checkpoint_is_named_and_the_previous_one_loads(tmp_path: Any) -> None:
    trainer = fit(PipeNet(), num_microbatches=2)
    good = tmp_path / "good.ckpt"
    trainer.save_checkpoint(good)
    assert not list(tmp_path.glob(".*.tmp-*"))  # written through a temporary file, renamed into place
    bad = tmp_path / "bad.ckpt"
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"Cannot read the checkpoint .*bad.ckpt: it is truncated or corrupt"):
        trainer.strategy.load_checkpoint(bad)
    assert "state_dict" in trainer.strategy.load_checkpoint(good)


def test_batch_that_does_not_split_evenly() -> None:
    with pytest.raises(ValueError, match=r"A batch of 12 samples does not split into num_microbatches=5 equal"):
        fit(PipeNet(), num_microbatches=5)


class TwoOptimizers(PipeNet):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)]


def test_more_than_one_optimizer() -> None:
    with pytest.raises(Exception, match="multiple optimizers is only supported with manual optimization"):
        fit(TwoOptimizers())


class ScalesOutput(PipeNet):
    """forward does more than the layers: trained as the layers, served as forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x) * 2


class Flattens(PipeNet):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).flatten()


@pytest.mark.parametrize("example", [False, True], ids=["first-batch", "example-input"])
def test_a_forward_that_is_not_the_layers_is_refused_naming_the_difference(example: bool) -> None:
    model = ScalesOutput()
    if example:
        model.example_input_array = torch.randn(5, 8)
    with pytest.raises(PipelineContractError, match=r"forward\(x\) is not its configure_pipeline\(\) layers") as info:
        fit(model, num_microbatches=2)
    assert "largest difference" in str(info.value) and "check_forward=False" in str(info.value)
    wrong_shape = r"forward gives float32 \(\d+,\), the layers give float32 \(2, 4\)"
    with pytest.raises(PipelineContractError, match=wrong_shape):
        fit(Flattens(), num_microbatches=2)


def test_the_forward_check_keeps_the_data_order_and_can_be_turned_off() -> None:
    from torch.utils.data import DataLoader

    from lightning_avgpipe.plugin.steps.data import peek
    from tests.helpers.lit import dataset

    shuffled = DataLoader(dataset(48), batch_size=12, shuffle=True)  # its order comes from the global RNG
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = peek(shuffled)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(first[0], next(iter(shuffled))[0])  # training then sees the batches it would have seen
    trainer = fit(ScalesOutput(), num_microbatches=2, check_forward=False)  # the user said: too large to run whole
    assert trainer.global_step == 1
