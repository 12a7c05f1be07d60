"""A checkpoint's write that ran out of disk space, said as such.

torch's writers rarely say it: DCP wraps each rank's error in a ``CheckpointException`` (a ``BaseException``)
listing every rank's traceback, and torch's zip writer reports a short write as "unexpected pos 704 vs 598". So a
failed write is called a full disk when an ENOSPC is anywhere in it, or when the disk it wrote to has (almost)
nothing left; the message names the file and the space left.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path

from lightning_avgpipe.runtime.failures.report import PeerFailureError

FULL_BELOW = 1 << 20  # bytes free under which a failed write is said to be a full disk


class DiskFullError(OSError, RuntimeError):
    """A checkpoint's write ran out of disk space."""


def no_space(err: BaseException, writing: Path) -> OSError | None:
    """A write that failed for a full disk, said as such: ``err`` (or an error it carries: DCP's
    ``CheckpointException`` holds every rank's) is ENOSPC, or the disk has (almost) nothing left. ``None`` for
    any other failure."""
    full = any(getattr(e, "errno", None) == errno.ENOSPC for e in _causes(err))
    if not full and isinstance(err, PeerFailureError):  # another rank's failure, whatever this disk holds
        return None
    try:
        free = shutil.disk_usage(writing.parent if not writing.exists() else writing).free
    except OSError:
        free = None
    if not full and (free is None or free >= FULL_BELOW):
        return None
    text = f"{free / 2**20:.0f} MiB" if free is not None else "unknown"
    return DiskFullError(
        errno.ENOSPC,
        f"No space left on device while writing {writing} (free: {text}). Free some space, or save elsewhere "
        "(ModelCheckpoint(dirpath=...)); the previous checkpoint is untouched.",
    )


def _causes(err: BaseException) -> Iterable[BaseException]:
    seen: set[int] = set()
    todo = [err]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [x for x in (e.__cause__, e.__context__) if x is not None]
        failures = getattr(e, "failures", None)  # DCP's CheckpointException: {rank: (exception, traceback)}
        if isinstance(failures, Mapping):
            todo += [f[0] if isinstance(f, tuple) else f for f in failures.values() if f is not None]
