"""``AvgPipeTuner``: before ``fit`` trains, profile one setting, predict every (M, N), apply the best that fits.

The glue between Lightning and the three tuning pieces (``tuning.profiler`` measures, ``tuning.model`` predicts,
``tuning.search`` chooses). It runs in ``on_fit_start``: after the strategy has split the model and built the
optimizers, before a checkpoint is restored, the sanity check runs or the training DataLoader is wrapped, so the
chosen N also sets how many batches an iteration takes.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_avgpipe.checks import is_int, is_number
from lightning_avgpipe.plugin.checkpoint.resume import resuming_from
from lightning_avgpipe.plugin.steps.precision import PipelineMixedPrecision
from lightning_avgpipe.plugin.tuner.retune import Retuner, check_retunable
from lightning_avgpipe.plugin.tuner.run import tune
from lightning_avgpipe.schedules.generate import reads_k
from lightning_avgpipe.tuning.model import PipelineProfile
from lightning_avgpipe.tuning.retune import check_lr_scaling, check_retune
from lightning_avgpipe.tuning.search import (
    OBJECTIVES,
    TuningTable,
    candidate_pipelines,
    check_averaging,
)

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy


class AvgPipeTuner(Callback):
    """Choose ``num_microbatches`` (M) and ``num_pipelines`` (N) for ``strategy="avgpipe"`` by profiling.

    Args:
        memory_limit: bytes a stage may hold at its peak (weights, gradients, optimizer states, the averaging's
            buffers and the activation stash), or a fraction (<= 1) of the device's memory; ``None``: the
            strategy's ``memory_limit`` (and no limit if that is ``None`` too). With D > 1 the log names the lightest
            ``sharding_strategy`` that fits (docs/tuning.md#sharding).
        num_pipelines: the largest N to consider (an int), the N values to consider (a list), or ``None`` for
            1..8 (stopping once no M fits).
        num_microbatches: the M values to consider (an int or a list of divisors of the batch size); ``None``:
            every divisor of the batch size.
        profile_steps: timed pipeline steps per profiled micro-batch size; the sizes take turns of two steps (the
            first untimed, after the change of shape), one turn each per round, so background load hits them alike.
        output_dir: folder for ``tuning.json`` (the table, the profile and the choice) and ``tuning.png`` (the
            heat map); ``None``: ``<trainer.default_root_dir>/tuning``.
        apply: set the chosen (M, N) (and k for ``schedule="advance"``) on the strategy; ``False`` only reports.
            With one stage per rank the search also weighs the backward split on or off (``"1f1b"`` against
            ``"zbh1"``, ``"advance"`` against ``"zbadvance"``; not with ``retune_every_n_steps``, whose noise scale a
            split backward cannot measure) and applies the faster; a schedule that would cut the
            model anew (``"zbv"``, ``"interleaved"``) is predicted in ``tuning.json`` and named in the log where it
            would win.
        calibrate_steps: with ``apply``, time this many training iterations of the chosen setting (after one
            warm-up iteration) and scale every predicted time in the table by measured / predicted (the model's
            own numbers stay in the JSON as ``raw_rows``; the choice does not change); 0 turns it off. With
            ``accumulate_grad_batches=K`` it times whole cycles of K (rounded up) and takes the mean; a validation
            in between starts the window again.
        objective: ``"goodput"`` (default) chooses the most samples/s x statistical efficiency: the efficiency
            follows from the gradient noise scale measured on the profiled steps (docs/tuning.md#goodput), so a
            larger N must teach enough per sample to pay. ``"throughput"`` chooses the most samples/s (N's effect
            on the samples training needs is not weighed).
        averaging: the ways to combine the N batches of a step that the search considers: ``"exact"`` (one
            batch of N x B) and ``"elastic"`` (the paper's rule); ``None``: both with ``"goodput"``, the strategy's
            own with ``"throughput"``.
        retune_every_n_steps: re-decide M and N during training (``objective="goodput"``, exact averaging): at the
            first epoch start after every this many optimizer steps, search again with the noise scale training
            measures and the step times measured so far, and apply a setting that predicts at least 3% more goodput
            (docs/tuning.md#retuning). ``None``: decide once, before training.
        lr_scaling: with ``retune_every_n_steps``, how the learning rate follows the effective batch (N x B x D)
            whenever the tuner changes it, the first choice included: ``"auto"`` (linear for SGD, square root for the
            Adam family), ``"sqrt"``, ``"linear"`` or ``"none"``.

    After ``fit`` starts, :attr:`table` holds every prediction and :attr:`choice` the chosen one.
    """

    def __init__(
        self,
        memory_limit: float | None = None,
        num_pipelines: int | Sequence[int] | None = None,
        num_microbatches: int | Sequence[int] | None = None,
        profile_steps: int = 3,
        output_dir: str | None = None,
        apply: bool = True,
        calibrate_steps: int = 4,
        objective: str = "goodput",
        averaging: str | Sequence[str] | None = None,
        retune_every_n_steps: int | None = None,
        lr_scaling: str = "auto",
    ) -> None:
        if not is_int(profile_steps, 1):
            raise ValueError(f"profile_steps={profile_steps!r} must be an int >= 1 (timed steps per size).")
        if memory_limit is not None and (not is_number(memory_limit) or not memory_limit > 0):
            raise ValueError(
                f"memory_limit={memory_limit!r} must be a number of bytes, or a fraction in (0, 1] of device memory."
            )
        if not is_int(calibrate_steps, 0):
            raise ValueError(f"calibrate_steps={calibrate_steps!r} must be an int >= 0 (0: no calibration).")
        candidate_pipelines(num_pipelines)  # validates
        if objective not in OBJECTIVES:
            raise ValueError(
                f"objective={objective!r} is not one of {list(OBJECTIVES)}; 'goodput' (the default) weighs samples/s "
                "by how much each sample teaches, 'throughput' counts samples/s alone."
            )
        if averaging is not None:
            check_averaging(averaging)
        check_lr_scaling(lr_scaling)
        if retune_every_n_steps is not None:
            check_retune(retune_every_n_steps, objective, averaging, apply)
        self.retune_every_n_steps = retune_every_n_steps
        self.lr_scaling = lr_scaling
        self.retuner: Retuner | None = None
        self.objective = objective
        self.averaging = averaging
        self.memory_limit = memory_limit
        self.num_pipelines = num_pipelines
        self.num_microbatches = num_microbatches
        self.profile_steps = profile_steps
        self.output_dir = output_dir
        self.apply = apply
        self.log_table = True  # the table in the setup log (the tune command prints it itself instead)
        self.table: TuningTable | None = None
        self.profile: PipelineProfile | None = None
        self.seconds: float = 0.0
        self.files: dict[str, Path] = {}
        self.calibrate_steps = calibrate_steps
        self._starts: list[float] = []
        self._calibrating = False
        self._out: Path | None = None
        self._trainer: pl.Trainer | None = None

    @property
    def decisions(self) -> list[dict[str, Any]]:
        """The retune's decisions in this fit (also in ``tuning.json``'s notes); empty without a retune."""
        return self.retuner.plan.decisions if self.retuner is not None and self.retuner.plan is not None else []

    @property
    def choice(self) -> Any:
        return self.table.choice if self.table is not None else None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_avgpipe.plugin.strategy import AvgPipeStrategy

        strategy = trainer.strategy
        if not isinstance(strategy, AvgPipeStrategy):
            raise ValueError(
                f"AvgPipeTuner tunes strategy='avgpipe', but the Trainer's strategy is {type(strategy).__name__}; "
                "use Trainer(strategy='avgpipe', callbacks=[AvgPipeTuner(...)]) or remove the callback."
            )
        self._calibrating, self._starts = False, []  # nothing of a previous fit carries over
        self._trainer = trainer
        self.retuner = None
        if self.retune_every_n_steps is not None:  # refused before profiling, not after
            self.retuner = Retuner(self.retune_every_n_steps, check_retunable(trainer, strategy, self.lr_scaling))
        if resuming_from(trainer) is not None:
            self.table = self.profile = None
            self.files = {}
            rank_zero_info(
                "AvgPipeTuner: resuming from a checkpoint; "
                + (
                    "its retune state sets num_microbatches and num_pipelines, and the retune goes on."
                    if self.retuner is not None
                    else "keeping the strategy's num_microbatches and num_pipelines (pass the values the first run "
                    "chose, recorded in its tuning.json)."
                )
            )
            return
        started = time.perf_counter()
        base = (strategy.pipeline.num_microbatches, strategy.config.num_pipelines, strategy.config.averaging)
        table = tune(
            strategy,
            trainer,
            self.memory_limit,
            self.num_pipelines,
            self.num_microbatches,
            self.profile_steps,
            objective=self.objective,
            averaging=self._averaging(strategy),
            weigh_split=self.retune_every_n_steps is None,  # a retune reads the noise scale, which a split hides
        )
        self.table, self.profile = table, table.profile
        if self.apply:
            _apply(strategy, table)
        if self.retuner is not None:
            self.retuner.start(trainer, strategy, table, base)
        self.seconds = time.perf_counter() - started
        table.notes["tuner_seconds"] = self.seconds
        self._calibrating = self.apply and self.calibrate_steps > 0
        self._starts = []
        out = Path(self.output_dir) if self.output_dir is not None else Path(trainer.default_root_dir) / "tuning"
        self._out = out
        if trainer.is_global_zero:
            self.files = _write(table, out)
            where = " and ".join(str(p) for p in self.files.values())
            summary = table.summary(strategy.topology.num_groups, self.apply, where, self.log_table, self._calibrating)
            rank_zero_info(f"AvgPipeTuner ({self.seconds:.1f} s): " + summary)
        for logger in trainer.loggers:
            logger.log_metrics(table.metrics(), step=0)

    def _averaging(self, strategy: AvgPipeStrategy) -> list[str]:
        """The ways to combine N batches the search weighs."""
        if self.retuner is not None or isinstance(strategy.precision_plugin, PipelineMixedPrecision):
            return ["exact"]  # one model per stage: its optimizer survives a new N, its scaler unscales it
        if strategy.config.fsdp:
            return ["exact"]  # ZeRO-2/3 shard one model over the D groups
        if self.averaging is not None:
            return check_averaging(self.averaging)
        return ["exact", "elastic"] if self.objective == "goodput" else [strategy.config.averaging]

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.retuner is not None and self.retuner.plan is None and resuming_from(trainer) is not None:
            rank_zero_warn(
                "AvgPipeTuner(retune_every_n_steps=...): the checkpoint holds no retune state (it was saved without "
                "retune_every_n_steps), so this fit keeps the strategy's setting and does not retune; start a new fit "
                "(without ckpt_path) to tune."
            )
            self.retuner = None
        if self.retuner is not None:
            before = len(self.decisions)
            self.retuner.epoch_started(trainer, trainer.strategy)  # type: ignore[arg-type]
            if (
                trainer.is_global_zero
                and self.table is not None
                and self._out is not None
                and len(self.decisions) > before
            ):
                self.table.notes["retunes"] = self.decisions
                self.files = _write(self.table, self._out)

    def state_dict(self) -> dict[str, Any]:
        if self.retuner is None or self._trainer is None:
            return {}
        return {"retune": self.retuner.state_dict(self._trainer.strategy)}  # type: ignore[arg-type]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.retuner is not None and self._trainer is not None and state_dict.get("retune"):
            self.retuner.load_state_dict(state_dict["retune"], self._trainer.strategy)  # type: ignore[arg-type]

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.retuner is not None:
            self.retuner.flush()  # an interval with validation in it is not an iteration
        if self._calibrating:
            self._starts = []  # an interval with validation in it is not an iteration: start the window again

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self.retuner is not None:
            self.retuner.batch_started()
        if not self._calibrating or self.table is None or self.table.choice is None:
            return
        self._starts.append(time.perf_counter())
        # With accumulate_grad_batches = K an optimizer step (and elastic update) comes every K iterations: time
        # whole cycles and take the mean. The first interval is a warm-up.
        K = max(1, int(trainer.accumulate_grad_batches))
        intervals = -(-self.calibrate_steps // K) * K
        if len(self._starts) < intervals + 2:
            return
        self._calibrating = False
        gaps = [b - a for a, b in zip(self._starts[1:], self._starts[2:])]
        typical = statistics.median(gaps) if K == 1 else statistics.fmean(gaps)
        measured = float(trainer.strategy.broadcast(typical, src=0))
        predicted = self.table.choice.step_time
        factor = measured / predicted
        self.table.calibrate(factor)
        self.table.notes.update(
            calibration_measured_step_s=measured,
            calibration_predicted_step_s=predicted,
            calibration_steps=self.calibrate_steps,
        )
        if trainer.is_global_zero and self._out is not None:
            self.files = _write(self.table, self._out)
            rank_zero_info(
                f"AvgPipeTuner: the chosen setting ran {measured * 1e3:.1f} ms per iteration against "
                f"{predicted * 1e3:.1f} ms predicted (x{factor:.2f}); the table's times are scaled by it in "
                f"{' and '.join(str(p) for p in self.files.values()) or 'tuning.json'}: the chosen setting now reads "
                f"{self.table.choice.samples_per_sec:.1f} samples/s (the raw figures stay there as raw_rows)."
            )
        for logger in trainer.loggers:
            logger.log_metrics(
                {"tuner/calibration_factor": factor, "tuner/measured_step_time_s": measured}, step=trainer.global_step
            )


def _apply(strategy: AvgPipeStrategy, table: TuningTable) -> None:
    """Run the table's choice (every rank alike)."""
    choice = table.choice
    assert choice is not None
    strategy.reconfigure(
        num_microbatches=choice.num_microbatches,
        num_pipelines=choice.num_pipelines,
        advance_forwards=choice.advance_forwards if reads_k(choice.schedule) else None,
        averaging=choice.averaging if choice.num_pipelines * strategy.topology.num_groups > 1 else None,
        schedule=choice.schedule if choice.schedule != strategy.config.schedule else None,
        schedule_costs=choice.schedule_costs,
    )
    if table.notes.get("activation_checkpointing"):  # "auto", and nothing fitted without it
        strategy.controller.set_recompute([True] * len(strategy.pipeline.layers))


def _write(table: TuningTable, out: Path) -> dict[str, Path]:
    """Write the report on rank 0; a failure warns instead of raising (the other ranks are already training)."""
    try:
        try:
            from lightning_avgpipe.tuning.report import write_report
        except ImportError:  # the heat map module is optional
            return {"json": table.write_json(out / "tuning.json")}
        return write_report(table, out)
    except Exception as err:  # noqa: BLE001 - a report must not end the run
        rank_zero_warn(
            f"AvgPipeTuner: could not write the report to {out} ({type(err).__name__}: {err}); the "
            "choice is applied and logged all the same. Pass AvgPipeTuner(output_dir=...) a writable "
            "folder."
        )
        return {}
