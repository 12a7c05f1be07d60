"""The single-file checkpoint (``save_distributed_checkpoint=False``), gathered one tensor at a time.

Inside Lightning's checkpoint dump each rank keeps its tensors in an :class:`Outbox` and sends rank 0 only their
keys, shapes and dtypes. Rank 0's checkpoint holds its own tensors and a ``torchfile.Slot`` for each of another
rank's (a tensor several ranks hold, as the D groups' copies of a stage, comes from the lowest of them). At
``save_checkpoint`` rank 0 writes the file tensor by tensor (``runtime/files/torchfile.py``), receiving each slot from
its owner as it writes it: rank 0's peak is its own state plus one tensor, and no dict of every stage's state is
pickled. A checkpoint IO other than Lightning's default, or a remote path, gets the whole dict, received slot by
slot.

Every wait is bounded by ``p2p_timeout`` (``runtime/files/save_waits.py``): the ranks arrive at each collective through
the store first, each other rank posts all its sends at once on the checkpoint group (gloo, on CPU) and then waits,
as long as rank 0 is alive, for rank 0 to finish writing; rank 0 waits at most ``p2p_timeout`` for each tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.plugin.checkpoint import sharded
from lightning_avgpipe.runtime.files import torchfile
from lightning_avgpipe.runtime.files.save_waits import SaveWaits


class Outbox:
    """A rank's tensors of the checkpoint being dumped, by key, until ``save_checkpoint`` sends them; on rank 0 also
    every key's owner rank, shape and dtype."""

    def __init__(self) -> None:
        self.tensors: dict[str, Tensor] = {}
        self.owners: dict[str, int] = {}
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.optimizers = 0  # optimizer states dumped so far (their keys' prefix)

    def __bool__(self) -> bool:
        return bool(self.tensors or self.owners)

    def gather(self, tree: Any, rank: int, world_size: int, waits: SaveWaits) -> list[Any] | None:
        """Collective: ``tree`` (references to this outbox's tensors) of every rank, on rank 0, each reference
        replaced by rank 0's own tensor or a slot; ``None`` elsewhere."""
        keys = set(sharded.refs_in(tree))
        specs = {k: (tuple(self.tensors[k].shape), self.tensors[k].dtype) for k in keys}
        parts: list[Any] | None = [(tree, specs)]
        if world_size > 1:
            parts = [None] * world_size if rank == 0 else None
            waits.collective("names", lambda g: dist.gather_object((tree, specs), parts, dst=0, group=g))
        if parts is None:
            return None
        for r, (_, rank_specs) in enumerate(parts):
            for key, spec in rank_specs.items():
                self.owners.setdefault(key, r)
                self.specs.setdefault(key, spec)

        def value(key: str) -> Any:
            return self.tensors[key] if self.owners[key] == 0 else torchfile.Slot(key, *self.specs[key])

        return [sharded.resolve(part, value) for part, _ in parts]


def transfer(
    checkpoint: dict[str, Any] | None,
    outbox: Outbox,
    rank: int,
    world_size: int,
    write: Callable[[torchfile.Prepared, Callable[[str], Tensor]], None],
    waits: SaveWaits,
) -> None:
    """Collective: rank 0 calls ``write(prepared, fetch)`` with its checkpoint prepared for writing and a ``fetch``
    that receives each slot from its owner; every other rank sends its owned slots in the order rank 0 writes them,
    all at once, and waits for rank 0 to have written the file."""
    if rank == 0:
        assert checkpoint is not None
        prepared = torchfile.Prepared(checkpoint)
        order = [(key, outbox.owners[key]) for key in prepared.keys]
    box = [order if rank == 0 else None]
    if world_size > 1:
        waits.collective("order", lambda g: dist.broadcast_object_list(box, 0, group=g))
    if rank != 0:
        sends = [
            dist.isend(outbox.tensors[key].detach().cpu().contiguous(), dst=0, group=waits.group)
            for key, owner in box[0] or []
            if owner == rank
        ]
        waits.arrive("written")  # rank 0 wrote the file: every send was received
        for sent in sends:
            if sent is not None:
                sent.wait()
        return

    def fetch(key: str) -> Tensor:
        shape, dtype = outbox.specs[key]
        buffer = torch.empty(shape, dtype=dtype)
        waits.receive(buffer, outbox.owners[key], key)
        return buffer

    write(prepared, fetch)
    waits.arrive("written")


def received(prepared: torchfile.Prepared, fetch: Callable[[str], Tensor], checkpoint: dict[str, Any]) -> Any:
    """The whole checkpoint in memory, every slot received in order (for a checkpoint IO that needs the dict)."""
    values = {key: fetch(key) for key in prepared.keys}
    return torchfile.filled(checkpoint, lambda slot: values[slot.key])
