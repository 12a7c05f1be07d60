"""Re-deciding (M, N) during training from the live noise scale and measured step times, and the learning-rate rule
for a change of effective batch (docs/tuning.md#retuning). Plain numbers and torch optimizers; no Lightning.

The gradient noise scale grows as training proceeds (McCandlish et al. 2018): a batch that wastes samples early can
be the most efficient one later. The retune keeps the profile the first tune measured, re-runs the search with the
noise scale training measures now, and replaces each predicted step time by the one measured while that setting ran
(a setting that has not run is scaled by the latest measured / predicted ratio).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from torch import optim
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.noise_scale import effective_batch
from lightning_avgpipe.tuning.model import PipelineProfile, Prediction
from lightning_avgpipe.tuning.search import TuningTable, search

LR_SCALINGS = ("auto", "sqrt", "linear", "none")
# the square-root rule (Malladi et al. 2022) for adaptive optimizers, the linear rule (Goyal et al. 2017) for SGD
SQRT_FAMILY: tuple[type[Optimizer], ...] = (
    optim.Adam,
    optim.AdamW,
    optim.Adamax,
    optim.NAdam,
    optim.RAdam,
    optim.Adagrad,
    optim.Adadelta,
    optim.RMSprop,
)
SWITCH_MARGIN = 0.03  # a new setting must predict this much more goodput than the running one to be applied
Key = tuple[int, int, str]  # (M, N, averaging)


def check_lr_scaling(lr_scaling: str) -> str:
    if lr_scaling not in LR_SCALINGS:
        raise ValueError(
            f"lr_scaling={lr_scaling!r} is not one of {list(LR_SCALINGS)}: 'auto' scales SGD's learning rate linearly "
            "with the effective batch and the Adam family's by its square root; 'none' leaves it alone."
        )
    return lr_scaling


def check_retune(every: Any, objective: str, averaging: Any, apply: bool) -> None:
    """The tuner's arguments a retune needs (``retune_every_n_steps``)."""
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(
            f"retune_every_n_steps={every!r} must be an int >= 1 (optimizer steps between decisions), or None to "
            "decide once."
        )
    if objective != "goodput":
        raise ValueError(
            f"retune_every_n_steps={every} with objective={objective!r}: a retune follows the noise scale, which "
            "changes goodput, not samples/s; use objective='goodput' or drop retune_every_n_steps."
        )
    if averaging is not None and list([averaging] if isinstance(averaging, str) else averaging) != ["exact"]:
        raise ValueError(
            f"retune_every_n_steps={every} with averaging={averaging!r}: only exact averaging can change N during "
            "training (its one model keeps its optimizer state; elastic replicas would restart theirs); use "
            "averaging='exact' or None."
        )
    if not apply:
        raise ValueError(
            f"retune_every_n_steps={every} with apply=False: a retune applies its decisions; use apply=True, or "
            "drop retune_every_n_steps to only report."
        )


def lr_exponent(optimizer: Optimizer, lr_scaling: str) -> float:
    """p in lr ∝ B_eff^p: 1 (linear), 0.5 (square root) or 0 (none); ``"auto"`` decides by the optimizer's class."""
    check_lr_scaling(lr_scaling)
    if lr_scaling != "auto":
        return {"sqrt": 0.5, "linear": 1.0, "none": 0.0}[lr_scaling]
    if isinstance(optimizer, optim.SGD):
        return 1.0
    if isinstance(optimizer, SQRT_FAMILY):
        return 0.5
    raise ValueError(
        f"lr_scaling='auto' scales SGD linearly and the Adam family ({', '.join(c.__name__ for c in SQRT_FAMILY)}) "
        f"by the square root, and does not know {type(optimizer).__name__}: pass lr_scaling='sqrt', 'linear' or "
        "'none' to AvgPipeTuner."
    )


LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")  # what schedulers keep in a param group


