"""The job's first failure, shared through the rendezvous store, and every store call on a failure path bounded.

The rank where a failure starts records it in the store (:func:`report_failure`); the others quote it in their
own messages (:func:`first_failure`) and their watchdogs poll it (``runtime/failures/watchdog.py``).

**Why every call here has a deadline.** The store is served by one process: rank 0 under Lightning's own launcher
and the ``env://`` rendezvous, torchrun's agent under torchrun. A call waits for that process's answer, and a
``TCPStore``'s own timeout does not bound that wait (it bounds waiting for a key to appear): with rank 0 stopped
(SIGSTOP, a debugger, a frozen node) the kernel still accepts the request, no answer ever comes, and the caller
blocks forever. So each call runs on a helper thread and is given up after :data:`STORE_DEADLINE` seconds. A call
still unanswered holds the store's client, so later calls do not queue behind it: they fail at once, and
:func:`store_silence` says for how long the store has been silent. A store that answers again (a rank frozen for a
while, then continued) is used again; the helper thread of a call that never returns is a daemon, and the process
exits over it.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from lightning_avgpipe.runtime.failures.console import labelled

T = TypeVar("T")

STORE_DEADLINE = 2.0
"""Seconds a store call on a failure path may take (on one machine an answer takes well under a millisecond)."""

FAILURE_KEY = "lightning_avgpipe/first_failure"
SEEN_KEY = "lightning_avgpipe/first_failure_seen"


class PeerFailureError(RuntimeError):
    """Another rank stopped answering: it failed, was killed, or is stuck."""


class StoreSilentError(RuntimeError):
    """The rendezvous store did not answer within the deadline (its process is stopped, stuck or gone)."""

    def __init__(self, silent_for: float) -> None:
        self.silent_for = silent_for
        super().__init__(
            f"the rendezvous store (served by rank 0, or by torchrun's agent) did not answer for {silent_for:.1f} s: "
            "its process is stopped, stuck or gone"
        )


_lock = threading.Lock()
_in_flight: dict[threading.Thread, float] = {}  # store calls still waiting for an answer -> when each began
_own: dict[str, Any] = {"store": None, "of": None}  # this process's own connection to the job's store


def default_store() -> Any:
    """The default process group's store (``torch.distributed``'s private accessor; see ``plugin/compat.py``)."""
    return dist.distributed_c10d._get_default_store()


def failure_store() -> Any:
    """A connection of this process's own to the job's store, for the failure records.

    Not the process group's: a ``TCPStore`` client runs one call at a time, and a healthy main thread may hold it for
    long (waiting for a key in ``new_group`` or NCCL's setup), so the watchdog's reads would wait behind it and read
    as a silent store. Made once per process group (a ``TCPStore`` under any ``PrefixStore``); other stores (a
    ``FileStore``) are used as they are.
    """
    base = default_store()
    if _own["of"] is base:
        return _own["store"]
    raw = base
    while isinstance(raw, dist.PrefixStore):
        raw = raw.underlying_store
    own = base
    if isinstance(raw, dist.TCPStore):
        own = dist.TCPStore(
            raw.host, raw.port, is_master=False, wait_for_workers=False, timeout=timedelta(seconds=STORE_DEADLINE)
        )
    _own["store"], _own["of"] = own, base
    return own


def store_silence() -> float:
    """Seconds the oldest unanswered store call has been waiting; 0.0 when none is (the store answers)."""
    with _lock:
        alive = [since for thread, since in _in_flight.items() if thread.is_alive()]
    return time.monotonic() - min(alive) if alive else 0.0


def store_call(fn: Callable[[Any], T], store: Any = None, deadline: float | None = None) -> T:
    """``fn(store)`` (:func:`failure_store` when ``store`` is None), given up after ``deadline`` seconds
    (:data:`STORE_DEADLINE` by default).

    Raises :class:`StoreSilentError` when no answer came in time, or at once while an earlier call is still
    unanswered past the deadline (ours would queue behind it in the client); any error of the call itself
    propagates.
    """
    deadline = STORE_DEADLINE if deadline is None else deadline
    with _lock:
        for thread in [t for t in _in_flight if not t.is_alive()]:
            del _in_flight[thread]
        oldest = min(_in_flight.values(), default=None)
    if oldest is not None and time.monotonic() - oldest >= deadline:
        raise StoreSilentError(time.monotonic() - oldest)
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn(failure_store() if store is None else store)
        except BaseException as err:  # noqa: BLE001 - handed to the caller
            box["error"] = err

    thread = threading.Thread(target=run, name="lightning_avgpipe-store-call", daemon=True)
    since = time.monotonic()
    with _lock:
        _in_flight[thread] = since
    thread.start()
    thread.join(deadline)
    if thread.is_alive():
        raise StoreSilentError(time.monotonic() - min(oldest or since, since))
    with _lock:
        _in_flight.pop(thread, None)
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]


def report_failure(description: str) -> None:
    """Record the first real failure of the job in the store, for the other ranks' messages (best effort)."""
    try:
        store_call(lambda s: s.compare_set(FAILURE_KEY, "", description))
    except Exception:  # noqa: BLE001 - the store may live on the failed rank, or be silent
        pass


_seen: dict[str, Any] = {"text": "", "acknowledged": False}  # this process's copy: the store may go with rank 0


def read_failure(store: Any = None) -> str:
    """The first failure recorded in ``store`` (the default store when None), or ""; read with a deadline.

    Reading it from the default store acknowledges it, once (rank 0 waits for every rank's acknowledgement before
    it takes the store down). Raises :class:`StoreSilentError` or the store's own error when it cannot be read.
    """

    def read(s: Any) -> str:
        return s.get(FAILURE_KEY).decode() if s.check([FAILURE_KEY]) else ""

    text = store_call(read, store)
    if text and store is None:
        _seen["text"] = text
        ranks = _ranks()
        if not _seen["acknowledged"] and ranks is not None:  # one key per rank: a retried write counts once
            store_call(lambda s: s.set(f"{SEEN_KEY}/{ranks[0]}", "1"))
            _seen["acknowledged"] = True
    return text


def recorded_failure() -> str:
    """The first failure some rank recorded (see :func:`report_failure`), or ""; read from the store, or this
    process's copy of it when the store is gone or silent (it lives on rank 0)."""
    try:
        read_failure()
    except Exception:  # noqa: BLE001 - the store is gone or silent: what was seen is kept
        pass
    return str(_seen["text"])


def first_failure() -> str:
    """ "First failure: ..." if some rank recorded one, "" if none did, or a note that it could not be read."""
    try:
        read_failure()
    except StoreSilentError as err:
        if not _seen["text"]:
            return f"(The first failure could not be read: {err}.) "
    except Exception:  # noqa: BLE001 - the store is gone: what was seen is kept
        pass
    text = str(_seen["text"]).rstrip(".")
    return f"First failure: {text}. " if text else ""


def shortened(text: str, limit: int = 200) -> str:
    """``text`` at most ``limit`` characters, cut at a word's end with an ellipsis (never mid-word)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - 4].rsplit(" ", 1)[0].rstrip(" ,;:.")
    return cut + " ..."


def _what(record: str) -> str:
    """A recorded failure without its site ("rank 1 (stage 1): ValueError: x" -> "ValueError: x")."""
    return record.split("): ", 1)[-1]


def handle_failure(exception: BaseException, where: str, rank: int, world_size: int) -> None:
    """What every rank does with an exception that ends its job (``where``: "rank 1 (stage 1)").

    The rank where a failure starts records it, so the others' messages name it (not just their neighbour); a
    neighbour's timeout is recorded too (unless something was first): then a rank stuck while alive, which raises
    nothing, is ended by its watchdog. An error that is a consequence (a neighbour gone mid-collective) gets a note
    naming the first failure (not an error of the model's build, labelled by ``runtime/failures/console.py``: each rank
    says its own). Rank 0 hosts the store, so it gives the others' watchdogs (they poll every second) a
    few seconds to read the failure before it exits and takes the store with it. Every store call is bounded.
    """
    mine = f"{where}: {type(exception).__name__}: {shortened(str(exception))}"
    report_failure(mine)
    first = recorded_failure()
    if first and first != mine and _what(first) == _what(mine):  # said in one line (runtime/failures/console.py)
        try:
            exception._avgpipe_same_as = first.split(": ", 1)[0]  # type: ignore[attr-defined]
        except AttributeError:
            pass
    # the same error on every rank needs no note, nor one the model's build raised on this rank (each rank's own:
    # the first one's rank prints it itself)
    if first and first != mine and _what(first) != _what(mine) and labelled(exception) is None:
        consequence = isinstance(exception, PeerFailureError) or is_transport_error(exception)
        name_first_failure(
            exception,
            (f"lightning_avgpipe: rank {rank} stopped because another rank failed first. " if consequence else "")
            + f"First failure: {first.rstrip('.')}.",
        )
    if rank == 0 and world_size > 1 and first:  # the others' acknowledgements (rank 0's own does not count)
        wait_until_seen(range(1, world_size), timeout=3.0)


def name_first_failure(exception: BaseException, note: str) -> None:
    """Add ``note`` to ``exception`` (a note on Python 3.11+, its message before), once."""
    if getattr(exception, "_avgpipe_named", False):
        return
    try:
        exception._avgpipe_named = True  # type: ignore[attr-defined]
    except AttributeError:  # a built-in exception that takes no attributes: a note is still fine
        pass
    if hasattr(exception, "add_note"):
        exception.add_note(note)
    elif exception.args and isinstance(exception.args[0], str):
        exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])


def wait_until_seen(ranks: Iterable[int], timeout: float) -> bool:
    """On the store's host (rank 0): wait up to ``timeout`` seconds until every rank of ``ranks`` acknowledged the
    first failure (the others' watchdogs poll every second), so that the store does not go down before they can
    name it."""
    keys = [f"{SEEN_KEY}/{r}" for r in ranks]
    deadline = time.monotonic() + timeout
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not keys or store_call(lambda s: s.check(keys), deadline=left):
                return True
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - best effort
        pass
    return False


# -- where each rank is: named when a collective fails ---------------------------------------------------------------

PROGRESS_KEY = "lightning_avgpipe/progress/{}"
_progress: dict[str, Any] = {"seq": 0, "what": ""}
_TRANSPORT = ("timed out", "connection reset", "connection closed", "connection refused", "broken pipe")


@functools.cache
def _machine() -> str:
    """This process's machine and pid namespace: two processes with the same are each other's to look up by pid
    (a hostname alone is shared by containers with the host's network)."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/pid").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def _ranks() -> tuple[int, int] | None:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    return dist.get_rank(), dist.get_world_size()


def record_progress(what: str) -> None:
    """Record in the store that this rank reached ``what`` (a point every rank reaches in the same order: a setup
    collective, a checkpoint's), with its host and pid; read back by :func:`absent_ranks` when a collective fails.
    Best effort, bounded; a no-op without a process group of several ranks."""
    ranks = _ranks()
    if ranks is None or ranks[1] < 2:
        return
    _progress["seq"] += 1
    _progress["what"] = what
    value = json.dumps(
        {"seq": _progress["seq"], "what": what, "host": _machine(), "pid": os.getpid(), "time": time.time()}
    )
    try:
        store_call(lambda s: s.set(PROGRESS_KEY.format(ranks[0]), value))
    except Exception:  # noqa: BLE001 - a failure path reads it; nothing here may fail a healthy job
        pass


def _process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (gone, or a zombie its launcher has not reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            pass
        return False


def recorded_point(rank: int) -> dict[str, Any] | None:
    """Rank ``rank``'s last :func:`record_progress` record (``what``, ``host``, ``pid``, ``time``), or None; read with
    a deadline (:class:`StoreSilentError`, or the store's own error, when it cannot be read)."""
    key = PROGRESS_KEY.format(rank)
    raw = store_call(lambda s: s.get(key) if s.check([key]) else b"")
    return json.loads(raw) if raw else None


def has_exited(record: dict[str, Any]) -> bool:
    """Whether the process of a :func:`recorded_point` record ran on this machine and has ended."""
    return bool(record["host"] == _machine() and _process_gone(int(record["pid"])))


def absent_ranks() -> str:
    """Which ranks a failed collective lacked, from :func:`record_progress`'s records: those whose process on this
    machine has ended, and those whose last recorded point is earlier than this rank's; "" if none can be named."""
    ranks = _ranks()
    if ranks is None:
        return ""
    me, world = ranks
    host, now = _machine(), time.time()
    gone, behind = [], []
    for r in range(world):
        if r == me:
            continue
        key = PROGRESS_KEY.format(r)
        try:
            raw = store_call(lambda s, key=key: s.get(key) if s.check([key]) else b"")  # type: ignore[misc]
        except StoreSilentError:
            return "the rendezvous store is silent (rank 0, or torchrun's agent, which serves it, is stopped)"
        except Exception:  # noqa: BLE001 - the store went with its process
            return "the rendezvous store is gone (rank 0, or torchrun's agent, which serves it, exited or was killed)"
        if not raw:
            behind.append(f"rank {r} (which recorded no point yet)")
            continue
        info = json.loads(raw)
        if info["host"] == host and _process_gone(int(info["pid"])):
            gone.append(f"rank {r} (pid {info['pid']}) has exited or was killed, after {info['what']}")
        elif int(info["seq"]) < _progress["seq"]:
            ago = now - float(info["time"])
            behind.append(f"rank {r} (whose last point was {info['what']}, {ago:.0f} s ago)")
    parts = gone + ([f"{', '.join(behind)} did not arrive"] if behind else [])
    return "; ".join(parts)


def is_transport_error(err: BaseException) -> bool:
    """Whether ``err`` is the backend's own failure of a collective (a timeout, a peer gone), not the caller's: one
    of ``torch.distributed``'s own errors, or gloo's ``RuntimeError`` (its message names its source file)."""
    if isinstance(err, PeerFailureError):
        return False
    if isinstance(err, (dist.DistBackendError, dist.DistNetworkError, dist.DistStoreError)):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and "gloo" in text and any(marker in text for marker in _TRANSPORT)


@contextmanager
def guarded(what: str, record: bool = True) -> Iterator[None]:
    """Run a collective that every rank reaches as ``what``; the backend's own failure of it (gloo's "Timed out
    waiting 40000ms ...", "Connection reset by peer") becomes a :class:`PeerFailureError` that names the ranks that
    did not arrive or are gone, and quotes the first failure. ``record``: first record ``what`` as this rank's
    progress (a store write: not for a collective that runs every step)."""
    if record:
        record_progress(what)
    try:
        yield
    except RuntimeError as err:
        if not is_transport_error(err):
            raise
        ranks = _ranks()
        me = f"rank {ranks[0]}" if ranks is not None else "this rank"
        who = absent_ranks() or "a rank failed, was killed or is stuck"
        raise PeerFailureError(
            f"{me}: {what} did not complete: {who}. {first_failure()}({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]})"
        ) from err
