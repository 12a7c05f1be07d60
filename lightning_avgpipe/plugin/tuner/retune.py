"""``AvgPipeTuner(retune_every_n_steps=K)``: re-decide (M, N) between epochs from the live noise scale.

The Lightning side of ``tuning/retune.py``: it times the iterations of the running setting, asks the strategy to
measure the noise scale often enough, and at the first epoch start after every K optimizer steps searches again and
applies a better setting through ``AvgPipeStrategy.reconfigure(keep_optimizers=True)``, scaling the learning rate
by the documented rule. Only exact averaging is retuned: its one model keeps its optimizer state under any N
(docs/tuning.md#retuning).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_avgpipe.plugin import compat
from lightning_avgpipe.schedules.generate import splits_backward
from lightning_avgpipe.tuning.retune import Key, RetunePlan, lr_exponent, lr_factor, scale_lr, setting_key
from lightning_avgpipe.tuning.search import TuningTable

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy


def check_retunable(trainer: pl.Trainer, strategy: AvgPipeStrategy, lr_scaling: str) -> list[float]:
    """Refuse what a retune cannot change or measure; returns each optimizer's learning-rate exponent."""
    if int(trainer.accumulate_grad_batches) != 1:
        raise ValueError(
            f"AvgPipeTuner(retune_every_n_steps=...) with accumulate_grad_batches={trainer.accumulate_grad_batches}: "
            "the noise scale it re-decides from is measured on steps of one iteration; use "
            "accumulate_grad_batches=1 (a larger N is the retune's way to a larger batch) or drop retune_every_n_steps."
        )
    if splits_backward(strategy.config.schedule) or strategy.config.chunks_per_rank > 1:
        raise ValueError(
            f"AvgPipeTuner(retune_every_n_steps=...) with schedule={strategy.config.schedule!r}: the noise scale it "
            "re-decides from is read from each unit's whole gradients, which a split backward or several stages per "
            "rank never hold at once. Use schedule='1f1b' (or 'advance'), or drop retune_every_n_steps."
        )
    defaults = {"outer_lr": 1.0, "outer_momentum": 0.0, "averaging_period": 1}  # the paper's rule
    set_ = {k: getattr(strategy.config, k) for k, v in defaults.items() if getattr(strategy.config, k) != v}
    if set_:
        raise ValueError(
            f"AvgPipeTuner(retune_every_n_steps=...) retunes exact averaging, where {set_} (options of elastic "
            "averaging) mean nothing: remove them from AvgPipeStrategy, or drop retune_every_n_steps to keep them."
        )
    return [lr_exponent(compat.unwrap_optimizer(o), lr_scaling) for o in strategy.optimizers]


