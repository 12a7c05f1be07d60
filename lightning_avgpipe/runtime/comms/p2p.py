"""Point-to-point transfers between neighbouring stages, with shape metadata sent once per input signature.

Every message on a channel (one direction between two neighbours) is matched in order, as NCCL requires, so
both ends must post in the same unit order (the plan validator guarantees it).

Metadata: the receiver must allocate buffers before data arrives. All stages of a pipeline see the same batch,
so both ends compute the same *key* for a unit (the training flag and the shapes and dtypes of the unit's
micro-batch). The first unit with a new key carries a small int64 header describing the stage output (tensor or
tuple, and each tensor's dtype, shape and requires-grad flag); later units with that key send data only. The
sender checks every output against the header it sent for the key, so a model whose activation shapes do not
follow from its input shapes gets a clear error instead of a corrupt transfer.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.runtime.failures.report import PeerFailureError, first_failure

META_LEN = 256
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


class StageOutputError(TypeError):
    """A stage produced something that cannot travel to the next stage."""


@dataclass(frozen=True)
class TensorMeta:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


@dataclass(frozen=True)
class OutputMeta:
    """The structure of one stage output: a single tensor or a tuple of tensors."""

    is_tuple: bool
    tensors: tuple[TensorMeta, ...]

    @classmethod
    def of(cls, value: Any, where: str) -> OutputMeta:
        tensors = flatten_output(value, where)
        return cls(
            isinstance(value, (tuple, list)),
            tuple(TensorMeta(t.dtype, tuple(t.shape), t.requires_grad) for t in tensors),
        )

    def encode(self, device: torch.device) -> Tensor:
        values = [int(self.is_tuple), len(self.tensors)]
        for t in self.tensors:
            values += [_DTYPES.index(t.dtype), int(t.requires_grad), len(t.shape), *t.shape]
        if len(values) > META_LEN:
            raise StageOutputError(
                f"A stage output with {len(self.tensors)} tensors needs {len(values)} metadata slots, more than "
                f"{META_LEN}; return fewer tensors from a stage boundary (pack them into one)."
            )
        values += [-1] * (META_LEN - len(values))
        return torch.tensor(values, dtype=torch.int64, device=device)

    @classmethod
    def decode(cls, buf: Tensor) -> OutputMeta:
        values = buf.tolist()
        is_tuple, n, i = bool(values[0]), values[1], 2
        tensors = []
        for _ in range(n):
            dtype, rg, ndim = _DTYPES[values[i]], bool(values[i + 1]), values[i + 2]
            tensors.append(TensorMeta(dtype, tuple(values[i + 3 : i + 3 + ndim]), rg))
            i += 3 + ndim
        return cls(is_tuple, tuple(tensors))


def flatten_output(value: Any, where: str) -> list[Tensor]:
    """The tensors of a stage output, or a ``StageOutputError`` naming the stage and what it returned."""
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, Tensor) for v in value):
        return list(value)
    kinds = type(value).__name__
    if isinstance(value, (tuple, list)):
        kinds += " of " + ", ".join(sorted({type(v).__name__ for v in value})) if value else " (empty)"
    raise StageOutputError(
        f"{where} returned {kinds}; a stage boundary must carry a tensor or a tuple of tensors. Move non-tensor "
        "values out of the pipelined layers, or choose a partition that does not cut there."
    )


def _check_dtype(t: Tensor, where: str) -> None:
    if t.dtype not in _DTYPES:
        raise StageOutputError(f"{where} returned a tensor of dtype {t.dtype}, which cannot be sent between stages.")


class _Deferred:
    """A send or receive posted inside a batch: its work exists once the batch is issued."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.work: Any = None

    def wait(self, timeout: timedelta | None = None) -> None:
        if self.work is None:
            self.link.flush_batch()  # a wait inside an open batch: issue what is collected first
        if timeout is None:
            self.work.wait()
        else:
            self.work.wait(timeout)


@dataclass
class _Incoming:
    key: Hashable
    meta_buf: Tensor | None = None
    meta_work: Any = None
    meta: OutputMeta | None = None
    bufs: list[Tensor] | None = None
    works: list[Any] | None = None


