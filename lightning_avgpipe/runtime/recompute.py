"""Activation checkpointing per stage (GPipe's re-materialisation; docs/how-it-works.md#activation-checkpointing).

A checkpointed layer keeps only its input during the forward and runs its forward again during its backward, so a
stage holds one input per checkpointed layer per micro-batch in flight instead of everything the layer's operations
save. The schedule is unchanged; the stash per unit shrinks and each backward costs one more forward of those layers.

It uses non-reentrant ``torch.utils.checkpoint`` (``use_reentrant=False``). The reentrant form runs the recomputed
forward inside its own ``autograd.backward`` call and needs an input that requires grad; a stage's first layer on
stage 0 has none, and the executor's backward of a stage output with given gradients would see none of the
recomputed graph's parameters. The RNG state is saved and restored around the recomputation
(``preserve_rng_state``), so dropout draws the same masks and training is unchanged to float tolerance.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_avgpipe.config import Spec  # validated there: PipelineConfig.activation_checkpointing
from lightning_avgpipe.runtime import streams
from lightning_avgpipe.runtime.trace import note_saved


def layer_mask(layers: Sequence[nn.Module], spec: Spec) -> list[bool]:
    """Which of ``layers`` are checkpointed: all, none, or those whose class (or a base class) has a listed name
    (``"auto"``: none until the pipeline decides, ``StagePipeline.observe_memory``)."""
    if isinstance(spec, bool) or spec == "auto":
        return [spec is True] * len(layers)
    names = set(spec)
    return [any(c.__name__ in names for c in type(layer).__mro__) for layer in layers]


def check_matches(layers: Sequence[nn.Module], spec: Spec) -> None:
    """Every listed type must name a layer of the pipeline (over all stages): a typo would checkpoint nothing."""
    if isinstance(spec, bool) or spec == "auto":
        return
    found = {c.__name__ for layer in layers for c in type(layer).__mro__}
    missing = [name for name in spec if name not in found]
    if missing:
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(
            f"activation_checkpointing names {missing}, which no layer of configure_pipeline() is (its layers are "
            f"{kinds}); name one of those, or pass True to checkpoint every layer."
        )


def stage_function(
    layers: Sequence[nn.Module],
    mask: Sequence[bool] | None = None,
    seed_of: Callable[[int], int | None] | None = None,
) -> Callable[[Any], Any]:
    """The layers applied in order; those in ``mask`` checkpointed while autograd records (not under no_grad). Where
    ``seed_of(index)`` gives a seed, the layer draws from generators seeded with it (``runtime/streams.py``); a
    recomputation replays it with the same seed."""
    marks = list(mask) if mask is not None else [False] * len(layers)

    def stage_fn(x: Any) -> Any:
        saved: list[Any] = []  # the generators before the first seeded layer, put back once after the last
        try:
            return layers_on(x, saved)
        finally:
            if saved:
                streams.restore(saved[0])

    def layers_on(x: Any, saved: list[Any]) -> Any:
        for index, (layer, recompute) in enumerate(zip(layers, marks)):
            seed = seed_of(index) if seed_of is not None else None
            run: Callable[[Any], Any] = layer
            if seed is not None and recompute and torch.is_grad_enabled():  # replayed alone: puts them back itself
                run = functools.partial(_seeded_call, layer, seed)
            elif seed is not None:
                device = streams.device_of(x)
                if not saved:
                    saved.append(streams.save(device))
                streams.reseed(seed, device)
            if recompute and torch.is_grad_enabled():
                for t in x if isinstance(x, (tuple, list)) else (x,):
                    if isinstance(t, Tensor):
                        note_saved(t)  # kept for the recomputation, where the meter's hooks do not see it
                x = checkpoint(run, x, use_reentrant=False)
                if not _tensors(x):
                    raise TypeError(
                        f"activation_checkpointing: layer {index} of this stage ({type(layer).__name__}) returned "
                        f"{type(x).__name__}, not a tensor or a tuple of tensors; leave it out of "
                        "activation_checkpointing (list the layer types to checkpoint instead of True)."
                    )
            else:
                x = run(x)
        return x

    return stage_fn


def _seeded_call(layer: nn.Module, seed: int, x: Any) -> Any:
    with streams.seeded(seed, streams.device_of(x)):
        return layer(x)


def _tensors(x: Any) -> bool:
    if isinstance(x, Tensor):
        return True
    return isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(t, Tensor) for t in x)
