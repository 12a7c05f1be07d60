"""The tuner's run: the batch, the candidates (micro-batch counts BatchNorm allows, the schedules a fit may switch
to), the profile (``tuning/measure.py``, through the strategy's ``StageProbe``), then the search over every (M, N,
averaging) (``tuning/search.py``), with what the other placements would predict. Collective over every rank;
``callback.py`` calls it in ``on_fit_start``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from lightning_avgpipe.algorithms import microbatch
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.plugin.steps.data import loader_generators
from lightning_avgpipe.schedules.generate import CHUNKED, SPLIT, reads_k, splits_backward
from lightning_avgpipe.tuning.busy import busy_machine
from lightning_avgpipe.tuning.measure import profile_pipeline
from lightning_avgpipe.tuning.model import PipelineProfile, checkpointed, microbatch_sizes, predict
from lightning_avgpipe.tuning.profiler import Snapshot
from lightning_avgpipe.tuning.recommend import recommend
from lightning_avgpipe.tuning.search import (
    NoFeasibleSettingError,
    TuningTable,
    candidate_microbatches,
    candidate_pipelines,
    search,
)

if TYPE_CHECKING:
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy


def tune(
    strategy: AvgPipeStrategy,
    trainer: pl.Trainer,
    memory_limit: float | None = None,
    num_pipelines: int | Sequence[int] | None = None,
    num_microbatches: int | Sequence[int] | None = None,
    profile_steps: int = 3,
    objective: str = "throughput",
    averaging: Sequence[str] = ("elastic",),
    weigh_split: bool = True,
) -> TuningTable:
    """Profile ``strategy``'s pipeline on one batch and search (M, N, averaging); collective over every rank.
    ``weigh_split``: also weigh the backward split on or off (not where a retune must go on measuring the noise
    scale, which a split backward cannot)."""
    batch, fetch_s, batches, last = first_batch(trainer)
    # every stage of every group profiles the same batch
    batch, fetch_s, batches, last = strategy.broadcast((batch, fetch_s, batches, last), src=0)
    batch = strategy.batch_to_device(batch)
    probe = strategy.probe()  # what the tuner measures through (tuning/probe.py)
    size = microbatch.batch_size(batch)
    ms = batch_norm_candidates(
        candidate_microbatches(size, num_microbatches),
        size,
        probe.pipeline.layers,
        probe.device,
        given=num_microbatches is not None,
        last_batch=last,
    )
    ns = candidate_pipelines(num_pipelines)
    cap = None
    if batches is not None:  # an iteration takes N batches: N above an epoch's batches (per group) trains nothing
        cap = max(1, batches // probe.topology.num_groups)
        dropped = [n for n in ns if n > cap]
        if dropped and num_pipelines is not None:
            rank_zero_info(
                f"AvgPipeTuner: leaving out num_pipelines={dropped}: an epoch has {cap} batches per "
                "pipeline group and an iteration takes one per pipeline."
            )
    profile = profile_pipeline(probe, batch, microbatch_sizes(size, ms), profile_steps)
    busy = busy_machine(profile.cpu_share, profile.clock, profile.rounds, profile_steps)
    if busy:
        rank_zero_warn(busy)
    profile.batch_fetch_s = fetch_s
    profile.accumulate = int(trainer.accumulate_grad_batches)
    limit = memory_limit if memory_limit is not None else strategy.config.memory_limit
    limit = strategy.memory_limit_bytes(limit)
    if limit is not None:  # a fraction of memory can differ by rank: the smallest rules
        limit = probe.least(limit)
    # the user's k, not one a previous fit's tuner applied (reconfigure replaces "auto" with a number)
    k: int | str = strategy.user_advance_forwards if reads_k(strategy.config.schedule) else 0
    # every rank searches the same broadcast profile: a setting that fits nowhere raises on every rank alike
    args = (ms, num_pipelines, limit, strategy.config.schedule, k)
    options: dict[str, Any] = {
        "max_pipelines": cap,
        "objective": objective,
        "averaging": averaging,
        "schedules": candidate_schedules(strategy.config.schedule, profile) if weigh_split else None,
        "stages_per_rank": strategy.config.stages_per_rank,
        "keep_pipelines": strategy.config.num_pipelines,
        "keep_microbatches": _users_microbatches(strategy),
    }
    keywords = dict(zip(("num_microbatches", "num_pipelines", "memory_limit", "schedule", "advance_forwards"), args))
    try:
        try:
            table = search(profile, *args, **options)
        except NoFeasibleSettingError as err:
            if strategy.config.activation_checkpointing != "auto" or any(probe.pipeline.recompute):
                raise
            # recomputation trades time for memory: what fits with every layer checkpointed (tuning.model.checkpointed)
            try:
                table = search(checkpointed(profile, strategy.partition), *args, **options)
            except NoFeasibleSettingError as again:
                raise NoFeasibleSettingError(f"{err} Even with every layer checkpointed: {again}") from again
            table.notes["activation_checkpointing"] = True  # its profile is the checkpointed one: what training runs
    except NoFeasibleSettingError as err:
        advice = recommend(profile, {**keywords, **options})  # a lighter level of sharding may fit (a new fit)
        if advice is None:
            raise
        raise NoFeasibleSettingError(f"{err} {advice['line']}") from err
    assert table.profile is not None
    table.notes["sharding_advice"] = recommend(table.profile, {**keywords, **options})
    table.notes["other_placements"] = other_placements(table)
    table.notes["busy_machine"] = busy
    return table


def first_batch(trainer: pl.Trainer, fetches: int = 3) -> tuple[Any, float, int | None, int | None]:
    """One training batch, the median time to draw one, the loader's batches per epoch (``None``: no length) and
    the size of its short last batch (``None``: none or not known).

    Drawn from a fresh iterator; the global RNG states and the loader's own generators (``DataLoader(generator=)``,
    a sampler's ``generator``) are put back, so the data order training sees is kept.
    """
    loader = compat.request_train_dataloader(trainer)
    if loader is None:
        raise ValueError("AvgPipeTuner needs a training DataLoader to profile on; none is attached to fit().")
    snap = Snapshot([], [], generators=loader_generators(loader))
    times = []
    try:
        it = iter(loader)
        batch = next(it)
        for _ in range(fetches):
            t0 = time.perf_counter()
            try:
                next(it)
            except StopIteration:
                break
            times.append(time.perf_counter() - t0)
    finally:
        snap.restore()
    try:
        batches: int | None = len(loader)
    except TypeError:  # an iterable dataset without a length
        batches = None
    return batch, statistics.median(times) if times else 0.0, batches, _last_batch_size(loader)


def _last_batch_size(loader: Any) -> int | None:
    """The size of an epoch's short last batch (``None``: none, or not known)."""
    size, drop = getattr(loader, "batch_size", None), getattr(loader, "drop_last", True)
    try:
        n = len(loader.dataset)
    except (TypeError, AttributeError):
        return None
    if not isinstance(size, int) or drop or n % size == 0:
        return None
    return n % size