class Retuner:
    """The retune's state and steps; :class:`~lightning_avgpipe.plugin.tuner.AvgPipeTuner` calls it."""

    def __init__(self, every: int, exponents: list[float]) -> None:
        self.every = every
        self.exponents = exponents  # per optimizer, p in lr ∝ B_eff^p (check_retunable)
        self.plan: RetunePlan | None = None
        self.last_step = 0
        self._starts: list[float] = []

    def start(self, trainer: pl.Trainer, strategy: AvgPipeStrategy, table: TuningTable, base: Key) -> None:
        """After the first tune applied ``table.choice``: scale the lr from the user's setting ``base`` to it."""
        assert table.profile is not None and table.choice is not None
        chosen = table.choice.schedule  # a retune moves M and N under the schedule the first tune chose
        args = dict(table.notes["search_args"], schedule=chosen, schedules=[chosen])
        self.plan = RetunePlan(table.profile, args, setting_key(table.choice))
        self.plan.advance_forwards = table.choice.advance_forwards
        if base[1] * strategy.topology.num_groups == 1:  # one model either way: only M and N tell settings apart
            base = (base[0], base[1], "exact")
        self._scale_lr(trainer, strategy, base, self.plan.current)
        self._arm(strategy)
        self.plan.noise_seen = strategy.controller.noise_scale.measurements  # training's own readings count from here
        self._record(trainer, strategy, base, "start", table.choice.goodput)

    def _arm(self, strategy: AvgPipeStrategy) -> None:
        # about 8 noise measurements per retune window, but never more than one step in 4 (a measured step at N = 1
        # costs about 4%, benchmarks/noise_cost.py)
        strategy.controller.measure_noise_every(max(4, self.every // 8))

    # -- timing --------------------------------------------------------------------------------------------------
    def batch_started(self) -> None:
        if self.plan is not None:
            self._starts.append(time.perf_counter())

    def flush(self) -> None:
        """Keep the running setting's iteration times (the first interval of a stretch is a warm-up)."""
        if self.plan is not None and len(self._starts) >= 3:
            self.plan.record(self.plan.current, [b - a for a, b in zip(self._starts[1:], self._starts[2:])])
        self._starts = []

    # -- deciding ------------------------------------------------------------------------------------------------
    def epoch_started(self, trainer: pl.Trainer, strategy: AvgPipeStrategy) -> None:
        """At an epoch start: if K steps passed since the last decision, search again and apply a better setting."""
        self.flush()
        if self.plan is None or trainer.global_step - self.last_step < self.every:
            return
        # every rank decides from rank 0's timings (the noise scale is the same everywhere: it is all-reduced)
        self.plan = RetunePlan.from_dict(strategy.broadcast(self.plan.to_dict(), src=0))
        noise = strategy.controller.noise_scale
        table = self.plan.search(noise.value, noise.measurements)
        assert table.choice is not None
        old, new = self.plan.current, setting_key(table.choice)
        if new != old:
            self.plan.current, self.plan.advance_forwards = new, table.choice.advance_forwards
            self._apply(strategy)
            compat.rebuild_train_dataloader(trainer)
            self._scale_lr(trainer, strategy, old, new)
        self.last_step = trainer.global_step
        self._record(trainer, strategy, old, str(table.notes.get("reason", "")), table.choice.goodput)

    def _apply(self, strategy: AvgPipeStrategy) -> None:
        """Run the plan's current setting; the optimizers and their state stay (one model per stage)."""
        assert self.plan is not None
        M, N, averaging = self.plan.current
        strategy.reconfigure(
            num_microbatches=M,
            num_pipelines=N,
            advance_forwards=self.plan.advance_forwards if strategy.config.schedule == "advance" else None,
            averaging=averaging if N * strategy.topology.num_groups > 1 else None,
            keep_optimizers=True,
        )

    def _scale_lr(self, trainer: pl.Trainer, strategy: AvgPipeStrategy, old: Key, new: Key) -> None:
        assert self.plan is not None
        schedulers = [c.scheduler for c in trainer.lr_scheduler_configs]
        for optimizer, p in zip(strategy.optimizers, self.exponents):
            factor = lr_factor(self.plan.profile, old, new, p)
            if factor != 1.0:
                scale_lr(compat.unwrap_optimizer(optimizer), factor, schedulers)

    def _record(self, trainer: pl.Trainer, strategy: AvgPipeStrategy, old: Key, why: str, goodput: float) -> None:
        assert self.plan is not None
        new = self.plan.current
        p = self.exponents[0] if self.exponents else 0.0
        factor = lr_factor(self.plan.profile, old, new, p)
        noise = strategy.controller.noise_scale
        entry = {
            "step": int(trainer.global_step),
            "epoch": int(trainer.current_epoch),
            "from": list(old),
            "to": list(new),
            "noise_scale": noise.value,
            "noise_measurements": noise.measurements,
            "lr_factor": factor,
            "predicted_goodput": goodput,
            "reason": why,
        }
        self.plan.decisions.append(entry)
        lrs = [g["lr"] for o in strategy.optimizers for g in compat.unwrap_optimizer(o).param_groups][:1]
        if why == "start":
            rank_zero_info(
                f"AvgPipeTuner: retuning every {self.every} steps from num_microbatches={new[0]}, num_pipelines="
                f"{new[1]} (exact averaging), lr x{factor:.3g} for its batch"
                + (f" (now {lrs[0]:.3g})" if lrs else "")
                + "."
            )
            return
        rank_zero_info(
            f"AvgPipeTuner retune at step {entry['step']}: B_noise = "
            + (f"{noise.value:.3g}" if noise.value is not None else "not measured yet")
            + f" ({noise.measurements} measurements); "
            + (
                f"num_microbatches {old[0]} -> {new[0]}, num_pipelines {old[1]} -> {new[1]} ({new[2]}), lr x"
                f"{factor:.3g}" + (f" (now {lrs[0]:.3g})" if lrs else "")
                if old != new
                else f"keeping num_microbatches={new[0]}, num_pipelines={new[1]}"
            )
            + (f". {why}" if why else "")
        )
        for logger in trainer.loggers:
            logger.log_metrics(
                {
                    "tuner/num_microbatches": float(new[0]),
                    "tuner/num_pipelines": float(new[1]),
                    "tuner/lr_factor": factor,
                    "tuner/retune_noise_scale": float(noise.value) if noise.value is not None else float("nan"),
                    "tuner/predicted_goodput": float(goodput),
                },
                step=int(trainer.global_step),
            )

    # -- checkpoints ---------------------------------------------------------------------------------------------
    def state_dict(self, strategy: AvgPipeStrategy) -> dict[str, Any]:
        if self.plan is None:
            return {}
        return {
            "plan": self.plan.to_dict(),
            "last_step": self.last_step,
            "noise_scale": strategy.controller.noise_scale.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any], strategy: AvgPipeStrategy) -> None:
        """On resume, before the optimizer states are restored: run the checkpoint's setting, with its noise scale."""
        if not state:
            return
        self.plan = RetunePlan.from_dict(state["plan"])
        self.last_step = int(state["last_step"])
        strategy.controller.noise_scale.load_state_dict(state["noise_scale"])
        self._apply(strategy)
        self._arm(strategy)
        M, N, _ = self.plan.current
        rank_zero_info(
            f"AvgPipeTuner: resuming the retune at num_microbatches={M}, num_pipelines={N} "
            f"({len(self.plan.decisions)} decisions so far); the learning rate comes with the optimizer state."
        )
