"""Every use of Lightning's private state, in one place (checked against the installed Lightning by
``tests/test_compat.py``, which names the use that broke when a Lightning release changes one). No other module
imports a private Lightning name or overrides a private Lightning method, and each entry below names the files that
use it (``tests/test_compat_boundary.py`` holds both to the code).

Private state read or written (each a function or class below; Lightning 2.6):

- ``resuming_from(trainer)``: the checkpoint this ``fit`` is about to restore, from ``Trainer._run``'s local
  ``ckpt_path`` (read through the calling frames). Used by: ``plugin/checkpoint/resume.py``, ``plugin/split/stages.py``.
- ``requested_checkpoint(trainer)``: the ``ckpt_path`` argument of the calling ``Trainer.fit`` (or ``validate``,
  ...), read through the calling frames, before Lightning resolves ``"last"``. Used by: ``plugin/checkpoint/resume.py``.
- ``interrupted_lasts(trainer)``: every ``last*.ckpt`` a kill left moved aside (``.last*.ckpt.replaced``), in the
  folder ``ModelCheckpoint``'s private ``__resolve_ckpt_dir`` (name-mangled) gives, as Lightning's own
  ``_find_last_checkpoints`` does (the launcher below uses it too). Used by: ``plugin/checkpoint/resume.py``.
- ``dumping_checkpoint(trainer)``: whether the call is inside ``trainer._checkpoint_connector.dump_checkpoint``
  (read through the calling frames), where the strategy's state dicts go to its own ``save_checkpoint``. Used by:
  ``plugin/checkpoint/hooks.py``.
- ``writes_logs(trainer)``: ``trainer._logger_connector.should_update_logs``. Used by: ``plugin/steps/hooks.py``.
- ``zeroes_gradients(trainer)``: automatic optimization whose backward is not skipped (``fit_loop._skip_backward``,
  which ``StochasticWeightAveraging`` sets), so ``zero_grad`` may run. Used by: ``plugin/steps/gradients.py``.
- ``reset_train_dataloader(trainer)``: ``trainer.fit_loop._combined_loader = None``. Used by:
  ``plugin/tuner_surface.py``.
- ``rebuild_train_dataloader(trainer)``: the same, then ``fit_loop.setup_data()`` and the sampler's epoch
  (``_set_sampler_epoch``). Used by: ``plugin/tuner/retune.py``.
- ``attached_trainer(module)``: ``LightningModule._trainer``. Used by: ``plugin/checkpoint/hooks.py``,
  ``plugin/process/base.py``, ``plugin/split/stages.py``, ``plugin/tuner_surface.py``.
- ``request_train_dataloader(trainer)``: ``trainer.fit_loop._data_source.dataloader()``. Used by:
  ``plugin/tuner/run.py``, ``plugin/split/stages.py``.
- ``stop_before_training(trainer)``: the epoch loop's ``max_steps = 0`` (``fit_loop.epoch_loop``, a loop's
  internals). Used by: ``cli.py``.
- ``ScriptLaunchedStrategy``: a ``ParallelStrategy`` whose private ``_configure_launcher`` sets the private
  ``_launcher`` to Lightning's ``_SubprocessScriptLauncher`` (the script run again once per local device), unless the
  cluster environment starts the processes itself. Used by: ``plugin/process/base.py``. It is a subclass adding
  ``plugin/process/launcher.py``'s guards: ``launch`` and the private ``_call_children_scripts`` overridden (the second
  sets the launcher's pid in the started ranks' environment only), ``self.procs`` read, and Lightning's private
  ``_ChildProcessObserver`` quieted (its ``_child_processes`` emptied) before the guard ends the ranks. Its
  ``launch`` also finishes a replace of ``last*.ckpt`` that a kill interrupted (``plugin/checkpoint/sharded.py``'s
  ``recover``) before Lightning resolves ``ckpt_path="last"``: the only hook before ``_fit_impl``, absent under
  torchrun, where ``plugin/checkpoint/resume.py`` puts it back at setup and stops the run with a message instead.
- ``AfterClosureMixedPrecision``: ``MixedPrecision`` whose private ``_after_closure`` hook (after the closure,
  before the optimizer step) calls a public ``after_closure``. Used by: ``plugin/steps/precision.py``.

Public helpers kept here because they stand beside those:

- ``unwrap_optimizer(optimizer)``: ``LightningOptimizer.optimizer``. Used by: ``plugin/checkpoint/state.py``,
  ``plugin/steps/gradients.py``, ``plugin/tuner/retune.py``.
- ``every(step, period)``: whether a step is one of every ``period``. Used by: ``plugin/steps/hooks.py``.

Private names imported from Lightning (internal, but the API every custom strategy uses), re-exported here so
the plugin imports them from one place:

- ``_StrategyRegistry`` (``lightning.fabric.strategies.registry``). Used by: ``plugin/strategy.py``.
- ``_distributed_is_initialized`` (``lightning.fabric.utilities.distributed``). Used by: ``plugin/process/base.py``.
- ``_get_default_process_group_backend_for_device`` (the same). Used by: ``plugin/process/base.py``.
- ``_init_dist_connection`` (the same). Used by: ``plugin/process/base.py``.
- ``_sync_ddp_if_available`` (the same). Used by: ``plugin/process/base.py``, ``plugin/strategy.py``.
- ``_optimizers_to_device`` (``lightning.fabric.utilities.optimizer``). Used by: ``plugin/checkpoint/hooks.py``,
  ``plugin/strategy.py``, ``plugin/tuner_surface.py``.

Private state of other libraries, not kept here: torchmetrics ``Metric._defaults``, ``_update_count``,
``_forward_cache``, ``_computed`` (``plugin/steps/bridge.py``); torch ``GradScaler._per_optimizer_states`` and
``_scale`` (``plugin/steps/precision.py``), ``optimizer._opt_called`` (``algorithms/optim.py``, what LR schedulers
check), ``torch.distributed._get_default_store`` (``runtime/failures/report.py``), a process group's
``options._timeout`` (``runtime/comms/topology.py``).
"""