def _users_microbatches(strategy: AvgPipeStrategy) -> int | None:
    """The strategy's M where it is a number (not ``"auto"``): the setting the tuner keeps within its noise."""
    m = strategy.config.num_microbatches
    return m if isinstance(m, int) and not isinstance(m, bool) else None


def candidate_schedules(schedule: str, profile: PipelineProfile) -> list[str]:
    """The schedules a running fit may switch to, to weigh with its own: the model stays cut as it is, so with one
    stage per rank the backward split on or off (``1f1b`` and ``zbh1``, ``advance`` and ``zbadvance``) where the
    profile timed it; with several, its own."""
    twins = {**SPLIT, **{unsplit: split for split, unsplit in SPLIT.items()}}
    if schedule not in twins or not all(st.split_profiled for st in profile.stages):
        return [schedule]
    return [schedule, twins[schedule]]


def other_placements(table: TuningTable) -> dict[str, Any]:
    """What the schedules that cut the model otherwise (``zbv``, ``interleaved`` at v = 2, from one stage per rank)
    predict at the choice's M, N and averaging: a fit can't switch to them, a new one can. Said in the setup log
    where one predicts more than the choice."""
    choice, profile = table.choice, table.profile
    if choice is None or profile is None or profile.stages_per_rank > 1:
        return {}
    out: dict[str, Any] = {}
    for name in CHUNKED:
        if splits_backward(name) and not all(st.split_profiled for st in profile.stages):
            continue
        try:
            r = predict(
                profile,
                choice.num_microbatches,
                choice.num_pipelines,
                name,
                memory_limit=table.memory_limit,
                averaging=choice.averaging,
            )
        except ValueError:
            continue
        ratio = table.value(r) / table.value(choice)
        out[name] = {"stages_per_rank": r.stages_per_rank, "ratio": ratio, "feasible": r.feasible, **r.to_dict()}
        if r.feasible and ratio > 1.03:
            rank_zero_info(
                f"AvgPipeTuner: schedule='{name}' ({r.stages_per_rank} stages per rank) predicts {ratio:.2f}x the "
                f"chosen setting's {'goodput' if table.objective == 'goodput' else 'samples/s'} (bubble "
                f"{r.bubble_fraction:.0%} against {choice.bubble_fraction:.0%}); it cuts the model anew, which a "
                f"running fit cannot: start the next one with AvgPipeStrategy(schedule='{name}')."
            )
    return out


