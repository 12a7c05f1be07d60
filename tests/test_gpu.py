"""On a CUDA device (marked ``gpu``; skipped without one): the strategy on one GPU against plain Lightning on it,
bf16 and 16-mixed, CUDA memory statistics, activation checkpointing's effect on CUDA memory, an NCCL group, and the
new schedules (the backward split, two stages on one rank) against 1F1B on CUDA.

Run them with ``python benchmarks/gpu_check.py`` (or ``pytest -m gpu``) on a machine with a GPU. A one-GPU
machine cannot run a multi-rank NCCL pipeline (NCCL needs one device per rank), so the multi-rank paths stay tested
on gloo only.
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_avgpipe import AvgPipeStrategy
from tests.helpers.lit import PipeNet, loader, quiet_trainer

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 4


def _fit(root: Path, strategy: Any = None, precision: str = "32-true", **kw: Any) -> tuple[Any, PipeNet]:
    torch.manual_seed(0)
    model = PipeNet(optimizer="adam", lr=0.01)
    trainer = quiet_trainer(
        root,
        accelerator="cuda",
        devices=1,
        max_steps=STEPS,
        precision=precision,
        use_distributed_sampler=False,
        enable_checkpointing=False,
        **({"strategy": strategy} if strategy is not None else {}),
        **kw,
    )
    trainer.fit(model, loader())
    return trainer, model


def _close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], **tol: Any) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key].float().cpu(), b[key].float().cpu(), msg=lambda m, k=key: f"{k}: {m}", **tol)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_one_stage_on_a_gpu_trains_as_plain_lightning(tmp_path: Path, precision: str) -> None:
    """S = 1, M = 1 on CUDA: the same weights as plain Lightning on the same GPU (32-bit and bf16 autocast)."""
    _, plain = _fit(tmp_path / "plain", precision=precision)
    _, piped = _fit(tmp_path / "piped", AvgPipeStrategy(num_microbatches=1), precision=precision)
    tol = {} if precision == "32-true" else {"rtol": 2e-2, "atol": 2e-3}
    _close(piped.state_dict(), plain.state_dict(), **tol)
    assert next(piped.parameters()).is_cuda


def test_16_mixed_on_a_gpu_uses_one_scaler(tmp_path: Path) -> None:
    """float16 autocast with CUDA's GradScaler through PipelineMixedPrecision: trains as plain Lightning's 16-mixed."""
    plain_trainer, plain = _fit(tmp_path / "plain", precision="16-mixed")
    trainer, piped = _fit(tmp_path / "piped", AvgPipeStrategy(num_microbatches=1), precision="16-mixed")
    assert type(trainer.precision_plugin).__name__ == "PipelineMixedPrecision"
    assert trainer.precision_plugin.scaler.get_scale() == plain_trainer.precision_plugin.scaler.get_scale()
    _close(piped.state_dict(), plain.state_dict(), rtol=1e-3, atol=1e-4)


def test_cuda_memory_is_logged_from_cuda_statistics(tmp_path: Path) -> None:
    """``avgpipe/peak_memory_mb/stage0`` comes from ``torch.cuda.max_memory_allocated`` on a GPU: above the
    weights' size, below the device's memory."""
    from lightning.pytorch.loggers import CSVLogger

    trainer, model = _fit(
        tmp_path, AvgPipeStrategy(num_microbatches=2), logger=CSVLogger(tmp_path), log_every_n_steps=1
    )
    peak = float(trainer.callback_metrics["avgpipe/peak_memory_mb/stage0"])
    weights = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    total = torch.cuda.get_device_properties(0).total_memory / 2**20
    assert weights < peak < total


def test_activation_checkpointing_lowers_cuda_memory() -> None:
    """One stage of wide MLP blocks on CUDA: checkpointing every block lowers ``max_memory_allocated`` during the
    step, and the weights after it are bit-identical."""
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    device = torch.device("cuda")
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)) for _ in range(8)]
    batch = (torch.randn(256, 1024, device=device), torch.randn(256, 1024, device=device))
    peaks, weights = [], []
    for ac in (False, True):
        layers = [copy.deepcopy(b).to(device) for b in blocks]
        pipe = StagePipeline(
            layers, Topology(0, 1, 1), PipelineConfig(num_microbatches=2, activation_checkpointing=ac), device
        )
        opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.01))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        pipe.train_step([batch], lambda out, b, share: F.mse_loss(out, b[1]))
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated(device) - base)
        opt.step()
        weights.append([p.detach().clone() for p in pipe.reference_params])
    assert peaks[1] < 0.7 * peaks[0], peaks
    for a, b in zip(*weights):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_an_nccl_group_reduces_on_the_gpu() -> None:
    """NCCL initialises on this machine and all-reduces a CUDA tensor (world size 1: one GPU)."""
    import torch.distributed as dist

    from tests.helpers.distributed import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    try:
        t = torch.ones(4, device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        assert t.tolist() == [1.0] * 4
    finally:
        dist.destroy_process_group()


def _one_rank_schedules(device: torch.device, dtype: torch.dtype | None) -> dict[str, list[torch.Tensor]]:
    """Two SGD steps of 8 MLP blocks on one rank under each schedule (S = 1; the chunked ones as 2 stages on it);
    ``dtype``: autocast's (the deferred weight gradients then use its casts)."""
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(256, 512), nn.GELU(), nn.Linear(512, 256)) for _ in range(8)]
    batches = [(torch.randn(64, 256, device=device), torch.randn(64, 256, device=device)) for _ in range(2)]
    out = {}
    for schedule in ("1f1b", "zbh1", "interleaved", "zbv"):
        chunked = schedule in ("interleaved", "zbv")
        cfg = PipelineConfig(num_microbatches=4, schedule=schedule, stages_per_rank=2 if chunked else None)
        layers = [copy.deepcopy(b).to(device) for b in blocks]
        pipe = StagePipeline(layers, Topology(0, 1, 1), cfg, device, chunks=[4, 4] if chunked else None)
        opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.05))

        def context() -> Any:
            return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()

        for batch in batches:
            opt.zero_grad()
            pipe.train_step([batch], lambda o, b, share: F.mse_loss(o.float(), b[1]), forward_context=context)
            opt.step()
        out[schedule] = [p.detach().clone() for p in pipe.reference_params]
    return out


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_the_new_schedules_train_as_1f1b_on_a_gpu(dtype: torch.dtype | None) -> None:
    """The backward split (deferred weight gradients on CUDA tensors, under bf16 autocast too) and two stages on one
    rank train as 1F1B does: the same weights after two steps."""
    weights = _one_rank_schedules(torch.device("cuda"), dtype)
    tol = {} if dtype is None else {"rtol": 2e-2, "atol": 2e-3}
    for schedule in ("zbh1", "interleaved", "zbv"):
        for a, b in zip(weights[schedule], weights["1f1b"]):
            torch.testing.assert_close(a, b, msg=lambda m, s=schedule: f"{s}: {m}", **tol)
