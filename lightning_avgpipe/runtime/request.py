"""One training step's request: built once by its caller (``plugin/steps/hooks.py`` for Lightning's ``training_step``)
and passed unchanged to the controller (``runtime/controller.py``), the pipeline (``runtime/pipeline.py``) and the
executor (``runtime/executor.py``); each reads the fields it needs. Pure PyTorch: no Lightning import."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from lightning_avgpipe.runtime.units import LossFn, first_input

Context = Callable[[], contextlib.AbstractContextManager[Any]]


@dataclass(frozen=True)
class StepRequest:
    """What one training iteration is asked to do.

    Attributes:
        batches: the N batches of this iteration, one per parallel pipeline.
        loss_fn: on the last stage, ``(output, micro_batch, share) -> loss`` for one micro-batch, ``share`` being its
            part of all N batches (to weight what is logged).
        inputs: micro-batch -> the first layer's input (first stage).
        accumulate: gradient accumulation steps the optimizer step spans.
        forward_context: entered around every forward and loss (autocast).
        divergence: also measure the replicas' distance to the reference over the pipeline (collective).
        noise: also measure the gradient noise (collective over the job; with ``accumulate`` 1 only).
        param_names: ``id(reference parameter) -> name`` for errors about non-finite gradients.
        key: a name that keeps this step's transfer metadata apart from other kinds of step.
        loss_scale: multiply every unit's loss by it before its backward (16-mixed's loss scale).
        step: the training step's number (Lightning's ``global_step``): what ``trace_steps`` names and, with
            ``batch_index``, what each layer's random stream follows (``runtime/streams.py``); ``None``: neither.
        batch_index: the batch's index in its epoch.
        log: whether this step's figures are logged (Lightning's ``log_every_n_steps``).
        optimizers: the step's optimizers, whose states the memory figure counts.
    """

    batches: Sequence[Any]
    loss_fn: LossFn
    inputs: Callable[[Any], Any] = first_input
    accumulate: int = 1
    forward_context: Context = contextlib.nullcontext
    divergence: bool = False
    noise: bool = False
    param_names: Mapping[int, str] | None = None
    key: str = "training_step"
    loss_scale: Any = None
    step: int | None = None
    batch_index: int = 0
    log: bool = False
    optimizers: Sequence[Any] = ()
