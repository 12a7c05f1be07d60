"""The checks of user input every module makes alike: an int that is not a bool, a number that is not a bool."""

from __future__ import annotations

from typing import Any


def is_int(value: Any, minimum: int | None = None) -> bool:
    """``value`` is an ``int`` (``True``/``False`` are not) and at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def is_number(value: Any) -> bool:
    """``value`` is an ``int`` or a ``float`` (``True``/``False`` are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)
