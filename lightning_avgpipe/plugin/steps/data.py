"""Training batches for N parallel pipelines: each iteration takes N consecutive batches of the user's DataLoader."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.utils.data import RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from lightning_avgpipe.tuning.profiler import Snapshot


class GroupedBatches:
    """Yields lists of ``num_pipelines`` consecutive batches of ``loader``; an incomplete last group is dropped.

    The DataLoader's batch size stays the per-pipeline batch B; an epoch has ``len(loader) // N`` iterations.
    ``sampler`` and ``batch_sampler`` are the loader's, so Lightning still calls ``set_epoch`` on them.
    """

    def __init__(self, loader: Any, num_pipelines: int) -> None:
        self.loader = loader
        self.num_pipelines = num_pipelines

    def __len__(self) -> int:
        return len(self.loader) // self.num_pipelines

    def __iter__(self) -> Iterator[list[Any]]:
        it = iter(self.loader)
        while True:
            group = []
            for _ in range(self.num_pipelines):
                try:
                    group.append(next(it))
                except StopIteration:
                    return
            yield group

    def __getattr__(self, name: str) -> Any:  # sampler, batch_sampler, dataset, batch_size, ...
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    @property
    def worker_init_fn(self) -> Any:
        return getattr(self.loader, "worker_init_fn", None)

    @worker_init_fn.setter
    def worker_init_fn(self, fn: Any) -> None:
        # Lightning sets it after process_dataloader (seed_everything(workers=True)): it belongs on the DataLoader,
        # whose workers call it, not on this wrapper.
        self.loader.worker_init_fn = fn


def loader_generators(loader: Any) -> list[torch.Generator]:
    """The ``torch.Generator`` objects a DataLoader draws from besides the global RNG (each once)."""
    found: dict[int, torch.Generator] = {}
    for owner in (
        loader,
        getattr(loader, "sampler", None),
        getattr(loader, "batch_sampler", None),
        getattr(getattr(loader, "batch_sampler", None), "sampler", None),
    ):
        g = getattr(owner, "generator", None)
        if isinstance(g, torch.Generator):
            found.setdefault(id(g), g)
    return list(found.values())


def peek(loader: Any) -> Any:
    """The first batch of a fresh iterator over ``loader``, leaving the global RNG states and the loader's own
    generators as they were (the data order training sees is kept); ``None`` when it yields nothing."""
    snap = Snapshot([], [], generators=loader_generators(loader))
    try:
        return next(iter(loader), None)
    finally:
        snap.restore()


def same_order_on_every_rank(loader: Any) -> int | None:
    """Every stage of a pipeline must read the same batches (stage 0 the inputs, the last the targets). A sampler
    that shuffles with the global RNG (``DataLoader(shuffle=True)`` without a generator) would diverge once the
    ranks' RNGs do (dropout runs on some stages only), so it gets a generator seeded alike on every rank
    (``PL_GLOBAL_SEED``, else 0, as Lightning's DistributedSampler), and the log says so. Returns that seed, or
    ``None`` where nothing needed it."""
    for sampler in (getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)):
        if (
            isinstance(sampler, (RandomSampler, SubsetRandomSampler, WeightedRandomSampler))
            and sampler.generator is None
        ):
            seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
            sampler.generator = torch.Generator().manual_seed(seed)
            rank_zero_info(
                f"AvgPipe: the training loader shuffles with the global RNG; every stage of a pipeline must read the "
                f"same batches, so its sampler draws from a generator seeded {seed} on every rank."
            )
            return seed
    return None
