"""A mistake this package names, said in a few lines on the console; its full traceback in a file the message names.

An error that one of this package's own checks raises (a bad partition, a ``forward`` that is not its layers, a
checkpoint of another model, a rank gone) is the user's to fix, and its message says how: the console gets that
message, where it was raised and from which line of the user's script, and the file of the whole traceback (the
frames of Lightning, torch and this package, which would otherwise fill the console on every rank, gloo's included).
A rank whose error is the same as the first failure's says so in one line. Any other exception (a bug: an
``AssertionError``, an ``AttributeError``, an error raised inside torch) keeps its full traceback on the console.
Pure Python: no Lightning import.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[1])  # the lightning_avgpipe directory
MAX_LINES = 12  # of the message (its notes included), before "..."
# exceptions this package raises for the user to fix; anything else it raises is a bug, with its whole traceback
NAMED = (ValueError, TypeError, KeyError, RuntimeError, FloatingPointError, TimeoutError, MemoryError)
_installed: dict[str, Any] = {}


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def print_short(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> bool:
    """Where ``value`` was raised by this package's own code as one of :data:`NAMED`: write its traceback to a file
    and print the short form on stderr. Returns whether it did (else the caller prints the traceback)."""
    frames = traceback.extract_tb(tb)
    if not frames or not issubclass(kind, NAMED) or not frames[-1].filename.startswith(PACKAGE):
        return False
    rank = _rank()
    path = Path(tempfile.gettempdir()) / f"lightning_avgpipe-traceback-rank{rank}-pid{os.getpid()}.txt"
    try:
        path.write_text("".join(traceback.format_exception(kind, value, tb)))
        where = f"the full traceback: {path}"
    except OSError:
        return False
    raised = frames[-1]
    user = next((f for f in reversed(frames) if not _library(f.filename)), None)
    at = f"raised at {Path(raised.filename).relative_to(Path(PACKAGE).parent)}:{raised.lineno}"
    if user is not None:
        at += f", from {user.filename}:{user.lineno}"
    same = getattr(value, "_avgpipe_same_as", None)
    if same is not None:
        lines = [f"{kind.__name__}: the same error as {same} ({at}; {where})"]
    else:
        lines = "".join(traceback.format_exception_only(kind, value)).rstrip().splitlines()
        if len(lines) > MAX_LINES:
            lines = [*lines[: MAX_LINES - 1], "..."]
        lines.append(f"({at}; {where})")
    sys.stderr.write("".join(f"{line}\n" for line in lines))  # torch's own hook prefixes "[rankN]: " where it wraps
    sys.stderr.flush()
    return True


def _library(filename: str) -> bool:
    """A frame of this package, of an installed library or of Python itself (not the user's script)."""
    return (
        filename.startswith(PACKAGE)
        or "site-packages" in filename
        or "dist-packages" in filename
        or filename.startswith(sys.prefix)
        or filename.startswith(sys.base_prefix)
        or filename.startswith("<")
    )


def install() -> None:
    """In this process, once: uncaught exceptions go through :func:`print_short` before the hook in place."""
    if _installed:
        return
    previous = sys.excepthook
    _installed["previous"] = previous

    def hook(kind: type[BaseException], value: BaseException, tb: TracebackType | None) -> None:
        if not print_short(kind, value, tb):
            previous(kind, value, tb)

    sys.excepthook = hook
