"""The single-file checkpoint (``save_distributed_checkpoint=False``), gathered one tensor at a time.

Inside Lightning's checkpoint dump each rank keeps its parts of the tensors in an :class:`Outbox`, as it holds them
(a ``DTensor``'s local shard, a ZeRO-1 slice's ``FlatPieces``, a plain tensor: nothing is gathered, no
``full_tensor()``), and sends rank 0 only their keys and, per key, the whole tensor's shape and dtype and the boxes
``(offsets, sizes)`` of it that the rank holds. Rank 0 chooses, per key, boxes that cover the tensor exactly
(:func:`cover`: the lowest rank's where ranks hold the same box, as the D groups' copies of a stage outside FSDP, a
``Replicate`` placement, a tied weight's copies) and asserts that they do. Its checkpoint holds its own whole tensors
and a ``torchfile.Slot`` for each other one. At ``save_checkpoint`` rank 0 writes the file tensor by tensor
(``runtime/files/torchfile.py``): for each slot it allocates the whole tensor, receives each box from its owner
straight into its slice (into a box-sized buffer first where the slice is not contiguous), writes it and frees it.
Rank 0's peak is its own state plus one whole tensor and one box; another rank allocates nothing (on the CPU: a
device tensor's box is copied to the CPU to be sent), and no collective of any sub-mesh runs in the save. A
checkpoint IO other than Lightning's default, or a remote path, gets the whole dict, assembled tensor by tensor.

Every wait is bounded by ``p2p_timeout`` (``runtime/files/save_waits.py``): the ranks arrive at each collective through
the store first, each other rank posts all its sends at once on the checkpoint group (gloo, on CPU) and then waits,
as long as rank 0 is alive, for rank 0 to finish writing; rank 0 waits at most ``p2p_timeout`` for each box.
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
from lightning_avgpipe.shards import is_dtensor

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) of a part of a whole tensor


def pieces(value: Any) -> tuple[tuple[int, ...], torch.dtype, dict[Box, Tensor]]:
    """The whole tensor's shape and dtype, and this rank's parts of it by box, without a copy or a collective: a
    ``DTensor``'s local shard (at its chunk's offsets), a ``FlatPieces``' parts, a plain tensor whole."""
    if isinstance(value, sharded.FlatPieces):
        parts = {(tuple(o), tuple(t.shape)): t for o, t in value.parts.items()}
        dtype = next(iter(value.parts.values())).dtype if value.parts else torch.float32
        return tuple(value.shape), dtype, parts
    if is_dtensor(value):
        shard = value.to_local()
        chunks = value.__create_chunk_list__()
        assert len(chunks) == 1, f"a DTensor with {len(chunks)} local chunks"
        box = (tuple(int(o) for o in chunks[0].offsets), tuple(int(s) for s in chunks[0].sizes))
        assert box[1] == tuple(shard.shape), (box, tuple(shard.shape))
        return tuple(value.shape), value.dtype, {box: shard}
    return tuple(value.shape), value.dtype, {((0,) * value.dim(), tuple(value.shape)): value}


def _numel(sizes: tuple[int, ...]) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _overlap(a: Box, b: Box) -> bool:
    return all(oa < ob + sb and ob < oa + sa for oa, sa, ob, sb in zip(a[0], a[1], b[0], b[1]))


def cover(key: str, shape: tuple[int, ...], held: list[tuple[int, Box]]) -> list[tuple[int, Box]]:
    """Boxes ``(owner rank, box)`` that cover a tensor of ``shape`` exactly, from every rank's (``held``, in rank
    order): a box that overlaps one already taken is left to it (the lowest rank's copy wins). Raises when they do
    not cover it (a rank's part is missing: a bug)."""
    taken: list[tuple[int, Box]] = []
    for rank, box in held:
        inside = len(box[0]) == len(shape) and all(o >= 0 and o + s <= n for o, s, n in zip(*box, shape))
        if not inside:
            raise RuntimeError(f"Rank {rank}'s part {box} of {key!r} lies outside its shape {shape}; this is a bug.")
        if _numel(box[1]) and not any(_overlap(box, b) for _, b in taken):
            taken.append((rank, box))
    if sum(_numel(b[1]) for _, b in taken) != _numel(shape):
        raise RuntimeError(
            f"The ranks' parts of {key!r} {[b for _, b in taken]} do not cover its shape {shape}; this is a bug in "
            "AvgPipeStrategy's checkpoint."
        )
    return sorted(taken, key=lambda rb: rb[1][0])


