"""Checksums that tell a damaged checkpoint from a good one: a file's, recorded when it was written and checked before
it is read, and a tensor's, for a single file whose readers each touch only their own tensors.

CRC-32 (zlib's): a check against damage (a flipped byte, a truncated copy, a disk error), not against a forger, who
could rewrite the checksums too; what keeps a crafted file from running code is that nothing in it is unpickled in
full (``plugin/checkpoint/dcp_reader.py``, ``weights_only=True``). It runs at several GB/s, so a save pays a few percent
(``benchmarks/big_model.py``).
"""

from __future__ import annotations

import contextlib
import os
import zlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.shards import is_dtensor

ALGORITHM = "crc32"
CHUNK = 8 << 20


class DamagedCheckpointError(ValueError):
    """A checkpoint's file or tensor differs from what was written: damaged, truncated or partly copied."""


def crc_bytes(data: Any, crc: int = 0) -> int:
    return zlib.crc32(data, crc)


def tensor_crc(tensor: Tensor) -> str:
    """The CRC-32 of a tensor's bytes, as they are laid out row-major (its storage's layout in a file); a
    ``DTensor`` is refused (its bytes are its ranks' parts: one rank reading it alone would fail or hang)."""
    if is_dtensor(tensor):
        raise TypeError(
            f"A DTensor of shape {tuple(tensor.shape)} reached a checkpoint's checksum on one rank; checksum its whole "
            "tensor instead. This is a bug in AvgPipeStrategy's checkpoint."
        )
    raw = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return f"{crc_bytes(raw.data):08x}"


def file_entry(path: Path, rank: int) -> dict[str, Any]:
    """What a file's check needs: its size, its CRC-32 and the rank that wrote it (for the message)."""
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = crc_bytes(chunk, crc)
    return {ALGORITHM: f"{crc:08x}", "bytes": os.path.getsize(path), "rank": rank}


def check_file(folder: Path, name: str, entry: Mapping[str, Any]) -> None:
    """Raise :class:`DamagedCheckpointError` naming the file and its writer if ``folder/name`` is not as recorded."""
    path = folder / name
    who = f"written by rank {entry.get('rank', '?')}"
    if not path.exists():
        raise DamagedCheckpointError(
            f"The checkpoint folder {folder} is incomplete: its file {name} ({who}) is missing. Copy the whole "
            "folder, or resume from another checkpoint."
        )
    size = os.path.getsize(path)
    if size != entry["bytes"]:
        raise DamagedCheckpointError(
            f"The checkpoint folder {folder} is damaged: its file {name} ({who}) is truncated or damaged: {size} "
            f"bytes where {entry['bytes']} were written. Copy it again, or resume from another checkpoint."
        )
    found = file_entry(path, int(entry.get("rank", -1)))[ALGORITHM]
    if found != entry[ALGORITHM]:
        raise DamagedCheckpointError(
            f"The checkpoint folder {folder} is damaged: its file {name} ({who}) does not match the checksum recorded "
            f"when it was saved ({ALGORITHM} {found}, saved {entry[ALGORITHM]}). Copy it again, or resume from "
            "another checkpoint."
        )


def checksummed_file_system() -> Any:
    """DCP's file system, keeping each written file's CRC-32 and size (``written``) as the bytes go out."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    class Stream:
        def __init__(self, f: Any) -> None:
            self.file, self.crc, self.size = f, 0, 0

        def write(self, data: Any) -> int:
            self.crc = crc_bytes(data, self.crc)
            n = self.file.write(data)
            self.size += n
            return n  # type: ignore[no-any-return]

        def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, ...
            return getattr(self.file, name)

    class Checksummed(FileSystem):
        def __init__(self) -> None:
            super().__init__()
            self.written: dict[str, tuple[str, int]] = {}

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as f:
                if "w" not in mode:
                    yield f
                    return
                stream = Stream(f)
                yield stream
            self.written[Path(path).name] = (f"{stream.crc:08x}", stream.size)

    return Checksummed()


# -- a single file's tensors, by their place in the checkpoint ---------------------------------------------------
def tensor_paths(obj: Any, leaf: Callable[[Any], bool], path: str = "") -> Iterator[tuple[str, Any]]:
    """``(path, x)`` for every ``x`` in ``obj`` for which ``leaf(x)`` holds, through dicts, lists and tuples; a path
    is the keys and indices joined by ``/`` (``state_dict/layers.0.weight``)."""
    if leaf(obj):
        yield path, obj
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from tensor_paths(v, leaf, f"{path}/{k}" if path else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from tensor_paths(v, leaf, f"{path}/{i}" if path else str(i))


def tensor_checksums(obj: Any) -> dict[str, Any]:
    """The entry a single-file checkpoint stores under ``avgpipe_checksums``: each tensor's CRC-32 by its path."""
    return {"algorithm": ALGORITHM, "tensors": {p: tensor_crc(t) for p, t in tensor_paths(obj, _is_tensor)}}


def check_tensors(obj: Any, recorded: Mapping[str, Any] | None, where: Any) -> int:
    """Check each tensor of ``obj`` (a checkpoint, or the part of it this rank reads, at the same paths) whose path
    ``recorded`` names; returns how many were checked. Raises :class:`DamagedCheckpointError` naming the first
    that differs."""
    if not isinstance(recorded, Mapping) or recorded.get("algorithm") != ALGORITHM:
        return 0
    sums = recorded.get("tensors", {})
    checked = 0
    for path, tensor in tensor_paths(obj, _is_tensor):
        saved = sums.get(path)
        if saved is None:
            continue
        found = tensor_crc(tensor)
        if found != saved:
            raise DamagedCheckpointError(
                f"The checkpoint {where} is damaged: its tensor {path} does not match the checksum recorded when it "
                f"was saved ({ALGORITHM} {found}, saved {saved}). Copy the file again, or resume from another "
                "checkpoint."
            )
        checked += 1
    return checked


def _is_tensor(x: Any) -> bool:
    return isinstance(x, Tensor)
