"""Choosing (M, N, averaging) from predictions: the highest predicted goodput (samples/s x statistical efficiency,
docs/how-it-works.md#goodput), or samples/s, among the settings whose every stage fits the memory limit."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_avgpipe.schedules import max_advance_forwards
from lightning_avgpipe.schedules.generate import CHUNKED, placed_by, reads_k
from lightning_avgpipe.tuning.model import PipelineProfile, Prediction, divisors, predict

DEFAULT_MAX_PIPELINES = 8
OBJECTIVES = ("goodput", "throughput")


class NoFeasibleSettingError(ValueError):
    """No candidate setting fits the memory limit."""


def candidate_microbatches(batch_size: int, num_microbatches: int | Sequence[int] | None = None) -> list[int]:
    """M values to consider: the divisors of B (or the given ones, which must divide B)."""
    if num_microbatches is None:
        return divisors(batch_size)
    values = [num_microbatches] if isinstance(num_microbatches, int) else list(num_microbatches)
    bad = [m for m in values if not isinstance(m, int) or isinstance(m, bool) or m < 1 or batch_size % m]
    if bad or not values:
        raise ValueError(
            f"num_microbatches={num_microbatches!r}: every candidate must be a positive divisor of the batch size "
            f"{batch_size}; use values from {divisors(batch_size)} or None for all of them."
        )
    return sorted(set(values))


def candidate_pipelines(num_pipelines: int | Sequence[int] | None = None) -> list[int]:
    """N values to consider: 1 up to ``num_pipelines`` (an int), the listed values, or 1..8 when ``None``."""
    if num_pipelines is None:
        return list(range(1, DEFAULT_MAX_PIPELINES + 1))
    if isinstance(num_pipelines, int) and not isinstance(num_pipelines, bool):
        if num_pipelines < 1:
            raise ValueError(f"num_pipelines={num_pipelines} must be at least 1 (the largest N to consider).")
        return list(range(1, num_pipelines + 1))
    if isinstance(num_pipelines, bool) or not isinstance(num_pipelines, Sequence):
        raise ValueError(f"num_pipelines={num_pipelines!r} must be a positive int, a list of positive ints, or None.")
    values = list(num_pipelines)
    if not values or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in values):
        raise ValueError(f"num_pipelines={num_pipelines!r} must be a positive int or a list of positive ints.")
    return sorted(set(values))


def _k_candidates(num_stages: int, units: int) -> list[int]:
    """The k tried under ``advance_forwards="auto"``: 0, the powers of two below the largest useful k, and it."""
    top = max_advance_forwards(num_stages, units)  # beyond it stages 0 .. S - 2 run AFAB's order
    ks = {0, top}
    k = 1
    while k < top:
        ks.add(k)
        k *= 2
    return sorted(ks)


@dataclass
class TuningTable:
    """Every candidate's prediction and the choice."""

    rows: list[Prediction]
    choice: Prediction | None
    memory_limit: float | None
    schedule: str
    profile: PipelineProfile | None = None
    notes: dict[str, Any] = field(default_factory=dict)
    raw_rows: list[Prediction] | None = None  # the model's own predictions, when ``rows`` were calibrated

    def calibrate(self, factor: float) -> None:
        """Scale every predicted time by ``factor`` (measured / predicted iteration time of a setting that ran).

        The model's own predictions stay in :attr:`raw_rows`; the choice is not changed (every row scales alike).
        """
        if not factor > 0 or not math.isfinite(factor):
            raise ValueError(f"calibration factor {factor!r} must be a positive finite number")
        base = self.raw_rows if self.raw_rows is not None else self.rows
        chosen = next((i for i, r in enumerate(self.rows) if r is self.choice), None)
        self.raw_rows = list(base)
        self.rows = [r.scaled(factor) for r in base]
        if chosen is not None:
            self.choice = self.rows[chosen]
        self.notes["calibration_factor"] = factor

    def choose(self) -> Prediction:
        """Set :attr:`choice` to the feasible row with the most :meth:`value` and its reason; ties (within 0.5%) go to
        fewer pipelines, then one model ("exact") over replicas, then the strategy's schedule, then fewer
        micro-batches. The user's own setting (``notes["keep_microbatches"]`` and ``keep_pipelines``, the strategy's
        schedule) is kept where the best row beats it by less than :func:`tie_window` of the profile's timing noise:
        a rerun of the profile could swap the two."""
        feasible = [r for r in self.rows if r.feasible]
        if self.objective == "goodput" and self.profile is not None and self.profile.noise_scale is None:
            # no noise-scale estimate: every batch would count as equally efficient, and the largest N would win on
            # samples/s alone; the least safe guess, so the user's own batch (their N) is kept instead
            keep = int(self.notes.get("keep_pipelines", 1))
            kept = [r for r in feasible if r.num_pipelines == keep]
            if kept:
                feasible = kept
                self.notes["kept_pipelines"] = keep
        top = max(self.value(r) for r in feasible)
        near = [r for r in feasible if self.value(r) >= top * 0.995]
        self.choice = min(
            near,
            key=lambda r: (r.num_pipelines, r.averaging != "exact", r.schedule != self.schedule, r.num_microbatches),
        )
        window = tie_window(self.profile)
        self.notes["tie_window"] = round(window, 4)
        said = ""
        own = [r for r in feasible if self.is_users(r) and self.value(r) >= top * (1 - window)]
        if own and not self.is_users(self.choice):
            best = self.choice
            self.choice = min(own, key=lambda r: (r.averaging != "exact", -self.value(r)))
            below = 1 - self.value(self.choice) / self.value(best)
            said = (
                f" Your own setting (M = {self.choice.num_microbatches}, N = {self.choice.num_pipelines}, "
                f"{self.choice.schedule}) was kept: it predicts {below:.1%} less than the best row (M = "
                f"{best.num_microbatches}, N = {best.num_pipelines}, {best.schedule}): a gap under the tie window of "
                f"{window:.1%} (twice the profile's timing noise, at most 10%), which a rerun could reverse (a larger "
                "profile_steps measures finer)."
            )
        self.notes["reason"] = reason(self) + said + schedule_reason(self)
        return self.choice

    def is_users(self, r: Prediction) -> bool:
        """Whether ``r`` is the user's own setting: their M (``notes["keep_microbatches"]``), N and schedule."""
        m = self.notes.get("keep_microbatches")
        return (
            m is not None
            and (r.num_microbatches, r.num_pipelines) == (int(m), int(self.notes.get("keep_pipelines", 1)))
            and r.schedule == self.schedule
        )

    def row(
        self, num_microbatches: int, num_pipelines: int, averaging: str | None = None, schedule: str | None = None
    ) -> Prediction:
        """The row of (M, N), its averaging and schedule (``None``: any; the strategy's schedule first)."""
        for r in sorted(self.rows, key=lambda r: r.schedule != self.schedule):
            if (r.num_microbatches, r.num_pipelines) == (num_microbatches, num_pipelines) and (
                (averaging is None or r.averaging == averaging) and (schedule is None or r.schedule == schedule)
            ):
                return r
        raise KeyError((num_microbatches, num_pipelines, averaging, schedule))

    @property
    def objective(self) -> str:
        return str(self.notes.get("objective", "throughput"))

    def value(self, r: Prediction) -> float:
        """What the choice maximises: goodput or samples/s."""
        return r.goodput if self.objective == "goodput" else r.samples_per_sec

    def to_dict(self) -> dict[str, Any]:
        return {
            "schedule": self.schedule,
            "memory_limit": self.memory_limit,
            "choice": self.choice.to_dict() if self.choice else None,
            "rows": [r.to_dict() for r in self.rows],
            "profile": self.profile.to_dict() if self.profile else None,
            "notes": self.notes,
            "raw_rows": [r.to_dict() for r in self.raw_rows] if self.raw_rows is not None else None,
        }

    def write_json(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1))
        tmp.replace(path)
        return path

    def summary(
        self, num_groups: int, applied: bool, where: str = "", with_rows: bool = True, calibrating: bool = False
    ) -> str:
        """The setup log's account: the table (``with_rows``), the choice with its predicted figures, whether it
        was applied and where the report went. ``num_groups``: D (the averaging is named where N x D > 1)."""
        c = self.choice
        assert c is not None
        rows = (
            "predicted iteration time and peak memory per setting"
            + (" (the model's raw figures: calibration rescales them)" if calibrating else "")
            + f"\n{self.format()}\n"
        )
        return (
            (rows if with_rows else "")
            + f"chosen: schedule='{c.schedule}', num_microbatches={c.num_microbatches}, num_pipelines={c.num_pipelines}"
            + (f", averaging='{c.averaging}'" if c.num_pipelines * num_groups > 1 else "")
            + (f", advance_forwards={c.advance_forwards}" if reads_k(c.schedule) else "")
            + (f", {placed_by(c.schedule_costs)}" if c.schedule_costs is not None else "")
            + f", {c.samples_per_sec:.1f} samples/s predicted"
            + (f", efficiency {c.efficiency:.3f}, goodput {c.goodput:.1f}" if self.objective == "goodput" else "")
            + (
                ", every layer checkpointed (nothing fits without)"
                if self.notes.get("activation_checkpointing")
                else ""
            )
            + ("" if applied else " (not applied: apply=False)")
            + (f"; written to {where}" if where else "")
            + (f"\n{self.notes['sharding_advice']['line']}" if self.notes.get("sharding_advice") else "")
        )

    def metrics(self) -> dict[str, float]:
        """The choice as logger metrics (``tuner/...``)."""
        c = self.choice
        assert c is not None
        return {
            "tuner/num_microbatches": float(c.num_microbatches),
            "tuner/num_pipelines": float(c.num_pipelines),
            "tuner/predicted_samples_per_sec": c.samples_per_sec,
            "tuner/predicted_efficiency": c.efficiency,
            "tuner/predicted_goodput": c.goodput,
            "tuner/exact_averaging": float(c.averaging == "exact"),
            "tuner/predicted_step_time_s": c.step_time,
            "tuner/seconds": float(self.notes.get("tuner_seconds", 0.0)),
        }

    def format(self) -> str:
        """The table as text: one line per (M, N, averaging), the choice marked, then the reason for it."""
        several = len({r.schedule for r in self.rows}) > 1  # a schedule column where the rows differ in it
        head = (
            (f"{'schedule':>11} " if several else "")
            + f"{'M':>4} {'N':>3} {'avg':>7} {'k':>3} {'iter ms':>9} {'samples/s':>10} {'eff':>6} "
            + f"{'goodput':>9} {'bubble':>7} {'peak MiB (per stage)':<28}"
        )
        lines = [head]
        order = {"exact": 0, "elastic": 1}
        for r in sorted(
            self.rows, key=lambda r: (r.num_pipelines, order.get(r.averaging, 2), r.schedule, r.num_microbatches)
        ):
            mark = " <- chosen" if self.choice is not None and r is self.choice else ""
            peaks = "/".join(f"{p / 2**20:.1f}" for p in r.peak_bytes)
            fit = "" if r.feasible else f"  (does not fit: {r.why_not})"
            lines.append(
                (f"{r.schedule:>11} " if several else "")
                + f"{r.num_microbatches:>4} {r.num_pipelines:>3} {r.averaging:>7} {r.advance_forwards:>3} "
                f"{r.step_time * 1e3:>9.2f} {r.samples_per_sec:>10.1f} {r.efficiency:>6.3f} {r.goodput:>9.1f} "
                f"{r.bubble_fraction:>6.1%} {peaks:<28}{fit}{mark}"
            )
        if self.notes.get("reason"):
            lines.append(str(self.notes["reason"]))
        return "\n".join(lines)


