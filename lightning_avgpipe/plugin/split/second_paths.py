"""Second paths: a module inside the pipeline's layers that the LightningModule also reaches by another path, outside
every layer (``self.gpt = gpt`` kept beside wrappers around ``gpt``'s layers). The split puts a placeholder there too
on a rank that does not run that stage (``plugin/split/stages.py``), and the checkpoint
holds the weights under both names.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn


@dataclass(frozen=True)
class SecondPath:
    """A module inside pipeline layers that the LightningModule also reaches by another path, outside every layer
    (``self.gpt = gpt`` kept beside wrappers around ``gpt.wte``): ``path`` is that other name, ``name`` its name
    inside the layer, ``stages`` the stages whose layers hold it."""

    path: str
    name: str
    stages: frozenset[int]
    parent: nn.Module
    attr: str


def second_paths(module: nn.Module, layers: Sequence[nn.Module], stage_of: Sequence[int]) -> list[SecondPath]:
    """Every path from ``module`` to a module inside ``layers`` that passes through no layer (the whole tree is
    walked once; a layer registered under two names is not one of them: the split replaces it under both)."""
    qualified = {id(m): n for n, m in module.named_modules()}
    is_layer = {id(layer) for layer in layers}
    inside: dict[int, tuple[str, set[int]]] = {}  # id(submodule) -> (its name inside a layer, the layers' stages)
    for layer, stage in zip(layers, stage_of):
        base = qualified[id(layer)]
        for name, sub in layer.named_modules(remove_duplicate=False):
            entry = inside.setdefault(id(sub), (f"{base}.{name}" if name else base, set()))
            entry[1].add(stage)
    found: list[SecondPath] = []
    seen: set[int] = set()

    def walk(parent: nn.Module, prefix: str) -> None:
        for attr, child in parent.named_children():
            if id(child) in is_layer:
                continue
            path = prefix + attr
            if id(child) in inside:
                name, holders = inside[id(child)]
                found.append(SecondPath(path, name, frozenset(holders), parent, attr))
                continue
            if id(child) not in seen:
                seen.add(id(child))
                walk(child, path + ".")

    walk(module, "")
    return found


def announce_second_paths(found: Sequence[SecondPath]) -> None:
    """Name the second paths: the checkpoint holds the trained weights under both names, and a rank that does not
    run a stage holds a placeholder under the second name too (no copy of another stage's weights)."""
    if found:
        pairs = ", ".join(f"{a.path} is {a.name} (stage {min(a.stages)})" for a in found)
        rank_zero_info(
            f"AvgPipe: the module reaches layers of the pipeline by a second path: {pairs}. The checkpoint holds "
            "their trained weights under both names; a rank that does not run that stage holds a placeholder there."
        )
