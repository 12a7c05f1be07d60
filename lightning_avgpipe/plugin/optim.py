"""The optimizer Lightning sees when N·D > 1: the user's optimizer driving one clone per replica, then the pull."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_avgpipe.elastic import ElasticAveraging


def clone_optimizer(optimizer: Optimizer, params: Sequence[nn.Parameter], like: Sequence[nn.Parameter]) -> Optimizer:
    """A fresh optimizer of ``optimizer``'s class and hyperparameters over ``params`` (``like[i]`` -> ``params[i]``).

    Parameters of ``optimizer`` that are not in ``like`` (a parameter-free stage's anchor) are left out.
    """
    mapping = {id(p): q for p, q in zip(like, params)}
    groups = []
    for group in optimizer.param_groups:
        mapped = [mapping[id(p)] for p in group["params"] if id(p) in mapping]
        if mapped:
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": mapped})
    if not groups:
        groups = [{"params": [nn.Parameter(torch.empty(0))]}]
    accepted = inspect.signature(type(optimizer)).parameters
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    try:
        return type(optimizer)(groups, **kwargs)
    except TypeError as err:
        raise TypeError(
            f"num_pipelines > 1 needs one copy of your {type(optimizer).__name__} per parallel pipeline, built as "
            f"{type(optimizer).__name__}(param_groups, **defaults), which failed: {err}. Use a torch.optim optimizer "
            "or one whose constructor takes its defaults as keyword arguments."
        ) from err


class ElasticOptimizer(Optimizer):
    """One optimizer to Lightning: steps every replica's own optimizer, then applies the elastic update.

    Its ``param_groups`` are the user's optimizer's, so lr schedulers (which Lightning binds to that optimizer)
    change them; before every step those hyperparameters are copied to each replica's optimizer.
    """

    def __init__(self, user: Optimizer, replicas: Sequence[Optimizer], elastic: ElasticAveraging) -> None:
        # Optimizer.__init__ is not called: the state lives in the replicas' optimizers.
        self.user = user
        self.optimizer = user  # what LearningRateMonitor looks for when it unwraps an optimizer
        self.replicas = list(replicas)
        self.elastic = elastic
        self.defaults = user.defaults

    @property  # type: ignore[override]
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.user.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.user.param_groups = value

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        return self.user.state

    @state.setter
    def state(self, value: Any) -> None:
        self.user.state = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.replicas:
            opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.replicas:
            for src, dst in zip(self.user.param_groups, opt.param_groups):
                dst.update({k: v for k, v in src.items() if k != "params"})
        self.elastic.begin_step()
        for opt in self.replicas:
            opt.step()
        self.elastic.finish_step()
        self.user._opt_called = True  # type: ignore[attr-defined]  # lr schedulers check the user's optimizer stepped
        return loss

    def state_dict(self) -> dict[str, Any]:
        return {"replicas": [opt.state_dict() for opt in self.replicas], "user_param_groups": _groups(self.user)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        for opt, state in zip(self.replicas, state_dict["replicas"]):
            opt.load_state_dict(state)
        for group, saved in zip(self.user.param_groups, state_dict.get("user_param_groups", [])):
            group.update(saved)

    def __repr__(self) -> str:
        return f"ElasticOptimizer({type(self.user).__name__} x {len(self.replicas)} replicas)"


def _groups(optimizer: Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
