"""A rank that is alive but stuck must not outlive a failed job: a watchdog thread ends it.

Failures are recorded in the rendezvous store (:func:`.failures.report_failure`): the rank where an exception
starts, and a rank whose neighbour went silent past ``p2p_timeout``. Every rank runs a daemon thread that polls the
store; once a failure is recorded and this rank is still running ``grace`` seconds later (its main thread stuck
in user code, a sleep, a wait without timeout), the thread prints why, dumps every thread's stack to stderr and
ends the process with exit code 1. A healthy rank that is already stopping is done long before that.

The store is served by rank 0 (or torchrun's agent): a store that is gone, or silent for ``grace`` seconds (its
process stopped), counts as a failure too, so a silent store ends a stuck rank ``2 x grace`` after it fell silent.
Every look at it has a deadline (``runtime/failures/report.py``), so the watchdog itself never blocks on it.
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import sys
import threading
import time
from collections.abc import Callable

from lightning_avgpipe.runtime.failures.report import StoreSilentError, read_failure

EXIT_CODE = 1


class Watchdog:
    """Ends this process ``grace`` seconds after any rank recorded a failure.

    Args:
        name: this rank, for the message (``"rank 1 (stage 1)"``).
        grace: seconds to let this rank stop by itself once a failure is recorded.
        store: the rendezvous store (``check``/``get``); ``None``: the default process group's.
        poll: seconds between looks at the store.
        exit: called with the exit code instead of ``os._exit`` (tests).
    """

    def __init__(
        self,
        name: str,
        grace: float,
        store: object | None = None,
        poll: float = 1.0,
        exit: Callable[[int], None] | None = None,
    ) -> None:
        self.name = name
        self.grace = float(grace)
        self.poll = float(poll)
        self._store = store
        self._exit = exit or os._exit
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.fired = False
        self._last: str | None = None

    def start(self) -> Watchdog:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="lightning_avgpipe-watchdog", daemon=True)
            self._thread.start()
            # never leave the thread inside a store call while the interpreter shuts down
            atexit.register(self.stop)
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 5.0)
        if self._thread is not None:
            atexit.unregister(self.stop)
        self._thread = None

    def _failure(self) -> tuple[str, float] | None:
        """The failure and since when (``time.monotonic``) it is known: one recorded in the store, the store gone,
        or the store silent (since its oldest unanswered call began); ``None`` while there is none."""
        try:
            value = read_failure(self._store)
        except StoreSilentError as err:
            # Known as a failure only once silent for the grace: a store frozen for less (rank 0 stopped, then
            # continued) is forgiven, and a rank waiting on rank 0's transfers ends by its own p2p_timeout first,
            # with the better message. So a rank stuck elsewhere is ended about 2 x grace after rank 0 froze.
            return self._gone(str(err)), time.monotonic() - err.silent_for + self.grace
        except Exception:  # noqa: BLE001 - the store lives on rank 0: gone when rank 0 is gone
            gone = "the rendezvous store on rank 0 stopped answering (rank 0 exited or was killed)"
            return self._gone(gone), time.monotonic()
        if value:
            self._last = value
            return value, time.monotonic()
        return None

    def _gone(self, why: str) -> str:
        return f"{self._last}; then {why}" if self._last else why

    def _run(self) -> None:
        seen: float | None = None
        main = threading.main_thread()
        while not self._stop.wait(self.poll):
            if sys.is_finalizing() or not main.is_alive():
                return
            found = self._failure()
            if found is None:
                seen = None
                continue
            failure, since = found
            now = time.monotonic()
            seen = since if seen is None else min(seen, since)
            if now - seen >= self.grace and not self._stop.is_set():
                self.fired = True
                sys.stderr.write(
                    f"lightning_avgpipe watchdog: {self.name} is still running {self.grace:g} s after the job failed "
                    f"(First failure: {failure}); it is stuck (in user code, or waiting on a rank that is gone). "
                    "Ending it. Its threads' stacks follow.\n"
                )
                try:
                    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                except Exception:  # noqa: BLE001
                    pass
                sys.stderr.flush()
                self._exit(EXIT_CODE)
                return