def batch_norm_candidates(
    ms: Sequence[int],
    batch_size: int,
    layers: Sequence[torch.nn.Module],
    device: torch.device | None = None,
    given: bool = False,
    last_batch: int | None = None,
) -> list[int]:
    """Drop the M whose micro-batches hold one sample when a stage has BatchNorm (training BatchNorm needs two).

    ``last_batch``: the size of the epoch's short last batch (``drop_last=False``); it is split into M parts too
    (into ``last_batch`` parts of one when it has fewer samples than M).

    Every rank decides alike: each checks its own stage's layers and an all-reduce over all ranks combines the
    answers (collective: every rank calls it). Candidates the user listed raise instead of being dropped silently.
    """
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for layer in layers for m in layer.modules())
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([float(has_bn)], device=device)  # on the device: NCCL has no CPU tensors
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        has_bn = bool(flag.item())
    if not has_bn:
        return list(ms)

    def smallest(m: int) -> int:
        sizes = [batch_size] + ([last_batch] if last_batch else [])
        return min(b // m if b >= m else 1 for b in sizes)

    ones = [m for m in ms if smallest(m) < 2]
    if ones and given:
        raise ValueError(
            f"num_microbatches={list(ms)!r} includes {ones}: with a batch size of {batch_size}"
            + (f" and a last batch of {last_batch}" if last_batch else "")
            + " that gives micro-batches of one sample, and the model has BatchNorm layers, which cannot train on "
            "one sample. "
            f"Leave out {ones} (or pass num_microbatches=None: the tuner then skips them)."
        )
    kept = [m for m in ms if m not in ones]
    if not kept:
        raise ValueError(
            f"AvgPipeTuner: the batch size {batch_size}"
            + (f" (last batch {last_batch})" if last_batch else "")
            + " leaves no micro-batch of two or more samples, which the model's BatchNorm layers need in training; "
            "use a batch size of at least 2 (and DataLoader(drop_last=True) if the last batch is the problem)."
        )
    if ones:
        rank_zero_info(
            f"AvgPipeTuner: skipping num_microbatches={ones} (micro-batches of one sample; the model has "
            "BatchNorm layers)."
        )
    return kept