class Outbox:
    """A rank's tensors of the checkpoint being dumped (as it holds them), by key, until ``save_checkpoint`` sends
    their parts; on rank 0 also every key's whole shape and dtype and which rank sends which box of it."""

    def __init__(self) -> None:
        self.tensors: dict[str, Any] = {}  # key -> a tensor, a DTensor or FlatPieces (sharded.to_refs fills it)
        self.parts: dict[str, dict[Box, Tensor]] = {}  # key -> this rank's parts of it by box
        self.boxes: dict[str, list[tuple[int, Box]]] = {}  # rank 0: key -> (owner, box) covering it
        self.specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # rank 0: key -> whole shape, dtype
        self.optimizers = 0  # optimizer states dumped so far (their keys' prefix)

    def __bool__(self) -> bool:
        return bool(self.tensors or self.boxes)

    def gather(self, tree: Any, rank: int, world_size: int, waits: SaveWaits) -> list[Any] | None:
        """Collective: ``tree`` (references to this outbox's tensors) of every rank, on rank 0, each reference
        replaced by rank 0's own whole tensor or a slot; ``None`` elsewhere."""
        specs = {}
        for key in dict.fromkeys(sharded.refs_in(tree)):
            shape, dtype, parts = pieces(self.tensors[key])
            self.parts[key] = parts
            specs[key] = (shape, dtype, list(parts))
        parts_of: list[Any] | None = [(tree, specs)]
        if world_size > 1:
            parts_of = [None] * world_size if rank == 0 else None
            waits.collective("names", lambda g: dist.gather_object((tree, specs), parts_of, dst=0, group=g))
        if parts_of is None:
            return None
        held: dict[str, list[tuple[int, Box]]] = {}
        for r, (_, rank_specs) in enumerate(parts_of):
            for key, (shape, dtype, boxes) in rank_specs.items():
                first = self.specs.setdefault(key, (shape, dtype))
                if first != (shape, dtype):
                    raise RuntimeError(
                        f"Rank {r} holds {key!r} as {shape} {dtype} where a lower rank holds {first}; this is a bug."
                    )
                held.setdefault(key, []).extend((r, box) for box in boxes)
        for key, boxes in held.items():
            self.boxes[key] = cover(key, self.specs[key][0], boxes)

        def value(key: str) -> Any:
            (owner, box), *more = self.boxes[key]
            if owner == 0 and not more and box[1] == self.specs[key][0]:  # rank 0 holds it whole
                return self.parts[key][box]
            return torchfile.Slot(key, *self.specs[key])

        return [sharded.resolve(part, value) for part, _ in parts_of]


def transfer(
    checkpoint: dict[str, Any] | None,
    outbox: Outbox,
    rank: int,
    world_size: int,
    write: Callable[[torchfile.Prepared, Callable[[str], Tensor]], None],
    waits: SaveWaits,
) -> None:
    """Collective: rank 0 calls ``write(prepared, fetch)`` with its checkpoint prepared for writing and a ``fetch``
    that assembles each slot's whole tensor from its owners' boxes; every other rank sends its boxes in the order
    rank 0 receives them, all at once, and waits for rank 0 to have written the file."""
    order: list[tuple[str, int, Box]] = []
    if rank == 0:
        assert checkpoint is not None
        prepared = torchfile.Prepared(checkpoint)
        order = [(key, owner, box) for key in prepared.keys for owner, box in outbox.boxes[key] if owner != 0]
    box_list: list[Any] = [order]
    if world_size > 1:
        waits.collective("order", lambda g: dist.broadcast_object_list(box_list, 0, group=g))
    if rank != 0:
        sends = [
            dist.isend(outbox.parts[key][box].detach().cpu().contiguous(), dst=0, group=waits.group)
            for key, owner, box in box_list[0]
            if owner == rank
        ]
        waits.arrive("written")  # rank 0 wrote the file: every send was received
        for sent in sends:
            if sent is not None:
                sent.wait()
        return

    def fetch(key: str) -> Tensor:
        shape, dtype = outbox.specs[key]
        whole = torch.empty(shape, dtype=dtype)
        for owner, (offsets, sizes) in outbox.boxes[key]:
            into = whole[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            if owner == 0:
                into.copy_(outbox.parts[key][(offsets, sizes)])
            elif into.is_contiguous():  # a Shard(0) part: received in place
                waits.receive(into, owner, key)
            else:
                part = torch.empty(sizes, dtype=dtype)
                waits.receive(part, owner, key)
                into.copy_(part)
                del part
        return whole

    write(prepared, fetch)
    waits.arrive("written")


def received(prepared: torchfile.Prepared, fetch: Callable[[str], Tensor], checkpoint: dict[str, Any]) -> Any:
    """The whole checkpoint in memory, every slot assembled in order (for a checkpoint IO that needs the dict)."""
    values = {key: fetch(key) for key in prepared.keys}
    return torchfile.filled(checkpoint, lambda slot: values[slot.key])
