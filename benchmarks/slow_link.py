"""An emulated slow link for benchmarks only: a ``Link`` whose sends reach the wire after latency + bytes / bandwidth.

This is *emulation*, not a network. It exists because the usual tool, ``tc qdisc ... netem delay``, needs the
``sch_netem`` kernel module, which sandboxes and containers often lack (the development machine has network
namespaces and ``tbf`` but no ``netem``). Nothing in the package uses it.

Model: each direction between two neighbours is one serial wire. A message of ``b`` bytes handed over at time ``t``
starts when the wire is free (``max(t, wire_free)``), occupies it for ``b / bandwidth`` and arrives ``latency``
later. A background thread per direction sleeps until the message's arrival time and only then calls the real
``dist.isend`` (over loopback, where it costs next to nothing). The sender's compute continues meanwhile, as it
would with a real slow wire: the delay overlaps compute and shows up only where a receiver has to wait for it.

Differences from a real slow network, which the benchmark reports say nothing about:

- a send's handle completes when the message has *arrived* (a real TCP send completes once the kernel buffered
  it); the executor waits on its sends only at the end of a step, where the receiver is waiting for the last
  message anyway;
- receives are not slowed on the receiving side (arrival is modelled on the sender's side);
- the sleeping thread needs the GIL for a moment when it wakes, so delays can overshoot by the interpreter's
  switch interval (the benchmark lowers it to 0.5 ms).
"""

from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.runtime import Link


class _DelayedSend:
    """The handle of one delayed send: ``wait()`` waits for the real send, once the thread has issued it."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        self.work: Any = None
        self.error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self.ready.wait(None if timeout is None else timeout.total_seconds()):
            raise RuntimeError(f"emulated slow link: the delayed send was not issued within {timeout} (timed out)")
        if self.error is not None:
            raise RuntimeError(f"emulated slow link: the delayed isend failed: {self.error}") from self.error
        return bool(self.work.wait() if timeout is None else self.work.wait(timeout))


class Wire:
    """One direction of the emulated link: a FIFO that hands each message to gloo when it would have arrived."""

    def __init__(self, latency_s: float, bandwidth_bytes_per_s: float, name: str = "wire") -> None:
        self.latency = float(latency_s)
        self.bandwidth = float(bandwidth_bytes_per_s)
        self._free_at = 0.0
        self._queue: queue.SimpleQueue[tuple[float, Tensor, int, Any, _DelayedSend] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, tensor: Tensor, peer: int, group: Any) -> _DelayedSend:
        now = time.perf_counter()
        start = max(now, self._free_at)
        self._free_at = start + tensor.numel() * tensor.element_size() / self.bandwidth
        handle = _DelayedSend()
        self._queue.put((self._free_at + self.latency, tensor, peer, group, handle))
        return handle

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            due, tensor, peer, group, handle = item
            delay = due - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            try:
                handle.work = dist.isend(tensor, peer, group=group)
            except BaseException as err:  # noqa: BLE001 - handed to the waiter
                handle.error = err
            finally:
                handle.ready.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)


class DelayedLink(Link):
    """A :class:`~lightning_avgpipe.runtime.Link` whose sends travel over emulated slow wires (gloo, unbatched).

    Args:
        latency_s: one-way latency of every message.
        bandwidth_bytes_per_s: bytes per second of each direction's wire.
        The rest as for ``Link``.
    """

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        *,
        latency_s: float,
        bandwidth_bytes_per_s: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(prev_rank, next_rank, device, **kwargs)
        self.wires = {
            peer: Wire(latency_s, bandwidth_bytes_per_s, f"slow-wire-to-{peer}")
            for peer in (prev_rank, next_rank)
            if peer is not None
        }

    def _p2p(self, send: bool, tensor: Tensor, peer: int, tag: int = 0) -> Any:
        if send and self._batch is None and not self.always_batch and not tag:  # one stage per rank: untagged
            return self.wires[peer].submit(tensor, peer, self.group)
        return super()._p2p(send, tensor, peer, tag)

    def close(self) -> None:
        for wire in self.wires.values():
            wire.close()
