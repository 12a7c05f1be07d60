"""Training batches for N parallel pipelines: each iteration takes N consecutive batches of the user's DataLoader."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


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
