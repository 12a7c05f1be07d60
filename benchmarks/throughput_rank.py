"""One rank of the throughput benchmark (``benchmarks/throughput.py``): every row's steps interleaved with the
compute probes, the ``Trainer.fit`` rounds, the single-process AvgPipe reference, and the launch of the ranks."""

from __future__ import annotations

import argparse
import copy
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.common import apply_layers as _apply
from benchmarks.common import lm_loss as _ce
from benchmarks.common import make_batches
from benchmarks.throughput_rows import (
    AVG_PREFIX,
    PROBES,
    WORLD,
    PipeRow,
    Row,
    SingleRow,
    TorchChunkRow,
    TorchRow,
    _adamw,
    measured_costs,
    row_names,
    v_chunks,
)
from examples.gpt_args import model_sizes
from tests.helpers.harness import run_distributed


def elastic_reference(
    base: list[nn.Module], n: int, steps: int, args: argparse.Namespace, batches: list[tuple[Tensor, Tensor]]
) -> list[float]:
    """AvgPipe in one process (as ``tests/helpers/lit.py::reference_elastic``): the per-step mean-over-replicas loss.

    The whole model, N replicas each on its own consecutive batch with gradient accumulation over the same
    micro-batches, one AdamW clone per replica, then the elastic update.
    """
    from lightning_avgpipe.algorithms import microbatch
    from lightning_avgpipe.algorithms.elastic import ElasticAveraging
    from lightning_avgpipe.algorithms.optim import clone_optimizer

    elastic = ElasticAveraging(copy.deepcopy(base), n)
    user = _adamw(elastic.reference_params, args)
    opts = [clone_optimizer(user, elastic.replica_params(r), elastic.reference_params) for r in range(n)]
    losses = []
    for i in range(steps):
        total = torch.zeros(())
        for r in range(n):
            x, y = batches[i * n + r]
            opts[r].zero_grad(set_to_none=True)
            for mx, my in microbatch.split((x, y), args.microbatches):
                loss = _ce(_apply(elastic.replicas[r], mx), my) * (len(my) / len(y))
                loss.backward()
                total += loss.detach()
        elastic.begin_step()
        for opt in opts:
            opt.step()
        elastic.finish_step()
        losses.append(float(total) / n)
    return losses


class ElasticProbe:
    """The elastic update alone: ``begin_step()`` + ``finish_step()`` on a private N-replica copy of this stage."""

    def __init__(self, layers: list[nn.Module], n: int) -> None:
        from lightning_avgpipe.algorithms.elastic import ElasticAveraging

        self.elastic = ElasticAveraging(copy.deepcopy(layers), n)

    def run(self) -> float:
        t0 = time.perf_counter()
        self.elastic.begin_step()
        self.elastic.finish_step()
        return time.perf_counter() - t0


class Probe:
    """This rank's stage compute alone: forward+backward of all micro-batches, then AdamW, no communication."""

    def __init__(
        self,
        layers: list[nn.Module],
        start: int,
        count: int,
        rank: int,
        args: argparse.Namespace,
        batch: tuple[Tensor, Tensor],
    ) -> None:
        self.own = copy.deepcopy(layers[start : start + count])
        self.opt = _adamw([p for layer in self.own for p in layer.parameters()], args)
        self.is_first, self.is_last = rank == 0, rank == WORLD - 1
        x, y = batch
        self.targets = list(torch.tensor_split(y, args.microbatches))
        self.scale = 1.0 / args.microbatches
        with torch.no_grad():  # the stage's real inputs, computed by the upstream layers of the (untrained) model
            self.inputs = [_apply(layers[:start], mx) for mx in torch.tensor_split(x, args.microbatches)]
            outs = [_apply(self.own, inp) for inp in self.inputs]
        g = torch.Generator().manual_seed(args.seed + 7)
        self.out_grads = [torch.randn(o.shape, generator=g) * 1e-3 for o in outs]

    def run(self) -> tuple[float, float]:
        """Seconds of forward+backward over all micro-batches, and of the optimizer step."""
        t0 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        for u, inp in enumerate(self.inputs):
            if not self.is_first:
                inp = inp.detach().requires_grad_(True)  # the pipeline computes the input gradient to send back
            out = _apply(self.own, inp)
            if self.is_last:
                (_ce(out, self.targets[u]) * self.scale).backward()
            else:
                out.backward(self.out_grads[u])
        t1 = time.perf_counter()
        self.opt.step()
        return t1 - t0, time.perf_counter() - t1


