"""What stands in for the layers a rank does not run, and what keeps the layers it runs from being called directly.

After the split (``plugin/split/stages.py``) a layer that lives on another stage is an :class:`Elsewhere` placeholder in
this rank's module: the module tree and its ``state_dict`` keys stay those of the whole model, and after a run any
use of it that would pass a part of the model for the whole (a forward, ``state_dict()``, ``parameters()``,
pickling) refuses, naming the cure. :class:`Guard` is set while a user's step runs under the pipeline, when the
rank's own layers must not be called directly; :class:`Anchor` gives a stage without parameters one for the
user's optimizer. :class:`Kept` is the other side of the placeholders on rank 0, for a model it built whole: the other
stages' layers, kept aside with their storage released, so that the whole trained model can come back into the
user's module after a run (``plugin/split/whole.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.plugin.contract import PipelineContractError


class NotWholeError(RuntimeError):
    """The module is not the whole model in this process: a layer of another stage was used after the run."""


class Guard:
    """Set while a user step runs under the pipeline: layers must then not be called directly. ``finished``: the
    run is over and this process holds only its own stages: a placeholder's use then refuses (the module is not
    the whole model here), except inside the strategy's own saves (:meth:`allowing`)."""

    def __init__(self) -> None:
        self.active = False
        self.hook: str = ""
        self.finished = False

    @contextmanager
    def allowing(self) -> Iterator[None]:
        """The strategy's own use of the split module (a checkpoint's state dict after the run)."""
        finished, self.finished = self.finished, False
        try:
            yield
        finally:
            self.finished = finished

    def check(self, name: str) -> None:
        if self.active:
            raise PipelineContractError(
                f"`{self.hook}` called the pipelined layer '{name}' directly. Under strategy='avgpipe' a step must "
                "get the model output through `self(x)` (the layers run on their own stages)."
            )


class Elsewhere(nn.Identity):
    """Placeholder for a layer that lives on another stage: keeps the module tree and state-dict keys honest."""

    def __init__(self, name: str, stage: int, guard: Guard) -> None:
        super().__init__()
        self.layer_name = name
        self.stage = stage
        self._guard = guard
        self.register_state_dict_pre_hook(Elsewhere._refuse_state_dict)
        # parameters(), named_parameters(), .to() read it: after the run they refuse as a forward does
        self.__dict__["_parameters"] = _Refusing(lambda: self._refuse("parameters()"))

    def forward(self, x: Any) -> Any:
        self._guard.check(self.layer_name)
        self._refuse("its forward")
        return x

    def _refuse(self, what: str) -> None:
        if self._guard.finished:
            raise NotWholeError(
                f"AvgPipe: {what} reached '{self.layer_name}', a layer that ran on stage {self.stage} in another "
                "process: after a run this process holds only its own stages, so this module is not the whole model "
                "here (a state dict, a forward, parameters() or save_pretrained would give a part of it). The "
                "launching process (rank 0) holds the whole trained model where it built it whole; else load a "
                "checkpoint: trainer.save_checkpoint(path), then MyModel.load_from_checkpoint(path) (a folder saved "
                "with save_distributed_checkpoint=True: python -m lightning_avgpipe consolidate FOLDER OUT.ckpt "
                "first)."
            )

    @staticmethod
    def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        module._refuse("state_dict()")  # type: ignore[operator]

    def __getstate__(self) -> dict[str, Any]:
        self._refuse("pickling (torch.save of the module, copy.deepcopy)")
        return self.__dict__.copy()

    def extra_repr(self) -> str:
        return f"{self.layer_name} on stage {self.stage}"


class _Refusing(dict):  # type: ignore[type-arg]
    """A placeholder's (empty) parameter dict: reading its items first asks ``refuse``."""

    def __init__(self, refuse: Any) -> None:
        super().__init__()
        self.refuse = refuse

    def items(self) -> Any:
        self.refuse()
        return super().items()

    def values(self) -> Any:
        self.refuse()
        return super().values()


class Anchor(nn.Module):
    """An empty parameter for a stage whose layers have none, so ``configure_optimizers`` still gets a parameter.

    It never appears in state dicts: checkpoints keep exactly the unsplit model's keys.
    """

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.empty(0))
        self._register_state_dict_hook(Anchor._drop)

    @staticmethod
    def _drop(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state_dict.pop(prefix + "anchor", None)


def guard_layers(layers: Mapping[str, nn.Module], guard: Guard) -> list[Any]:
    """Make the given (owned) layers refuse direct calls while ``guard`` is active; returns the hook handles."""
    return [layer.register_forward_pre_hook(lambda _m, _a, n=name: guard.check(n)) for name, layer in layers.items()]


@dataclass
class Kept:
    """On the launching process (rank 0), for a model it built whole: what the split took away, so that the whole
    trained model can come back into the user's module after a run (:meth:`SplitModule.put_back`)."""

    spots: list[tuple[nn.Module, str, nn.Module, nn.Module]]  # parent, attribute, the layer, its placeholder
    tensors: dict[str, Tensor]  # state-dict name -> another stage's tensor, its storage released while split
    shapes: dict[str, tuple[int, ...]]
    whole: bool = False  # the layers are back in place, with the trained values

    def release(self) -> None:
        for t in self.tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)

    def take_away(self) -> None:
        """Split again: the placeholders back in place, the other stages' storage released."""
        self.place(layers=False)
        self.release()
        self.whole = False

    def place(self, layers: bool) -> None:
        """Put the layers (``True``) or their placeholders back where the module holds them."""
        for parent, attr, layer, placeholder in self.spots:
            setattr(parent, attr, layer if layers else placeholder)
