"""Pretrained weights from safetensors files, read tensor by tensor: each rank reads only the tensors it holds.

:func:`load_pretrained` takes a ``.safetensors`` file or a folder (``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps, as Hugging Face's ``save_pretrained`` writes them) and fills a module's
parameters and persistent buffers, matching names as ``from_pretrained`` does: the file's keys with or without the
model's ``base_model_prefix``, the legacy ``gamma``/``beta`` names, the class's ``_checkpoint_conversion_mapping``,
and a tied weight from whichever of its names the file holds.

Called on a model being built on the meta device under a recorded build (``runtime/init_record.py``; the strategy's
``configure_model``), each copy is recorded as a step of the build: the replay runs it only for the tensors a rank
keeps, after the layers' own initialization, each read memory-mapped from its file. On a real model it copies now.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.runtime.init_record import record_step

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Loaded:
    """What :func:`load_pretrained` matched: module name -> the file's key, and the names it found no key for (left
    as initialized, as ``from_pretrained`` leaves them) and the file's keys nothing took."""

    keys: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    deferred: bool = False


def files_of(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The file's keys -> the file holding each (reading only the headers)."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX).exists():
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            return {key: path / name for key, name in weight_map.items()}
        if (path / SINGLE).exists():
            path = path / SINGLE
        else:
            raise FileNotFoundError(f"load_pretrained: {path} holds neither {INDEX} nor {SINGLE}.")
    if not path.exists():
        raise FileNotFoundError(f"load_pretrained: there is no file {path}.")
    safe_open = _safe_open()
    with safe_open(str(path), framework="pt") as f:
        return dict.fromkeys(f.keys(), path)


def _safe_open() -> Any:
    try:
        from safetensors import safe_open
    except ImportError as err:  # pragma: no cover - installed with transformers
        raise ImportError("load_pretrained reads safetensors files: pip install safetensors") from err
    return safe_open


def _renamed(key: str, mapping: dict[str, str]) -> str:
    for pattern, replacement in mapping.items():
        key, n = re.subn(pattern, replacement, key)
        if n:
            break
    parts = key.split(".")
    if parts[-1] == "gamma":
        parts[-1] = "weight"
    elif parts[-1] == "beta":
        parts[-1] = "bias"
    return ".".join(parts)


def match(module: nn.Module, file_keys: Iterable[str]) -> Loaded:
    """Which file key fills each of ``module``'s parameters and persistent buffers."""
    prefix = str(getattr(module, "base_model_prefix", "") or "")
    mapping = dict(getattr(module, "_checkpoint_conversion_mapping", None) or {})
    tensors = module.state_dict(keep_vars=True)
    names = list(tensors)
    by_name: dict[str, str] = {}
    for key in file_keys:
        name = _renamed(key, mapping)
        for candidate in (name, f"{prefix}.{name}" if prefix else name, name.removeprefix(f"{prefix}.")):
            if candidate in names and candidate not in by_name:
                by_name[candidate] = key
                break
    loaded = Loaded(keys=by_name)
    # a tied weight: one tensor under several names, the file holding one of them (lm_head.weight is not saved)
    for name in names:
        if name in by_name:
            continue
        twin = next((n for n in by_name if tensors[n] is tensors[name]), None)
        if twin is None:
            loaded.missing.append(name)
    used = set(by_name.values())
    loaded.unexpected = [k for k in file_keys if k not in used]
    return loaded


def read_into_(dest: Tensor, file: str, key: str) -> Tensor:
    """``dest`` filled with the file's tensor ``key`` (only its bytes are read); nothing on the meta device."""
    if dest.is_meta:
        return dest
    safe_open = _safe_open()
    with safe_open(file, framework="pt", device="cpu") as f:
        value = f.get_tensor(key)
    if tuple(value.shape) != tuple(dest.shape):
        raise ValueError(
            f"load_pretrained: {file}'s {key!r} is {tuple(value.shape)}; the model's is {tuple(dest.shape)}."
        )
    with torch.no_grad():
        dest.copy_(value)
    return dest


def load_pretrained(module: nn.Module, path: str | os.PathLike[str]) -> Loaded:
    """Fill ``module``'s parameters and persistent buffers from a safetensors file or a Hugging Face folder (one
    file, or shards with ``model.safetensors.index.json``), by name as ``from_pretrained`` matches them.

    Inside ``configure_model`` under ``AvgPipeStrategy`` the model is on the meta device: each copy is recorded, and
    each rank reads only the tensors of its own stages when it makes them real at setup. Anywhere else it copies
    now. Returns the matching (``missing`` names keep their initialization, as ``from_pretrained`` leaves them).
    """
    where = files_of(path)
    loaded = match(module, where)
    state = module.state_dict(keep_vars=True)
    done: set[int] = set()
    for name, key in loaded.keys.items():
        tensor = state[name]
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        if tensor.is_meta:
            loaded.deferred = True
            record_step(read_into_, (tensor, str(where[key]), key))
        else:
            read_into_(tensor, str(where[key]), key)
    return loaded