def _fit_module(layers: list[nn.Module], args: argparse.Namespace) -> Any:
    """The same model as a user's LightningModule (the pipeline contract, a logged loss, AdamW)."""
    import lightning.pytorch as pl

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(*layers)

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: Tensor) -> Tensor:
            return self.layers(x)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            loss = _ce(self(batch[0]), batch[1])
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return _adamw(list(self.parameters()), args)

    return Net()


def fit_round(
    base: list[nn.Module],
    rank: int,
    args: argparse.Namespace,
    batches: list[tuple[Tensor, Tensor]],
    logdir: Path,
    row: Row,
) -> tuple[list[float], list[float]]:
    """One ``Trainer.fit`` under ``strategy="avgpipe"`` (1F1B, the rows' partition, a CSV logger every 50 steps), with
    one step of the runtime ``row`` run between every two of its iterations (from ``on_train_batch_start``).

    Returns, per iteration after the warm-up, the seconds of Lightning's whole iteration (hooks, the step, the
    optimizer, logging, fetching the next batch) and of the runtime step before it, each from a barrier to a barrier:
    the pair ran at the same moment, so load on a shared machine hits both alike.
    """
    import lightning.pytorch as pl

    from lightning_avgpipe import AvgPipeStrategy

    fit_starts: list[float] = []  # after the runtime step: Lightning's iteration begins
    fit_ends: list[float] = []  # at the next training-batch start: the iteration (and the next batch's fetch) is over
    runtime: list[float] = []

    class Interleave(pl.Callback):
        """At every training-batch start: a barrier (the previous iteration is over on both ranks), one runtime step,
        a barrier (it is over on both ranks). Each segment then costs what its slowest rank took."""

        def on_train_batch_start(self, *_: Any) -> None:
            dist.barrier()
            t0 = time.perf_counter()
            fit_ends.append(t0)
            row.step(len(runtime))
            dist.barrier()
            t1 = time.perf_counter()
            runtime.append(t1 - t0)
            fit_starts.append(t1)

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(WORLD))  # ranks made by this benchmark
    total = args.warmup + args.steps + 1
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=WORLD,
        max_steps=total,
        logger=pl.loggers.CSVLogger(logdir),
        log_every_n_steps=50,
        strategy=AvgPipeStrategy(num_microbatches=args.microbatches, partition=list(args.partition), schedule="1f1b"),
        callbacks=[Interleave()],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
        num_sanity_val_steps=0,
    )
    loader = torch.utils.data.DataLoader(batches[:total], batch_size=None)
    trainer.fit(_fit_module(copy.deepcopy(base), args), loader)
    w = args.warmup
    fit = [end - start for start, end in zip(fit_starts[w:], fit_ends[w + 1 :])]
    return fit, runtime[w : w + len(fit)]


