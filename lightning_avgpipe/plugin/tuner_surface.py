"""What the tuner may touch of ``AvgPipeStrategy`` besides its settings (``config``) and state (``topology``,
``controller``): :meth:`TunerSurface.probe` to measure, :meth:`TunerSurface.reconfigure` to apply a setting and
:meth:`TunerSurface.memory_limit_bytes` to read the limit. ``plugin/tuner/`` reaches the strategy through these.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import Metric

from lightning_avgpipe.config import PipelineConfig, check_same_placement
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.compat import _optimizers_to_device
from lightning_avgpipe.plugin.contract import pipeline_inputs
from lightning_avgpipe.plugin.process.base import ProcessStrategy
from lightning_avgpipe.plugin.steps.bridge import StepBridge
from lightning_avgpipe.plugin.steps.precision import PipelineMixedPrecision
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.controller import StepController, memory_limit_bytes
from lightning_avgpipe.schedules.generate import placed_by, reads_k
from lightning_avgpipe.tuning.probe import StageProbe


def next_config(
    old: PipelineConfig,
    changes: dict[str, Any],
    num_groups: int | None,
    loss_scaling: bool = False,
    keep_optimizers: bool = False,
) -> PipelineConfig:
    """``old`` with ``changes`` (``PipelineConfig`` fields), or a ``ValueError`` naming the fix when the running job
    (``num_groups`` D once the pipeline exists, else ``None``) cannot take it: under loss scaling (16-mixed) only one
    model per stage, and with ``keep_optimizers`` one model before and after (its optimizer carries on)."""
    new = replace(old, **changes)
    check_same_placement(old, new)
    if num_groups is None:
        return new
    if loss_scaling and not new.one_model(num_groups):
        raise ValueError(
            f"reconfigure to num_pipelines={new.num_pipelines} with elastic averaging under precision='16-mixed': the "
            "loss scaler unscales one model per stage; use averaging='exact'."
        )
    if keep_optimizers and not (old.one_model(num_groups) and new.one_model(num_groups)):
        raise ValueError(
            f"reconfigure(keep_optimizers=True) from num_pipelines={old.num_pipelines} ({old.averaging}) to "
            f"num_pipelines={new.num_pipelines} ({new.averaging}) would make replicas with fresh optimizers: keep N, "
            "or use averaging='exact', whose one model keeps its optimizer."
        )
    return new


def describe(config: PipelineConfig, num_stages: int, num_groups: int) -> str:
    """The log line of a reconfigure."""
    return (
        f"AvgPipe: reconfigured to num_microbatches={config.microbatches_for(num_stages)}, "
        f"num_pipelines={config.num_pipelines}"
        + (f", averaging='{config.averaging}'" if config.num_pipelines * num_groups > 1 else "")
        + f", schedule={config.schedule!r}"
        + (f", advance_forwards={config.advance_forwards}" if reads_k(config.schedule) else "")
        + (f", {placed_by(config.schedule_costs)}" if config.schedule_costs is not None else "")
        + "."
    )


class Steered(Protocol):
    """What the tuner-facing methods read of their strategy besides ``ProcessStrategy``'s: ``AvgPipeStrategy`` defines
    each. A class that subclasses a protocol must define its members, so mypy refuses a strategy that lacks one."""

    @property
    def topology(self) -> Topology: ...

    @property
    def controller(self) -> StepController: ...

    @property
    def bridge(self) -> StepBridge: ...


class TunerSurface(ProcessStrategy, Steered):
    """The strategy's tuner-facing methods (``AvgPipeStrategy`` sets the state they read)."""

    config: PipelineConfig
    _controller: StepController | None

    def memory_limit_bytes(self, limit: float | None = None) -> float | None:
        """``limit`` (default: the configured ``memory_limit``) in bytes: a fraction (<= 1) is of device memory
        (on CPU, of this machine's memory shared by the stage processes on it)."""
        limit = self.config.memory_limit if limit is None else limit
        return memory_limit_bytes(limit, self.root_device, self.num_processes)

    def reconfigure(
        self,
        num_microbatches: int | None = None,
        num_pipelines: int | None = None,
        advance_forwards: int | str | None = None,
        averaging: str | None = None,
        keep_optimizers: bool = False,
        schedule: str | None = None,
        schedule_costs: tuple[float, float, float] | None = None,
    ) -> None:
        """Change M, N, k, the averaging or the schedule (the tuner calls it in ``on_fit_start``, and between epochs
        to retune). A new schedule must keep the model's cut: one stage per rank (``1f1b``, ``zbh1``, ``advance``,
        ``zbadvance``, ``afab``) or the same chunked schedule, which ``schedule_costs`` may place anew.

        A new N or averaging that needs replicas re-makes them from the reference and the optimizers
        (``configure_optimizers`` runs again), as does any new N unless ``keep_optimizers``; every rank must call it
        with the same values. ``keep_optimizers=True`` (during training) keeps the optimizers and their state, which
        only one model per stage allows (exact averaging, or N·D = 1).
        """
        changes = {
            "num_microbatches": num_microbatches,
            "num_pipelines": num_pipelines,
            "advance_forwards": advance_forwards,
            "averaging": averaging,
            "schedule": schedule,
            "schedule_costs": schedule_costs,
        }
        old, control = self.config, self._controller
        groups = self.topology.num_groups if control is not None else None
        scaling = isinstance(self.precision_plugin, PipelineMixedPrecision)
        changes = {k: v for k, v in changes.items() if v is not None}
        new = self.config = next_config(old, changes, groups, scaling, keep_optimizers)  # checked, then swapped in
        if control is not None:
            remade = control.reconfigure(new)
            module = self.lightning_module
            trainer = compat.attached_trainer(module) if module is not None else None
            if trainer is not None and trainer.state.fn == TrainerFn.FITTING:
                new_n = old.num_pipelines != new.num_pipelines
                if remade or new_n:
                    # A loader already grouped for the old N (trainer.estimated_stepping_batches sets it up early)
                    # is set up again, and configure_optimizers then sees the new number of iterations per epoch.
                    compat.reset_train_dataloader(trainer)
                if remade or (new_n and not keep_optimizers):
                    self.setup_optimizers(trainer)
                    _optimizers_to_device(self.optimizers, self.root_device)
        rank_zero_info(describe(new, self.topology.num_stages, self.topology.num_groups))

    def probe(self) -> StageProbe:
        """The tuner's one handle on this rank's stage (``tuning/probe.py``): run steps at a setting, return their
        timings, put every state back. Lightning stays here: the user's ``training_step`` is the probe's loss."""
        module, bridge = self.lightning_module, self.bridge
        assert module is not None
        return StageProbe(
            self.controller,
            loss=lambda output, micro, share: bridge.call_step("training_step", output, micro, share, 0),
            inputs=lambda micro: pipeline_inputs(module, micro),
            forward_context=self.precision_plugin.train_step_context,
            after_step=bridge.take_logs,
            optimizer=self.optimizers[0],
            metrics=[m for m in module.modules() if isinstance(m, Metric)],
        )
