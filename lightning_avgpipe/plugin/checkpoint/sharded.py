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

import ctypes
import errno
import os
import pickle
import re
import shutil
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe import shards
from lightning_avgpipe.plugin.checkpoint import dcp_reader
from lightning_avgpipe.runtime.files import checksums, torchfile

REF = "__avgpipe_dcp__"
META = "avgpipe.pt"
DCP_META = dcp_reader.DCP_META
INCOMPLETE = ".incomplete"
REPLACED = ".replaced"
SHARDED = "avgpipe_sharded"  # avgpipe.pt's own entry: the world size and layout that wrote the folder
FILES = "avgpipe_files"  # avgpipe.pt's own entry: each file's size, checksum and writer (runtime/files/checksums.py)
CHECKSUMS = "avgpipe_checksums"  # a single file's own entry: each tensor's checksum (runtime/files/checksums.py)


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


def to_refs(obj: Any, key: str, tensors: dict[str, Tensor], seen: dict[Any, str] | None = None) -> Any:
    """``obj`` with each tensor replaced by a reference keyed by its path under ``key``, the tensor put in
    ``tensors``. A tensor over the same bytes as one already put (a weight under two names) is referenced by that
    one's key: it is stored once, and read back under both names."""
    seen = {} if seen is None else seen
    if isinstance(obj, (Tensor, FlatPieces)):
        same = shards.same_data(obj)
        if same is not None and same in seen:
            return ref(seen[same])
        if same is not None:
            seen[same] = key
        tensors[key] = obj.detach() if isinstance(obj, Tensor) else obj  # type: ignore[assignment]
        return ref(key)
    if isinstance(obj, Mapping):
        return type(obj)((k, to_refs(v, f"{key}.{k}", tensors, seen)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, (list, tuple)) and type(obj) in (list, tuple):
        return type(obj)(to_refs(v, f"{key}.{i}", tensors, seen) for i, v in enumerate(obj))
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


def replaced(path: Path) -> Path:
    return path.with_name(f".{path.name}{REPLACED}")


def prepare(path: Path) -> Path:
    """Rank 0, before the ranks write: an empty staging folder beside ``path`` (a stale one from a killed save
    removed, and a replace a kill interrupted completed first: :func:`recover`)."""
    recover(path, quiet=True)
    tmp = staging(path)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if not os.access(tmp, os.W_OK):
        raise PermissionError(f"Cannot save the checkpoint {path}: its folder {tmp} is not writable.")
    return tmp


def write_tensors(
    tmp: Path, tensors: dict[str, Tensor], process_group: Any, wrap: Any = None
) -> dict[str, dict[str, Any]]:
    """Every rank at once (collective): its tensors into DCP's files in ``tmp``; a key several ranks hold is written
    by one of them. ``wrap``: given the storage writer, what DCP gets instead. Returns the checksum entry
    (``runtime/files/checksums.py``) of each file this rank wrote, computed as it was written (no second read)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    inner = dcp.FileSystemWriter(tmp, thread_count=1)
    fs = inner.fs = checksums.checksummed_file_system()
    writer = inner if wrap is None else wrap(inner)
    planner = _planner()
    distributed = dist.is_initialized()
    dcp.save(tensors, storage_writer=writer, planner=planner, process_group=process_group, no_dist=not distributed)
    rank = dist.get_rank(process_group) if distributed else 0
    mine = [f.name for f in sorted(tmp.glob(f"__{rank}_*.distcp"))]
    written = fs.written
    return {
        name: {checksums.ALGORITHM: written[name][0], "bytes": written[name][1], "rank": rank}
        if name in written and written[name][1] == os.path.getsize(tmp / name)
        else checksums.file_entry(tmp / name, rank)
        for name in mine
    }


def file_entries(folder: Path, names: Iterable[str], rank: int) -> dict[str, dict[str, Any]]:
    """The checksum entries (``runtime/files/checksums.py``) of the folder's files ``names``, written by ``rank``."""
    return {name: checksums.file_entry(folder / name, rank) for name in names}


def finish(path: Path, meta: dict[str, Any], files: Mapping[str, Any] | None = None) -> None:
    """Rank 0, after every rank wrote: ``avgpipe.pt`` (with ``files``, the checksum of every file the ranks wrote),
    then the folder put into place (a checkpoint already there, file or folder, replaced only then)."""
    tmp = staging(path)
    if files is not None:
        meta = {**meta, FILES: dict(files)}
    with open(tmp / META, "wb") as f:
        torch.save(meta, f)
        f.flush()
        os.fsync(f.fileno())
    put_in_place(tmp, path)


def put_in_place(tmp: Path, path: Path) -> None:
    """``tmp`` renamed to ``path``. A folder or file already at ``path`` is swapped with ``tmp`` in one step where
    the system can (Linux's ``renameat2(RENAME_EXCHANGE)``), then removed: ``path`` is never missing. Elsewhere it is
    moved aside to ``.<name>.replaced`` first; a kill between the two renames leaves both, and :func:`recover` puts
    the complete one back."""
    if path.exists() or path.is_symlink():
        if _exchange(tmp, path):
            _remove(tmp)
            return
        old = replaced(path)
        _remove(old)
        os.replace(path, old)
        os.replace(tmp, path)
        _remove(old)
        return
    os.replace(tmp, path)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _exchange(a: Path, b: Path) -> bool:
    """Swap ``a`` and ``b`` atomically; ``False`` where the system or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def recover(path: Path, quiet: bool = False) -> str | None:
    """Finish a replace of ``path`` that a kill interrupted between its two renames: no ``path``, but
    ``.<name>.replaced`` (the previous checkpoint) and ``.<name>.incomplete`` (the new one, complete once its
    ``avgpipe.pt`` is written). The complete new one is renamed into place, else the previous one is put back.
    Returns what was done, or ``None`` when there was nothing to do; raises naming both when neither is complete
    (``quiet``: leaves them as they are)."""
    old, new = replaced(path), staging(path)
    if path.exists() or not old.exists():
        return None
    for candidate, what in ((new, "the new checkpoint"), (old, "the previous checkpoint")):
        if _complete(candidate):
            os.replace(candidate, path)
            for rest in (old, new):
                _remove(rest)
            return f"{path} was missing after an interrupted save; {what} ({candidate.name}) is back in its place"
    if quiet:
        return None
    raise ValueError(
        f"The checkpoint {path} is missing: a save was interrupted while replacing it, and neither {old} (the "
        f"previous checkpoint) nor {new} (the new one) is complete. Resume from another checkpoint."
    )


def interrupted(path: Path) -> Path | None:
    """Where to read ``path`` from when a kill interrupted its replace (:func:`recover`), without renaming anything
    (every rank reads at once): the complete one of ``.<name>.incomplete`` and ``.<name>.replaced``; ``None`` when
    ``path`` is there or no replace was interrupted. Raises naming both when neither is complete."""
    old, new = replaced(path), staging(path)
    if path.exists() or not old.exists():
        return None
    for candidate in (new, old):
        if _complete(candidate):
            return candidate
    raise ValueError(
        f"The checkpoint {path} is missing: a save was interrupted while replacing it, and neither {old} (the "
        f"previous checkpoint) nor {new} (the new one) is complete. Resume from another checkpoint."
    )


def _complete(path: Path) -> bool:
    if path.is_file():
        return True  # a single file is renamed into place only once complete
    try:
        meta, _ = check_folder(path, allow_staged=True)
        for name, entry in meta.get(FILES, {}).items():
            if os.path.getsize(path / name) != entry["bytes"]:
                return False
        return True
    except Exception:  # noqa: BLE001 - not complete, whatever is wrong with it
        return False


# -- reading ---------------------------------------------------------------------------------------------------
def read_meta(path: Path, trusted: bool = False) -> dict[str, Any]:
    """``avgpipe.pt``, with ``weights_only=True`` unless ``trusted``: a refusal said as one, any other failure as
    a damaged file."""
    try:
        return torch.load(path / META, map_location="cpu", weights_only=not trusted)  # type: ignore[no-any-return]
    except pickle.UnpicklingError as err:
        if "weights_only" not in str(err):
            raise _damaged_meta(path, err) from err
        raise dcp_reader.UnsafeCheckpointError(
            f"Refusing to load {path / META}: it holds objects other than tensors and plain values, and unpickling "
            "them could run code from the file. If you wrote this folder yourself, pass "
            "AvgPipeStrategy(trusted_checkpoints=True) (consolidate: --trusted)."
        ) from err
    except Exception as err:  # noqa: BLE001 - zip, EOF and OS errors all mean a damaged file
        raise _damaged_meta(path, err) from err


def _damaged_meta(path: Path, err: BaseException) -> ValueError:
    return checksums.DamagedCheckpointError(
        f"The checkpoint folder {path} is damaged: its {META} (written by rank 0) is truncated or damaged and cannot "
        f"be read ({type(err).__name__}: {str(err).splitlines()[0][:120] if str(err) else ''}). Copy the folder "
        "again, or resume from another checkpoint."
    )


def check_folder(path: Path, trusted: bool = False, allow_staged: bool = False) -> tuple[dict[str, Any], Any]:
    """Read a sharded checkpoint's ``avgpipe.pt`` and DCP's metadata, or say why the folder is not a complete one
    (naming the missing rank's file or key), is damaged (a file not as written) or is refused (it would run code).
    Only ``.metadata`` is checked against its checksum here; each tensor file when it is read
    (:func:`check_files`)."""
    if not path.is_dir():
        raise FileNotFoundError(f"There is no checkpoint folder {path}.")
    staged = path.name.endswith(INCOMPLETE) and not allow_staged
    if staged or not ((path / META).exists() or (path / DCP_META).exists()):
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
    meta = read_meta(path, trusted)
    files = meta.get(FILES) or {}
    if DCP_META in files:
        checksums.check_file(path, DCP_META, files[DCP_META])
    metadata = dcp_reader.load_metadata(path, trusted)
    missing = sorted({info.relative_path for info in metadata.storage_data.values()} - set(os.listdir(path)))
    if missing:
        ranks = sorted({int(m.group(1)) for f in missing if (m := re.match(r"__(\d+)_", f))})
        raise ValueError(
            f"The checkpoint folder {path} is incomplete: rank(s) {ranks}'s file(s) {missing[:4]} are missing. "
            "Copy the whole folder, or resume from another checkpoint."
        )
    keys = set(metadata.state_dict_metadata)
    lost = [k for k in refs_in(meta) if k not in keys]
    if lost:
        raise ValueError(f"The checkpoint folder {path} lacks the tensors {lost[:5]} that its {META} names.")
    dcp_reader.check_items(path, metadata, refs_in(meta), trusted)
    return meta, metadata


def check_files(path: Path, meta: Mapping[str, Any], names: Iterable[str], checked: set[str] | None = None) -> None:
    """Check each of the folder's files ``names`` against the checksum ``avgpipe.pt`` recorded for it (once per
    ``checked``); a folder saved before checksums has none to check."""
    files = meta.get(FILES) or {}
    for name in sorted(set(names) - (checked or set())):
        if name in files:
            checksums.check_file(path, name, files[name])
        if checked is not None:
            checked.add(name)


def read_tensors(
    path: Path,
    metadata: Any,
    keys: Iterable[str],
    into: dict[str, Tensor] | None = None,
    split_as: dict[str, Tensor] | None = None,
    meta: Mapping[str, Any] | None = None,
    checked: set[str] | None = None,
) -> dict[str, Tensor]:
    """The tensors ``keys`` of a sharded checkpoint, read by this process alone (only their bytes); a key in
    ``into`` is read into that tensor in place (a parameter being restored: no second copy of it); a key in
    ``split_as`` (a tensor-parallel parameter, a DTensor) is read as a DTensor of its layout: this rank's shard
    alone. The files they are in are first checked against ``meta``'s checksums (each once per ``checked``)."""
    import torch.distributed.checkpoint as dcp

    keys = list(dict.fromkeys(keys))
    if meta is not None:
        check_files(path, meta, dcp_reader.files_of(metadata, keys), checked)
    state: dict[str, Tensor] = {}
    for key in keys:
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
            dcp.load(
                state, storage_reader=dcp_reader.reader(path, metadata), planner=dcp_reader.planner(), no_dist=True
            )
    return state


def consolidate(folder: str | os.PathLike[str], out: str | os.PathLike[str], trusted: bool = False) -> None:
    """The single-file checkpoint (``save_distributed_checkpoint=False``'s) of a sharded one, written tensor by
    tensor: the peak is the largest tensor (``torchfile.write``). Every file is checked against its checksum
    first; nothing in the folder is unpickled in full unless ``trusted``."""
    found = interrupted(Path(folder))
    path = found or Path(folder)
    meta, metadata = check_folder(path, trusted, allow_staged=found is not None)
    check_files(path, meta, {info.relative_path for info in metadata.storage_data.values()})
    meta.pop(FILES, None)

    def slot(key: str) -> torchfile.Slot:
        md = metadata.state_dict_metadata[key]
        return torchfile.Slot(key, tuple(md.size), md.properties.dtype)

    meta.pop(SHARDED, None)
    tree = resolve(meta, slot)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        torchfile.write(tmp, tree, lambda key: read_tensors(path, metadata, [key])[key], checksums=CHECKSUMS)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            tmp.unlink()