def rank_main(rank: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    from examples.char_gpt import GPTConfig, gpt_layers

    cfg = GPTConfig(vocab_size=vocab_size, **model_sizes(args), dropout=0.0)
    torch.manual_seed(args.seed)
    base = list(gpt_layers(cfg))  # identical on every rank: same seed, same construction order
    total = args.warmup + args.steps
    # batch i is the other rows' step i; avgpipe-N's step i takes batches i*N .. i*N + N-1 (the same first `total`)
    batches = make_batches(
        data, args.block_size, args.batch_size, (total + 1) * max([1, *args.pipelines]), args.seed + 1
    )
    start, count = sum(args.partition[:rank]), args.partition[rank]

    def own_copy() -> list[nn.Module]:
        return copy.deepcopy(base)[start : start + count]

    def chunked(placement: str) -> tuple[list[nn.Module], list[int]]:
        return v_chunks(copy.deepcopy(base), rank, placement)

    v_own, v_sizes = chunked("v")
    loop_own, loop_sizes = chunked("loop")
    costs = measured_costs(v_own, v_sizes, rank, args, batches[0])
    rows: dict[str, Row] = {
        "ours-1f1b": PipeRow("1f1b", 1, own_copy(), rank, args, batches),
        "ours-afab": PipeRow("afab", 1, own_copy(), rank, args, batches),
        "ours-zbh1": PipeRow("zbh1", 1, own_copy(), rank, args, batches),
        "ours-zbv": PipeRow("zbv", 1, v_own, rank, args, batches, v_sizes),
        "ours-zbv-placed": PipeRow("zbv", 1, chunked("v")[0], rank, args, batches, v_sizes, costs),
        "ours-interleaved": PipeRow("interleaved", 1, loop_own, rank, args, batches, loop_sizes),
        "torch-1f1b": TorchRow("1f1b", own_copy(), rank, args, batches),
        "torch-gpipe": TorchRow("gpipe", own_copy(), rank, args, batches),
        "torch-interleaved": TorchChunkRow("interleaved", *chunked("loop"), rank, args, batches),
        "torch-interleaved-zb": TorchChunkRow("interleaved-zb", *chunked("loop"), rank, args, batches),
        "torch-zbv": TorchChunkRow("zbv", *chunked("v"), rank, args, batches),
        "single": SingleRow(copy.deepcopy(base), rank, args, batches),
    }
    for n in args.pipelines:
        rows[f"{AVG_PREFIX}{n}"] = PipeRow("1f1b", n, own_copy(), rank, args, batches)
    probe = Probe(base, start, count, rank, args, batches[0])
    elastic_probes = {n: ElasticProbe(base[start : start + count], n) for n in args.pipelines if n > 1}

    all_rows = row_names(args)
    times: dict[str, list[float]] = {name: [] for name in all_rows}
    probe_times: dict[str, list[tuple[float, float]]] = {"solo": [], "both": []}
    elastic_times: dict[int, list[float]] = {n: [] for n in elastic_probes}
    losses: dict[str, list[float | None]] = {name: [] for name in all_rows}
    # `single` runs last among the rows, followed by the probes: the original rows keep the neighbours they had before
    # the avgpipe rows existed, and no pipeline row starts right after one rank idled through a single-process step
    names = [*(name for name in all_rows if name != "single"), "single", *PROBES]
    for i in range(total):
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:  # rotate so no row always runs right after the same one
            dist.barrier()
            t0 = time.perf_counter()
            if name == "probe-both":
                probe_times["both"].append(probe.run())
                continue
            if name.startswith("probe-solo-"):
                if name == f"probe-solo-{rank}":
                    probe_times["solo"].append(probe.run())
                    for n, ep in elastic_probes.items():
                        elastic_times[n].append(ep.run())
                continue
            rows[name].step(i)
            times[name].append(time.perf_counter() - t0)
            losses[name].append(rows[name].loss())
    dist.barrier()
    # Trainer.fit against the runtime it calls, paired step by step: one runtime step between two fit iterations
    fit_times: list[list[float]] = []
    runtime_times: list[list[float]] = []
    if args.fit_rounds:
        import tempfile

        with tempfile.TemporaryDirectory() as logdir:
            for _ in range(args.fit_rounds):
                dist.barrier()
                row = PipeRow("1f1b", 1, own_copy(), rank, args, batches)
                fit_s, runtime_s = fit_round(base, rank, args, batches, Path(logdir), row)
                fit_times.append(fit_s)
                runtime_times.append(runtime_s)
    dist.barrier()

    # ours-1f1b vs torch-1f1b: the same stage, trained by two runtimes from the same weights on the same data
    ours = rows["ours-1f1b"].pipe.reference_params  # type: ignore[attr-defined]
    theirs = list(rows["torch-1f1b"].module.parameters())  # type: ignore[attr-defined]
    with torch.no_grad():
        diff = max((float((a - b).abs().max()) for a, b in zip(ours, theirs, strict=True)), default=0.0)
    # single-process AvgPipe over the first steps, for the avgpipe rows' loss check (rank 0; the other rank waits)
    check_steps = min(args.check_steps, total)
    reference = {n: elastic_reference(base, n, check_steps, args, batches) for n in args.pipelines} if rank == 0 else {}
    parts = {name: row.parts for name, row in rows.items() if name.startswith(AVG_PREFIX)}  # type: ignore[attr-defined]
    dist.barrier()
    return {
        "rank": rank,
        "times": times,
        "probe": probe_times,
        "losses": losses,
        "param_diff": diff,
        "elastic_probe": elastic_times,
        "avgpipe_parts": parts,
        "elastic_reference": reference,
        "fit_rounds": fit_times,
        "runtime_rounds": runtime_times,
    }


def _rank(rank: int, world: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    return rank_main(rank, args, data, vocab_size)


def launch(args: argparse.Namespace, data: Tensor, vocab_size: int) -> list[dict[str, Any]]:
    """``rank_main`` on WORLD gloo ranks, 1 thread each; every rank is killed after ``--timeout`` seconds."""
    return run_distributed(_rank, WORLD, args, data, vocab_size, timeout=args.timeout, what="throughput benchmark")
