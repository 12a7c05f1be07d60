"""Every use of Lightning's private state, in one place (checked against the installed Lightning by
``tests/test_compat.py``, which names the use that broke when a Lightning release changes one).

Private state read or written (each a function below; Lightning 2.6):

- ``resuming_from(trainer)``: the checkpoint this ``fit`` is about to restore, from ``Trainer._run``'s local
  ``ckpt_path`` (read through the calling frames). Used by ``resume.py`` (the strategy's resumed partition, the
  tuner's "keep a resumed run's setting").
- ``writes_logs(trainer)``: ``trainer._logger_connector.should_update_logs``. Used by ``strategy.py``.
- ``reset_train_dataloader(trainer)``: ``trainer.fit_loop._combined_loader = None``. Used by ``strategy.py``.
- ``attached_trainer(module)``: ``LightningModule._trainer``. Used by ``strategy.py``.
- ``request_train_dataloader(trainer)``: ``trainer.fit_loop._data_source.dataloader()``. Used by ``tuner.py``.
- ``unwrap_optimizer(optimizer)``: public (``LightningOptimizer.optimizer``); replaces ``strategy.py``'s
  ``getattr(optimizer, "_optimizer", optimizer)``.

Private names imported from Lightning (internal, but the API every custom strategy uses), re-exported here so
the plugin imports them from one place:

- ``lightning.fabric.strategies.registry._StrategyRegistry``: ``strategy.py`` (``register_strategies``).
- ``lightning.fabric.utilities.distributed._distributed_is_initialized``,
  ``_get_default_process_group_backend_for_device``, ``_init_dist_connection``, ``_sync_ddp_if_available``:
  ``strategy.py``.
- ``lightning.fabric.utilities.optimizer._optimizers_to_device``: ``strategy.py``.
- ``lightning.pytorch.strategies.launchers.subprocess_script._SubprocessScriptLauncher``: ``strategy.py``.

Private state of other libraries, not kept here: torchmetrics ``Metric._defaults``, ``_update_count``,
``_forward_cache``, ``_computed`` (``bridge.py``); torch ``optimizer._opt_called`` (``optim.py``, what LR
schedulers check); ``torch.distributed._get_default_store`` (``runtime/p2p.py``, ``runtime/watchdog.py``).
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.data import _set_sampler_epoch
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from torch.optim import Optimizer

__all__ = [
    "_StrategyRegistry",
    "_SubprocessScriptLauncher",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "attached_trainer",
    "request_train_dataloader",
    "reset_train_dataloader",
    "resuming_from",
    "unwrap_optimizer",
    "writes_logs",
]


def resuming_from(trainer: pl.Trainer) -> Any:
    """The checkpoint this ``fit`` is about to restore, or ``None``; from ``setup``/``on_fit_start`` on.

    Lightning resolves the path (``"last"``, ``"hpc"``, ``trainer.ckpt_path = ...``) in ``_fit_impl`` and hands it
    to ``_run`` as the local ``ckpt_path``; nothing else holds it until the restore. With
    ``restore_checkpoint_after_setup`` (this strategy) the restore runs after ``strategy.setup`` and
    ``on_fit_start``, and only then sets ``trainer.ckpt_path`` (``_checkpoint_connector.resume_start``); before,
    ``trainer.ckpt_path`` is still the previous ``fit``'s. Hooking ``_run`` or ``_select_ckpt_path`` instead would
    need a hook before ``_fit_impl`` runs, and the only one (the strategy's launcher) is absent under torchrun. So
    the local is read from the calling frames (the innermost ``Trainer._run`` of this trainer); outside a
    ``fit``/``validate``/... call, ``trainer.ckpt_path``.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")  # this fit's; trainer.ckpt_path may be a previous call's
        frame = frame.f_back  # type: ignore[assignment]
    return trainer.ckpt_path


def writes_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (``log_every_n_steps``; the same on every rank).

    ``trainer._logger_connector.should_update_logs``: counts from the step about to run, so it answers inside
    ``training_step`` for that step. Anything not shaped like a Trainer answers ``True``.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def reset_train_dataloader(trainer: pl.Trainer) -> None:
    """Make ``fit`` set the train dataloader up again (calling ``train_dataloader()`` anew) when it next needs it.

    ``fit_loop.setup_data`` returns early while ``fit_loop._combined_loader`` is set (and
    ``trainer.estimated_stepping_batches`` sets it up before training starts); ``None`` makes it start over.
    """
    trainer.fit_loop._combined_loader = None


def every(step: int, period: int) -> bool:
    """Whether ``step`` is one of every ``period`` steps (never when ``period`` is 0)."""
    return period > 0 and step % period == 0


def rebuild_train_dataloader(trainer: pl.Trainer) -> None:
    """Set the train dataloader up again now, in ``on_train_epoch_start``: the fit loop set it up just before that
    hook (``_FitLoop.on_advance_start``) and iterates it right after, so a new grouping must be in place already."""
    loop = trainer.fit_loop
    loop._combined_loader = None
    loop.setup_data()
    if loop._combined_loader is not None:
        for dl in loop._combined_loader.flattened:
            _set_sampler_epoch(dl, loop.epoch_progress.current.processed)


def attached_trainer(module: Any) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or ``None`` (``LightningModule.trainer`` raises instead)."""
    return getattr(module, "_trainer", None)


def request_train_dataloader(trainer: pl.Trainer) -> Any:
    """A train dataloader straight from what ``fit`` was given, independent of the one the fit loop iterates.

    ``trainer.fit_loop._data_source.dataloader()``: calls the datamodule's or module's ``train_dataloader()``, or
    returns the loader(s) passed as ``fit(train_dataloaders=...)``.
    """
    return trainer.fit_loop._data_source.dataloader()


def unwrap_optimizer(optimizer: Optimizer) -> Optimizer:
    """The user's optimizer behind a ``LightningOptimizer`` (itself otherwise)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