from __future__ import annotations

import inspect
import logging
import os
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver
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
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.strategies.launchers.subprocess_script import _SubprocessScriptLauncher
from lightning.pytorch.strategies.parallel import ParallelStrategy
from torch.optim import Optimizer

from lightning_avgpipe.plugin.checkpoint.sharded import recover
from lightning_avgpipe.plugin.process.launcher import LAUNCHER_ENV, ChildGuard, check_port_free

__all__ = [
    "AfterClosureMixedPrecision",
    "ScriptLaunchedStrategy",
    "_StrategyRegistry",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "attached_trainer",
    "every",
    "rebuild_train_dataloader",
    "request_train_dataloader",
    "reset_train_dataloader",
    "resuming_from",
    "requested_checkpoint",
    "interrupted_lasts",
    "stop_before_training",
    "unwrap_optimizer",
    "writes_logs",
    "zeroes_gradients",
    "dumping_checkpoint",
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


def requested_checkpoint(trainer: pl.Trainer) -> Any:
    """The ``ckpt_path`` the user passed to this ``fit``/``validate``/``test``/``predict`` (``"last"``, a path or
    ``None``), before Lightning resolved it: the calling ``Trainer.fit`` frame's argument (as :func:`resuming_from`
    reads ``_run``'s); ``None`` outside such a call."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name in ("fit", "validate", "test", "predict") and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")
        frame = frame.f_back  # type: ignore[assignment]
    return None


def dumping_checkpoint(trainer: pl.Trainer | None) -> bool:
    """Whether this call comes from ``trainer``'s checkpoint dump (``Trainer.save_checkpoint``), whose state dicts
    reach ``strategy.save_checkpoint`` next, rather than from user code that wants the state dict itself. Lightning
    calls ``lightning_module_state_dict`` and ``optimizer_state`` from ``_CheckpointConnector.dump_checkpoint`` with
    no hook before it; the frames say whether it is the caller."""
    if trainer is None:
        return False
    connector = trainer._checkpoint_connector
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "dump_checkpoint" and frame.f_locals.get("self") is connector:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


def writes_logs(trainer: pl.Trainer) -> bool:
    """Whether Lightning writes this training step's logs (``log_every_n_steps``; the same on every rank).

    ``trainer._logger_connector.should_update_logs``: counts from the step about to run, so it answers inside
    ``training_step`` for that step. Anything not shaped like a Trainer answers ``True``.
    """
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def zeroes_gradients(trainer: pl.Trainer) -> bool:
    """Whether this training step's closure may run ``zero_grad``: automatic optimization, and the fit loop's
    private ``_skip_backward`` (set by ``StochasticWeightAveraging``: no ``zero_grad`` and no ``backward``) unset."""
    loop = getattr(getattr(trainer, "fit_loop", None), "epoch_loop", None)
    skip = getattr(getattr(loop, "automatic_optimization", None), "_skip_backward", True)
    return bool(trainer.lightning_module.automatic_optimization) and not skip


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


def stop_before_training(trainer: pl.Trainer) -> None:
    """Make the next ``fit`` run its setup and ``on_fit_start`` (the tuner) but no training step: the epoch loop's
    ``max_steps`` (``trainer.fit_loop.epoch_loop``, a loop's internals) set to 0; Lightning's "`max_steps=0`
    reached" line, which would read as a setting of the user's, is left out of the log."""
    trainer.fit_loop.epoch_loop.max_steps = 0
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_not_max_steps_zero)


def _not_max_steps_zero(record: logging.LogRecord) -> bool:
    return "`max_steps=0` reached" not in record.getMessage()


class AfterClosureMixedPrecision(MixedPrecision):
    """``MixedPrecision`` with a public hook right after the optimizer's closure (``training_step`` and
    ``backward``) and before the optimizer step: Lightning's private ``_after_closure`` calls :meth:`after_closure`
    first (there the gradients are unscaled and the scaler has recorded its overflow flags)."""

    def after_closure(self, model: Any, optimizer: Any) -> None:
        """Override: runs after the closure, before Lightning's own ``_after_closure`` (the gradient clipping)."""

    def _after_closure(self, model: Any, optimizer: Any) -> None:
        self.after_closure(model, optimizer)
        super()._after_closure(model, optimizer)


class ScriptLaunchedStrategy(ParallelStrategy):
    """A ``ParallelStrategy`` whose processes, when the cluster environment does not start them, are this script run
    again once per local device (Lightning's ``_SubprocessScriptLauncher``, as ``DDPStrategy`` does)."""

    @property
    def num_processes(self) -> int:
        """Processes on this node: one per device."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def num_nodes(self) -> int:
        """Nodes of the job (a subclass that the Trainer gives ``num_nodes`` overrides it)."""
        return 1

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _GuardedScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)


class _GuardedScriptLauncher(_SubprocessScriptLauncher):
    """Lightning's launcher, with ``plugin/process/launcher.py``'s guards: a port in use is refused before any rank
    starts, the started ranks watch this process, and this process ends them on a failure of its own (at exit)."""

    def launch(self, function: Callable[..., Any], *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        env = self.cluster_environment
        if not env.creates_processes_externally:  # the first call: the ranks start now
            if env.node_rank() == 0:  # the rendezvous is on this node (the other nodes reach node 0's)
                check_port_free(env.main_address, env.main_port)
                if trainer is not None and _requested_checkpoint(function, args, kwargs) == "last":
                    for path in interrupted_lasts(trainer):  # before Lightning looks for them, and any rank starts
                        _finish_replace(path)
            ChildGuard(lambda: self.procs, before_ending=quiet_child_observer)  # procs: filled when they start
        return super().launch(function, *args, trainer=trainer, **kwargs)

    def _call_children_scripts(self) -> None:
        os.environ[LAUNCHER_ENV] = str(os.getpid())  # the started ranks inherit it, nothing this process starts later
        try:
            super()._call_children_scripts()
        finally:
            os.environ.pop(LAUNCHER_ENV, None)


def _requested_checkpoint(function: Callable[..., Any], args: Any, kwargs: Any) -> Any:
    """The ``ckpt_path`` the user passed to ``fit``/``validate``/... (``"last"``, a path, ``None``), read from the
    arguments Lightning hands the launcher for ``Trainer._fit_impl`` (and its siblings)."""
    try:
        return inspect.signature(function).bind_partial(*args, **kwargs).arguments.get("ckpt_path")
    except TypeError:
        return None


def interrupted_lasts(trainer: Any) -> list[Path]:
    """Every ``last*.ckpt`` a kill left moved aside (``.last*.ckpt.replaced``, the checkpoint itself missing) in a
    ``ModelCheckpoint``'s folder, where Lightning's ``ckpt_path="last"`` looks; the folder as ``ModelCheckpoint``
    resolves it (its private ``__resolve_ckpt_dir``, as Lightning's own ``_find_last_checkpoints`` does)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    found = []
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        resolve = callback._ModelCheckpoint__resolve_ckpt_dir  # type: ignore[attr-defined]
        folder = Path(str(callback.dirpath or resolve(trainer)))
        pattern = f".{callback.CHECKPOINT_NAME_LAST}*{callback.FILE_EXTENSION}.replaced"
        found += [p.with_name(p.name[1 : -len(".replaced")]) for p in sorted(folder.glob(pattern))]
    return [p for p in found if not p.exists()]


def _finish_replace(path: Path) -> None:
    done = recover(path)
    if done is not None:
        print(f"AvgPipe: {done}.", file=sys.stderr)


def quiet_child_observer() -> None:
    """Make Lightning's ``_ChildProcessObserver`` thread stop without acting: it SIGKILLs the launching process once
    a started rank exits non-zero, which the launching process ending its ranks would trigger (an empty list of
    processes reads as all done)."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver):
            thread._child_processes = []
