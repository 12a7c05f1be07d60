"""What :func:`~lightning_avgpipe.runtime.build.pretrained.load_pretrained` says when it cannot load what it was asked
to.

A file that is not a readable safetensors file (a ``torch.save`` file, random bytes, a truncated or damaged file) is
named with what it holds instead. A strict load with tensors left unmatched names them; when fewer than half of the
module's tensors match, it shows the nearest names of both sides and the fix that would match most: a submodule
to pass instead (the module's names have more in front, ``net.model.layers.0...`` against ``model.layers.0...``)
and/or the ``prefix`` the file's keys carry. Pure PyTorch: no Lightning import.
"""

from __future__ import annotations

import difflib
import json
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

from torch import nn

SHOWN = 3
"""The names an error shows of a list (the nearest names, the missing ones), before "and N more"."""

Counting = Callable[[nn.Module, str], tuple[int, int]]
"""(submodule, the file keys' prefix) -> (its tensors a key would fill, its tensors)."""

_AMBIGUOUS = 8  # a tail that ends this many of the file's keys (``weight``) says nothing about where names begin


def unreadable(path: Path, err: BaseException) -> ValueError:
    """The error for ``path``, which safetensors could not open (``err``): what the file holds instead."""
    return ValueError(f"load_pretrained: {path} is not a readable safetensors file: {_what_it_is(path, err)}.")


def _what_it_is(path: Path, err: BaseException) -> str:
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(9)
            n = int.from_bytes(head[:8], "little")
            header = head[8:] + f.read(n - 1) if head[8:] == b"{" and n <= size - 8 else b""
    except OSError as read_err:
        return f"it cannot be read ({read_err})"
    if size == 0:
        return "it is empty"
    if head[8:] == b"{":  # an 8-byte length, then the JSON header: safetensors, cut short or damaged
        if n > size - 8:
            return f"it is truncated (its header alone is {n} bytes; the file has {size}): copy it again"
        try:
            entries = [e for k, e in json.loads(header).items() if k != "__metadata__"]
            end = 8 + n + max((int(e["data_offsets"][1]) for e in entries), default=0)
        except (ValueError, KeyError, TypeError, IndexError):
            end = 0
        if end > size:
            return f"it is truncated ({size} of the {end} bytes its header lists): copy it again"
    elif head.startswith(b"PK\x03\x04"):
        return "it is a zip archive, as torch.save writes (load_pretrained reads safetensors files only)"
    elif head[:1] == b"\x80" and head[1:2] in (b"\x02", b"\x03", b"\x04", b"\x05"):
        return "it is a pickle, as an old torch.save writes (load_pretrained reads safetensors files only)"
    return f"it is damaged, or of another format (safetensors: {err})"


def mismatch(
    module: nn.Module, path: object, keys: Sequence[str], missing: Sequence[str], unused: Sequence[str], count: Counting
) -> str:
    """The strict refusal: ``missing`` are the module's tensors that no key of ``path`` fills (``unused``: the keys
    nothing took). ``count(submodule, prefix)``: how many of a submodule's tensors the keys under ``prefix`` fill."""
    total = len(module.state_dict())
    matched = total - len(missing)
    if 2 * matched >= total:
        return (
            f"load_pretrained: {len(missing)} of the module's {total} tensors {'has' if len(missing) == 1 else 'have'} "
            f"no key in {path}: "
            f"{_listed(missing)}. Pass strict=False to leave them as initialized (Loaded.missing lists them)."
        )
    lines = [
        f"load_pretrained: only {matched} of the module's {total} tensors match a key of {path} "
        f"({len(keys)} keys). Nearest names:"
    ]
    fix, sub, prefix = _best_fix(module, missing, keys, count, matched)
    near_of = sorted(set(unused or keys))
    for name in missing[:SHOWN]:
        lines.append(f"  module: {name}  file: {_nearest(name, near_of, sub, prefix)}")
    cure = "pass strict=False to load what matches (Loaded.missing lists the rest)"
    lines.append(f"{fix}; or {cure}." if fix else f"No prefix on either side makes them match: {cure}.")
    return "\n".join(lines)


def _listed(names: Sequence[str], shown: int = 5) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _nearest(name: str, keys: Sequence[str], sub: str, prefix: str) -> str:
    """The key nearest to ``name``: the one the fix (``sub``, ``prefix``) matches it with, else the most similar (of
    those with its last part, ``weight``, where any has it)."""
    if sub or prefix:
        fixed = prefix + name.removeprefix(sub)
        if name.startswith(sub) and fixed in keys:
            return fixed
    last = name.rpartition(".")[2]
    alike = [k for k in keys if k.rpartition(".")[2] == last] or list(keys)
    near = difflib.get_close_matches(name, alike[:2000], n=1, cutoff=0.0)
    return near[0] if near else "(no key)"


def _best_fix(
    module: nn.Module, names: Sequence[str], keys: Sequence[str], count: Counting, matched: int
) -> tuple[str, str, str]:
    """What to pass so that most of ``names`` equal a key: a submodule and/or the file keys' prefix, said with how
    many of the tensors would match then, and the two; ("", "", "") when nothing would match more than ``matched``
    do now."""
    for (sub, prefix), _ in _common_heads(names, keys).most_common(3):
        if not sub and not prefix:
            continue
        try:
            target = module.get_submodule(sub.removesuffix(".")) if sub else module
        except AttributeError:
            continue
        filled, total = count(target, prefix)
        if filled <= matched:
            continue
        if sub and prefix:
            said = f"The module's names have {sub!r} in front, the file's keys {prefix!r}"
        else:
            said = f"The module's names have {sub!r} in front" if sub else f"The file's keys have {prefix!r} in front"
        args = [f"{_attribute(sub)} instead of the module"] if sub else []
        args += [f"prefix={prefix!r}"] if prefix else []
        whose = "its" if sub else "the module's"
        return f"{said}: pass {' and '.join(args)} ({filled} of {whose} {total} tensors match then)", sub, prefix
    return "", "", ""


def _common_heads(names: Sequence[str], keys: Sequence[str]) -> Counter[tuple[str, str]]:
    """For each module name and file key ending in the same longest tail (``layers.0.mlp.up_proj.weight``), what
    comes before it on each side: ("net.", "model.") counted once per name."""
    heads_of: dict[str, set[str]] = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts)):
            heads_of.setdefault(".".join(parts[i:]), set()).add("".join(p + "." for p in parts[:i]))
    counts: Counter[tuple[str, str]] = Counter()
    for name in names:
        parts = name.split(".")
        for i in range(len(parts)):
            heads = heads_of.get(".".join(parts[i:]))
            if heads:
                if len(heads) <= _AMBIGUOUS:
                    counts.update(("".join(p + "." for p in parts[:i]), head) for head in heads)
                break
    return counts


def _attribute(sub: str) -> str:
    """The submodule ``sub`` ("net.model.") as the user writes it: ``module.net.model``, or ``get_submodule``."""
    path = sub.removesuffix(".")
    if all(part.isidentifier() for part in path.split(".")):
        return f"module.{path}"
    return f"module.get_submodule({path!r})"