def search(
    profile: PipelineProfile,
    num_microbatches: int | Sequence[int] | None = None,
    num_pipelines: int | Sequence[int] | None = None,
    memory_limit: float | None = None,
    schedule: str | None = None,
    advance_forwards: int | str = 0,
    latency_s: float | None = None,
    bandwidth: float | None = None,
    max_pipelines: int | None = None,
    objective: str = "throughput",
    averaging: Sequence[str] = ("elastic",),
    schedules: Sequence[str] | None = None,
    stages_per_rank: int | None = None,
    keep_pipelines: int = 1,
    keep_microbatches: int | None = None,
    sharding: str | None = None,
    reduce_gradients: str | None = None,
) -> TuningTable:
    """Predict every candidate (schedule, M, N, averaging) and choose the best that fits ``memory_limit`` (bytes).

    ``keep_pipelines``: the N of the user's own batch, which ``"goodput"`` keeps when the profile has no noise-scale
    estimate (it would otherwise count every batch as equally efficient and take the largest N).
    ``keep_microbatches``: the user's M; with ``keep_pipelines`` and ``schedule``, the setting kept where the best
    row's gain over it is within the profile's timing noise (:meth:`TuningTable.choose`).

    ``schedules``: the schedules to weigh (default: ``schedule`` alone); ``stages_per_rank``: v for those that run
    several chunks per rank (``None``: their default). Ties go to ``schedule``, the one the strategy runs.

    ``objective="goodput"`` maximises samples/s x statistical efficiency (the noise scale,
    ``algorithms/noise_scale.py``); ``"throughput"`` maximises samples/s. ``averaging`` lists the ways to combine N
    batches to consider (``"elastic"``, ``"exact"``); with N x D = 1 they are the same training and one row stands
    for both.
    ``sharding``/``reduce_gradients``: how each stage is shared over D (``None``: as profiled; ``model.predict``).

    ``max_pipelines`` drops the candidate N above it (the tuner passes the batches an epoch has per group: an
    iteration takes N of them).

    With ``schedule="advance"`` and ``advance_forwards="auto"`` each (M, N) gets the k (0, 1, 2, 4, ... and
    ``max_advance_forwards(S, units)``, from which stages 0 .. S - 2 run AFAB's order; the last stage runs no advance
    forwards) with the best predicted time that fits. Ties in samples/s (within 0.5%) go to fewer pipelines, then fewer
    micro-batches (less memory, less statistical change). ``num_pipelines=None`` stops raising N once no M fits.

    Raises:
        NoFeasibleSettingError: nothing fits; the message names the smallest setting's need.
    """
    if objective not in OBJECTIVES:
        raise ValueError(
            f"objective={objective!r} is not one of {list(OBJECTIVES)}; 'goodput' weighs samples/s by how much each "
            "sample teaches at that batch size, 'throughput' counts samples/s alone."
        )
    averagings = check_averaging(averaging)
    schedule = schedule or profile.schedule
    ms = candidate_microbatches(profile.batch_size, num_microbatches)
    ns = candidate_pipelines(num_pipelines)
    if max_pipelines is not None:
        ns = [n for n in ns if n <= max_pipelines] or [min(ns)]
    names = list(dict.fromkeys(schedules or [schedule]))
    rows: list[Prediction] = []
    for n in ns:
        any_fit = False
        for avg in averagings if n * profile.num_groups > 1 else averagings[:1]:
            for name, m in ((name, m) for name in names for m in ms):
                v = stages_per_rank if name in CHUNKED else None
                ks = [int(advance_forwards)] if advance_forwards != "auto" else _k_candidates(profile.num_stages, m * n)
                options = [
                    predict(
                        profile, m, n, name, k, memory_limit, latency_s, bandwidth, avg, v, sharding, reduce_gradients
                    )
                    for k in (ks if reads_k(name) else [0])
                ]
                fits = [p for p in options if p.feasible] or options[:1]
                best = min(fits, key=lambda p: (p.step_time, p.advance_forwards))
                rows.append(best)
                any_fit |= best.feasible
        if num_pipelines is None and not any_fit:
            break
    feasible = [r for r in rows if r.feasible]
    if not feasible:
        smallest = min(rows, key=lambda r: max(r.peak_bytes))
        worst = max(range(len(smallest.peak_bytes)), key=lambda s: smallest.peak_bytes[s])
        assert memory_limit is not None
        raise NoFeasibleSettingError(
            f"memory_limit={memory_limit:.0f} bytes ({memory_limit / 2**20:.1f} MiB) is met by no setting: the "
            f"smallest, num_microbatches={smallest.num_microbatches}, num_pipelines={smallest.num_pipelines}, needs "
            f"{smallest.peak_bytes[worst] / 2**20:.1f} MiB on stage {worst}. Raise memory_limit to at least "
            f"{max(smallest.peak_bytes) / 2**20:.1f} MiB, use more stages, or a smaller batch size."
        )
    table = TuningTable(rows=rows, choice=None, memory_limit=memory_limit, schedule=schedule, profile=profile)
    table.notes["objective"] = objective
    table.notes["keep_pipelines"] = keep_pipelines
    table.notes["keep_microbatches"] = keep_microbatches
    table.notes["search_args"] = {  # what a retune searches again with (tuning/retune.py)
        "num_microbatches": ms,
        "num_pipelines": ns if num_pipelines is not None else None,
        "memory_limit": memory_limit,
        "schedule": schedule,
        "schedules": names,
        "stages_per_rank": stages_per_rank,
        "advance_forwards": advance_forwards,
        "max_pipelines": max_pipelines,
        "averaging": averagings,
        "keep_pipelines": keep_pipelines,
        "keep_microbatches": keep_microbatches,
        "sharding": sharding,
        "reduce_gradients": reduce_gradients,
    }
    table.choose()
    return table


