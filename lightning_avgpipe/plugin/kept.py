"""What splitting took away from a model rank 0 built whole: the other stages' layers, kept aside with their storage
released, so that the whole trained model can come back into the user's module after a run (``plugin/whole.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn


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
