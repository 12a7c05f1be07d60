"""``lightning_avgpipe.plugin.compat`` against the installed Lightning: each use of Lightning's private state still
means what compat assumes. A failure names the use; fix that function of compat.py (and nothing else should need to
change)."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import SingleDeviceStrategy
from torch.utils.data import DataLoader

from lightning_avgpipe.plugin import compat


def broke(use: str) -> str:
    return f"Lightning {lightning.__version__} changed {use}; update lightning_avgpipe/plugin/compat.py"


def trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    kwargs = {
        "accelerator": "cpu",
        "devices": 1,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "limit_val_batches": 0,
        "max_steps": 4,
        "default_root_dir": tmp_path,
        **kwargs,
    }
    return pl.Trainer(**kwargs)


class LateRestore(SingleDeviceStrategy):
    """Restores the checkpoint after ``setup`` and ``on_fit_start``, as AvgPipeStrategy does."""

    def __init__(self, seen: list[Any]) -> None:
        super().__init__(device=torch.device("cpu"))
        self.seen = seen

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    def setup(self, trainer: pl.Trainer) -> None:
        self.seen.append(("strategy.setup", compat.resuming_from(trainer)))
        super().setup(trainer)


class Probe(pl.Callback):
    def __init__(self, seen: list[Any]) -> None:
        self.seen = seen

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.seen.append(("setup", compat.resuming_from(trainer)))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen.append(("on_fit_start", compat.resuming_from(trainer)))


def test_resuming_from(tmp_path: Path) -> None:
    """The path this fit restores, seen in setup, strategy.setup and on_fit_start before the restore sets
    ``trainer.ckpt_path``; ``None`` in a later fit of the same Trainer without one (``ckpt_path`` is then stale)."""
    use = "Trainer._run's local ckpt_path (compat.resuming_from)"
    assert "ckpt_path" in inspect.signature(pl.Trainer._run).parameters, broke(use)
    first = trainer(tmp_path, max_steps=2)
    first.fit(BoringModel())
    path = str(tmp_path / "two.ckpt")
    first.save_checkpoint(path)
    assert compat.resuming_from(first) is None  # outside a fit: trainer.ckpt_path (this Trainer never resumed)

    seen: list[Any] = []
    second = trainer(tmp_path, strategy=LateRestore(seen), callbacks=[Probe(seen)])
    second.fit(BoringModel(), ckpt_path=path)
    assert second.global_step == 4  # resumed at 2, ran to max_steps
    assert seen == [("setup", path), ("strategy.setup", path), ("on_fit_start", path)], broke(use)
    assert compat.resuming_from(second) == path  # after the fit: trainer.ckpt_path

    seen.clear()
    second.fit_loop.epoch_loop.max_steps = 5
    second.fit(BoringModel())  # no ckpt_path: trainer.ckpt_path still names the previous fit's checkpoint
    assert seen == [("setup", None), ("strategy.setup", None), ("on_fit_start", None)], broke(use)


def test_writes_logs(tmp_path: Path) -> None:
    """Inside ``training_step``: True on every ``log_every_n_steps``-th step (counting the step that runs)."""
    use = "trainer._logger_connector.should_update_logs (compat.writes_logs)"
    assert isinstance(
        inspect.getattr_static(type(pl.Trainer(logger=False)._logger_connector), "should_update_logs", None), property
    ), broke(use)
    seen: list[bool] = []

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(compat.writes_logs(self.trainer))
            return super().training_step(batch, batch_idx)

    trainer(tmp_path, log_every_n_steps=2, max_steps=6).fit(Model())
    assert seen == [False, True, False, True, False, True], broke(use)
    assert compat.writes_logs(object()) is True  # type: ignore[arg-type]  # not a Trainer: log


def test_zeroes_gradients(tmp_path: Path) -> None:
    """Inside ``training_step`` of automatic optimization: True, and False once the fit loop skips the backward (what
    ``StochasticWeightAveraging`` sets: no ``zero_grad`` runs then)."""
    use = "trainer.fit_loop._skip_backward (compat.zeroes_gradients)"
    seen: list[bool] = []

    class Model(BoringModel):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            seen.append(compat.zeroes_gradients(self.trainer))
            return super().training_step(batch, batch_idx)

    fitted = trainer(tmp_path, max_steps=2)
    fitted.fit(Model())
    assert seen == [True, True], broke(use)
    fitted.fit_loop._skip_backward = True
    assert compat.zeroes_gradients(fitted) is False, broke(use)


@pytest.mark.parametrize("reset", [False, True])
def test_reset_train_dataloader(tmp_path: Path, reset: bool) -> None:
    """A loader set up early (``estimated_stepping_batches`` in ``configure_optimizers``) is requested again."""
    use = "trainer.fit_loop._combined_loader (compat.reset_train_dataloader)"
    calls: list[int] = []

    class Model(BoringModel):
        def train_dataloader(self) -> DataLoader:
            calls.append(1)
            return super().train_dataloader()

        def configure_optimizers(self) -> Any:
            assert self.trainer.estimated_stepping_batches == 4  # sets the train loader up
            assert self.trainer.train_dataloader is not None, broke(use)
            if reset:
                compat.reset_train_dataloader(self.trainer)
                assert self.trainer.train_dataloader is None, broke(use)
            return super().configure_optimizers()

    trainer(tmp_path, max_epochs=1).fit(Model())  # a finite epoch count: the estimate sets the loader up
    assert len(calls) == (2 if reset else 1), broke(use)


def test_attached_trainer(tmp_path: Path) -> None:
    use = "LightningModule._trainer (compat.attached_trainer)"
    module = BoringModel()
    assert compat.attached_trainer(module) is None, broke(use)
    with pytest.raises(RuntimeError):  # the public property raises instead: why compat has this function
        module.trainer  # noqa: B018
    t = trainer(tmp_path)
    module.trainer = t
    assert compat.attached_trainer(module) is t, broke(use)
    assert compat.attached_trainer(object()) is None


def test_request_train_dataloader(tmp_path: Path) -> None:
    """A fresh loader from the module's hook, or the very loader passed to ``fit``."""
    use = "trainer.fit_loop._data_source.dataloader() (compat.request_train_dataloader)"
    got: list[Any] = []

    class Model(BoringModel):
        def on_fit_start(self) -> None:
            got.append(compat.request_train_dataloader(self.trainer))

    model = Model()
    trainer(tmp_path, max_steps=1).fit(model)
    assert isinstance(got[-1], DataLoader), broke(use)
    loader = model.train_dataloader()
    trainer(tmp_path, max_steps=1).fit(Model(), train_dataloaders=loader)
    assert got[-1] is loader, broke(use)


