"""The executor: runs one rank's lowered action list, whatever the schedule that produced it.

A rank runs one stage, or several (``v`` model chunks: interleaved 1F1B, ZB-V, ``schedules/chunks.py``). What a
stage passes to a stage on the same rank stays in memory, detached like a received tensor, so each stage's backward
is its own action, as across ranks; what crosses ranks goes through that stage's link.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.errors import loss_of
from lightning_avgpipe.runtime import streams
from lightning_avgpipe.runtime.comms.p2p import Link, flatten_output
from lightning_avgpipe.runtime.deferred import WeightGradQueue
from lightning_avgpipe.runtime.request import StepRequest
from lightning_avgpipe.runtime.trace import ActivationMeter, StepTrace
from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.chunks import Layout

StageFn = Callable[[Any], Any]
HeadFn = Callable[[int, Any], Any]
Key = tuple[int, int]  # (stage, unit)


class StageExecutor:
    """Runs plans for one rank.

    Args:
        stage: this rank's stage (with several chunks, its first).
        num_stages: ranks in the pipeline.
        stage_fn: this stage's layers applied in order to one unit's input.
        link: transfers to and from the neighbouring stages (``None`` when ``num_stages == 1``).
        coalesce: issue each run of communication actions between two computes as one ``batch_isend_irecv``
            group (needed on NCCL with plans lowered with ``recv_lookahead=0``; see :mod:`..schedules.nccl`).
        layout: which rank runs which stage, with several chunks per rank (``None``: one stage per rank).
        chunks: with ``layout``, every stage this rank runs -> (its layers applied in order, its link).
    """

    def __init__(
        self,
        stage: int,
        num_stages: int,
        stage_fn: StageFn,
        link: Link | None,
        coalesce: bool = False,
        *,
        layout: Layout | None = None,
        chunks: Mapping[int, tuple[StageFn, Link | None]] | None = None,
    ) -> None:
        self.layout = layout or Layout(num_stages)
        self.stage_fns: dict[int, StageFn] = {stage: stage_fn}
        self.links: dict[int, Link | None] = {stage: link}
        if chunks is not None:
            self.stage_fns = {j: fn for j, (fn, _) in chunks.items()}
            self.links = {j: ln for j, (_, ln) in chunks.items()}
        self.stage = min(self.stage_fns)
        self.num_stages = num_stages
        self.is_first = 0 in self.stage_fns  # holds the first stage: the inputs come in here
        self.is_last = self.layout.num_chunks - 1 in self.stage_fns  # holds the last stage: the loss is here
        # every stage's link on this rank (a stage with nothing to send has none); read before every action
        self.all_links: tuple[Link, ...] = tuple(ln for ln in self.links.values() if ln is not None)
        self.coalesce = coalesce and bool(self.all_links)
        self.weight_grads: WeightGradQueue | None = None  # where input-gradient actions queue the weight gradients
        for ln in self.all_links:
            ln.always_batch = self.coalesce

    @property
    def stage_fn(self) -> StageFn:
        """The layers of this rank's (first) stage."""
        return self.stage_fns[self.stage]

    @stage_fn.setter
    def stage_fn(self, fn: StageFn) -> None:
        self.stage_fns[self.stage] = fn

    @property
    def link(self) -> Link | None:
        """The link of this rank's (first) stage."""
        return self.links[self.stage]

    def run(
        self,
        actions: Sequence[Action],
        keys: Sequence[Hashable],
        *,
        training: bool,
        inputs: Callable[[int], Any] | None = None,
        head: HeadFn | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        stage_fn_for: Callable[[int, int], StageFn] | None = None,
        trace: StepTrace | None = None,
        meter: ActivationMeter | None = None,
        after_backward: Callable[[int], None] | None = None,
        request: StepRequest | None = None,
    ) -> dict[int, Any]:
        """Run ``actions`` for units ``0..len(keys)-1``.

        Args:
            actions: this stage's lowered plan.
            keys: per unit, the metadata key both neighbours compute for it (see :mod:`.p2p`).
            training: run backwards too; otherwise forwards run under ``torch.no_grad``.
            inputs: on the first stage, unit -> the first layer's input.
            head: on the last stage, ``(unit, output) -> value``. In training the value must be the scalar loss
                to backpropagate for that unit (already weighted); in evaluation it is returned as is.
            forward_context: entered around every forward (autocast, for example).
            stage_fn_for: (stage, unit) -> the layers that run it (a replica's), instead of the stage's own.
            trace: filled with this step's timeline (compute, waits on neighbours, sends).
            meter: counts the activation bytes each unit saves for backward (training).
            after_backward: called with the unit once its gradients are whole on this stage (after its ``B``, or its
                ``W``), for the noise probe (one stage per rank).
            request: the training step's request (``runtime/request.py``): its ``forward_context`` (instead of the
                argument) and its ``loss_scale``, by which each unit's loss is multiplied before its backward.

        Returns:
            On the last stage, unit -> the head's value (detached in training); elsewhere an empty dict.
        """
        run = _Run(
            self,
            keys,
            training=training,
            inputs=inputs,
            head=head,
            forward_context=request.forward_context if request is not None else forward_context,
            stage_fn_for=stage_fn_for,
            trace=trace,
            meter=meter,
            after_backward=after_backward,
            loss_scale=request.loss_scale if request is not None else None,
        )
        steps = {
            Kind.RECV_F: run.recv_activations,
            Kind.FORWARD: run.forward,
            Kind.SEND_F: run.send_activations,
            Kind.RECV_B: run.recv_grads,
            Kind.BACKWARD: run.backward,
            Kind.INPUT_GRAD: run.input_grad,
            Kind.WEIGHT_GRAD: run.weight_grad,
            Kind.SEND_B: run.send_grads,
        }
        with torch.enable_grad() if training else torch.no_grad():
            for action in actions:
                self._between(action.kind)
                steps[action.kind](action.stage, action.unit)
        return run.finish()

    def _between(self, kind: Kind) -> None:
        """Before each action: group a run of communications into one batch (``coalesce``), and let sent tensors go
        before a compute (they need not outlive their transfer)."""
        for link in self.all_links:
            if self.coalesce:
                if kind.is_compute:
                    link.flush_batch()
                else:
                    link.begin_batch()
            if kind.is_compute:
                link.reap_sends()


