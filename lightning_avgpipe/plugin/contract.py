"""The pipeline contract of a LightningModule: its layers in order, and what the first layer takes from a batch.

A module is pipeline-ready when it implements ``configure_pipeline()``, returning the layers in order (an
``nn.Sequential`` or a list of modules that are attributes of the module), and its ``forward`` applies exactly
those layers in order. Its ``training_step`` / ``validation_step`` / ``test_step`` / ``predict_step`` then work
unchanged: under the pipeline, ``self(x)`` inside a step returns the last stage's output for the micro-batch.
``pipeline_inputs(batch)`` says what ``x`` is; the default takes ``batch[0]`` of a tuple or list, or the batch
itself when it is a tensor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_avgpipe.errors import PipelineContractError

CONTRACT_HELP = (
    "Implement `configure_pipeline(self)` returning the layers in order (an nn.Sequential or a list of submodules), "
    "with `forward` applying exactly those layers in order; see docs/contract.md."
)


def pipeline_layers(module: nn.Module) -> list[nn.Module]:
    """Call ``module.configure_pipeline()`` and check what it returns."""
    hook = getattr(module, "configure_pipeline", None)
    if not callable(hook):
        raise PipelineContractError(
            f"{type(module).__name__} has no `configure_pipeline()` hook, which strategy='avgpipe' needs. "
            f"{CONTRACT_HELP}"
        )
    layers = hook()
    if isinstance(layers, nn.Sequential):
        layers = list(layers.children())
    elif isinstance(layers, (list, tuple, nn.ModuleList)):
        layers = list(layers)
    else:
        raise PipelineContractError(
            f"{type(module).__name__}.configure_pipeline() returned {type(layers).__name__}. {CONTRACT_HELP}"
        )
    if not layers or not all(isinstance(layer, nn.Module) for layer in layers):
        raise PipelineContractError(
            f"{type(module).__name__}.configure_pipeline() must return at least one nn.Module, got "
            f"{[type(layer).__name__ for layer in layers]}. {CONTRACT_HELP}"
        )
    if len({id(layer) for layer in layers}) != len(layers):
        raise PipelineContractError(
            f"{type(module).__name__}.configure_pipeline() lists the same module twice; each layer must appear once."
        )
    registered = {id(m) for m in module.modules()}
    strays = [i for i, layer in enumerate(layers) if id(layer) not in registered]
    if strays:
        raise PipelineContractError(
            f"Layers {strays} returned by configure_pipeline() are not submodules of {type(module).__name__}; "
            "assign them as attributes (for example self.layers = nn.Sequential(...)) so checkpoints hold them."
        )
    inside = {id(p) for layer in layers for p in layer.parameters()}
    outside = [name for name, p in module.named_parameters() if id(p) not in inside]
    if outside:
        raise PipelineContractError(
            f"Parameters {outside[:5]} of {type(module).__name__} are not in any layer of configure_pipeline(); every "
            "trainable parameter must belong to a pipelined layer (move it into one of the layers)."
        )
    return layers


def default_pipeline_inputs(batch: Any) -> Any:
    """The first layer's input of a batch: the batch if it is a tensor, else its first element."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, (tuple, list)) and batch:
        return batch[0]
    kind = "dict" if isinstance(batch, Mapping) else type(batch).__name__
    raise PipelineContractError(
        f"Cannot tell the model input of a {kind} batch. Implement `pipeline_inputs(self, batch)` in your "
        "LightningModule returning what the first pipelined layer takes (for example batch['input_ids'])."
    )


def pipeline_inputs(module: nn.Module, batch: Any) -> Any:
    hook = getattr(module, "pipeline_inputs", None)
    return hook(batch) if callable(hook) else default_pipeline_inputs(batch)


def same_structure(a: Any, b: Any) -> bool:
    """True when ``a`` and ``b`` are the same object or equal tensors in the same structure."""
    if a is b:
        return True
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool((a == b).all())
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b))
    return False


def locate(root: nn.Module, layer: nn.Module) -> list[tuple[nn.Module, str]]:
    """Every (parent, attribute name) under which ``layer`` is registered in ``root``."""
    return [(parent, name) for parent in root.modules() for name, child in parent.named_children() if child is layer]


def check_forward(module: nn.Module, layers: list[nn.Module], x: Any) -> None:
    """Raise when ``module(x)`` is not ``layers`` applied to ``x`` in order (eval mode, no grad, RNG untouched).

    Training under the pipeline runs the layers; inference after ``load_from_checkpoint`` runs ``forward``: when
    they differ, the two are different models and nothing else would say so.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            by_forward = module(x)
            by_layers = x
            for layer in layers:
                by_layers = layer(by_layers)
    finally:
        module.train(was_training)
    difference = _difference(by_forward, by_layers)
    if difference is None:
        return
    name = type(module).__name__
    raise PipelineContractError(
        f"{name}.forward(x) is not its configure_pipeline() layers applied in order: {difference}. Training under "
        "strategy='avgpipe' runs the layers, while inference (load_from_checkpoint, predict on one device) runs "
        "forward, so they would be two different models. Move the extra computation into a layer of "
        "configure_pipeline(), or into your step after self(x). (AvgPipeStrategy(check_forward=False) skips this "
        "check, for a model too large to run whole on one device.)"
    )


def _difference(a: Any, b: Any) -> str | None:
    """How ``a`` and ``b`` (tensors, or tuples/lists/dicts of them) differ, or ``None`` when they match."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return (
                f"forward gives {str(a.dtype).replace('torch.', '')} {tuple(a.shape)}, the layers give "
                f"{str(b.dtype).replace('torch.', '')} {tuple(b.shape)}"
            )
        if a.is_meta or b.is_meta:  # a model built without memory: shapes and dtypes are all there is
            return None
        try:
            torch.testing.assert_close(a, b, equal_nan=True)
        except AssertionError:
            gap = (a.double() - b.double()).abs().nan_to_num(float("inf"))
            return f"the largest difference is {float(gap.max()):.4g} (output shape {tuple(a.shape)})"
        return None
    if isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys():
        return next((f"[{k!r}]: {d}" for k in a if (d := _difference(a[k], b[k])) is not None), None)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)) and len(a) == len(b):
        return next((f"[{i}]: {d}" for i, (u, v) in enumerate(zip(a, b)) if (d := _difference(u, v)) is not None), None)
    if isinstance(a, Tensor) or isinstance(b, Tensor) or type(a) is not type(b):
        return f"forward gives {type(a).__name__}, the layers give {type(b).__name__}"
    return None if a == b else f"forward gives {a!r}, the layers give {b!r}"