def scale_lr(optimizer: Optimizer, factor: float, schedulers: Iterable[Any] = ()) -> None:
    """Multiply ``optimizer``'s learning rates, and the base rates ``schedulers`` compute from, by ``factor``."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"learning-rate factor {factor!r} must be a positive finite number")
    for group in optimizer.param_groups:
        for key in LR_KEYS:
            if isinstance(group.get(key), (int, float)):
                group[key] = group[key] * factor
    for scheduler in schedulers:
        if getattr(scheduler, "optimizer", None) is optimizer and hasattr(scheduler, "base_lrs"):
            scheduler.base_lrs = [b * factor for b in scheduler.base_lrs]


def setting_key(row: Prediction) -> Key:
    return (row.num_microbatches, row.num_pipelines, row.averaging)


@dataclass
class RetunePlan:
    """What a retune needs to search again: the first tune's profile and search arguments, the measured step times
    (per setting, seconds per iteration) and the setting running now. Saved in checkpoints as :meth:`to_dict`."""

    profile: PipelineProfile
    search_args: dict[str, Any]  # num_microbatches, num_pipelines, memory_limit, schedule, advance_forwards, ...
    current: Key
    advance_forwards: int = 0  # k of the running setting (schedule="advance")
    measured: dict[Key, list[float]] = field(default_factory=dict)
    predicted: dict[Key, float] = field(default_factory=dict)  # the model's raw step time of each measured setting
    decisions: list[dict[str, Any]] = field(default_factory=list)
    # the noise measurements training had made at the last decision: a switch needs a newer one, taken at the running
    # setting (a retune that found none keeps the setting instead of deciding again on the reading that chose it)
    noise_seen: int = 0

    def record(self, key: Key, seconds: Sequence[float]) -> None:
        """Add iteration times measured while ``key`` ran (the latest 64 are kept)."""
        if seconds:
            self.measured[key] = (self.measured.get(key, []) + [float(s) for s in seconds])[-64:]
            if key not in self.predicted:
                raw = search(self.profile, objective="goodput", **self.search_args).rows
                self.predicted[key] = next((r.step_time for r in raw if setting_key(r) == key), 0.0)

    def factors(self) -> tuple[dict[Key, float], float]:
        """Measured / predicted per measured setting, and the factor for the rest (that of the latest measured)."""
        own = {k: statistics.median(v) / self.predicted[k] for k, v in self.measured.items() if self.predicted.get(k)}
        latest = own.get(self.current, next(reversed(own.values()), 1.0) if own else 1.0)
        return own, latest

    def search(self, noise_scale: float | None, measurements: int | None = None) -> TuningTable:
        """Every candidate again at ``noise_scale``, with measured step times where a setting ran; the choice keeps
        the running setting unless another predicts :data:`SWITCH_MARGIN` more goodput, and unless
        ``measurements`` (training's count of noise measurements, ``None``: not counted) has grown since the last
        decision: a switch rests on a reading taken at the running setting."""
        table = search(replace(self.profile, noise_scale=noise_scale), objective="goodput", **self.search_args)
        raw = list(table.rows)
        own, latest = self.factors()
        table.rows = [r.scaled(own.get(setting_key(r), latest)) for r in raw]
        table.raw_rows = raw
        table.choose()
        running = next((r for r in table.rows if setting_key(r) == self.current and r.feasible), None)
        stale = measurements is not None and measurements <= self.noise_seen
        if measurements is not None:
            self.noise_seen = max(self.noise_seen, measurements)
        if running is not None and stale:
            table.choice = running
            table.notes["reason"] = (
                f"Kept num_microbatches={running.num_microbatches}, num_pipelines={running.num_pipelines}: no noise "
                "measurement since the last decision, so nothing new to decide on (the next retune looks again)."
            )
        elif (
            running is not None
            and table.choice is not None
            and table.choice.goodput < running.goodput * (1 + SWITCH_MARGIN)
        ):
            table.choice = running
            table.notes["reason"] = (
                f"Kept num_microbatches={running.num_microbatches}, num_pipelines={running.num_pipelines}: no "
                f"setting predicts {SWITCH_MARGIN:.0%} more goodput than it at B_noise = "
                + (f"{noise_scale:.0f}" if noise_scale is not None else "unknown")
                + "."
            )
        return table

    def to_dict(self) -> dict[str, Any]:
        return {
            "profile": self.profile.to_dict(),
            "search_args": dict(self.search_args),
            "current": list(self.current),
            "advance_forwards": self.advance_forwards,
            "measured": [[list(k), v] for k, v in self.measured.items()],
            "predicted": [[list(k), v] for k, v in self.predicted.items()],
            "decisions": list(self.decisions),
            "noise_seen": self.noise_seen,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetunePlan:
        def key(k: Sequence[Any]) -> Key:
            return (int(k[0]), int(k[1]), str(k[2]))

        return cls(
            profile=PipelineProfile.from_dict(data["profile"]),
            search_args=dict(data["search_args"]),
            current=key(data["current"]),
            advance_forwards=int(data.get("advance_forwards", 0)),
            measured={key(k): list(v) for k, v in data["measured"]},
            predicted={key(k): float(v) for k, v in data["predicted"]},
            decisions=list(data["decisions"]),
            noise_seen=int(data.get("noise_seen", 0)),
        )


def lr_factor(profile: PipelineProfile, old: Key, new: Key, exponent: float) -> float:
    """How the learning rate changes from setting ``old`` to ``new``: (B_eff new / B_eff old) ** exponent."""
    batch = profile.batch_size * max(1, profile.accumulate)
    before = effective_batch(old[2], old[1], batch, profile.num_groups)
    after = effective_batch(new[2], new[1], batch, profile.num_groups)
    return float((after / before) ** exponent)
