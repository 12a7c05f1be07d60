"""After a run, the whole trained model back in the user's module in the launching process (rank 0), as Lightning's
own launchers bring the trained weights back (docs/guide.md#checkpoint-resume-and-load).

Rank 0 built the model whole (in ``__init__``), so it fits there: the split kept the other stages' layers aside with
their storage released (``placeholders.Kept``). At the end of a run each of their tensors comes from the lowest rank of
the first pipeline group that holds it (its stage's reference, the model the run trained), one tensor at a time, and the
layers go back in place of the placeholders. On the other ranks, and for a model built without memory (which may
not fit one process), the placeholders stay and refuse to pass for the whole model (``placeholders.Elsewhere``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.plugin.split.stages import SplitModule
from lightning_avgpipe.shards import full, is_dtensor


def released(rank: int) -> str:
    """The warning of a rank that stopped inside a step with its part of a sharded reference released."""
    return (
        f"AvgPipe: rank {rank} stopped inside a training step with the reference sharded (shard_optimizer_state=True): "
        "this rank's part of the module holds NaN placeholders. Resume from the last checkpoint."
    )


def own_state(module: torch.nn.Module, keep: bool) -> dict[str, Tensor]:
    """``module``'s state-dict tensors by name, a tensor or FSDP shard made whole (collective over its mesh: every
    rank calls this, in the same order, ``keep`` or not); empty where not ``keep``."""
    out: dict[str, Tensor] = {}
    for name, value in module.state_dict(keep_vars=True).items():
        whole = full(value.detach()) if is_dtensor(value) else value
        if keep:
            out[name] = whole
    return out


def bring_back(split: SplitModule, mine: dict[str, Tensor], rank: int, world_size: int) -> None:
    """Collective over every rank: rank 0 receives each tensor its ``split.kept`` lacks from the lowest rank whose
    ``mine`` (its state-dict tensors by name; empty outside the first pipeline group) holds it, and puts the layers
    back; every other rank sends its share."""
    names: list[list[str] | None] | None = [None] * world_size if rank == 0 else None
    dist.gather_object(sorted(mine), names, dst=0)
    order: list[tuple[str, int]] = []
    if rank == 0:
        assert split.kept is not None and names is not None
        held: list[set[str]] = [set(n or ()) for n in names]
        for name in split.kept.tensors:
            owner = next((r for r in range(1, world_size) if name in held[r]), None)
            if owner is None:
                raise RuntimeError(f"AvgPipe: no rank holds '{name}' at the end of the run; this is a bug.")
            order.append((name, owner))
    box: list[object] = [order]
    dist.broadcast_object_list(box, src=0)
    values: dict[str, Tensor] = {}
    for name, owner in box[0]:  # type: ignore[attr-defined]
        if rank == owner:
            dist.send(mine[name].detach().contiguous(), dst=0)
        elif rank == 0:
            assert split.kept is not None
            like = split.kept.tensors[name]
            values[name] = torch.empty(split.kept.shapes[name], dtype=like.dtype, device=like.device)
            dist.recv(values[name], src=owner)
    if rank == 0:
        split.put_back(values)
