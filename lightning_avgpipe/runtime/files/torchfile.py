"""A file that ``torch.load`` reads as it reads ``torch.save``'s, written one tensor at a time.

``torch.save`` needs every tensor of the object in memory at once. :func:`write` takes the object with each large
tensor replaced by a :class:`Slot` (its key, shape and dtype) and asks ``fetch(key)`` for the values one slot at a
time, while it writes: the writer's peak is the largest tensor, whatever the file's size. Used to consolidate a
sharded checkpoint (``plugin/checkpoint/state.py``) and to gather a single-file checkpoint stage by stage.

The format is ``torch.save``'s zip archive (version 3): ``data.pkl`` pickles the object with each tensor as
``_rebuild_tensor_v2(storage, ...)`` and each storage as a persistent id naming a record ``data/<n>``, stored
uncompressed at a 64-byte boundary (so ``torch.load(mmap=True)`` maps it); only tensors, containers and plain values
are pickled, so ``torch.load(weights_only=True)`` reads it.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.runtime.files import checksums as _checksums
from lightning_avgpipe.shards import is_dtensor, same_data

ALIGNMENT = 64
# dtype -> the storage class torch's pickles name (torch.save's persistent ids)
STORAGE_TYPES = {
    torch.float64: torch.DoubleStorage,
    torch.float32: torch.FloatStorage,
    torch.float16: torch.HalfStorage,
    torch.bfloat16: torch.BFloat16Storage,
    torch.int64: torch.LongStorage,
    torch.int32: torch.IntStorage,
    torch.int16: torch.ShortStorage,
    torch.int8: torch.CharStorage,
    torch.uint8: torch.ByteStorage,
    torch.bool: torch.BoolStorage,
    torch.complex64: torch.ComplexFloatStorage,
    torch.complex128: torch.ComplexDoubleStorage,
}


@dataclass(frozen=True)
class Slot:
    """A tensor that :func:`write` fetches by ``key`` when it writes it."""

    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, key: str, tensor: Tensor) -> Slot:
        return cls(key, tuple(tensor.shape), tensor.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class _Storage:
    slot: Slot
    record: str


def _rebuild() -> Any:
    """torch's tensor-rebuilding function, as a tensor's own pickle names it (a public call, not a private name)."""
    return torch.empty(0).__reduce_ex__(2)[0]  # type: ignore[index]


class _Pickler(pickle.Pickler):
    """Pickles each :class:`Slot` as a tensor over the record of its key: slots of one key (a tensor under two
    names) share one record, as ``torch.save`` stores a shared storage once."""

    def __init__(self, file: Any, slots: list[tuple[Slot, str]], records: dict[str, str]) -> None:
        super().__init__(file, protocol=2)
        self.slots = slots
        self.records = records
        self.rebuild = _rebuild()

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _Storage):
            return ("storage", STORAGE_TYPES[obj.slot.dtype], obj.record, "cpu", obj.slot.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if not isinstance(obj, Slot):
            return NotImplemented
        if obj.dtype not in STORAGE_TYPES:
            raise TypeError(f"Cannot write a tensor of dtype {obj.dtype} ({obj.key!r}) into a checkpoint file.")
        record = self.records.get(obj.key)
        if record is None:
            record = self.records[obj.key] = str(len(self.slots))
            self.slots.append((obj, record))
        stride: list[int] = []
        step = 1
        for s in reversed(obj.shape):
            stride.append(step)
            step *= max(s, 1)
        hooks: collections.OrderedDict[str, Any] = collections.OrderedDict()  # a tensor's backward hooks: none
        args = (_Storage(obj, record), 0, obj.shape, tuple(reversed(stride)), False, hooks)
        return self.rebuild, args


def _record(zf: zipfile.ZipFile, name: str, size: int) -> Any:
    """Open the record ``name`` for writing, its data starting at an ``ALIGNMENT`` boundary."""
    info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_STORED
    zip64 = size > 0x7FFFFFFF
    assert zf.fp is not None
    start = zf.fp.tell() + 30 + len(name.encode()) + (20 if zip64 else 0) + 4  # + the padding field's header
    info.extra = b"FB" + (-start % ALIGNMENT).to_bytes(2, "little") + b"Z" * (-start % ALIGNMENT)
    info.file_size = size
    return zf.open(info, mode="w", force_zip64=zip64)


class Prepared:
    """``obj`` pickled, its slots in the order :func:`write` fetches them (``keys``; real tensors excluded)."""

    def __init__(self, obj: Any) -> None:
        self.real: dict[str, Tensor] = {}
        self.slots: list[tuple[Slot, str]] = []
        self.records: dict[str, str] = {}  # slot key -> its record
        self.obj = self._slotted(obj)
        self.pickle = self.pickled(self.obj)

    def pickled(self, obj: Any) -> bytes:
        buffer = io.BytesIO()
        _Pickler(buffer, self.slots, self.records).dump(obj)
        return buffer.getvalue()

    def with_checksums(self, key: str, crcs: dict[str, str]) -> bytes:
        """The pickle of ``obj`` (a dict) with ``key`` added: each tensor's CRC-32 by its path
        (``runtime/files/checksums.py``), from ``crcs`` (record -> CRC-32)."""
        if not isinstance(self.obj, dict):
            raise TypeError(f"Checksums go into a checkpoint dict, not a {type(self.obj).__name__}.")
        paths = _checksums.tensor_paths(self.obj, lambda x: isinstance(x, Slot))
        entry = {"algorithm": _checksums.ALGORITHM, "tensors": {p: crcs[self.records[s.key]] for p, s in paths}}
        return self.pickled({**self.obj, key: entry})

    @property
    def keys(self) -> list[str]:
        return [slot.key for slot, _ in self.slots if slot.key not in self.real]

    def _slotted(self, value: Any) -> Any:
        seen: dict[Any, Slot] = {}  # a tensor under two names (over the same bytes) is one slot, one record

        def slot(tensor: Tensor) -> Slot:
            refuse_split(tensor, "a checkpoint file")
            same = same_data(tensor)
            if same is not None and same in seen:
                return seen[same]
            key = f"\0real/{len(self.real)}"
            self.real[key] = tensor
            made = Slot.of(key, tensor)
            if same is not None:
                seen[same] = made
            return made

        return mapped(value, lambda x: isinstance(x, Tensor), slot)


def write(
    path: str | os.PathLike[str], obj: Any | Prepared, fetch: Callable[[str], Tensor], checksums: str | None = None
) -> None:
    """Write ``obj`` to ``path`` as ``torch.save`` would, each :class:`Slot` in it fetched only when written (in
    the order of ``Prepared(obj).keys``); slots of one key are stored once. ``checksums``: a key under which the
    dict ``obj`` also holds each tensor's CRC-32 (computed as it is written; the pickle goes last).

    A real tensor left in ``obj`` is written as it is (keep those small: they are all in memory already).
    """
    prepared = obj if isinstance(obj, Prepared) else Prepared(obj)
    real = dict(prepared.real)
    crcs: dict[str, str] = {}
    with zipfile.ZipFile(Path(path), "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for name, data in (
            *([] if checksums else [("archive/data.pkl", prepared.pickle)]),
            ("archive/.format_version", b"1"),
            ("archive/.storage_alignment", str(ALIGNMENT).encode()),
            ("archive/byteorder", b"little"),
        ):
            with _record(zf, name, len(data)) as f:
                f.write(data)
        for slot, record in prepared.slots:
            tensor = real.pop(slot.key) if slot.key in real else fetch(slot.key)
            refuse_split(tensor, f"the checkpoint file {path}")
            if tuple(tensor.shape) != slot.shape or tensor.dtype != slot.dtype:
                raise ValueError(
                    f"The tensor fetched for {slot.key!r} is {tuple(tensor.shape)} {tensor.dtype}; its slot said "
                    f"{slot.shape} {slot.dtype}."
                )
            raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
            with _record(zf, f"archive/data/{record}", raw.nbytes) as f:
                f.write(raw.data)
            if checksums:
                crcs[record] = f"{_checksums.crc_bytes(raw.data):08x}"
            del tensor, raw
        if checksums:
            data = prepared.with_checksums(checksums, crcs)
            with _record(zf, "archive/data.pkl", len(data)) as f:
                f.write(data)
        with _record(zf, "archive/version", 2) as f:
            f.write(b"3\n")


def refuse_split(tensor: Tensor, where: str) -> None:
    """Raise for a ``DTensor``: one rank writing it alone would fail, or start a collective no other rank joins
    (its whole comes from its ranks' parts: ``plugin/checkpoint/streamed.py``)."""
    if is_dtensor(tensor):
        raise TypeError(
            f"A DTensor of shape {tuple(tensor.shape)} reached {where}, which one rank writes alone; pass its whole "
            "tensor (assembled from its ranks' local parts) instead. This is a bug in AvgPipeStrategy's checkpoint."
        )


def mapped(obj: Any, leaf: Callable[[Any], bool], value: Callable[[Any], Any]) -> Any:
    """``obj`` with every ``x`` for which ``leaf(x)`` holds replaced by ``value(x)``, through dicts (an
    ``OrderedDict`` stays one), lists and tuples; anything else is kept as it is."""
    if leaf(obj):
        return value(obj)
    if isinstance(obj, dict):
        items = ((k, mapped(v, leaf, value)) for k, v in obj.items())
        return collections.OrderedDict(items) if isinstance(obj, collections.OrderedDict) else dict(items)
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(mapped(v, leaf, value) for v in obj)
    return obj


def filled(obj: Any, value: Callable[[Slot], Any]) -> Any:
    """``obj`` with each :class:`Slot` replaced by ``value(slot)``."""
    return mapped(obj, lambda x: isinstance(x, Slot), value)
