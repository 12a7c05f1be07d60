"""The checks of user input every module makes alike: an int that is not a bool, a number that is not a bool."""

from __future__ import annotations

from typing import Any


def is_int(value: Any, minimum: int | None = None) -> bool:
    """``value`` is an ``int`` (``True``/``False`` are not) and at least ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum)


def is_number(value: Any) -> bool:
    """``value`` is an ``int`` or a ``float`` (``True``/``False`` are not)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_flag(name: str, value: Any, true: str, false: str) -> bool:
    """``value`` when it is a bool; otherwise a TypeError naming ``name`` and what True and False mean."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}={value!r} must be True ({true}) or False ({false}).")
    return value
