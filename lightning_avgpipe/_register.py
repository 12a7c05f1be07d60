"""Register ``strategy="avgpipe"`` in Lightning's ``StrategyRegistry`` without importing Lightning.

``import lightning_avgpipe`` must stay Lightning-free (importing Lightning costs seconds, and the schedule
simulator, partitioner and runtime do not need it), yet ``Trainer(strategy="avgpipe")`` must work whichever of
the two packages is imported first. Lightning looks the name up in ``lightning.pytorch.strategies.StrategyRegistry``
when a ``Trainer`` is built (``_AcceleratorConnector``: the name must be a key, then ``StrategyRegistry.get(name)``
calls the registered factory), so the entry only has to exist by then:

- Lightning already imported: register now.
- Not yet: a ``sys.meta_path`` finder waits for ``lightning.pytorch.strategies``, lets the normal finder load it,
  and registers right after the module has run (then removes itself).

The entry is a small factory, not the class: at that moment ``lightning.pytorch`` is still half-imported
(``lightning.pytorch.trainer`` is importing ``strategies``), so importing ``lightning_avgpipe.plugin.strategy``
there could trip over the partial package. The factory imports it when a Trainer asks for the strategy.
"""

from __future__ import annotations

import importlib.abc
import sys
from types import ModuleType
from typing import Any

STRATEGIES = "lightning.pytorch.strategies"
NAME = "avgpipe"  # AvgPipeStrategy.strategy_name (tests/test_import_boundary.py checks they agree)
DESCRIPTION = "AvgPipe pipeline parallelism (lightning_avgpipe)"


def make_strategy(**init_params: Any) -> Any:
    """What ``StrategyRegistry.get("avgpipe")`` calls: a default ``AvgPipeStrategy``."""
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy

    return AvgPipeStrategy(**init_params)


def _register(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    if NAME not in registry:  # AvgPipeStrategy.register_strategies may have put the class there already
        registry.register(NAME, make_strategy, description=DESCRIPTION)


class _Loader(importlib.abc.Loader):
    """The real loader of ``lightning.pytorch.strategies``, plus the registration once it has run."""

    def __init__(self, loader: Any, finder: _Finder) -> None:
        self._loader = loader
        self._finder = finder

    def create_module(self, spec: Any) -> ModuleType | None:
        return self._loader.create_module(spec)  # type: ignore[no-any-return]

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._finder.remove()
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, is_package, ... as the real loader has them
        return getattr(self._loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> Any:
        if fullname != STRATEGIES:
            return None
        for finder in sys.meta_path:  # the finders after us find the real spec
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, self)
                return spec
        return None

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def register_avgpipe() -> None:
    """Make ``strategy="avgpipe"`` known to Lightning now, or as soon as Lightning's strategies are imported."""
    strategies = sys.modules.get(STRATEGIES)
    if strategies is not None and hasattr(strategies, "StrategyRegistry"):
        _register(strategies)
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
