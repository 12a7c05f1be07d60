"""The convergence benchmark's pipelined step time of each method (``benchmarks/convergence.py``): StagePipeline
(the strategy's step), 1F1B, on 2 gloo ranks."""

from __future__ import annotations

import copy
import multiprocessing as mp
import statistics
import time
from typing import Any

import torch
from torch import Tensor

from benchmarks.convergence_studies import METHODS, SPECS, Data, Study, data_for
from tests.helpers.harness import run_distributed

PIPE_WORLD = 2


def _pipe_rank(rank: int, study: Study, n: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    data = data_for(study)
    layers = list(data.model(0))
    cut = -(-len(layers) // 2)  # the first half of the layers (rounded up) on stage 0
    own = layers[:cut] if rank == 0 else layers[cut:]
    b = study.batch
    g = torch.Generator().manual_seed(1)

    def batch(size: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, len(data.x), (size,), generator=g)
        return data.x[idx], data.y[idx]

    def loss(out: Tensor, micro: tuple[Tensor, Tensor], share: float) -> Tensor:
        return Data.loss(out, micro[1])

    class Config:
        """One method's StagePipeline step (what the strategy runs), 1F1B, then the optimizer it wraps."""

        def __init__(self, method: str) -> None:
            spec = SPECS[method]
            self.method = method
            self.replicas = 1 if spec.kind == "plain-B" else n  # batches per step (exact: one model, N batches)
            cfg = PipelineConfig(
                num_microbatches=m,
                num_pipelines=self.replicas,
                sync_reference=True,
                partition=[cut, len(layers) - cut],
                **spec.strategy_options(),
            )
            self.pipe = StagePipeline(copy.deepcopy(own), Topology(rank, PIPE_WORLD, PIPE_WORLD), cfg)
            self.opt = self.pipe.optimizer(data.optimizer(self.pipe.reference_params, study.lr_center))

        def step(self) -> None:
            batches = [batch(b) for _ in range(self.replicas)]
            self.opt.zero_grad(set_to_none=True)
            self.pipe.train_step(batches, loss)
            self.opt.step()

    configs = {name: Config(name) for name in METHODS}
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for i in range(warmup + steps):
        shift = i % len(METHODS)
        for name in METHODS[shift:] + METHODS[:shift]:  # interleaved, rotating: load bursts hit every row alike
            dist.barrier()
            t0 = time.perf_counter()
            configs[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    dist.barrier()
    return times


def _pipe_entry(rank: int, world: int, study: Study, n: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    return _pipe_rank(rank, study, n, m, steps, warmup)


def measure_pipeline(study: Study, n: int, m: int, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """Median training-step seconds of each method's configuration, run by the real runtime on 2 gloo ranks."""
    got = run_distributed(
        _pipe_entry,
        PIPE_WORLD,
        study,
        n,
        m,
        steps,
        warmup,
        timeout=timeout,
        start_method="fork" if "fork" in mp.get_all_start_methods() else "spawn",
        what="pipeline timing",
    )
    out = {}
    for name in METHODS:
        per_step = [max(got[r][name][i] for r in range(PIPE_WORLD)) for i in range(steps)]  # the slowest rank's
        period = SPECS[name].period
        whole = per_step[: len(per_step) // period * period] or per_step
        out[name] = {
            # with a period H the averaging runs every H steps: the mean over whole periods counts it once per H
            "step_s": statistics.median(per_step) if period == 1 else statistics.fmean(whole),
            "step_s_median": statistics.median(per_step),
            "step_s_min": min(per_step),
            "step_s_max": max(per_step),
            "microbatches": m if name == "pipe-B" else n * m,
            "microbatch_size": study.batch // m,
        }
    return out
