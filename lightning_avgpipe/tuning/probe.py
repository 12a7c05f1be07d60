"""``StageProbe``: the one object through which the tuner measures a running strategy (no Lightning here).

The strategy builds it (``AvgPipeStrategy.probe``) from its controller and the few hooks only it can give: the
user's ``training_step`` as the loss, the module's inputs, the precision's forward context, how to drop what a
step logged and the metrics whose states a step changes. The tuner then asks it for three things: run steps of
this rank's stage at a setting (:meth:`setting`, :meth:`step`), give back the timings (each step's trace and the
collectives below) and put every state back (:meth:`held`). ``tuning/measure.py`` does the measuring with it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.optim import clone_optimizer
from lightning_avgpipe.config import PipelineConfig
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.controller import StepController
from lightning_avgpipe.runtime.pipeline import StagePipeline
from lightning_avgpipe.runtime.units import StepResult
from lightning_avgpipe.tuning.profiler import CopyOptimizer, Snapshot


@dataclass
class StageProbe:
    """This rank's stage, runnable at any (M, schedule) with replica 0 alone, and restorable.

    Args:
        controller: the stage's step and what steers it.
        loss: ``(output, micro-batch, share) -> loss``: the user's training step on the last stage.
        inputs: a micro-batch -> the first layer's input.
        forward_context: a context every forward runs in (the precision's autocast).
        after_step: drops what a probe step logged (the user's ``self.log`` calls).
        optimizer: the user's optimizer, which a copy of the stage's optimizer is cloned from.
        metrics: objects whose states a step changes and :meth:`held` puts back (torchmetrics).
    """

    controller: StepController
    loss: Callable[[Any, Any, float], Any]
    inputs: Callable[[Any], Any]
    forward_context: Callable[[], Any]
    after_step: Callable[[], object]
    optimizer: Optimizer
    metrics: Sequence[Any] = field(default_factory=list)

    @property
    def pipeline(self) -> StagePipeline:
        return self.controller.pipeline

    @property
    def config(self) -> PipelineConfig:
        return self.controller.config

    @property
    def topology(self) -> Topology:
        return self.pipeline.topology

    @property
    def device(self) -> torch.device:
        return self.pipeline.device

    @property
    def last_layer(self) -> nn.Module:
        """What this stage sends: the output of replica 0's last layer."""
        return self.pipeline.replicas.elastic.replicas[0][-1]

    # -- running -------------------------------------------------------------------------------------------------
    def setting(self, num_microbatches: int, schedule: str) -> StagePipeline:
        """The stage at ``num_microbatches`` under ``schedule``, replica 0 alone, k = 0 (same layers and link)."""
        return self.controller.variant(num_microbatches=num_microbatches, schedule=schedule, advance_forwards=0)

    def step(self, setting: StagePipeline, batch: Any, measure: bool, noise: bool, split: bool = False) -> StepResult:
        """One step of ``setting`` on ``batch`` from zero gradients; ``split`` defers the weight gradients (the
        split backward's W). Collective over the pipeline, like training's."""
        for p in self.pipeline.replicas.params:
            p.grad = None
        if split:
            with self.pipeline.deferring_weight_grads():
                result = self._run(setting, batch, False, False)
        else:
            result = self._run(setting, batch, measure, noise)
        self.after_step()
        return result

    def _run(self, setting: StagePipeline, batch: Any, measure: bool, noise: bool) -> StepResult:
        return setting.train_step(
            [batch],
            self.loss,
            inputs=self.inputs,
            forward_context=self.forward_context,
            measure=measure,
            noise=noise,
            key="avgpipe-tune",
        )

    @contextmanager
    def held(self, generators: Sequence[torch.Generator] = ()) -> Iterator[None]:
        """Put back on exit what probe steps change: gradients, buffers (of the replicas too), metric states and
        random states."""
        elastic = self.pipeline.replicas.elastic
        replicas = [m for layers in elastic.replicas for m in layers] if not elastic.trivial else []
        snap = Snapshot(self.pipeline.replicas.params, [*self.pipeline.layers, *replicas], self.metrics, generators)
        try:
            yield
        finally:
            snap.restore()

    def optimizer_copy(self) -> CopyOptimizer:
        """A fresh optimizer like the user's over copies of the stage's reference (it never touches the real one)."""
        user = getattr(self.optimizer, "user", self.optimizer)
        reference = self.pipeline.replicas.elastic.reference_params
        return CopyOptimizer(lambda ps: clone_optimizer(user, ps, reference), reference)

    # -- collectives ---------------------------------------------------------------------------------------------
    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank of the job."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def least(self, value: float) -> float:
        """The smallest ``value`` over every rank of the job."""
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return float(t[0])

    # -- the pipeline's collectives ------------------------------------------------------------------------------
    def max_over(self, values: Sequence[float]) -> list[float]:
        """The largest of each value over this pipeline's stages."""
        t = torch.tensor(list(values), dtype=torch.float64, device=self.device)
        if self.topology.num_stages > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.topology.pipeline_group)
        return [float(v) for v in t]

    def gather(self, mine: Any) -> list[Any]:
        """Every stage's ``mine``, in stage order."""
        if self.topology.num_stages == 1:
            return [mine]
        gathered: list[Any] = [None] * self.topology.num_stages
        dist.all_gather_object(gathered, mine, group=self.topology.pipeline_group)
        return gathered
