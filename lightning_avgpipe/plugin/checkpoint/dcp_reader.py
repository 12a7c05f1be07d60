"""Reading a checkpoint folder's ``torch.distributed.checkpoint`` (DCP) files without running code from them.

A folder is data from wherever it was copied from, so it is read as untrusted unless the user says otherwise
(``AvgPipeStrategy(trusted_checkpoints=True)``):

- DCP's ``.metadata`` is a pickle. :class:`MetadataUnpickler` lets it name only the classes and constants DCP's
  metadata is made of, each by module and name (an explicit list: a module's other names, such as the ``os`` that
  ``torch.distributed.checkpoint.metadata`` imports, are refused, and so is a dotted name reaching through one).
- DCP would read ``.metadata`` again with plain ``pickle.load`` on every read: :class:`Reader` hands it ours.
- Every item is checked before a byte is read (:func:`check_items`): a tensor, in a file of the folder named as
  DCP names its files, with no transform. A ``BytesStorageMetadata`` item (DCP reads those with
  ``torch.load(weights_only=False)``) is refused, and :class:`Planner` reads one with ``weights_only=True`` if it
  ever gets that far.
"""

from __future__ import annotations

import io
import pickle
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

DCP_META = ".metadata"
FILE_NAME = re.compile(r"__\d+_\d+\.distcp")


def _constants() -> set[str]:
    """torch's dtype, layout and memory-format constants by name (values, never callables)."""
    kinds = (torch.dtype, torch.layout, torch.memory_format)
    return {name for name in dir(torch) if isinstance(getattr(torch, name, None), kinds)}


ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
            "ChunkStorageMetadata",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        }
    ),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo"}),
    "torch.serialization": frozenset({"_get_layout"}),  # a layout by its name, from torch's own constants
    "torch": frozenset({"Size", *_constants()}),
    "pathlib": frozenset({"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset"}),
}
"""Every global a ``.metadata`` may name, by module: nothing else is looked up."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds something whose unpickling could run code from the file."""


class _Refused(pickle.UnpicklingError):
    """A global outside :data:`ALLOWED`."""


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` holds only its own dataclasses, torch's sizes and dtypes, and paths: any other global is
    refused before it is looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if name in ALLOWED.get(module, ()):
            return super().find_class(module, name)
        raise _Refused(f"{module}.{name}")


def load_metadata(path: Path, trusted: bool = False) -> Any:
    """The folder's DCP metadata, read with :class:`MetadataUnpickler` (plain ``pickle`` when ``trusted``).

    Raises :class:`UnsafeCheckpointError` for a global outside :data:`ALLOWED`, and a ``ValueError`` saying the
    file is damaged for anything else that stops the read (a truncated file)."""
    from torch.distributed.checkpoint.metadata import Metadata

    data = (path / DCP_META).read_bytes()
    try:
        if trusted:
            metadata = pickle.loads(data)  # noqa: S301 - the user said the folder is theirs
        else:
            metadata = MetadataUnpickler(io.BytesIO(data)).load()
    except _Refused as err:
        raise UnsafeCheckpointError(
            f"Refusing to load the checkpoint folder {path}: its {DCP_META} names {err}, which is not part of "
            "torch.distributed.checkpoint's metadata, and unpickling it could run code from the file. If you "
            "wrote this folder yourself, pass AvgPipeStrategy(trusted_checkpoints=True) (consolidate: --trusted)."
        ) from err
        raise _damaged(path, err) from err
    except Exception as err:  # noqa: BLE001 - a truncated or garbled pickle fails in many ways
        raise _damaged(path, err) from err
    if not isinstance(metadata, Metadata):
        raise _damaged(path, TypeError(f"it holds a {type(metadata).__name__}, not DCP's Metadata"))
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        raise _damaged(path, TypeError("its Metadata has no items"))
    return metadata


def _damaged(path: Path, err: BaseException) -> ValueError:
    return ValueError(
        f"The checkpoint folder {path} is damaged: its {DCP_META} is truncated or damaged and cannot be read "
        f"({type(err).__name__}: {str(err)[:120]}). Copy the folder again, or resume from another checkpoint."
    )


def check_items(path: Path, metadata: Any, keys: Iterable[str], trusted: bool = False) -> None:
    """Before anything is read: each of ``keys`` is a tensor of the metadata, stored in a file of the folder as DCP
    names them, with no transform (a crafted ``.metadata`` could point anywhere, or ask for a pickle)."""
    from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata

    for key in keys:
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata) and not trusted:
            raise UnsafeCheckpointError(
                f"Refusing to load the checkpoint folder {path}: its {DCP_META} declares {key!r} as "
                f"{type(md).__name__}, not a tensor; AvgPipeStrategy writes only tensors, and reading a pickled "
                "object could run code from the folder."
            )
    for index, info in metadata.storage_data.items():
        name = getattr(info, "relative_path", None)
        if not isinstance(index, MetadataIndex):
            raise UnsafeCheckpointError(f"Refusing to load the checkpoint folder {path}: its {DCP_META} is malformed.")
        if not isinstance(name, str) or not FILE_NAME.fullmatch(name) or getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"Refusing to load the checkpoint folder {path}: its {DCP_META} places {index.fqn!r} in "
                f"{name!r}, not a file of the folder as torch.distributed.checkpoint names them (__<rank>_<n>.distcp)."
            )


def files_of(metadata: Any, keys: Iterable[str]) -> set[str]:
    """The folder's files that hold any part of ``keys``."""
    wanted = set(keys)
    return {info.relative_path for index, info in metadata.storage_data.items() if index.fqn in wanted}


def reader(path: Path, metadata: Any) -> Any:
    """DCP's file reader of ``path``, its ``read_metadata`` returning ``metadata`` (already read and checked)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(path)


def planner() -> Any:
    """DCP's default load planner, reading a pickled item (never one of ours) with ``weights_only=True``."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)

    return Planner(flatten_state_dict=False)  # the keys are flat already
