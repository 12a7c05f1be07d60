"""Every wait of a checkpoint save bounded by ``p2p_timeout``, a slow write never failed for being slow
(docs/strategy.md#checkpoints).

A save is a sequence of points every rank reaches in the same order (the folder prepared, the parts gathered, the
tensors written, the checkpoint renamed into place). Between two points a rank may do I/O for as long as its disk
takes, so no fixed timeout fits a wait on it; a rank frozen (SIGSTOP, a debugger, a dead node) must still be named
within about ``p2p_timeout``. So a save is a :class:`SaveWaits` session:

- each rank runs a heartbeat thread for the session's length: a counter in the rendezvous store it bumps every
  second (a frozen process's threads stop with it; a busy one's keep beating);
- at a point, a rank records its arrival in the store and waits for the others' (:meth:`SaveWaits.arrive`); it fails
  with a :class:`~.failures.PeerFailureError` naming the rank once a rank that has not arrived gave no sign of life
  for ``p2p_timeout`` (counted from the start of the wait: a rank that never began the save is named too), when the
  store is silent that long (rank 0, which serves it, is frozen), once another rank recorded a failure, or once a
  live rank is ``timeout`` late;
- the collectives of the save (a gather of structures, torch.distributed.checkpoint's own, the single file's
  tensors) run only after such an arrival, on a gloo group of the whole job whose timeout is ``p2p_timeout``
  (:func:`checkpoint_group`): every rank is there, so only a rank frozen in between waits that long.

Each session has its own keys (a counter every rank advances identically), so a save never reads an earlier one's;
a rank removes its keys of a session two sessions later, when every rank is past it. The heartbeat needs the GIL:
I/O (file writes, ``fsync``, torch's copies) releases it, so a rank busy writing keeps beating.
"""

from __future__ import annotations

import inspect
import itertools
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from lightning_avgpipe.runtime.failures.report import (
    FAILURE_KEY,
    PeerFailureError,
    StoreSilentError,
    first_failure,
    guarded,
    has_exited,
    is_transport_error,
    record_progress,
    recorded_point,
    store_call,
)

T = TypeVar("T")

BEAT = 1.0
"""Seconds between a rank's heartbeats during a save (less when ``p2p_timeout`` is under 4 s)."""

_sessions = itertools.count()
_mine: dict[int, list[str]] = {}  # session -> the keys this rank set in it (removed two sessions later)
_group: dict[str, Any] = {"of": None, "group": None}  # the checkpoint group, made once per default process group


def checkpoint_group(timeout: float) -> Any:
    """Collective (every rank, in the same order, all of them present): the gloo group of the whole job a save's
    collectives run on, its timeout ``timeout`` seconds; made once per default process group (gloo on any device:
    the default group may be NCCL, whose waits no timeout of ours bounds)."""
    world = dist.group.WORLD
    if _group["of"] is not world or _group["group"] is None:
        _group["group"] = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        _group["of"] = world
    return _group["group"]


def release_group() -> None:
    """Drop this module's reference to the checkpoint group, at exit before the groups are destroyed: nothing then
    holds it, so destroying it frees it and joins its gloo threads (``runtime/failures/shutdown.py``)."""
    _group["group"] = _group["of"] = None


def _forget_group() -> None:
    """Destroy the checkpoint group after a failed wait (no work is pending on it): a collective still to come on it
    (torch.distributed.checkpoint's own, after our wait raised inside it) then fails at once instead of waiting on
    the absent rank for ``p2p_timeout`` again."""
    group, _group["group"], _group["of"] = _group["group"], None, None
    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception:  # noqa: BLE001 - the job is failing; this only shortens it
            pass


