"""Running the user's step hooks on the last stage, and mirroring what they log to every stage.

On the last stage, the user's ``training_step`` (or validation/test/predict step) runs once per micro-batch with
``self(x)`` returning the pipeline's output for that micro-batch. What the step logs is recorded instead of
logged, averaged over the micro-batches (weighted by their size, so a logged mean equals the full batch's), and
replayed with ``self.log`` on every rank of the pipeline once per step: the logger on rank 0 (stage 0), the
progress bar and callbacks such as ``ModelCheckpoint`` see the same values on every rank. torchmetrics objects
travel as their state, so epoch-level ``compute()`` gives the same result everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_avgpipe.algorithms.microbatch import to_cpu
from lightning_avgpipe.plugin.contract import PipelineContractError, pipeline_inputs, same_structure
from lightning_avgpipe.plugin.split.placeholders import Guard


@dataclass
class _Record:
    name: str
    value: Any
    kwargs: dict[str, Any]
    weights: list[float] = field(default_factory=list)
    values: list[Any] = field(default_factory=list)


class StepBridge:
    """Calls the user's step hooks with the pipeline output substituted for ``self(x)``, recording their logs."""

    def __init__(self, module: nn.Module, guard: Guard) -> None:
        self.module = module
        self.guard = guard
        self._records: dict[str, _Record] = {}
        # torchmetrics submodule -> its update count when this step's first hook call began (None: no call yet)
        self._step_counts: dict[str, int] | None = None
        self._metrics: list[tuple[str, Metric]] | None = None  # walked once per step (see metrics())

    def metrics(self) -> list[tuple[str, Metric]]:
        """The module's torchmetrics submodules with their qualified names (walked once per step's first call, not
        per micro-batch: a module's tree has hundreds of submodules)."""
        if self._metrics is None:
            self._metrics = [(q, m) for q, m in self.module.named_modules() if isinstance(m, Metric)]
        return self._metrics

    def call_step(self, hook: str, output: Any, micro: Any, weight: float, *args: Any) -> Any:
        """Run ``module.<hook>(micro, *args)`` where ``self(x)`` returns ``output``; record what it logs."""
        module = self.module
        if self._step_counts is None:  # a metric reset between steps and updated again keeps its old count
            self._step_counts = {q: m._update_count for q, m in self.metrics()}
        expected = pipeline_inputs(module, micro)
        calls = 0

        def forward(*f_args: Any, **f_kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls > 1:
                raise PipelineContractError(
                    f"`{hook}` called self(...) twice for one micro-batch; under strategy='avgpipe' a step may run the "
                    "model once."
                )
            given = f_args[0] if len(f_args) == 1 and not f_kwargs else (f_args, f_kwargs)
            if not same_structure(given, expected):
                raise PipelineContractError(
                    f"`{hook}` called self(...) with an input that differs from pipeline_inputs(batch). Make "
                    "`pipeline_inputs(self, batch)` return exactly what your step passes to self(...)."
                )
            return output

        def log(name: str, value: Any, *l_args: Any, **l_kwargs: Any) -> None:
            if l_args:
                raise TypeError("Pass self.log options by keyword under strategy='avgpipe'.")
            rec = self._records.get(name)
            if rec is None:
                rec = self._records[name] = _Record(name, value, dict(l_kwargs))
            rec.values.append(value)
            rec.weights.append(weight)

        module.forward = forward  # type: ignore[method-assign]
        module.log = log  # type: ignore[method-assign,assignment]
        self.guard.active, self.guard.hook = True, hook
        try:
            result = getattr(module, hook)(micro, *args)
        finally:
            self.guard.active = False
            del module.forward
            del module.log
        if calls == 0:
            raise PipelineContractError(
                f"`{hook}` never called self(...). Under strategy='avgpipe' the model output of a step comes from "
                "self(x), with x = pipeline_inputs(batch)."
            )
        return result

    def take_logs(self) -> list[tuple[str, str, Any, dict[str, Any]]]:
        """The step's logs, reduced over micro-batches, as picklable records; clears the recorder."""
        out: list[tuple[str, str, Any, dict[str, Any]]] = []
        names = {id(m): q for q, m in self.metrics()}
        for rec in self._records.values():
            last = rec.values[-1]
            if isinstance(last, Metric):
                out.append((rec.name, "metric", (names.get(id(last)), *_metric_state(last)), rec.kwargs))
            else:
                values = torch.stack([_as_tensor(v).cpu() for v in rec.values])
                reduce = _reduction(rec.kwargs.get("reduce_fx", "mean"))
                if reduce == "sum":
                    value = values.sum()
                elif reduce == "max":
                    value = values.max()
                elif reduce == "min":
                    value = values.min()
                else:  # a size-weighted mean equals the full batch's mean
                    weights = torch.tensor(rec.weights, dtype=values.dtype)
                    value = (values * weights).sum() / weights.sum()
                out.append((rec.name, "value", value, rec.kwargs))
        self._records.clear()
        # Metrics updated in a step but not logged (computed later, e.g. in on_validation_epoch_end) are mirrored too,
        # so every stage computes the same value.
        logged = {payload[0] for _, kind, payload, _ in out if kind == "metric"}
        before = self._step_counts or {}
        self._step_counts = None
        for qualname, m in self.metrics():
            if qualname not in logged and m._update_count != before.get(qualname, m._update_count):
                out.append((qualname, "state", (qualname, *_metric_state(m)), {}))
        self._metrics = None  # the next step walks the module again (a metric may have been added)
        return out


def replay_logs(module: nn.Module, logs: Sequence[tuple[str, str, Any, dict[str, Any]]], device: torch.device) -> None:
    """Log ``logs`` (from :meth:`StepBridge.take_logs` on the last stage) through ``module.log`` on this rank."""
    modules: dict[str, nn.Module] | None = None  # only metrics need the walk
    for name, kind, payload, kwargs in logs:
        if kind == "value":
            module.log(name, payload.to(device), **kwargs)  # type: ignore[operator]
            continue
        qualname, state, extra = payload
        modules = modules if modules is not None else dict(module.named_modules())
        metric = modules.get(qualname) if qualname is not None else None
        if kind == "state" and isinstance(metric, Metric):
            _load_metric(metric, state, extra, device)
            continue
        if not isinstance(metric, Metric):
            raise PipelineContractError(
                f"self.log({name!r}, metric) logs a torchmetrics Metric that is not a submodule of the "
                "LightningModule; "
                "assign it as an attribute (self.metric = ...) so every stage can mirror it."
            )
        _load_metric(metric, state, extra, device)
        module.log(name, metric, **kwargs)  # type: ignore[operator]


def _metric_state(metric: Metric) -> tuple[dict[str, Any], dict[str, Any]]:
    """A metric's state on the CPU, and its update count and forward cache: what :func:`_load_metric` puts back."""
    state = {k: to_cpu(getattr(metric, k)) for k in metric._defaults}
    return state, {"count": metric._update_count, "cache": to_cpu(metric._forward_cache)}


def _load_metric(metric: Metric, state: dict[str, Any], extra: dict[str, Any], device: torch.device) -> None:
    for key, value in state.items():
        setattr(metric, key, _to_device(value, device))
    metric._update_count = extra["count"]
    metric._forward_cache = _to_device(extra["cache"], device)
    metric._computed = None


def _reduction(fx: Any) -> str:
    """The name of a ``self.log(reduce_fx=...)``: micro-batches combine the way steps do."""
    name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
    return {"amax": "max", "amin": "min"}.get(name, name)


def _as_tensor(v: Any) -> Tensor:
    if isinstance(v, Tensor):
        return v.detach().float()
    return torch.tensor(float(v))


def _to_device(v: Any, device: torch.device) -> Any:
    if isinstance(v, Tensor):
        return v.to(device)
    if isinstance(v, list):
        return [_to_device(x, device) for x in v]
    return v
