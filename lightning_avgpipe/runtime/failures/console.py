"""A mistake this package names, said in a few lines on the console; its full traceback in a file the message names.

An error that one of this package's own checks raises (a bad partition, a ``forward`` that is not its layers, a
checkpoint of another model, a rank gone) is the user's to fix, and its message says how: the console gets that
message, where it was raised and from which line of the user's script, and the file of the whole traceback (the
frames of Lightning, torch and this package, which would otherwise fill the console on every rank, gloo's included).
So does any error raised while the model is built (``configure_model``, or its build replayed at setup), which
:func:`mark` labels: its message is the user's to read first, whoever raised it. A rank whose error is the same as the
first failure's says so in one line (not the launching process, which prints the message: the rank that recorded it
first may be ended before it prints it). Any other exception (a bug: an ``AssertionError``, an ``AttributeError``, an
error raised inside torch) keeps its full traceback on the console.

The file goes to the folder :func:`set_folder` names (the trainer's log directory, set at setup), else to the
current directory (a Trainer's default ``default_root_dir``). Pure Python: no Lightning import.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from types import TracebackType
from typing import Any

PACKAGE = str(Path(__file__).resolve().parents[2])  # the lightning_avgpipe directory (this is runtime/failures/)
MAX_LINES = 12  # of the message (its notes included), before "..."
# exceptions this package raises for the user to fix; anything else it raises is a bug, with its whole traceback
NAMED = (ValueError, TypeError, KeyError, RuntimeError, FloatingPointError, TimeoutError, MemoryError)
_installed: dict[str, Any] = {}
_folder: dict[str, Path] = {}


def set_folder(folder: str | os.PathLike[str] | None) -> None:
    """Write this process's traceback files under ``folder`` (made when one is written); ``None``: the current
    directory."""
    if folder is None:
        _folder.pop("path", None)
    else:
        _folder["path"] = Path(folder)


def traceback_path() -> Path:
    """Where this process writes the full traceback of an error it says in short."""
    folder = _folder.get("path", Path.cwd())
    return folder.resolve() / f"lightning_avgpipe-traceback-rank{_rank()}-pid{os.getpid()}.txt"


def mark(value: BaseException, during: str, site: str | None = None) -> None:
    """Label ``value`` as raised ``during`` a step whose errors are the user's to read first (``"configure_model()"``):
    said in short whoever raised it; ``site``, the user's line that led to it (``file:line``) when its own frames do
    not show it (a call recorded in ``configure_model`` and replayed at setup)."""
    if labelled(value) is not None:
        return  # the innermost label stays
    try:
        value._avgpipe_during = during  # type: ignore[attr-defined]
        value._avgpipe_site = site  # type: ignore[attr-defined]
    except AttributeError:  # an exception type that takes no attributes
        pass


def _rank() -> str:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0"))


def labelled(value: BaseException) -> str | None:
    """What :func:`mark` labelled ``value`` as raised during, or ``None``."""
    return getattr(value, "_avgpipe_during", None)


def print_short(
    kind: type[BaseException], value: BaseException, tb: TracebackType | None, abbreviate: bool = True
) -> bool:
    """Where ``value`` was raised by this package's own code as one of :data:`NAMED`, or labelled by :func:`mark`:
    write its traceback to a file and print the short form on stderr. Returns whether it did (else the caller
    prints the traceback). ``abbreviate=False``: the message even where it is the first failure's, recorded by
    another rank (the launching process: it may end that rank before that rank prints its own)."""
    frames = traceback.extract_tb(tb)
    during = labelled(value)
    ours = issubclass(kind, NAMED) and bool(frames) and frames[-1].filename.startswith(PACKAGE)
    if not frames or not (ours or (during is not None and issubclass(kind, Exception))):
        return False
    path = traceback_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(traceback.format_exception(kind, value, tb)))
        where = f"the full traceback: {path}"
    except OSError:
        return False
    origin = _origin(value, frames)
    raised, site = origin[-1], getattr(value, "_avgpipe_site", None)
    user = next((f for f in reversed(origin) if not _library(f.filename)), None)
    at = f"raised in {during}, at " if during is not None else "raised at "
    at += f"{_shown(raised.filename)}:{raised.lineno}"
    if site is not None:
        at += f", from {site}"
    elif user is not None and (user.filename, user.lineno) != (raised.filename, raised.lineno):
        at += f", from {user.filename}:{user.lineno}"
    same = getattr(value, "_avgpipe_same_as", None)
    if same is not None and abbreviate:
        lines = [f"{kind.__name__}: the same error as {same} ({at}; {where})"]
    else:
        lines = "".join(traceback.format_exception_only(kind, value)).rstrip().splitlines()
        if len(lines) > MAX_LINES:
            lines = [*lines[: MAX_LINES - 1], "..."]
        lines.append(f"({at}; {where})")
    sys.stderr.write("".join(f"{line}\n" for line in lines))  # torch's own hook prefixes "[rankN]: " where it wraps
    sys.stderr.flush()
    return True


def _origin(value: BaseException, frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames to name where ``value`` came from, innermost last: for an error labelled by :func:`mark` that this
    package raised from another (a message of ours around an error of the user's build), that other's."""
    cause = value.__cause__
    ours = frames[-1].filename.startswith(PACKAGE)
    if labelled(value) is not None and ours and cause is not None and cause.__traceback__ is not None:
        return traceback.extract_tb(cause.__traceback__)
    return frames


def _shown(filename: str) -> str:
    """A file as the message names it: this package's and an installed library's from their top folder."""
    if filename.startswith(PACKAGE):
        return str(Path(filename).relative_to(Path(PACKAGE).parent))
    for folder in ("site-packages", "dist-packages"):
        if f"/{folder}/" in filename:
            return filename.split(f"/{folder}/", 1)[1]
    return filename


def user_site() -> str | None:
    """``file:line`` of the innermost frame of the user's script in the calling stack, or ``None``."""
    frame = sys._getframe(1)
    while frame is not None:
        if not _library(frame.f_code.co_filename):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back  # type: ignore[assignment]
    return None


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
