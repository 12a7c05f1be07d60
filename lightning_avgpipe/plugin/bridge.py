"""Running the user's step hooks on the last stage, and mirroring what they log to every stage.

On the last stage, the user's ``training_step`` (or validation/test/predict step) runs once per micro-batch with
``self(x)`` returning the pipeline's output for that micro-batch. What the step logs is recorded instead of
logged, averaged over the micro-batches (weighted by their size, so a logged mean equals the full batch's), and
replayed with ``self.log`` on every rank of the pipeline once per step: the logger on rank 0 (stage 0), the
progress bar and callbacks such as ``ModelCheckpoint`` see the same values on every rank. torchmetrics objects
travel as their state, so epoch-level ``compute()`` gives the same result everywhere.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_avgpipe.microbatch import to_cpu
from lightning_avgpipe.plugin.contract import PipelineContractError, pipeline_inputs, same_structure


class NotWholeError(RuntimeError):
    """The module is not the whole model in this process: a layer of another stage was used after the run."""


class Guard:
    """Set while a user step runs under the pipeline: layers must then not be called directly. ``finished``: the
    run is over and this process holds only its own stages: a placeholder's use then refuses (the module is not
    the whole model here), except inside the strategy's own saves (:meth:`allowing`)."""

    def __init__(self) -> None:
        self.active = False
        self.hook: str = ""
        self.finished = False

    @contextmanager
    def allowing(self) -> Iterator[None]:
        """The strategy's own use of the split module (a checkpoint's state dict after the run)."""
        finished, self.finished = self.finished, False
        try:
            yield
        finally:
            self.finished = finished

    def check(self, name: str) -> None:
        if self.active:
            raise PipelineContractError(
                f"`{self.hook}` called the pipelined layer '{name}' directly. Under strategy='avgpipe' a step must "
                "get the model output through `self(x)` (the layers run on their own stages)."
            )


class Elsewhere(nn.Identity):
    """Placeholder for a layer that lives on another stage: keeps the module tree and state-dict keys honest."""

    def __init__(self, name: str, stage: int, guard: Guard) -> None:
        super().__init__()
        self.layer_name = name
        self.stage = stage
        self._guard = guard
        self.register_state_dict_pre_hook(Elsewhere._refuse_state_dict)
        # parameters(), named_parameters(), .to() read it: after the run they refuse as a forward does
        self.__dict__["_parameters"] = _Refusing(lambda: self._refuse("parameters()"))

    def forward(self, x: Any) -> Any:
        self._guard.check(self.layer_name)
        self._refuse("its forward")
        return x

    def _refuse(self, what: str) -> None:
        if self._guard.finished:
            raise NotWholeError(
                f"AvgPipe: {what} reached '{self.layer_name}', a layer that ran on stage {self.stage} in another "
                "process: after a run this process holds only its own stages, so this module is not the whole model "
                "here (a state dict, a forward, parameters() or save_pretrained would give a part of it). The "
                "launching process (rank 0) holds the whole trained model where it built it whole; else load a "
                "checkpoint: trainer.save_checkpoint(path), then MyModel.load_from_checkpoint(path) (a folder saved "
                "with save_distributed_checkpoint=True: python -m lightning_avgpipe consolidate FOLDER OUT.ckpt "
                "first)."
            )

    @staticmethod
    def _refuse_state_dict(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        module._refuse("state_dict()")  # type: ignore[operator]

    def __getstate__(self) -> dict[str, Any]:
        self._refuse("pickling (torch.save of the module, copy.deepcopy)")
        return self.__dict__.copy()

    def extra_repr(self) -> str:
        return f"{self.layer_name} on stage {self.stage}"


class _Refusing(dict):  # type: ignore[type-arg]
    """A placeholder's (empty) parameter dict: reading its items first asks ``refuse``."""

    def __init__(self, refuse: Any) -> None:
        super().__init__()
        self.refuse = refuse

    def items(self) -> Any:
        self.refuse()
        return super().items()

    def values(self) -> Any:
        self.refuse()
        return super().values()


class Anchor(nn.Module):
    """An empty parameter for a stage whose layers have none, so ``configure_optimizers`` still gets a parameter.

    It never appears in state dicts: checkpoints keep exactly the unsplit model's keys.
    """

    def __init__(self) -> None:
        super().__init__()
        self.anchor = nn.Parameter(torch.empty(0))
        self._register_state_dict_hook(Anchor._drop)

    @staticmethod
    def _drop(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        state_dict.pop(prefix + "anchor", None)


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
                state = {k: to_cpu(getattr(last, k)) for k in last._defaults}
                extra = {"count": last._update_count, "cache": to_cpu(last._forward_cache)}
                out.append((rec.name, "metric", (names.get(id(last)), state, extra), rec.kwargs))
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
                state = {k: to_cpu(getattr(m, k)) for k in m._defaults}
                extra = {"count": m._update_count, "cache": to_cpu(m._forward_cache)}
                out.append((qualname, "state", (qualname, state, extra), {}))
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


def guard_layers(layers: Mapping[str, nn.Module], guard: Guard) -> list[Any]:
    """Make the given (owned) layers refuse direct calls while ``guard`` is active; returns the hook handles."""
    return [layer.register_forward_pre_hook(lambda _m, _a, n=name: guard.check(n)) for name, layer in layers.items()]


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
        if pipe.num_stages == 1:
            assert loss is not None and logs is not None
            return loss, logs
        buf = torch.zeros(self.CAPACITY, dtype=torch.float64, device=pipe.device)
        if pipe.is_last:
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
            if pipe.is_last:
                assert loss is not None and logs is not None
                return loss, logs
            assert self._spec is not None
            values = buf[2 : 2 + len(self._spec)].cpu()
            mirrored = [
                (name, "value", values[i].to(dtype), kwargs) for i, (name, kwargs, dtype) in enumerate(self._spec)
            ]
            return buf[1].float().cpu(), mirrored
        shared_loss, shared_logs = pipe.share((loss, logs) if pipe.is_last else None)
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