class SaveWaits:
    """One save's waits (a context manager: the heartbeat runs inside it). A no-op in a single process.

    Args:
        what: the save, as a message names it ("a sharded checkpoint's save").
        p2p_timeout: seconds a rank may give no sign of life before it is named.
        timeout: seconds a live rank may take to arrive (the strategy's ``timeout``).
    """

    def __init__(self, what: str, p2p_timeout: float, timeout: float) -> None:
        self.what = what
        self.p2p_timeout = float(p2p_timeout)
        self.timeout = max(float(timeout), self.p2p_timeout)
        up = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if up else 0
        self.world_size = dist.get_world_size() if up else 1
        self.index = next(_sessions)
        self.ns = f"lightning_avgpipe/save/{self.index}"
        self.failure: PeerFailureError | None = None  # a wait that failed inside torch.distributed.checkpoint
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        self._writer: Any = None  # the last writer(): its deferred finish

    # -- the heartbeat -----------------------------------------------------------------------------------------------
    def __enter__(self) -> SaveWaits:
        if self.world_size > 1:
            self._forget_old_keys()
            _mine[self.index] = [self._key("alive", self.rank)]
            self._bump()
            self._beat = threading.Thread(target=self._beating, name="lightning_avgpipe-save-heartbeat", daemon=True)
            self._beat.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._beat is not None:
            self._beat.join(timeout=5.0)
            self._beat = None

    def _forget_old_keys(self) -> None:
        """Remove this rank's keys of sessions two or more before this one: every rank has arrived in the session
        between, so none still reads them."""
        old = [key for i in [i for i in _mine if i <= self.index - 2] for key in _mine.pop(i)]
        if not old:
            return
        try:
            store_call(lambda s: [s.delete_key(key) for key in old])
        except Exception:  # noqa: BLE001 - a key left behind is a few bytes in the store
            pass

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.ns}/{kind}/{rank}"

    def _bump(self) -> None:
        key = self._key("alive", self.rank)
        try:
            store_call(lambda s: s.add(key, 1))
        except Exception:  # noqa: BLE001 - a missed beat is a late one; the waits say why the store is silent
            pass

    def _beating(self) -> None:
        while not self._stop.wait(min(BEAT, self.p2p_timeout / 4)):
            self._bump()

    # -- the waits ---------------------------------------------------------------------------------------------------
    @property
    def group(self) -> Any:
        """The checkpoint group (made at a session's first collective: every rank has arrived by then)."""
        return checkpoint_group(self.p2p_timeout) if self.world_size > 1 else None

    def arrive(self, point: str) -> None:
        """Record that this rank reached ``point`` and wait until every rank did; raise a :class:`PeerFailureError`
        naming a rank that gave no sign of life for ``p2p_timeout`` (or exited) instead."""
        if self.world_size < 2:
            return
        record_progress(f"{self.what} ({point})")
        mine = self._key(point, self.rank)
        _mine.setdefault(self.index, []).append(mine)
        waiting = [r for r in range(self.world_size) if r != self.rank]
        start = time.monotonic()
        silent_since: float | None = None
        beats: dict[int, tuple[int, float]] = {r: (-1, start) for r in waiting}  # last beat, when it last changed
        posted, pause, look = False, 0.001, start + 0.5
        while True:
            try:
                if not posted:
                    store_call(lambda s: s.set(mine, "1"))
                    posted = True
                keys = [self._key(point, r) for r in waiting]
                if not waiting or store_call(lambda s, keys=keys: s.check(keys)):  # type: ignore[misc]
                    return
                if time.monotonic() >= look:
                    waiting = self._look(point, waiting, beats, start)
                    look = time.monotonic() + 0.5
                silent_since = None
            except StoreSilentError as err:
                silent_since = time.monotonic() - err.silent_for if silent_since is None else silent_since
                if time.monotonic() - silent_since >= self.p2p_timeout:
                    silent = time.monotonic() - silent_since
                    raise PeerFailureError(
                        f"rank {self.rank}: {self.what} ({point}) did not complete: rank 0 did not arrive: the "
                        f"rendezvous store it serves did not answer for {silent:.1f} s (rank 0, or torchrun's agent, "
                        "is stopped, frozen or stuck)."
                    ) from err
            except PeerFailureError:
                raise
            except Exception as err:  # noqa: BLE001 - the store went with its process
                gone = "the rendezvous store is gone (rank 0, which serves it, exited or was killed)"
                self._fail(point, f"{gone}: {type(err).__name__}: {str(err).splitlines()[0][:160]}")
            time.sleep(pause)  # 1 ms doubling to 10 ms for a second, then to 100 ms (a long wait is an I/O's)
            pause = min(pause * 2, 0.01 if time.monotonic() - start < 1.0 else 0.1)

    def _look(self, point: str, waiting: list[int], beats: dict[int, tuple[int, float]], start: float) -> list[int]:
        """The ranks still missing at ``point``, each one's heartbeat noted; fail on a silent one, a late one or a
        failure another rank recorded."""

        def read(s: Any) -> tuple[bool, list[int], list[int]]:
            missing = [r for r in waiting if not s.check([self._key(point, r)])]
            return bool(s.check([FAILURE_KEY])), missing, [s.add(self._key("alive", r), 0) for r in missing]

        failed, missing, counts = store_call(read)
        if failed:
            self._fail(point, "another rank failed")
        now = time.monotonic()
        for r, count in zip(missing, counts, strict=True):
            record = recorded_point(r)
            if record is not None and has_exited(record):
                self._fail(point, f"rank {r} (pid {record['pid']}) has exited or was killed, after {record['what']}")
            last, since = beats[r]
            if count != last:
                beats[r] = (count, now if last >= 0 else since)
            quiet = now - beats[r][1]
            if quiet >= self.p2p_timeout:
                began = "" if count > 0 else " and never began this save"
                self._fail(
                    point,
                    f"rank {r} did not arrive within p2p_timeout={self.p2p_timeout:g} s: it gave no sign of life "
                    f"for {quiet:.1f} s{began} (stopped, frozen or stuck){self._last_point(r)}",
                )
            if now - start >= self.timeout:
                late = f"rank {r} is alive but did not arrive within timeout={self.timeout:g} s"
                self._fail(point, late + self._last_point(r))
        return missing

    def _last_point(self, rank: int) -> str:
        try:
            info = recorded_point(rank)
        except Exception:  # noqa: BLE001 - only a detail of the message
            return ""
        if not info:
            return ""
        return f"; its last recorded point: {info['what']}, {time.time() - float(info['time']):.0f} s ago"

    def _fail(self, point: str, why: str) -> None:
        raise PeerFailureError(f"rank {self.rank}: {self.what} ({point}) did not complete: {why}. {first_failure()}")

    def collective(self, point: str, fn: Callable[[Any], T]) -> T:
        """``fn(group)``, a collective on the checkpoint group, once every rank arrived at ``point``."""
        self.arrive(point)
        with guarded(f"{self.what} ({point})", record=False):
            return fn(self.group)

    def receive(self, buffer: torch.Tensor, src: int, name: str) -> None:
        """Receive ``buffer`` (the tensor ``name``) from ``src`` on the checkpoint group; ``src`` has arrived and
        sent it already, so a transfer that times out names it."""
        try:
            dist.recv(buffer, src=src, group=self.group)
        except RuntimeError as err:
            if not is_transport_error(err):
                raise
            raise PeerFailureError(
                f"rank {self.rank}: {self.what} did not complete: rank {src} did not send the tensor {name} within "
                f"p2p_timeout={self.p2p_timeout:g} s (stopped, frozen or stuck). {first_failure()}"
                f"({type(err).__name__}: {str(err).splitlines()[0][:160]})"
            ) from err

    def inside(self, point: str) -> None:
        """:meth:`arrive` inside torch.distributed.checkpoint, which wraps whatever its steps raise and goes on to its
        next collective: a failed wait is kept for :meth:`reraise` and the checkpoint group destroyed, so that
        collective fails at once."""
        try:
            self.arrive(point)
        except PeerFailureError as err:
            self.failure = err
            _forget_group()
            raise

    def reraise(self, err: BaseException) -> None:
        """After torch.distributed.checkpoint failed with ``err``: raise the failed wait's error, if one did."""
        if self.failure is not None:
            raise self.failure from err

    def writer(self, inner: Any) -> Any:
        """``inner`` (a torch.distributed.checkpoint ``StorageWriter``) with a wait after each rank's plan and after
        each rank's write, and its ``finish`` (rank 0 writing the metadata) deferred to :meth:`finish`."""
        self._writer = _waiting_writer()(inner, self)
        return self._writer

    def finish(self) -> None:
        """Rank 0, after the save's collectives: the deferred ``finish`` of :meth:`writer`'s writer (DCP's
        ``.metadata``, written while no other rank waits in a collective)."""
        writer, self._writer = self._writer, None
        if writer is not None and writer.deferred is not None:
            writer.inner.finish(*writer.deferred)


