"""The lightest sharding of the stages over the D groups that fits a memory limit (docs/tuning.md#sharding).

The search (``tuning/search.py``) is run under each level, lightest first (``NO_SHARD``, ``SHARD_OPTIM``,
``SHARD_GRAD_OP``, ``FULL_SHARD``), the last two under ``averaging="exact"`` and with each ``reduce_gradients``; the
first level under which some setting fits is recommended, with the reduce mode whose best setting predicts more.
Changing the level rebuilds the model, which a running fit cannot: the tuner says it, and does not apply it.
"""

from __future__ import annotations

from typing import Any

from lightning_avgpipe.tuning.model import PipelineProfile, Prediction, predict
from lightning_avgpipe.tuning.search import NoFeasibleSettingError, search
from lightning_avgpipe.tuning.sharding import FSDP, REDUCE, levels_for


def _need(profile: PipelineProfile, args: dict[str, Any], level: str, reduce: str) -> float:
    """The least peak per rank any candidate M needs under ``level`` at the smallest N (the least memory)."""
    smallest = {**args, "memory_limit": None, "num_pipelines": [1], "max_pipelines": None, "keep_pipelines": 1}
    table = search(profile, sharding=level, reduce_gradients=reduce, **smallest)
    return min(max(r.peak_bytes) for r in table.rows)


def _row(profile: PipelineProfile, args: dict[str, Any], level: str, reduce: str) -> dict[str, Any]:
    """The search under ``level`` and ``reduce``: its choice's figures, or the least it needs where nothing fits."""
    row: dict[str, Any] = {"sharding": level, "reduce_gradients": reduce, "fits": False}
    try:
        table = search(profile, sharding=level, reduce_gradients=reduce, **args)
    except NoFeasibleSettingError:
        row["peak_bytes"] = _need(profile, args, level, reduce)
        return row
    c = table.choice
    assert c is not None
    row.update(
        fits=True,
        peak_bytes=max(c.peak_bytes),
        rest_bytes=max(c.rest_bytes),
        value=table.value(c),
        num_microbatches=c.num_microbatches,
        num_pipelines=c.num_pipelines,
        averaging=c.averaging,
        samples_per_sec=c.samples_per_sec,
        step_time=c.step_time,
        traffic_bytes=c.traffic_bytes,
    )
    return row


def recommend(profile: PipelineProfile, args: dict[str, Any]) -> dict[str, Any] | None:
    """The lightest level that fits ``args["memory_limit"]`` and its figures; ``None`` with no limit or D = 1.

    ``args``: :func:`search`'s keyword arguments (``averaging`` among them: the levels that shard one model are
    weighed where it holds ``"exact"``; under elastic averaging only ``SHARD_OPTIM``). Within a level the reduce mode
    whose best setting predicts more wins. ``per_step`` holds more within a step than ZeRO-1, so it is the lightest
    only where the profiled level is ZeRO-2/3 already: there the other reduce mode is named where it fits and
    predicts more (``"reduce"``).
    """
    limit = args.get("memory_limit")
    averaging = list(args.get("averaging") or ["elastic"])
    if limit is None or profile.num_groups <= 1:
        return None
    base = {k: v for k, v in args.items() if k not in ("sharding", "reduce_gradients")}

    def kw(level: str) -> dict[str, Any]:
        return {**base, "averaging": ["exact"] if level in FSDP else averaging}

    rows: list[dict[str, Any]] = []
    chosen: dict[str, Any] | None = None
    for level in levels_for(profile.num_groups, "exact" in averaging):
        for reduce in REDUCE if level in FSDP else REDUCE[:1]:
            row = _row(profile, kw(level), level, reduce)
            if row["fits"] and (chosen is None or row["value"] > chosen["value"]):
                chosen = row
            rows.append(row)
        if chosen is not None:
            break
    current = (profile.sharding, profile.reduce_gradients if profile.sharding in FSDP else REDUCE[0])
    line = _line(chosen, rows, limit, current)
    other = None
    if current[0] in FSDP:  # the strategy's own ZeRO-2/3: would the other reduce mode fit and run faster?
        mine = {(r["sharding"], r["reduce_gradients"]): r for r in rows}
        own = mine.get(current) or _row(profile, kw(current[0]), *current)
        flip = (current[0], REDUCE[1 - REDUCE.index(current[1])])
        other = mine.get(flip) or _row(profile, kw(current[0]), *flip)
        if other["fits"] and (not own["fits"] or other["value"] > own["value"] * 1.005):
            line += (
                f" At the strategy's {current[0]}, reduce_gradients='{flip[1]}' fits and predicts "
                + (f"{other['value'] / own['value']:.2f}x" if own["fits"] else "where yours does not")
                + " (a strategy argument: the next fit)."
            )
        else:
            other = None
    return {"choice": chosen, "rows": rows, "line": line, "reduce": other}