def test_unwrap_optimizer() -> None:
    from lightning.pytorch.core.optimizer import LightningOptimizer

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(opt)) is opt
    assert compat.unwrap_optimizer(opt) is opt


def test_private_imports_keep_their_shape() -> None:
    """The re-exported private names exist (else importing compat fails) and take the arguments the plugin passes."""

    def params(fn: Any) -> list[str]:
        return list(inspect.signature(fn).parameters)

    assert params(compat._SubprocessScriptLauncher)[:3] == ["cluster_environment", "num_processes", "num_nodes"], broke(
        "_SubprocessScriptLauncher(cluster_environment, num_processes, num_nodes)"
    )
    assert params(compat._init_dist_connection)[:2] == [
        "cluster_environment",
        "torch_distributed_backend",
    ] and "kwargs" in params(compat._init_dist_connection), broke("_init_dist_connection(env, backend, timeout=)")
    assert params(compat._sync_ddp_if_available)[:3] == ["result", "group", "reduce_op"], broke(
        "_sync_ddp_if_available(tensor, group, reduce_op=)"
    )
    assert params(compat._optimizers_to_device)[:2] == ["optimizers", "device"], broke("_optimizers_to_device")
    assert compat._get_default_process_group_backend_for_device(torch.device("cpu")) == "gloo", broke(
        "_get_default_process_group_backend_for_device"
    )
    assert compat._distributed_is_initialized() is torch.distributed.is_initialized(), broke(
        "_distributed_is_initialized"
    )
    registry = compat._StrategyRegistry()
    registry.register("probe", dict, description="d", a=1)
    assert registry.get("probe") == {"a": 1} and "probe" in registry.available_strategies(), broke(
        "_StrategyRegistry.register/get"
    )
    from lightning.pytorch.strategies import StrategyRegistry

    assert isinstance(StrategyRegistry, compat._StrategyRegistry), broke("StrategyRegistry's type")
