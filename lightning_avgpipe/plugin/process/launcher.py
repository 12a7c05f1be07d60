"""What the default launcher adds to Lightning's (``python train.py``: the script run again once per local device):
no rank outlives the job, and a port that is taken is refused before any rank starts.

- **The launching process ends what it started.** On any failure of its own (an exception out of ``fit``, or one
  that ends the script), at exit it sends every rank it started that is still alive SIGTERM (and SIGCONT, for a
  stopped one), then SIGKILL after :data:`END_GRACE` seconds, and says so. Lightning's own observer ends the job
  only when a started rank fails, and dies with the launching process.
- **The launching process waits for what it started.** Done without a failure, it waits at exit (at most
  :data:`FINISH_WAIT` seconds) for the other ranks to finish the script, so the command returns when the job is done.
- **A started rank ends itself when its launching process is gone** (killed, or exited without ending it): a
  thread compares its parent with the launcher's pid (:data:`LAUNCHER_ENV`) twice a second; on Linux the parent's
  death also sends it SIGCONT (``PR_SET_PDEATHSIG``), which wakes a stopped rank so that thread can run.
- **A port in use is refused at launch.** A second job started with the first one's ``MASTER_PORT`` would have its
  rank 0 fail at once (EADDRINUSE) while its other ranks joined the first job's store and waited forever.

No Lightning import here: the launcher itself is ``plugin/compat.py``'s (it subclasses Lightning's private one).
"""

from __future__ import annotations

import atexit
import ctypes
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from lightning_avgpipe.runtime.failures import console
from lightning_avgpipe.runtime.failures.shutdown import failed, mark_failed

LAUNCHER_ENV = "LIGHTNING_AVGPIPE_LAUNCHER_PID"
"""Set by the launching process for the ranks it starts: its pid."""

END_GRACE = 3.0
"""Seconds a started rank has, after SIGTERM, before SIGKILL."""

FINISH_WAIT = 300.0
"""Seconds the launching process, done without a failure, waits at exit for the ranks it started to finish."""

_PR_SET_PDEATHSIG = 1


class PortInUseError(RuntimeError):
    """``MASTER_PORT`` is taken on this machine (another job's rendezvous, most likely)."""


def check_port_free(address: str, port: int) -> None:
    """Raise :class:`PortInUseError` naming ``port`` and the fix if something listens there or it cannot be bound.

    Checked on the launching process's node before any rank starts; the rendezvous store binds it right after.
    """
    taken = ""
    try:
        with socket.create_connection((address, port), timeout=1.0):
            taken = f"something is listening on {address}:{port}"
    except OSError:
        pass
    if not taken:
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store does: TIME_WAIT is no clash
            probe.bind(("", port))
        except OSError as err:
            if err.errno == errno.EADDRINUSE:
                taken = f"port {port} cannot be bound ({err.strerror})"
        finally:
            probe.close()
    if taken:
        raise PortInUseError(
            f"MASTER_PORT={port} is already in use: {taken}, most likely another job's rendezvous on this machine. "
            "Set MASTER_PORT to another free port, or leave it unset and Lightning picks a free one; to run several "
            "jobs on one machine, give each its own MASTER_PORT (see docs/guide.md, 'Several jobs on one machine')."
        )


def end_processes(procs: Sequence[subprocess.Popen], why: str, grace: float = END_GRACE) -> list[str]:
    """SIGTERM (and SIGCONT) every process of ``procs`` still alive, SIGKILL those left after ``grace`` seconds;
    print and return one line per process ended (``procs[i]`` is local rank ``i + 1``)."""
    alive = [(i + 1, p) for i, p in enumerate(procs) if p.poll() is None]
    if not alive:
        return []
    for _, p in alive:
        for sig in (signal.SIGTERM, signal.SIGCONT):
            try:
                p.send_signal(sig)
            except OSError:
                pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(p.poll() is None for _, p in alive):
        time.sleep(0.05)
    lines = []
    for rank, p in alive:
        how = "by SIGTERM"
        if p.poll() is None:
            p.kill()
            how = f"by SIGKILL ({grace:g} s after SIGTERM)"
        try:
            p.wait(timeout=5.0)
        except subprocess.TimeoutExpired:  # unkillable for now (a device call in the kernel): said, not waited for
            how += ", and it had not ended 5 s later"
        lines.append(f"lightning_avgpipe: {why}; ended local rank {rank} (pid {p.pid}) {how}.")
    sys.stderr.write("".join(line + "\n" for line in lines))
    sys.stderr.flush()
    return lines


