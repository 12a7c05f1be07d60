"""The executor: runs one stage's lowered action list, whatever the schedule that produced it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_avgpipe.errors import loss_of
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
            after_backward: called with the unit after each backward on this stage (the noise probe).

        Returns:
            On the last stage, unit -> the head's value (detached in training); elsewhere an empty dict.
        """
        results: dict[int, Any] = {}
        stash: dict[int, tuple[list[Tensor], list[Tensor]]] = {}  # unit -> (inputs needing grad, outputs to backprop)
        outgoing: dict[int, Any] = {}
        input_grads: dict[int, list[Tensor]] = {}
        link = self.link
        clock = time.perf_counter
        note = trace.add if trace is not None else (lambda kind, unit, t0, t1: None)
        grad_mode = torch.enable_grad() if training else torch.no_grad()
        with grad_mode:
            for action in actions:
                kind, u = action.kind, action.unit
                if self.coalesce:
                    assert link is not None
                    if kind.is_compute:
                        link.flush_batch()
                    else:
                        link.begin_batch()
                if kind.is_compute and link is not None:
                    link.reap_sends()  # sent activations/gradients need not outlive their transfer
                if kind is Kind.RECV_F:
                    assert link is not None
                    link.post_activations(u, keys[u])
                elif kind is Kind.FORWARD:
                    t0 = clock()
                    if self.is_first:
                        assert inputs is not None, "the first stage needs inputs"
                        x = inputs(u)
                    else:
                        assert link is not None
                        x = link.wait_activations(u, training)
                        note("wait", u, t0, clock())
                    t1 = clock()
                    counting = meter.unit(u) if meter is not None and training else contextlib.nullcontext()
                    with forward_context(), counting:
                        try:
                            y = (stage_fn_for(u) if stage_fn_for is not None else self.stage_fn)(x)
                        except (RuntimeError, TypeError, ValueError, IndexError) as err:
                            if not self.is_first:
                                _note_boundary(err, self.stage, u, x)
                            raise
                        if self.is_last:  # the loss / user step runs in the same context (autocast) as the model
                            assert head is not None, "the last stage needs a head"
                            value = head(u, y)
                    note("F", u, t1, clock())
                    if self.is_last:
                        if training:
                            value = loss_of(value, "the training head")
                            stash[u] = (_needing_grad(x), [value])
                            value = value.detach()
                        results[u] = value
                    else:
                        outgoing[u] = y
                        if training:
                            outs = [t for t in flatten_output(y, f"stage {self.stage}") if t.requires_grad]
                            stash[u] = (_needing_grad(x), outs)
                elif kind is Kind.SEND_F:
                    assert link is not None
                    t0 = clock()
                    link.send_activations(keys[u], outgoing.pop(u))
                    note("send", u, t0, clock())
                elif kind is Kind.RECV_B:
                    assert link is not None
                    link.post_grads(u, stash[u][1])
                elif kind is Kind.BACKWARD:
                    ins, outs = stash.pop(u)
                    grads = None
                    if not self.is_last:
                        assert link is not None
                        t0 = clock()
                        grads = link.wait_grads(u)
                        note("wait", u, t0, clock())
                    t1 = clock()
                    if self.is_last:  # with loss scaling (16-mixed) every gradient of the pipeline is scaled
                        torch.autograd.backward(outs if loss_scale is None else [o * loss_scale for o in outs])
                    elif outs:
                        torch.autograd.backward(outs, grads)
                    if not self.is_first:
                        input_grads[u] = [t.grad if t.grad is not None else torch.zeros_like(t) for t in ins]
                    note("B", u, t1, clock())
                    if meter is not None:
                        meter.release(u)
                    if after_backward is not None:
                        after_backward(u)
                elif kind is Kind.SEND_B:
                    assert link is not None
                    t0 = clock()
                    link.send_grads(input_grads.pop(u))
                    note("send", u, t0, clock())
                else:  # pragma: no cover - Kind is closed
                    raise ValueError(f"unknown action {action}")
        if link is not None:
            t0 = clock()
            link.wait_sends()
            note("wait", -1, t0, clock())
        if trace is not None:
            trace.finish()
            if meter is not None:
                trace.peak_activation_bytes = meter.peak
        if stash or outgoing or input_grads:
            raise RuntimeError(f"stage {self.stage}: plan left units unfinished: {sorted(stash) or sorted(outgoing)}")
        return results


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
