"""Pretrained weights from safetensors files, read tensor by tensor: each rank reads only the tensors it holds.

:func:`load_pretrained` takes a ``.safetensors`` file or a folder (``model.safetensors``, or the shards that
``model.safetensors.index.json`` maps, as Hugging Face's ``save_pretrained`` writes them) and fills a module's
parameters and persistent buffers, matching names as ``from_pretrained`` does: the file's keys with or without the
model's ``base_model_prefix``, the legacy ``gamma``/``beta`` names, the class's ``_checkpoint_conversion_mapping``,
and a tied weight from whichever of its names the file holds; ``prefix`` takes only the file's keys that start with it,
without it.

Strict by default, as ``load_state_dict`` is: a tensor of the module that no key fills is an error naming it, and when
fewer than half match, the error shows the nearest names of both sides and the submodule or ``prefix`` that would
match (``runtime/build/pretrained_check.py``); ``strict=False`` leaves such tensors as initialized and lists them in
``Loaded.missing``. A file that is not a readable safetensors file is named, with what it holds instead. The check
needs only the names: on the meta device in ``configure_model`` every rank builds the whole model and reads every
file's header, so every rank takes the same decision, and raises the same error before any rank waits for another.

Called on a model being built on the meta device under a recorded build (``runtime/build/init_record.py``; the
strategy's ``configure_model``), each copy is recorded as a step of the build: the replay runs it only for the tensors
a rank keeps, after the layers' own initialization, each read memory-mapped from its file. On a real model it copies
now.
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

from lightning_avgpipe.runtime.build.init_record import record_step
from lightning_avgpipe.runtime.build.pretrained_check import mismatch, unreadable

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass
class Loaded:
    """What :func:`load_pretrained` matched: module name -> the file's key, the names it found no key for (with
    ``strict=False``, left as initialized, as ``from_pretrained`` leaves them; else an error) and the file's keys
    nothing took."""

    keys: dict[str, str] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    deferred: bool = False


def files_of(path: str | os.PathLike[str]) -> dict[str, Path]:
    """The file's keys -> the file holding each (reading only the headers: every shard's, so that a damaged or
    missing one is named here, on every rank alike, not by the one rank that reads it later)."""
    path = Path(path)
    if path.is_dir():
        if (path / INDEX).exists():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as err:
                raise ValueError(f"load_pretrained: {path / INDEX} is not a readable index ({err!r}).") from err
            where = {key: path / name for key, name in weight_map.items()}
            by_shard: dict[Path, list[str]] = {}
            for key, shard in where.items():
                by_shard.setdefault(shard, []).append(key)
            for shard, keys in sorted(by_shard.items()):
                held = set(_keys_of(shard, f" (a shard that {INDEX} names)"))
                absent = [key for key in keys if key not in held]
                if absent:
                    raise ValueError(
                        f"load_pretrained: {INDEX} maps {absent[0]!r} to {shard}, which does not hold it "
                        f"({len(absent)} such keys): the folder's files do not belong together."
                    )
            return where
        if (path / SINGLE).exists():
            path = path / SINGLE
        else:
            raise FileNotFoundError(f"load_pretrained: {path} holds neither {INDEX} nor {SINGLE}.")
    return dict.fromkeys(_keys_of(path), path)


def _keys_of(path: Path, what: str = "") -> list[str]:
    if not path.exists():
        raise FileNotFoundError(f"load_pretrained: there is no file {path}{what}.")
    safe_open = _safe_open()
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except Exception as err:  # noqa: BLE001 - safetensors' own SafetensorError (an Exception), for any damage
        raise unreadable(path, err) from err


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


def match(module: nn.Module, file_keys: Iterable[str], prefix: str = "") -> Loaded:
    """Which file key fills each of ``module``'s parameters and persistent buffers (of the keys starting with
    ``prefix``, read without it)."""
    base = str(getattr(module, "base_model_prefix", "") or "")
    mapping = dict(getattr(module, "_checkpoint_conversion_mapping", None) or {})
    tensors = module.state_dict(keep_vars=True)
    names = set(tensors)
    by_name: dict[str, str] = {}
    for key in file_keys:
        if not key.startswith(prefix):
            continue
        name = _renamed(key.removeprefix(prefix), mapping)
        for candidate in (name, f"{base}.{name}" if base else name, name.removeprefix(f"{base}.")):
            if candidate in names and candidate not in by_name:
                by_name[candidate] = key
                break
    loaded = Loaded(keys=by_name)
    # a tied weight: one tensor under several names, the file holding one of them (lm_head.weight is not saved)
    for name in tensors:
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
    try:
        with safe_open(file, framework="pt", device="cpu") as f:
            value = f.get_tensor(key)
    except Exception as err:  # noqa: BLE001 - safetensors' own SafetensorError; the file changed since its header
        raise unreadable(Path(file), err) from err
    if tuple(value.shape) != tuple(dest.shape):
        raise ValueError(
            f"load_pretrained: {file}'s {key!r} is {tuple(value.shape)}; the model's is {tuple(dest.shape)}."
        )
    with torch.no_grad():
        dest.copy_(value)
    return dest


def load_pretrained(
    module: nn.Module, path: str | os.PathLike[str], *, strict: bool = True, prefix: str = ""
) -> Loaded:
    """Fill ``module``'s parameters and persistent buffers from a safetensors file or a Hugging Face folder (one
    file, or shards with ``model.safetensors.index.json``), by name as ``from_pretrained`` matches them.

    ``strict`` (the default, as ``load_state_dict``): a tensor of the module that no key fills is an error naming
    it; when fewer than half match, the error shows the nearest names of both sides and the submodule to pass or the
    ``prefix`` that would match. ``strict=False`` leaves such tensors as initialized (as ``from_pretrained`` does)
    and lists them in the result's ``missing``. Keys that fill nothing are never an error (``unexpected``).
    ``prefix``: read only the file's keys that start with it, without it (``"model."`` for a file whose keys are
    ``model.layers.0...`` loaded into the module whose names are ``layers.0...``).

    Inside ``configure_model`` under ``AvgPipeStrategy`` the model is on the meta device: each copy is recorded, and
    each rank reads only the tensors of its own stages when it makes them real at setup. The check runs at the call,
    on the whole model, so every rank raises alike. Anywhere else it copies now. Returns the matching.
    """
    if prefix and not prefix.endswith("."):
        prefix += "."
    where = files_of(path)
    loaded = match(module, where, prefix)
    if strict and loaded.missing:

        def count(sub: nn.Module, head: str) -> tuple[int, int]:
            total = len(sub.state_dict())
            return total - len(match(sub, where, head).missing), total

        # a ValueError, not load_state_dict's RuntimeError: the meta build reads a RuntimeError that says "meta" (a
        # path such as meta-llama/...) as a value read on the meta device, and would add a wrong hint
        raise ValueError(mismatch(module, path, list(where), loaded.missing, loaded.unexpected, count))
    state = module.state_dict(keep_vars=True)
    done: set[int] = set()
    for name, key in loaded.keys.items():
        tensor = state[name]
        if id(tensor) in done:
            continue
        done.add(id(tensor))
        if tensor.is_meta:
            loaded.deferred = True
            record_step(read_into_, (tensor, str(where[key]), key), overwrites=True)
        else:
            read_into_(tensor, str(where[key]), key)
    return loaded
