"""Sharded checkpoints (``save_distributed_checkpoint=True``): a folder every rank writes its own part of, in parallel,
with ``torch.distributed.checkpoint`` (DCP). Nothing is gathered to one rank.

``FOLDER/``
- ``.metadata``, ``__<rank>_<n>.distcp``: DCP's files, every tensor under a key. The model's weights and the
  optimizer's per-parameter state are keyed by the unsplit model's names (``state_dict.<name>``,
  ``optimizer_states.<i>.state.<name>.<key>``), so another layout finds them by name; copies of one tensor (the
  D groups' copies of a stage, a tied weight's copies) are written once. A rank's own state (its replicas, their
  optimizers, the averaging's) is keyed by its rank, for a resume in the same layout.
- ``avgpipe.pt``: written by rank 0 last, ``torch.save``'s format: the rest of Lightning's checkpoint (loops,
  callbacks, hyperparameters) and the structure of the above, each tensor in it a reference ``{REF: key}``.

A save writes ``.<name>.incomplete`` and renames it into place once every rank has written: a save killed midway
leaves the previous checkpoint whole. Nothing is unpickled in full: ``avgpipe.pt`` is read with
``weights_only=True``, DCP's ``.metadata`` is checked by a restricted unpickler before DCP reads it, and DCP reads
tensors with ``weights_only=True``. ``consolidate`` writes the single file of ``save_distributed_checkpoint=False``.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe import shards
from lightning_avgpipe.runtime import torchfile

REF = "__avgpipe_dcp__"
META = "avgpipe.pt"
DCP_META = ".metadata"
INCOMPLETE = ".incomplete"
SHARDED = "avgpipe_sharded"  # avgpipe.pt's own entry: the world size and layout that wrote the folder


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """The flat range ``[start, stop)`` of a row-major tensor of ``shape`` as rectangular boxes ``(offsets, sizes,
    flat start)``, each a contiguous run of the range: a partial first row, whole rows, a partial last row (each
    partial row cut the same way one dimension down)."""
    if start >= stop:
        return []
    if len(shape) <= 1:
        return [((start,), (stop - start,), start)] if shape else [((), (), start)]
    inner = 1
    for n in shape[1:]:
        inner *= n
    first, last = start // inner, (stop - 1) // inner

    def within(row: int, a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
        return [((row, *o), (1, *z), row * inner + f) for o, z, f in boxes(shape[1:], a, b)]

    if first == last:
        return within(first, start - first * inner, stop - first * inner)
    out = []
    if start % inner:
        out += within(first, start % inner, inner)
        first += 1
    full_end = stop // inner
    if first < full_end:
        out.append(((first, *[0] * (len(shape) - 1)), (full_end - first, *shape[1:]), first * inner))
    if stop % inner:
        out += within(full_end, 0, stop % inner)
    return out


class FlatPieces:
    """This rank's pieces of one tensor of ``shape`` held as flat runs (a ZeRO-1 slice of an optimizer state): DCP
    writes each as the boxes of the whole tensor it covers (:func:`boxes`), so the ranks' pieces make the tensor in
    the folder with nothing gathered."""

    def __init__(self, shape: tuple[int, ...], pieces: list[tuple[int, Tensor]]) -> None:
        self.shape = shape
        self.parts: dict[tuple[int, ...], Tensor] = {}
        for start, flat in pieces:
            for offsets, sizes, at in boxes(shape, start, start + flat.numel()):
                n = 1
                for z in sizes:
                    n *= z
                self.parts[offsets] = flat[at - start : at - start + n].view(sizes)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=part.shape),
                    properties=TensorProperties.create_from_tensor(part),
                    size=torch.Size(self.shape),
                ),
            )
            for offsets, part in self.parts.items()
        ]


def _planner() -> Any:
    """DCP's default planner, finding a :class:`FlatPieces` part by its offsets."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class PiecesPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = self.state_dict.get(index.fqn)
            if isinstance(obj, FlatPieces):
                return obj.parts[tuple(index.offset)]
            return super().lookup_object(index)

    return PiecesPlanner()