class Link:
    """The two channels of one stage: activations from ``prev_rank`` / to ``next_rank``, gradients the other way."""

    def __init__(
        self,
        prev_rank: int | None,
        next_rank: int | None,
        device: torch.device,
        group: Any = None,
        name: str = "stage",
        stage: int | None = None,
        tagged: bool = False,
    ) -> None:
        self.prev_rank = prev_rank
        # Several stages per rank: each stage's messages carry tags of their own, so two stages exchanging with the
        # same neighbour rank keep separate in-order channels (gloo matches by peer and tag). Activations arriving at
        # stage j are tagged 2j, gradients arriving at it 2j + 1.
        j = stage if tagged and stage is not None else None
        self._tags = (0, 0, 0, 0) if j is None else (2 * j, 2 * (j + 1), 2 * j + 1, 2 * j - 1)
        self.next_rank = next_rank
        self.stage = stage
        # Seconds a receive may wait before the job fails naming the silent neighbour; None: the process group's.
        self.timeout: float | None = None
        self.device = device
        self.group = group
        self.name = name
        self._sent_meta: dict[Hashable, OutputMeta] = {}
        self._recv_meta: dict[Hashable, OutputMeta] = {}
        self._incoming: dict[int, _Incoming] = {}
        self._unresolved: deque[int] = deque()
        self._grads_in: dict[int, tuple[list[Tensor], list[Any]]] = {}
        self._sends: list[tuple[Any, Tensor]] = []
        self._batch: list[tuple[dist.P2POp, _Deferred]] | None = None
        # NCCL runs batched point-to-point operations on the whole group's communicator and single ones on a
        # two-rank one: a batched send never matches a single receive. In batched mode every operation is batched.
        self.always_batch = False
        # bytes of the receive buffers posted and not yet handed over, and their peak (the memory breakdown's)
        self.in_flight = self.peak_in_flight = 0

    # -- batching (NCCL) -------------------------------------------------------------------------------------------
    def begin_batch(self) -> None:
        """Collect the following sends and receives, to issue them as one batch_isend_irecv group."""
        if self._batch is None:
            self._batch = []

    def flush_batch(self) -> None:
        """Issue the collected operations together (one NCCL group)."""
        batch, self._batch = self._batch, None
        if batch:
            try:
                works = dist.batch_isend_irecv([op for op, _ in batch])
            except RuntimeError as err:  # a neighbour already gone: posting fails at once
                peer = batch[0][0].peer
                raise self._peer_error(err, "a batch of transfers", peer, -1 if peer == self.prev_rank else 1) from err
            if len(works) != len(batch):  # NCCL coalesces the group into one request that completes them all
                works = [works[-1]] * len(batch)
            for (_, handle), work in zip(batch, works):
                handle.work = work

    def _p2p(self, send: bool, tensor: Tensor, peer: int, tag: int = 0) -> Any:
        if self._batch is None and self.always_batch:
            self.begin_batch()
            handle = self._p2p(send, tensor, peer, tag)
            self.flush_batch()
            return handle
        if self._batch is not None:
            handle = _Deferred(self)
            fn = dist.isend if send else dist.irecv
            op = dist.P2POp(fn, tensor, peer, self.group, tag) if tag else dist.P2POp(fn, tensor, peer, self.group)
            self._batch.append((op, handle))
            return handle
        try:
            tagged = {"tag": tag} if tag else {}  # one stage per rank: untagged, as before
            return (dist.isend if send else dist.irecv)(tensor, peer, group=self.group, **tagged)
        except RuntimeError as err:  # a neighbour already gone: posting fails at once
            what = "a transfer (send)" if send else "a transfer (receive)"
            raise self._peer_error(err, what, peer, -1 if peer == self.prev_rank else 1) from err

    # -- activations, forward direction ------------------------------------------------------------------------
    def send_activations(self, key: Hashable, value: Any) -> None:
        """Send a stage output to the next stage, with a metadata header the first time ``key`` is seen."""
        assert self.next_rank is not None
        where = f"{self.name} (the last layer before the cut)"
        meta = OutputMeta.of(value, where)
        known = self._sent_meta.get(key)
        if known is None:
            for t in flatten_output(value, where):
                _check_dtype(t, where)
            self._sent_meta[key] = meta
            self._isend(meta.encode(self.device), tag=self._tags[1])
        elif known != meta:
            raise StageOutputError(
                f"{where} produced {meta} for an input of the same shapes that earlier gave {known}; activation "
                "shapes, dtypes and requires-grad flags must follow from the input's shapes."
            )
        for t in flatten_output(value, where):
            self._isend(t.detach().contiguous(), tag=self._tags[1])

    def post_activations(self, unit: int, key: Hashable) -> None:
        """Post the receive of ``unit``'s activations from the previous stage; returns without waiting."""
        assert self.prev_rank is not None
        while self._unresolved:  # keep posting order == unit order (FIFO channels)
            self._resolve(self._unresolved.popleft())
        inc = _Incoming(key)
        self._incoming[unit] = inc
        if key in self._recv_meta:
            self._post_data(inc, self._recv_meta[key])
        else:
            inc.meta_buf = torch.empty(META_LEN, dtype=torch.int64, device=self.device)
            inc.meta_work = self._p2p(False, inc.meta_buf, self.prev_rank, self._tags[0])
            self._unresolved.append(unit)

    def wait_activations(self, unit: int, training: bool) -> Any:
        """Wait for ``unit``'s activations; floating tensors the sender tracked come back requiring grad."""
        if unit in self._unresolved:
            while self._unresolved:
                u = self._unresolved.popleft()
                self._resolve(u)
                if u == unit:
                    break
        inc = self._incoming.pop(unit)
        assert inc.works is not None and inc.bufs is not None and inc.meta is not None
        for w in inc.works:
            self._wait(w, f"the activations of unit {unit}", self.prev_rank, -1)
        self._count(-sum(b.nbytes for b in inc.bufs))
        tensors = []
        for buf, tm in zip(inc.bufs, inc.meta.tensors):
            if training and tm.requires_grad:
                buf.requires_grad_(True)
            tensors.append(buf)
        return tuple(tensors) if inc.meta.is_tuple else tensors[0]

    def received_meta(self, key: Hashable) -> OutputMeta:
        """The header received for ``key`` (after a unit with that key arrived)."""
        return self._recv_meta[key]

    def _resolve(self, unit: int) -> None:
        inc = self._incoming[unit]
        self._wait(inc.meta_work, f"the activation header of unit {unit}", self.prev_rank, -1)
        assert inc.meta_buf is not None
        meta = OutputMeta.decode(inc.meta_buf)
        self._recv_meta[inc.key] = meta
        self._post_data(inc, meta)

    def _post_data(self, inc: _Incoming, meta: OutputMeta) -> None:
        inc.meta = meta
        inc.bufs = [torch.empty(tm.shape, dtype=tm.dtype, device=self.device) for tm in meta.tensors]
        self._count(sum(b.nbytes for b in inc.bufs))
        assert self.prev_rank is not None
        inc.works = [self._p2p(False, b, self.prev_rank, self._tags[0]) for b in inc.bufs]

    # -- gradients, backward direction ---------------------------------------------------------------------------
    def post_grads(self, unit: int, like: Sequence[Tensor]) -> None:
        """Post the receive of the gradients of ``unit``'s outputs (``like``) from the next stage."""
        assert self.next_rank is not None
        bufs = [torch.empty_like(t, memory_format=torch.contiguous_format) for t in like]
        self._count(sum(b.nbytes for b in bufs))
        self._grads_in[unit] = (bufs, [self._p2p(False, b, self.next_rank, self._tags[2]) for b in bufs])

    def wait_grads(self, unit: int) -> list[Tensor]:
        bufs, works = self._grads_in.pop(unit)
        self._count(-sum(b.nbytes for b in bufs))
        for w in works:
            self._wait(w, f"the gradients of unit {unit}", self.next_rank, +1)
        return bufs

    def send_grads(self, grads: Sequence[Tensor]) -> None:
        assert self.prev_rank is not None
        for g in grads:
            self._isend(g.contiguous(), dst=self.prev_rank, tag=self._tags[3])

    def _count(self, nbytes: int) -> None:
        self.in_flight += nbytes
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    # -- sends -----------------------------------------------------------------------------------------------------
    def _isend(self, tensor: Tensor, dst: int | None = None, tag: int = 0) -> None:
        dst = self.next_rank if dst is None else dst
        assert dst is not None
        self._sends.append((self._p2p(True, tensor, dst, tag), tensor))

    def reap_sends(self) -> None:
        """Forget sends that have completed, so their buffers are freed before the end of the step."""
        if self._sends:
            self._sends = [(w, t) for w, t in self._sends if not _completed(w)]

    def wait_sends(self) -> None:
        """Wait for every send posted so far (their buffers may be freed afterwards)."""
        self.flush_batch()
        for work, _ in self._sends:
            self._wait(work, "the acknowledgement of a send", None, 0)
        self._sends.clear()

    def _wait(self, work: Any, what: str, peer: int | None, direction: int) -> None:
        """Wait for ``work``; a dead or silent neighbour becomes a :class:`PeerFailureError` that names it."""
        try:
            if self.timeout is None:
                work.wait()
            else:
                work.wait(timedelta(seconds=self.timeout))
        except RuntimeError as err:
            raise self._peer_error(err, what, peer, direction) from err

    def _peer_error(self, err: BaseException, what: str, peer: int | None, direction: int) -> PeerFailureError:
        """A :class:`PeerFailureError` naming the neighbour ``peer`` (``direction``: -1 previous, +1 next stage)."""
        if peer is None:
            who = "a neighbouring stage"
        elif self.stage is not None:
            who = f"rank {peer} (stage {self.stage + direction})"
        else:
            who = f"rank {peer} (the {'previous' if direction < 0 else 'next'} stage)"
        timed_out = "timed out" in str(err).lower() or "timeout" in str(err).lower()
        limit = f" within {self.timeout:g} s" if timed_out and self.timeout is not None else ""
        return PeerFailureError(
            f"{self.name}: {what} from {who} did not arrive{limit}: that rank failed, was killed or is stuck. "
            f"{first_failure()}({type(err).__name__}: {str(err).splitlines()[0][:160]})"
        )

    def reset(self) -> None:
        """Forget cached metadata (both ends must reset together, e.g. after the layout changed)."""
        self._sent_meta.clear()
        self._recv_meta.clear()


def _completed(work: Any) -> bool:
    if isinstance(work, _Deferred):
        work = work.work
        if work is None:
            return False
    try:
        return bool(work.is_completed())
    except (AttributeError, RuntimeError):
        return False