class _Run:
    """One run of a rank's plan: what its units hold between actions, and one method per kind of action."""

    def __init__(
        self,
        executor: StageExecutor,
        keys: Sequence[Hashable],
        *,
        training: bool,
        inputs: Callable[[int], Any] | None,
        head: HeadFn | None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
        stage_fn_for: Callable[[int, int], StageFn] | None,
        trace: StepTrace | None,
        meter: ActivationMeter | None,
        after_backward: Callable[[int], None] | None,
        loss_scale: Any,
    ) -> None:
        self.executor, self.keys, self.training = executor, keys, training
        self.inputs, self.head, self.forward_context = inputs, head, forward_context
        self.stage_fn_for = stage_fn_for
        self.trace, self.meter, self.after_backward = trace, meter, after_backward
        self.layout = executor.layout
        self.last = self.layout.num_chunks - 1
        self.loss_scale = loss_scale
        self.results: dict[int, Any] = {}
        self.stash: dict[Key, tuple[list[Tensor], list[Tensor]]] = {}  # (inputs needing grad, outputs to backprop)
        self.outgoing: dict[Key, Any] = {}  # outputs to send
        self.input_grads: dict[Key, list[Tensor]] = {}  # input gradients to send
        self.local: dict[Key, Any] = {}  # outputs for the next stage on this rank
        self.local_grads: dict[Key, list[Tensor]] = {}  # input gradients for the previous stage on this rank

    def link(self, j: int) -> Link:
        link = self.executor.links.get(j)
        assert link is not None, f"stage {j}: a transfer without a link"
        return link

    def note(self, kind: str, unit: int, t0: float, t1: float) -> None:
        if self.trace is not None:
            self.trace.add(kind, unit, t0, t1)

    # -- forward -------------------------------------------------------------------------------------------------
    def recv_activations(self, j: int, u: int) -> None:
        self.link(j).post_activations(u, self.keys[u])

    def _input(self, j: int, u: int) -> Any:
        if j == 0:
            assert self.inputs is not None, "the first stage needs inputs"
            return self.inputs(u)
        if not self.layout.crosses(j - 1, j):  # from this rank's stage j - 1, as a receive would give it
            return _detached(self.local.pop((j - 1, u)), self.training)
        t0 = time.perf_counter()
        x = self.link(j).wait_activations(u, self.training)
        self.note("wait", u, t0, time.perf_counter())
        return x

    def forward(self, j: int, u: int) -> None:
        x = self._input(j, u)
        t1 = time.perf_counter()
        counting = self.meter.unit((j, u)) if self.meter is not None and self.training else contextlib.nullcontext()
        drawing = streams.unit(u) if self.training else contextlib.nullcontext()  # each layer's own random stream
        with self.forward_context(), counting, drawing:
            fn = self.stage_fn_for(j, u) if self.stage_fn_for is not None else self.executor.stage_fns[j]
            try:
                y = fn(x)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                if j > 0:
                    _note_boundary(err, j, u, x)
                raise
            if j == self.last:  # the loss / user step runs in the same context (autocast) as the model
                assert self.head is not None, "the last stage needs a head"
                y = self.head(u, y)
        self.note("F", u, t1, time.perf_counter())
        if j == self.last:
            if self.training:
                y = loss_of(y, "the training head")
                self.stash[(j, u)] = (_needing_grad(x), [y])
                y = y.detach()
            self.results[u] = y
            return
        (self.outgoing if self.layout.crosses(j, j + 1) else self.local)[(j, u)] = y
        if self.training:
            self.stash[(j, u)] = (_needing_grad(x), [t for t in flatten_output(y, f"stage {j}") if t.requires_grad])

    def send_activations(self, j: int, u: int) -> None:
        t0 = time.perf_counter()
        self.link(j).send_activations(self.keys[u], self.outgoing.pop((j, u)))
        self.note("send", u, t0, time.perf_counter())

    # -- backward ------------------------------------------------------------------------------------------------
    def recv_grads(self, j: int, u: int) -> None:
        self.link(j).post_grads(u, self.stash[(j, u)][1])

    def backward(self, j: int, u: int) -> None:
        """The whole backward of unit ``u`` on stage ``j``: input and weight gradients."""
        self._backward(j, u, "B")
        if self.after_backward is not None:
            self.after_backward(u)

    def input_grad(self, j: int, u: int) -> None:
        """The input gradient of unit ``u``; its layers' weight gradients wait in the queue for :meth:`weight_grad`
        (a stage without a queue, or a layer that cannot defer, takes them now: the plan still runs)."""
        queue = self.executor.weight_grads
        with queue.deferring((j, u)) if queue is not None else contextlib.nullcontext():
            self._backward(j, u, "I")

    def weight_grad(self, j: int, u: int) -> None:
        """The weight gradients unit ``u``'s input gradient queued on stage ``j``."""
        t0 = time.perf_counter()
        if self.executor.weight_grads is not None:
            self.executor.weight_grads.run((j, u))
        self.note("W", u, t0, time.perf_counter())
        if self.after_backward is not None:  # the unit's gradients are whole now
            self.after_backward(u)

    def _output_grads(self, j: int, u: int) -> list[Tensor] | None:
        if j == self.last:
            return None
        if not self.layout.crosses(j, j + 1):
            return self.local_grads.pop((j + 1, u))
        t0 = time.perf_counter()
        grads = self.link(j).wait_grads(u)
        self.note("wait", u, t0, time.perf_counter())
        return grads

    def _backward(self, j: int, u: int, label: str) -> None:
        ins, outs = self.stash.pop((j, u))
        grads = self._output_grads(j, u)
        t1 = time.perf_counter()
        if j == self.last:  # with loss scaling (16-mixed) every gradient of the pipeline is scaled
            scale = self.loss_scale
            torch.autograd.backward(outs if scale is None else [o * scale for o in outs])
        elif outs:
            torch.autograd.backward(outs, grads)
        if j > 0:
            given = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
            (self.input_grads if self.layout.crosses(j - 1, j) else self.local_grads)[(j, u)] = given
        self.note(label, u, t1, time.perf_counter())
        if self.meter is not None:
            self.meter.release((j, u))

    def send_grads(self, j: int, u: int) -> None:
        t0 = time.perf_counter()
        self.link(j).send_grads(self.input_grads.pop((j, u)))
        self.note("send", u, t0, time.perf_counter())

    # -- the end -------------------------------------------------------------------------------------------------
    def finish(self) -> dict[int, Any]:
        """Wait for the sends, close the timeline; fail if the plan left a unit unfinished."""
        links = self.executor.all_links
        if links:
            t0 = time.perf_counter()
            for link in links:
                link.wait_sends()
            self.note("wait", -1, t0, time.perf_counter())
        if self.trace is not None:
            self.trace.finish()
            if self.meter is not None:
                self.trace.peak_activation_bytes = self.meter.peak
        left = {**self.stash, **self.outgoing, **self.input_grads, **self.local, **self.local_grads}
        if left:
            raise RuntimeError(f"stage {self.executor.stage}: plan left (stage, unit) unfinished: {sorted(left)}")
        return self.results