def ref(key: str) -> dict[str, str]:
    return {REF: key}


def is_ref(value: Any) -> bool:
    return isinstance(value, dict) and len(value) == 1 and REF in value


def to_refs(obj: Any, key: str, tensors: dict[str, Tensor]) -> Any:
    """``obj`` with each tensor replaced by a reference keyed by its path under ``key``, the tensor put in
    ``tensors``."""
    if isinstance(obj, (Tensor, FlatPieces)):
        tensors[key] = obj.detach() if isinstance(obj, Tensor) else obj  # type: ignore[assignment]
        return ref(key)
    if isinstance(obj, Mapping):
        return type(obj)((k, to_refs(v, f"{key}.{k}", tensors)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_refs(v, f"{key}.{i}", tensors) for i, v in enumerate(obj))
    return obj


def refs_in(obj: Any) -> Iterable[str]:
    if is_ref(obj):
        yield obj[REF]
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from refs_in(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from refs_in(v)


def resolve(obj: Any, value: Callable[[str], Any]) -> Any:
    """``obj`` with each reference replaced by ``value(key)``."""
    return torchfile.mapped(obj, is_ref, lambda r: value(r[REF]))


# -- writing ---------------------------------------------------------------------------------------------------
def staging(path: Path) -> Path:
    return path.with_name(f".{path.name}{INCOMPLETE}")


def prepare(path: Path) -> Path:
    """Rank 0, before the ranks write: an empty staging folder beside ``path`` (a stale one from a killed save
    removed)."""
    tmp = staging(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if not os.access(tmp, os.W_OK):
        raise PermissionError(f"Cannot save the checkpoint {path}: its folder {tmp} is not writable.")
    return tmp


def write_tensors(tmp: Path, tensors: dict[str, Tensor], process_group: Any, wrap: Any = None) -> None:
    """Every rank at once (collective): its tensors into DCP's files in ``tmp``; a key several ranks hold is written
    by one of them. ``wrap``: given the storage writer, what DCP gets instead."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    writer = dcp.FileSystemWriter(tmp, thread_count=1)
    writer = writer if wrap is None else wrap(writer)
    planner = _planner()
    dcp.save(
        tensors, storage_writer=writer, planner=planner, process_group=process_group, no_dist=not dist.is_initialized()
    )


def finish(path: Path, meta: dict[str, Any]) -> None:
    """Rank 0, after every rank wrote: ``avgpipe.pt``, then the folder renamed into place (a checkpoint already
    there, file or folder, replaced only then)."""
    tmp = staging(path)
    with open(tmp / META, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    old = path.with_name(f".{path.name}.replaced")
    if path.exists() or path.is_symlink():
        if old.is_dir():
            shutil.rmtree(old)
        os.replace(path, old)
    os.replace(tmp, path)
    if old.is_dir():
        shutil.rmtree(old)
    elif old.exists():
        old.unlink()


# -- reading ---------------------------------------------------------------------------------------------------
class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` holds only its own dataclasses, dtypes, sizes and paths: anything else is refused."""

    ALLOWED = {
        "torch.distributed.checkpoint.metadata": None,  # any of its dataclasses
        "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
        "torch.serialization": {"_get_layout"},
        "torch": {"Size", "strided", "contiguous_format", "preserve_format", "channels_last", *dir(torch)},
        "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"},
        "collections": {"OrderedDict"},
        "builtins": {"set", "frozenset", "tuple", "list", "dict"},
    }

    def find_class(self, module: str, name: str) -> Any:
        allowed = self.ALLOWED.get(module, set())
        if module in self.ALLOWED and (allowed is None or name in allowed):
            value = super().find_class(module, name)
            if module == "torch" and not isinstance(value, (torch.dtype, type, torch.layout, torch.memory_format)):
                raise pickle.UnpicklingError(f"{module}.{name}")
            return value
        raise pickle.UnpicklingError(f"{module}.{name}")


def read_dcp_metadata(path: Path) -> Any:
    try:
        return _MetadataUnpickler(io.BytesIO((path / DCP_META).read_bytes())).load()
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"Refusing to load the checkpoint folder {path}: its {DCP_META} holds objects other than "
            f"torch.distributed.checkpoint's metadata ({err}), and unpickling them could run code from the file."
        ) from err


def check_folder(path: Path) -> tuple[dict[str, Any], Any]:
    """Read a sharded checkpoint's ``avgpipe.pt`` and DCP's metadata, or say why the folder is not a complete one
    (naming the missing rank's file or key)."""
    if not path.is_dir():
        raise FileNotFoundError(f"There is no checkpoint folder {path}.")
    if path.name.endswith(INCOMPLETE) or not ((path / META).exists() or (path / DCP_META).exists()):
        raise ValueError(
            f"The folder {path} is not a complete checkpoint: it has no {META}, which rank 0 writes last (a save "
            f"that did not finish leaves a folder named .<name>{INCOMPLETE}). Resume from the previous checkpoint."
        )
    if not (path / META).exists():
        raise ValueError(
            f"The folder {path} is a torch.distributed.checkpoint folder not written by AvgPipeStrategy (it has no "
            f"{META}). Load it with torch.distributed.checkpoint, or pass a checkpoint AvgPipeStrategy saved."
        )
    if not (path / DCP_META).exists():
        raise ValueError(f"The checkpoint folder {path} is incomplete: it lacks {DCP_META}. Resume from another one.")
    metadata = read_dcp_metadata(path)
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(os.listdir(path)))
    if missing:
        ranks = sorted({int(m.group(1)) for f in missing if (m := re.match(r"__(\d+)_", f))})
        raise ValueError(
            f"The checkpoint folder {path} is incomplete: rank(s) {ranks}'s file(s) {missing[:4]} are missing. "
            "Copy the whole folder, or resume from another checkpoint."
        )
    try:
        meta = torch.load(path / META, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        raise ValueError(
            f"Refusing to load {path / META}: it holds objects other than tensors and plain values, and unpickling "
            "them could run code from the file."
        ) from err
    keys = set(metadata.state_dict_metadata)
    lost = [k for k in refs_in(meta) if k not in keys]
    if lost:
        raise ValueError(f"The checkpoint folder {path} lacks the tensors {lost[:5]} that its {META} names.")
    return meta, metadata


def read_tensors(
    path: Path,
    metadata: Any,
    keys: Iterable[str],
    into: dict[str, Tensor] | None = None,
    split_as: dict[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    """The tensors ``keys`` of a sharded checkpoint, read by this process alone (only their bytes); a key in
    ``into`` is read into that tensor in place (a parameter being restored: no second copy of it); a key in
    ``split_as`` (a tensor-parallel parameter, a DTensor) is read as a DTensor of its layout: this rank's shard
    alone."""
    import torch.distributed.checkpoint as dcp

    state: dict[str, Tensor] = {}
    for key in dict.fromkeys(keys):
        md = metadata.state_dict_metadata[key]
        target = (into or {}).get(key)
        like = (split_as or {}).get(key)
        if target is None and like is not None and tuple(like.shape) == tuple(md.size):
            target = shards.empty_like_split(like, md.properties.dtype)
        if target is None or tuple(target.shape) != tuple(md.size) or target.dtype != md.properties.dtype:
            target = torch.empty(tuple(md.size), dtype=md.properties.dtype)
        state[key] = target
    if state:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled", category=UserWarning)
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return state


def consolidate(folder: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """The single-file checkpoint (``save_distributed_checkpoint=False``'s) of a sharded one, written tensor by
    tensor: the peak is the largest tensor (``torchfile.write``)."""
    path = Path(folder)
    meta, metadata = check_folder(path)

    def slot(key: str) -> torchfile.Slot:
        md = metadata.state_dict_metadata[key]
        return torchfile.Slot(key, tuple(md.size), md.properties.dtype)

    meta.pop(SHARDED, None)
    tree = resolve(meta, slot)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torchfile.write(tmp, tree, lambda key: read_tensors(path, metadata, [key])[key])
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
