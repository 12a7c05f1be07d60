"""The step's loss and logs, from the pipeline's last stage to every stage (``plugin/steps/hooks.py`` calls it)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor


class StepResults:
    """The step's loss and logs, from the pipeline's last stage to every stage, every step.

    While the step logs the same plain values under the same names as the previous step (the common case), one
    broadcast of a small float64 tensor carries the loss and the values; when the names change, or a torchmetrics
    state travels, the whole ``(loss, logs)`` goes as a pickled object (two broadcasts and the pickling: about a
    millisecond a step on CPU), and every stage remembers the new names.
    """

    CAPACITY = 64  # float64 slots: a flag, the loss, up to 62 logged values

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self._spec: list[tuple[str, dict[str, Any], torch.dtype]] | None = None

    def exchange(self, loss: Tensor | None, logs: list[Any] | None) -> tuple[Tensor, list[Any]]:
        """Every stage calls it; the last stage passes its ``loss`` and ``logs`` (the others ``None``)."""
        pipe = self.pipeline
        if pipe.topology.num_stages == 1:
            assert loss is not None and logs is not None
            return loss, logs
        buf = torch.zeros(self.CAPACITY, dtype=torch.float64, device=pipe.device)
        if pipe.executor.is_last:
            assert loss is not None and logs is not None
            spec = _spec_of(logs)
            fast = spec is not None and _same(spec, self._spec) and len(spec) + 2 <= self.CAPACITY
            buf[1] = float(loss)
            if fast:
                buf[0] = 1.0
                if logs:
                    buf[2 : 2 + len(logs)] = torch.stack([record[2].double() for record in logs]).to(buf.device)
        pipe.share_tensor(buf)
        if bool(buf[0] == 1.0):
            if pipe.executor.is_last:
                assert loss is not None and logs is not None
                return loss, logs
            assert self._spec is not None
            values = buf[2 : 2 + len(self._spec)].cpu()
            mirrored = [
                (name, "value", values[i].to(dtype), kwargs) for i, (name, kwargs, dtype) in enumerate(self._spec)
            ]
            return buf[1].float().cpu(), mirrored
        shared_loss, shared_logs = pipe.share((loss, logs) if pipe.executor.is_last else None)
        self._spec = _spec_of(shared_logs)
        return shared_loss, shared_logs


def _same(a: Any, b: Any) -> bool:
    """``a == b`` for log specs, ``False`` when an option cannot be compared (a tensor passed as an option)."""
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _spec_of(logs: Sequence[Any]) -> list[tuple[str, dict[str, Any], torch.dtype]] | None:
    """Names, options and dtypes of a step's logs when all are plain values (``None`` when a metric travels)."""
    if any(kind != "value" for _, kind, _, _ in logs):
        return None
    return [(name, kwargs, value.dtype) for name, _, value, kwargs in logs]
