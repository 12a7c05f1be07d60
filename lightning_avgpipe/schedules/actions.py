"""Actions: the small values a pipeline plan is made of."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class Kind(str, enum.Enum):
    """What an action does. Compute kinds run the stage; the others move tensors between neighbours."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward: input and weight gradients
    INPUT_GRAD = "I"  # the input gradient alone (what stage - 1 waits for); the weight gradient is queued
    WEIGHT_GRAD = "W"  # the queued weight gradient (nothing waits for it: it fills idle time)
    SEND_F = "SF"  # send this unit's activations to stage + 1
    RECV_F = "RF"  # post the receive of this unit's activations from stage - 1
    SEND_B = "SB"  # send this unit's input gradients to stage - 1
    RECV_B = "RB"  # post the receive of this unit's output gradients from stage + 1

    @property
    def is_compute(self) -> bool:
        return self in (Kind.FORWARD, Kind.BACKWARD, Kind.INPUT_GRAD, Kind.WEIGHT_GRAD)

    @property
    def sends_grads(self) -> bool:
        """Whether this compute produces the input gradient stage - 1 receives (``B`` or ``I``)."""
        return self in (Kind.BACKWARD, Kind.INPUT_GRAD)


_PATTERN = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|I|W)(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One step of one stage: ``1F0`` is stage 1's forward of unit 0, ``0RB3`` stage 0 posting unit 3's grad receive.

    A *unit* is one micro-batch of one replica; the executor maps unit indices to (replica, micro-batch).
    """

    stage: int
    kind: Kind
    unit: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.unit}"

    def __repr__(self) -> str:
        return f"Action({self})"

    @property
    def message(self) -> tuple[str, int, int] | None:
        """What a send or receive carries, the same on both ends: ("F" or "B", the stage that computes it, unit);
        ``None`` for a compute action."""
        if self.kind in (Kind.SEND_F, Kind.SEND_B):
            return ("F" if self.kind is Kind.SEND_F else "B", self.stage, self.unit)
        if self.kind is Kind.RECV_F:
            return ("F", self.stage - 1, self.unit)
        if self.kind is Kind.RECV_B:
            return ("B", self.stage + 1, self.unit)
        return None

    @property
    def peer_stage(self) -> int | None:
        """The stage on the other end of a send or receive (``None`` for a compute action)."""
        if self.kind.is_compute:
            return None
        return self.stage + (1 if self.kind in (Kind.SEND_F, Kind.RECV_B) else -1)

    @classmethod
    def parse(cls, text: str) -> Action:
        """Inverse of ``str``: ``Action.parse("1F0") == Action(1, Kind.FORWARD, 0)``."""
        match = _PATTERN.match(text.strip())
        if match is None:
            raise ValueError(
                f"Cannot parse action {text!r}: expected '<stage><kind><unit>' with kind one of "
                f"{[k.value for k in Kind]}, for example '1F0'."
            )
        return cls(int(match.group(1)), Kind(match.group(2)), int(match.group(3)))


def F(stage: int, unit: int) -> Action:  # noqa: N802 - reads like the notation in the paper's figures
    return Action(stage, Kind.FORWARD, unit)


def B(stage: int, unit: int) -> Action:  # noqa: N802
    return Action(stage, Kind.BACKWARD, unit)


def I(stage: int, unit: int) -> Action:  # noqa: N802, E743
    return Action(stage, Kind.INPUT_GRAD, unit)


def W(stage: int, unit: int) -> Action:  # noqa: N802
    return Action(stage, Kind.WEIGHT_GRAD, unit)
