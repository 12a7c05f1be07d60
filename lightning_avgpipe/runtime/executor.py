"""The executor: runs one stage's lowered action list, whatever the schedule that produced it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.errors import loss_of
from lightning_avgpipe.runtime.deferred import WeightGradQueue
from lightning_avgpipe.runtime.p2p import Link, flatten_output
from lightning_avgpipe.runtime.trace import ActivationMeter, StepTrace
from lightning_avgpipe.schedules.actions import Action, Kind

StageFn = Callable[[Any], Any]
HeadFn = Callable[[int, Any], Any]


class StageExecutor:
    """Runs plans for one stage.

    Args:
        stage: this stage's index.
        num_stages: stages in the pipeline.
        stage_fn: this stage's layers applied in order to one unit's input.
        link: transfers to and from the neighbouring stages (``None`` when ``num_stages == 1``).
        coalesce: issue each run of communication actions between two computes as one ``batch_isend_irecv``
            group (needed on NCCL with plans lowered with ``recv_lookahead=0``; see :mod:`..schedules.nccl`).
    """

    def __init__(
        self, stage: int, num_stages: int, stage_fn: StageFn, link: Link | None, coalesce: bool = False
    ) -> None:
        self.stage = stage
        self.num_stages = num_stages
        self.stage_fn = stage_fn
        self.link = link
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.coalesce = coalesce and link is not None
        self.weight_grads: WeightGradQueue | None = None  # where input-gradient actions queue the weight gradients
        if self.coalesce:
            assert link is not None
            link.always_batch = True

    def run(
        self,
        actions: Sequence[Action],
        keys: Sequence[Hashable],
        *,
        training: bool,
        inputs: Callable[[int], Any] | None = None,
        head: HeadFn | None = None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
        stage_fn_for: Callable[[int], StageFn] | None = None,
        trace: StepTrace | None = None,
        meter: ActivationMeter | None = None,
        after_backward: Callable[[int], None] | None = None,
        loss_scale: Any = None,
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
            stage_fn_for: unit -> the layers that run it (a replica's), instead of the executor's ``stage_fn``.
            trace: filled with this step's timeline (compute, waits on neighbours, sends).
            meter: counts the activation bytes each unit saves for backward (training).
            after_backward: called with the unit once its gradients are whole on this stage (after its ``B``, or its
                ``W``), for the noise probe.

        Returns:
            On the last stage, unit -> the head's value (detached in training); elsewhere an empty dict.
        """
        run = _Run(self, keys, training, inputs, head, forward_context, stage_fn_for, trace, meter, after_backward)
        run.loss_scale = loss_scale
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
                steps[action.kind](action.unit)
        return run.finish()

    def _between(self, kind: Kind) -> None:
        """Before each action: group a run of communications into one batch (``coalesce``), and let sent tensors go
        before a compute (they need not outlive their transfer)."""
        link = self.link
        if link is None:
            return
        if self.coalesce:
            if kind.is_compute:
                link.flush_batch()
            else:
                link.begin_batch()
        if kind.is_compute:
            link.reap_sends()