def check_averaging(averaging: Sequence[str] | str) -> list[str]:
    """The averaging options to consider, validated (``"elastic"``, ``"exact"``)."""
    values = [averaging] if isinstance(averaging, str) else list(averaging)
    bad = [a for a in values if a not in ("elastic", "exact")]
    if bad or not values:
        raise ValueError(
            f"averaging={averaging!r}: give one or more of ['exact', 'elastic'] ('exact': the N batches as one batch; "
            "'elastic': the paper's rule)."
        )
    return list(dict.fromkeys(values))


NOISE_WINDOW_MAX = 0.10  # the widest tie window the profile's noise can open: a larger gain is always taken


def tie_window(profile: PipelineProfile | None) -> float:
    """How close a prediction must come to the best to keep the user's own setting: 0.5%, or twice the profile's
    relative timing noise (two standard errors), up to ``NOISE_WINDOW_MAX``."""
    noise = profile.timing_noise if profile is not None else 0.0
    return max(0.005, min(NOISE_WINDOW_MAX, 2 * noise))


def reason(table: TuningTable) -> str:
    """One sentence on why the choice won; with goodput, whether any N > 1 pays and by how much."""
    c = table.choice
    assert c is not None
    feasible = [r for r in table.rows if r.feasible]
    if table.objective == "throughput":
        return (
            f"Chosen for the most samples/s ({c.samples_per_sec:.1f}); objective='throughput' does not weigh what N "
            "does to the samples training needs."
        )
    profile = table.profile
    noise = profile.noise_scale if profile is not None else None
    measured = profile.noise_measurements if profile is not None else 0
    if noise is not None:
        known = f"at the measured noise scale B_noise = {noise:.0f} samples"
    elif measured:
        known = (
            f"with the gradient noise dominating all {measured} profiled measurements (|G|² not above 0): every "
            "batch size counts as equally efficient, so check the choice against avgpipe/noise_scale in training"
        )
    else:
        known = "with no noise-scale estimate (one micro-batch of one pipeline has one batch size): efficiency 1"
    if "kept_pipelines" in table.notes:
        return (
            f"N = {c.num_pipelines}, your own batch, kept: {known}, and without an estimate the largest N would win on "
            "samples/s alone, which is the least safe guess. A larger N is weighed once a noise scale is measured "
            "(retune_every_n_steps measures it in training)."
        )
    ones = [r for r in feasible if r.num_pipelines == 1]
    more = [r for r in feasible if r.num_pipelines > 1]
    if c.num_pipelines == 1:
        if not more:
            return f"N = 1: no N > 1 fits or was considered ({known})."
        best = max(more, key=table.value)
        return (
            f"N = 1 is the right answer: no N > 1 pays {known}. The best, N = {best.num_pipelines} "
            f"({best.averaging}), predicts {best.samples_per_sec / c.samples_per_sec:.2f}x the samples/s but "
            f"learns {best.efficiency / c.efficiency:.2f}x as much per sample, so "
            f"{best.goodput / c.goodput:.2f}x the goodput."
        )
    base = max(ones, key=table.value) if ones else None
    versus = (
        f"{c.goodput / base.goodput:.2f}x the goodput of N = 1 ({c.samples_per_sec / base.samples_per_sec:.2f}x "
        f"the samples/s, {c.efficiency / base.efficiency:.2f}x the progress per sample)"
        if base is not None
        else "N = 1 does not fit"
    )
    return f"N = {c.num_pipelines} with averaging='{c.averaging}': {versus}, {known}."


def schedule_reason(table: TuningTable) -> str:
    """Where several schedules were weighed: the chosen one against the best row of each other, at its M and N."""
    c = table.choice
    assert c is not None
    others = sorted({r.schedule for r in table.rows} - {c.schedule})
    if not others:
        return ""
    parts = []
    for name in others:
        same = [
            r
            for r in table.rows
            if r.schedule == name
            and r.feasible
            and (r.num_microbatches, r.num_pipelines) == (c.num_microbatches, c.num_pipelines)
        ]
        if same:
            r = max(same, key=table.value)
            parts.append(f"{table.value(c) / table.value(r):.3f}x '{name}' (bubble {r.bubble_fraction:.0%})")
        else:
            parts.append(f"'{name}' does not fit there")
    v = f", stages_per_rank={c.stages_per_rank}" if c.stages_per_rank > 1 else ""
    return (
        f" Schedule '{c.schedule}'{v} (bubble {c.bubble_fraction:.0%}) at M = {c.num_microbatches}, "
        f"N = {c.num_pipelines}: " + ", ".join(parts) + "."
    )