def _line(chosen: dict[str, Any] | None, rows: list[dict[str, Any]], limit: float, current: tuple[str, str]) -> str:
    mib = 2**20
    needs = ", ".join(
        f"{r['sharding']}"
        + (f"/{r['reduce_gradients']}" if r["sharding"] in FSDP else "")
        + f" {r['peak_bytes'] / mib:.1f}"
        for r in rows
        if not r["fits"]
    )
    if chosen is None:
        return f"sharding: no level fits memory_limit={limit / mib:.1f} MiB per rank (peak MiB: {needs})."
    c = chosen
    name = f"sharding_strategy='{c['sharding']}'" + (
        f", reduce_gradients='{c['reduce_gradients']}'" if c["sharding"] in FSDP else ""
    )
    said = (
        f"sharding: {name} is the lightest that fits memory_limit={limit / mib:.1f} MiB: peak "
        f"{c['peak_bytes'] / mib:.1f} MiB per rank ({c['rest_bytes'] / mib:.1f} between steps), M = "
        f"{c['num_microbatches']}, N = {c['num_pipelines']}, {c['averaging']}, {c['samples_per_sec']:.1f} samples/s"
        + (f"; those that do not fit need (MiB) {needs}" if needs else "")
    )
    if (c["sharding"], c["reduce_gradients"]) == current:
        return said + " (the profiled level)."
    return (
        said
        + f". Not applied: it rebuilds the model; start the next fit with AvgPipeStrategy({name}"
        + (", averaging='exact'" if c["averaging"] == "exact" else "")
        + ")."
    )


def format_levels(profile: PipelineProfile, choice: Prediction, memory_limit: float | None = None) -> str:
    """Each level's per-rank bytes (the largest stage's), traffic over D and time at ``choice``'s M, N, schedule
    and k, one model (``averaging="exact"``): what ``whatif --sharding all`` prints."""
    if profile.num_groups <= 1:
        return "sharding: D = 1, nothing to shard (every level holds what NO_SHARD does)."
    lines = [
        f"sharding at M = {choice.num_microbatches}, N = {choice.num_pipelines}, {choice.schedule}, "
        "averaging='exact' (per rank, the largest stage):",
        f"{'level':<14} {'reduce':<15} {'rest MiB':>9} {'peak MiB':>9} {'traffic MB':>11} {'iter ms':>9} "
        f"{'samples/s':>10}",
    ]
    for level in levels_for(profile.num_groups, True):
        for reduce in REDUCE if level in FSDP else REDUCE[:1]:
            r = predict(
                profile,
                choice.num_microbatches,
                choice.num_pipelines,
                choice.schedule,
                choice.advance_forwards,
                memory_limit,
                averaging="exact",
                stages_per_rank=choice.stages_per_rank,
                sharding=level,
                reduce_gradients=reduce,
            )
            lines.append(
                f"{level:<14} {reduce if level in FSDP else '-':<15} {max(r.rest_bytes) / 2**20:>9.1f} "
                f"{max(r.peak_bytes) / 2**20:>9.1f} {r.traffic_bytes / 1e6:>11.2f} {r.step_time * 1e3:>9.2f} "
                f"{r.samples_per_sec:>10.1f}" + ("" if r.feasible else "  (does not fit)")
            )
    return "\n".join(lines)