def _waiting_writer() -> type:
    """The :meth:`SaveWaits.writer` class (torch.distributed.checkpoint imported only when a folder is saved)."""
    from torch.distributed.checkpoint import StorageWriter

    class WaitingWriter(StorageWriter):
        def __init__(self, inner: Any, waits: SaveWaits) -> None:
            self.inner, self.waits = inner, waits
            self.deferred: tuple[Any, Any] | None = None

        @property
        def checkpoint_id(self) -> Any:
            return getattr(self.inner, "checkpoint_id", None)

        def reset(self, checkpoint_id: Any = None) -> None:
            self.inner.reset(checkpoint_id)

        @classmethod
        def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
            return False

        def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
            if "kwargs" in inspect.signature(self.inner.set_up_storage_writer).parameters:
                self.inner.set_up_storage_writer(is_coordinator, *args, **kwargs)
            else:
                self.inner.set_up_storage_writer(is_coordinator, *args)

        def storage_meta(self) -> Any:
            return self.inner.storage_meta()

        def prepare_local_plan(self, plan: Any) -> Any:
            try:
                return self.inner.prepare_local_plan(plan)
            finally:  # an error of its own still arrives: torch gathers it, and every rank raises it
                self.waits.inside("planned")

        def prepare_global_plan(self, plans: Any) -> Any:
            return self.inner.prepare_global_plan(plans)

        def write_data(self, plan: Any, planner: Any) -> Any:
            try:
                done = self.inner.write_data(plan, planner)
                done.wait()
            finally:
                self.waits.inside("written")
            return done

        def finish(self, metadata: Any, results: Any) -> None:
            self.deferred = (metadata, results)

    return WaitingWriter
