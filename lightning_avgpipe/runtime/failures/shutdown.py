"""A process that used gloo process groups must destroy them before the interpreter finalizes.

Why (the SIGABRT "terminate called without an active exception" at exit, see docs/how-it-works.md, "Exit"):
a gloo process group runs each collective on a worker thread (``pt_gloo_runloop``). After the work completes,
which is when the caller's ``wait`` returns, that thread still holds the work, and with it the tensors it was
given, for a moment. If the interpreter is finalizing by then, the tensors' Python objects have been freed and
handed to the C++ side, so dropping the work takes the GIL; a thread that takes the GIL during finalization is
ended with ``pthread_exit``, whose unwinding through a ``noexcept`` destructor calls ``std::terminate``. The
process has done all its work and exits -6. ``benchmarks/exit_race.py`` reproduces it with bare gloo.

The cure is to free every process group while the interpreter is alive: its destructor waits for its workers
and joins them. ``destroy_process_group`` takes the groups out of torch's registry; a group is freed once nothing
else refers to it, so the owner of the groups releases its references first (``release``).
"""

from __future__ import annotations

import atexit
import gc
import os
import weakref
from typing import Any

_state: dict[str, Any] = {"failed": False, "owners": [], "hooked": False}


def mark_failed() -> None:
    """This process's job failed: at exit, leave the groups alone (destroying one can wait on a rank that is
    gone or stuck)."""
    _state["failed"] = True


def failed() -> bool:
    return bool(_state["failed"])


def destroy_process_groups() -> None:
    """Destroy every process group of this process and free those nothing refers to any longer (their worker
    threads are joined). A no-op without ``torch.distributed`` or once the job failed."""
    if failed():
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # groups held only by reference cycles (a trainer and its strategy) are freed now, not in finalization


def close_at_exit(owner: object, release: str = "close") -> None:
    """Call ``owner.<release>()`` at interpreter exit, before finalization (once per owner), then
    :func:`destroy_process_groups`. Owners are held weakly: one that is gone has nothing left to release."""
    owners: list[tuple[weakref.ref[Any], str]] = _state["owners"]
    owners[:] = [(ref, name) for ref, name in owners if ref() is not None]
    if any(ref() is owner for ref, _ in owners):
        return
    owners.append((weakref.ref(owner), release))
    if not _state["hooked"]:
        _state["hooked"] = True
        atexit.register(_at_exit)


def _at_exit() -> None:
    owners: list[tuple[weakref.ref[Any], str]] = _state["owners"]
    live = [(ref(), name) for ref, name in owners]
    owners.clear()
    if not failed():
        for owner, name in live:
            if owner is not None:
                getattr(owner, name)()
    destroy_process_groups()


def native_threads() -> list[str]:
    """The names of this process's native threads (Linux ``/proc``; ``[]`` elsewhere): gloo's are
    ``pt_gloo_runloop`` (collectives) and ``gloo_tcp_loop`` (its transport)."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return []
    names = []
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            continue
    return sorted(names)