def _detached(value: Any, training: bool) -> Any:
    """A stage's output as the next stage on the same rank takes it: detached, a floating tensor that required grad
    a leaf that requires grad again (what a receive gives), so each stage's backward is its own."""
    if isinstance(value, Tensor):
        t = value.detach()
        return t.requires_grad_(True) if training and value.requires_grad else t
    if isinstance(value, tuple):
        return tuple(_detached(v, training) for v in value)
    return value


def _needing_grad(x: Any) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x] if x.requires_grad else []
    if isinstance(x, (tuple, list)):
        return [t for t in x if isinstance(t, Tensor) and t.requires_grad]
    return []


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"{x.dtype} {tuple(x.shape)}".replace("torch.", "")
    if isinstance(x, (tuple, list)):
        return "(" + ", ".join(_describe(t) for t in x) + ")"
    return type(x).__name__


def _note_boundary(err: BaseException, stage: int, unit: int, x: Any) -> None:
    """Add what arrived from the previous stage to an error raised by this stage's layers (type and message kept)."""
    if not hasattr(err, "add_note"):  # Python < 3.11: the original error only
        return
    err.add_note(
        f"lightning_avgpipe: stage {stage} raised this on unit {unit}, running its first layers on what stage "
        f"{stage - 1} sent: {_describe(x)}. If it is a shape or dtype mismatch, stage {stage - 1}'s last layer and "
        f"stage {stage}'s first layer disagree: check the order of configure_pipeline() and the partition."
    )