class ChildGuard:
    """The launching process's side: marks a failure, and at exit ends the started ranks if it failed.

    Args:
        procs: the started ranks' processes (read when needed: the launcher fills its list when they start).
        before_ending: called before the ranks are signalled (Lightning's observer quieted).
    """

    def __init__(
        self, procs: Callable[[], Sequence[subprocess.Popen]], before_ending: Callable[[], None] | None = None
    ) -> None:
        self._procs = procs
        self._before_ending = before_ending
        self.failure: str | None = None
        self._previous_hook = sys.excepthook
        sys.excepthook = self._excepthook
        atexit.register(self.at_exit)
        _guards.append(self)

    @property
    def procs(self) -> Sequence[subprocess.Popen]:
        return self._procs()

    def failed(self, why: str) -> None:
        self.failure = self.failure or why
        mark_failed()  # at exit, the process groups are left alone (destroying one could wait on a rank)

    def _excepthook(self, kind: type[BaseException], value: BaseException, tb: object) -> None:
        self.failed(f"the launching process (local rank 0) failed with {kind.__name__}")
        # a named mistake: a few lines, the message itself (the rank that failed first may be ended before it says it)
        if not console.print_short(kind, value, tb, abbreviate=False):  # type: ignore[arg-type]
            self._previous_hook(kind, value, tb)  # type: ignore[arg-type]

    def at_exit(self) -> list[str]:
        """Called at exit: ends the started ranks still alive if this process failed; else waits for them to finish
        the script (as torchrun does), at most :data:`FINISH_WAIT` seconds."""
        if self.failure is None and not failed():
            deadline = time.monotonic() + FINISH_WAIT
            while time.monotonic() < deadline and any(p.poll() is None for p in self.procs):
                time.sleep(0.05)
            why = f"local rank 0 finished, and the ranks it started had not {FINISH_WAIT:g} s later"
        else:
            why = self.failure or "the launching process (local rank 0) failed"
        if self._before_ending is not None and any(p.poll() is None for p in self.procs):
            self._before_ending()
        return end_processes(self.procs, why)


_guards: list[ChildGuard] = []


def short_errors() -> None:
    """In a rank (not the launching process, whose :class:`ChildGuard` does it): a mistake this package names is
    said in a few lines, its traceback in a file (``runtime/failures/console.py``)."""
    if not _guards:
        console.install()


def note_failure(exception: BaseException) -> None:
    """In the launching process: the job failed with ``exception`` (the strategy's ``on_exception``); at exit the
    started ranks are ended. A no-op in any other process."""
    for guard in _guards:
        guard.failed(f"the launching process (local rank 0) failed with {type(exception).__name__}")


def watch_launcher(poll: float = 0.5) -> None:
    """In a rank the default launcher started: end this process when the launching process is gone.

    Reads (and removes, so this rank's own subprocesses do not inherit it) :data:`LAUNCHER_ENV`; a no-op without it.
    """
    value = os.environ.get(LAUNCHER_ENV)
    if not value or int(value) == os.getpid() or os.name != "posix":  # none, the launching process itself, or not POSIX
        return
    del os.environ[LAUNCHER_ENV]
    launcher = int(value)
    if os.getppid() != launcher:
        try:
            os.kill(launcher, 0)
        except ProcessLookupError:  # gone before the watch began
            sys.stderr.write(f"lightning_avgpipe: the launching process (pid {launcher}) is gone; ending this rank.\n")
            os._exit(1)
        except OSError:
            pass
        return  # started through a wrapper process: its parent is not the launcher to watch
    if sys.platform.startswith("linux"):  # the parent's death wakes this rank if it is stopped (SIGSTOP)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGCONT), 0, 0, 0)
        except (OSError, AttributeError):
            pass

    stop = threading.Event()

    def run() -> None:
        while not stop.wait(poll):
            if os.getppid() != launcher:
                sys.stderr.write(
                    f"lightning_avgpipe: rank {os.environ.get('LOCAL_RANK', '?')} (pid {os.getpid()}): its launching "
                    f"process (pid {launcher}, local rank 0) is gone; ending this rank.\n"
                )
                sys.stderr.flush()
                os._exit(1)

    thread = threading.Thread(target=run, name="lightning_avgpipe-launcher-watch", daemon=True)
    thread.start()

    def finish() -> None:  # no thread of ours left running when the interpreter finalizes
        stop.set()
        thread.join(poll + 1.0)

    atexit.register(finish)