class _Run:
    """One run of a stage's plan: what its units hold between actions, and one method per kind of action."""

    def __init__(
        self,
        executor: StageExecutor,
        keys: Sequence[Hashable],
        training: bool,
        inputs: Callable[[int], Any] | None,
        head: HeadFn | None,
        forward_context: Callable[[], contextlib.AbstractContextManager[Any]],
        stage_fn_for: Callable[[int], StageFn] | None,
        trace: StepTrace | None,
        meter: ActivationMeter | None,
        after_backward: Callable[[int], None] | None,
    ) -> None:
        self.executor, self.keys, self.training = executor, keys, training
        self.inputs, self.head, self.forward_context = inputs, head, forward_context
        self.stage_fn_for = stage_fn_for
        self.trace, self.meter, self.after_backward = trace, meter, after_backward
        self.loss_scale: Any = None
        self.results: dict[int, Any] = {}
        self.stash: dict[int, tuple[list[Tensor], list[Tensor]]] = {}  # unit -> (inputs needing grad, outputs)
        self.outgoing: dict[int, Any] = {}
        self.input_grads: dict[int, list[Tensor]] = {}

    @property
    def link(self) -> Link:
        link = self.executor.link
        assert link is not None, f"stage {self.executor.stage}: a transfer with one stage"
        return link

    def note(self, kind: str, unit: int, t0: float, t1: float) -> None:
        if self.trace is not None:
            self.trace.add(kind, unit, t0, t1)

    # -- forward -------------------------------------------------------------------------------------------------
    def recv_activations(self, u: int) -> None:
        self.link.post_activations(u, self.keys[u])

    def _input(self, u: int) -> Any:
        if self.executor.is_first:
            assert self.inputs is not None, "the first stage needs inputs"
            return self.inputs(u)
        t0 = time.perf_counter()
        x = self.link.wait_activations(u, self.training)
        self.note("wait", u, t0, time.perf_counter())
        return x

    def forward(self, u: int) -> None:
        ex = self.executor
        x = self._input(u)
        t1 = time.perf_counter()
        counting = self.meter.unit(u) if self.meter is not None and self.training else contextlib.nullcontext()
        with self.forward_context(), counting:
            try:
                y = (self.stage_fn_for(u) if self.stage_fn_for is not None else ex.stage_fn)(x)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                if not ex.is_first:
                    _note_boundary(err, ex.stage, u, x)
                raise
            if ex.is_last:  # the loss / user step runs in the same context (autocast) as the model
                assert self.head is not None, "the last stage needs a head"
                y = self.head(u, y)
        self.note("F", u, t1, time.perf_counter())
        if ex.is_last:
            if self.training:
                y = loss_of(y, "the training head")
                self.stash[u] = (_needing_grad(x), [y])
                y = y.detach()
            self.results[u] = y
            return
        self.outgoing[u] = y
        if self.training:
            self.stash[u] = (_needing_grad(x), [t for t in flatten_output(y, f"stage {ex.stage}") if t.requires_grad])

    def send_activations(self, u: int) -> None:
        t0 = time.perf_counter()
        self.link.send_activations(self.keys[u], self.outgoing.pop(u))
        self.note("send", u, t0, time.perf_counter())

    # -- backward ------------------------------------------------------------------------------------------------
    def recv_grads(self, u: int) -> None:
        self.link.post_grads(u, self.stash[u][1])

    def backward(self, u: int) -> None:
        """The whole backward of unit ``u``: input and weight gradients."""
        self._backward(u, "B")
        if self.after_backward is not None:
            self.after_backward(u)

    def input_grad(self, u: int) -> None:
        """The input gradient of unit ``u``; its layers' weight gradients wait in the queue for :meth:`weight_grad`
        (a stage without a queue, or a layer that cannot defer, takes them now: the plan still runs)."""
        queue = self.executor.weight_grads
        with queue.deferring(u) if queue is not None else contextlib.nullcontext():
            self._backward(u, "I")

    def weight_grad(self, u: int) -> None:
        """The weight gradients unit ``u``'s input gradient queued."""
        t0 = time.perf_counter()
        if self.executor.weight_grads is not None:
            self.executor.weight_grads.run(u)
        self.note("W", u, t0, time.perf_counter())
        if self.after_backward is not None:  # the unit's gradients are whole now
            self.after_backward(u)

    def _backward(self, u: int, label: str) -> None:
        ex = self.executor
        ins, outs = self.stash.pop(u)
        grads = None
        if not ex.is_last:
            t0 = time.perf_counter()
            grads = self.link.wait_grads(u)
            self.note("wait", u, t0, time.perf_counter())
        t1 = time.perf_counter()
        if ex.is_last:  # with loss scaling (16-mixed) every gradient of the pipeline is scaled
            scale = self.loss_scale
            torch.autograd.backward(outs if scale is None else [o * scale for o in outs])
        elif outs:
            torch.autograd.backward(outs, grads)
        if not ex.is_first:
            self.input_grads[u] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
        self.note(label, u, t1, time.perf_counter())
        if self.meter is not None:
            self.meter.release(u)

    def send_grads(self, u: int) -> None:
        t0 = time.perf_counter()
        self.link.send_grads(self.input_grads.pop(u))
        self.note("send", u, t0, time.perf_counter())

    # -- the end -------------------------------------------------------------------------------------------------
    def finish(self) -> dict[int, Any]:
        """Wait for the sends, close the timeline; fail if the plan left a unit unfinished."""
        link = self.executor.link
        if link is not None:
            t0 = time.perf_counter()
            link.wait_sends()
            self.note("wait", -1, t0, time.perf_counter())
        if self.trace is not None:
            self.trace.finish()
            if self.meter is not None:
                self.trace.peak_activation_bytes = self.meter.peak
        if self.stash or self.outgoing or self.input_grads:
            left = sorted(self.stash) or sorted(self.outgoing)
            raise RuntimeError(f"stage {self.executor.stage}: plan left units unfinished: {left}")
        return self.results


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
