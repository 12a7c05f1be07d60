"""One rank of a Lightning run under AvgPipeStrategy, driven by a JSON argument; rank 0 writes results.json."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, DistributedSampler, Subset

from lightning_avgpipe import AvgPipeStrategy, AvgPipeTuner
from lightning_avgpipe.runtime.failures.shutdown import native_threads
from lightning_avgpipe.shards import is_dtensor, local
from tests.helpers.lit import AliasedNet, LateNet, PipeNet, dataset, loader
from tests.helpers.seqnet import SeqNet, seq_loader
from tests.helpers.tied import LateTiedLM, TiedLM, token_loader

# a Fault's kinds in the save of the checkpoint at its step: SIGSTOP before this rank writes its part of a folder,
# while it writes it, at the save's last wait, in the dump (before a single file's transfer), as it sends its first
# tensor of a single file, or as rank 0 writes the file; or a write ("slow_write": this rank's part of a folder,
# "slow_file": rank 0's file) that sleeps ``seconds`` first
SAVE_FAULTS = {
    *("stop_before_write", "stop_in_write", "stop_at_end", "stop_in_save", "stop_in_transfer", "stop_in_file"),
    *("slow_write", "slow_file"),
}


class Fault(pl.Callback):
    """Make one rank fail inside the pipeline at a given step: raise in, or SIGKILL, its first layer's forward."""

    def __init__(self, rank: int, step: int, kind: str, record: str | None = None, seconds: float = 0.0) -> None:
        self.rank, self.step, self.kind = rank, step, kind
        self.record = record  # kind "stop": a file that receives the moment it stopped (time.monotonic())
        self.handle: Any = None  # kind "inf_grad": the gradient hook of the step it is injected in
        self.seconds = seconds  # kinds "slow_*": how long the write sleeps

    def stop(self) -> None:
        """Freeze this process (SIGSTOP, never continued), the moment recorded first."""
        if self.record:
            Path(self.record).write_text(repr(time.monotonic()))
        os.kill(os.getpid(), signal.SIGSTOP)

    def in_save(self) -> None:
        """Arm a fault of :data:`SAVE_FAULTS` for this save."""
        import torch.distributed.checkpoint as dcp

        from lightning_avgpipe.plugin.checkpoint import sharded
        from lightning_avgpipe.runtime.files import save_waits, torchfile

        fault, kind = self, self.kind
        if kind == "stop_in_save":
            self.stop()
        elif kind == "stop_before_write":
            write_tensors = sharded.write_tensors

            def frozen_first(*args: Any, **kwargs: Any) -> None:
                fault.stop()
                write_tensors(*args, **kwargs)

            sharded.write_tensors = frozen_first  # type: ignore[assignment]
        elif kind in ("stop_in_write", "slow_write"):
            write_data = dcp.FileSystemWriter.write_data

            def write(writer: Any, *args: Any, **kwargs: Any) -> Any:
                dcp.FileSystemWriter.write_data = write_data  # type: ignore[method-assign]
                if kind == "slow_write":
                    time.sleep(fault.seconds)
                else:
                    fault.stop()
                return write_data(writer, *args, **kwargs)

            dcp.FileSystemWriter.write_data = write  # type: ignore[method-assign]
        elif kind == "stop_at_end":
            arrive = save_waits.SaveWaits.arrive

            def arrive_frozen(waits: Any, point: str, *args: Any) -> None:
                if point == "done":
                    fault.stop()
                arrive(waits, point, *args)

            save_waits.SaveWaits.arrive = arrive_frozen  # type: ignore[method-assign]
        elif kind in ("slow_file", "stop_in_file"):
            write_file = torchfile.write

            def slow(*args: Any, **kwargs: Any) -> None:
                torchfile.write = write_file
                if kind == "slow_file":
                    time.sleep(fault.seconds)
                else:
                    fault.stop()
                write_file(*args, **kwargs)

            torchfile.write = slow
        elif kind == "stop_in_transfer":
            isend = torch.distributed.isend

            def frozen_send(*args: Any, **kwargs: Any) -> Any:
                fault.stop()
                return isend(*args, **kwargs)

            torch.distributed.isend = frozen_send

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_rank != self.rank or trainer.global_step != self.step:
            return
        if self.kind == "kill_in_save" or self.kind in SAVE_FAULTS:
            return

        def fail(*_: Any) -> None:
            if self.kind == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.kind == "hang":  # alive but stuck, raising nothing
                time.sleep(3600)
            if self.kind == "stop":  # frozen from outside (SIGSTOP), never continued: no thread of it runs
                if self.record:
                    Path(self.record).write_text(repr(time.monotonic()))
                os.kill(os.getpid(), signal.SIGSTOP)
            raise RuntimeError(f"injected failure on rank {self.rank}")

        def nan(_: Any, args: Any) -> Any:
            return (args[0] * float("nan"),) if isinstance(args[0], torch.Tensor) else args

        strategy = trainer.strategy
        if self.kind == "inf_grad":  # an overflow in this stage's first weight's gradient, this step only
            weight = next(strategy.pipeline.layers[0].parameters())
            self.handle = weight.register_hook(lambda g: g * float("inf"))
            return
        firsts = {
            id(m): m
            for m in [
                strategy.pipeline.layers[0],
                *(layers[0] for layers in strategy.pipeline.replicas.elastic.replicas),
            ]
        }
        for layer in firsts.values():  # the reference and every replica's copy of this rank's first layer
            layer.register_forward_pre_hook(nan if self.kind == "nan" else fail)

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: Any) -> None:
        if self.kind in SAVE_FAULTS and trainer.global_rank == self.rank and trainer.global_step == self.step:
            self.in_save()
        if self.kind == "kill_in_save" and trainer.global_rank == self.rank:  # killed between a save's collectives
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "kill_in_write" and trainer.global_rank == self.rank and trainer.global_step == self.step:
            from lightning_avgpipe.plugin.checkpoint import sharded

            def killed(*args: Any) -> None:  # as it writes its part of a folder
                os.kill(os.getpid(), signal.SIGKILL)

            sharded.write_tensors = killed  # type: ignore[assignment]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


class FolderAt(pl.Callback):
    """Save a folder checkpoint (``save_distributed_checkpoint=True`` for this save) at ``dirpath / "step=N"`` after
    the optimizer step that makes the global step N, where ModelCheckpoint saves (beside a single file of it)."""

    def __init__(self, step: int, dirpath: Path) -> None:
        self.step, self.dirpath = step, dirpath

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            strategy: Any = trainer.strategy
            strategy.save_distributed_checkpoint = True
            try:
                trainer.save_checkpoint(self.dirpath / f"step={self.step}")
            finally:
                strategy.save_distributed_checkpoint = False


class ScaleRecorder(pl.Callback):
    """The loss scale after every optimizer step (``result["scales"]``)."""

    def __init__(self) -> None:
        self.scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.scales.append(float(trainer.precision_plugin.scaler.get_scale()))  # type: ignore[attr-defined]


class SetupFault(pl.Callback):
    """Make one rank fail during setup, after the process group is up (its neighbours wait in a collective)."""

    def __init__(self, rank: int, stall: float | None = None) -> None:
        self.rank = rank
        self.stall = stall  # seconds to sleep instead (a rank that does not arrive at the setup collectives)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if trainer.global_rank == self.rank:
            if self.stall is not None:
                time.sleep(self.stall)
                return
            raise ValueError(f"injected setup failure on rank {self.rank}")


class Recorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.finite: list[bool] = []
        self.labels: list[Any] | None = None
        self.held = (0, 0)  # at the end of training: the parameter elements this rank holds (whole, local shards)
        self.sharded: list[str] = []  # and the parameters it holds as tensor shards (DTensor)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        params = list(pl_module.parameters())
        self.held = (sum(p.numel() for p in params), sum(local(p).numel() for p in params))
        self.sharded = sorted(n for n, p in pl_module.named_parameters() if is_dtensor(p))

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.losses.append(float(outputs["loss"]) * trainer.accumulate_grad_batches)
        if self.labels is not None:  # the batches this rank read (every stage of a pipeline must read the same)
            self.labels.append(batch[1].tolist())
        # what a callback sees of the module between steps (a sharded reference is whole again here)
        self.finite.append(all(bool(torch.isfinite(local(p.detach())).all()) for p in pl_module.parameters()))


def group_loader(cfg: dict[str, Any], batch_size: int = 12) -> DataLoader:
    """Pipeline group d's batches: batches d, d + D, d + 2D, ... of the dataset in order (no shuffling).

    With D = 1 that is every batch in order, so N parallel pipelines in one group see exactly the batches that
    D groups of one pipeline each see (replica n <-> group n).
    """
    tp = cfg["strategy"].get("tensor_parallel_size", 1)
    stages = cfg["strategy"].get("num_stages") or cfg["devices"] // tp
    groups = cfg["devices"] // (stages * tp)
    d = int(os.environ.get("LOCAL_RANK", "0")) // (stages * tp)
    data = dataset()
    count = len(data) // batch_size
    indices = [i for b in range(d, count, groups) for i in range(b * batch_size, (b + 1) * batch_size)]
    return DataLoader(Subset(data, indices), batch_size=batch_size, shuffle=False)


def exit_probe(out: Path, who: dict[str, int]) -> None:
    """Registered first, so it runs last at exit: the native threads still alive when finalization starts."""
    if "rank" in who:
        (out / f"rank{who['rank']}.exit.json").write_text(json.dumps({"threads": native_threads()}))


def training_loader(cfg: dict[str, Any], bs: int, rec: Any, trainer_kwargs: dict[str, Any]) -> DataLoader:
    """The loader ``cfg`` asks for (in order, as one pipeline group reads it, unless told otherwise)."""
    train_loader = group_loader(cfg, bs) if cfg.get("group_data") else loader(bs)
    if cfg.get("tied"):
        train_loader = token_loader(bs)
    if cfg.get("seq"):
        train_loader = seq_loader(bs)
    if cfg.get("shuffle_default"):  # shuffle=True under Lightning's defaults, the ranks' global RNGs apart
        torch.manual_seed(1000 + int(os.environ.get("LOCAL_RANK", "0")))
        train_loader = DataLoader(dataset(), batch_size=bs, shuffle=True)
        rec.labels = []
    if cfg.get("resumable") is not None:  # shuffled by epoch: torchdata's StatefulDataLoader, or a plain one
        from torchdata.stateful_dataloader import StatefulDataLoader

        kind = StatefulDataLoader if cfg["resumable"] else DataLoader
        by_epoch = DistributedSampler(dataset(), num_replicas=1, rank=0, shuffle=True, seed=3)
        train_loader = kind(dataset(), batch_size=bs, sampler=by_epoch)
    if cfg.get("empty_batch") is not None:  # batch number cfg["empty_batch"] holds 0 samples
        x, y = next(iter(DataLoader(dataset(), batch_size=bs)))
        batches = [(x, y)] * 4
        batches[cfg["empty_batch"]] = (x[:0], y[:0])
        train_loader = DataLoader(batches, batch_size=None)
    if cfg.get("shuffle"):  # the order comes from torch's global RNG (the same seed on every rank)
        pl.seed_everything(cfg.get("seed", 0), verbose=False)
        trainer_kwargs["use_distributed_sampler"] = False
        train_loader = DataLoader(dataset(), batch_size=bs, shuffle=True)
    return train_loader


def record_made() -> list[int]:
    """The bytes each replay of a meta-device build on this rank made real and kept (``Materialized.kept_bytes``,
    what the setup line says for rank 0), recorded as the replay returns them."""
    from lightning_avgpipe.plugin.split import stages

    made: list[int] = []
    replay = stages.materialize

    def counted(*args: Any, **kwargs: Any) -> Any:
        report = replay(*args, **kwargs)
        made.append(report.kept_bytes)
        return report

    stages.materialize = counted  # type: ignore[assignment]
    return made


def count_full_tensor_in_saves(trainer: pl.Trainer) -> dict[str, int]:
    """Count the ``DTensor.full_tensor`` calls made inside ``trainer.save_checkpoint`` (every save: ModelCheckpoint's
    and the final one), and the saves."""
    from torch.distributed.tensor import DTensor

    counts = {"saves": 0, "calls": 0, "inside": 0}
    full_tensor, save = DTensor.full_tensor, trainer.save_checkpoint

    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["calls"] += counts["inside"]
        return full_tensor(self, *args, **kwargs)

    def saving(*args: Any, **kwargs: Any) -> Any:
        counts["saves"] += 1
        counts["inside"] = 1
        try:
            return save(*args, **kwargs)
        finally:
            counts["inside"] = 0

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    trainer.save_checkpoint = saving  # type: ignore[method-assign]
    return counts


def injected(cfg: dict[str, Any], out: Path) -> list[pl.Callback]:
    """The callbacks ``cfg`` asks for that act on the run: its faults, and a folder checkpoint at a step."""
    callbacks: list[pl.Callback] = []
    if cfg.get("fault"):
        callbacks.append(Fault(**cfg["fault"]))
    if cfg.get("folder_at"):
        callbacks.append(FolderAt(cfg["folder_at"], out / "folder"))
    if cfg.get("setup_fault"):
        callbacks.append(SetupFault(**cfg["setup_fault"]))
    return callbacks


def make_model(cfg: dict[str, Any]) -> pl.LightningModule:
    """The LightningModule ``cfg`` names (PipeNet unless told otherwise), built with ``cfg["model"]``."""
    late = cfg.get("late")
    tied = LateTiedLM if late else TiedLM
    kind = tied if cfg.get("tied") else AliasedNet if cfg.get("aliased") else LateNet if late else PipeNet
    if cfg.get("seq"):  # activations [batch, sequence, hidden], for the 2D and 2.5D grids
        kind = SeqNet
    return kind(**cfg.get("model", {}))  # type: ignore[no-any-return]


def main(cfg: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    out = Path(cfg["out"])
    who: dict[str, int] = {}
    atexit.register(exit_probe, out, who)
    if cfg.get("seed") is not None:  # the run's seed (seed_everything): what the layers' random streams derive from
        pl.seed_everything(cfg["seed"], verbose=False)
    model = make_model(cfg)
    if cfg.get("example_input"):  # lets partition="balanced" profile the layers
        model.example_input_array = torch.zeros(2, 8)
    rec = Recorder()
    made = record_made()
    trainer_kwargs = dict(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy="ddp" if cfg["strategy"] == "ddp" else AvgPipeStrategy(**cfg["strategy"]),
        max_steps=cfg["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[rec],
        num_sanity_val_steps=cfg.get("sanity", 0),
        limit_val_batches=cfg.get("limit_val_batches", 0),
        default_root_dir=str(out),
    )
    if cfg.get("monitor"):
        trainer_kwargs["enable_checkpointing"] = True
        trainer_kwargs["callbacks"].append(
            pl.callbacks.ModelCheckpoint(dirpath=out / "ckpts", monitor=cfg["monitor"], mode="max", save_top_k=1)
        )
    if cfg.get("every_n_train_steps"):
        trainer_kwargs["enable_checkpointing"] = True
        trainer_kwargs["callbacks"].append(
            pl.callbacks.ModelCheckpoint(
                dirpath=out / "every", every_n_train_steps=cfg["every_n_train_steps"], save_top_k=-1
            )
        )
    tuner = None
    if cfg.get("tuner") is not None:
        tuner = AvgPipeTuner(**cfg["tuner"])
        trainer_kwargs["callbacks"].append(tuner)
    trainer_kwargs["callbacks"] += injected(cfg, out)
    trainer_kwargs.update(cfg.get("trainer", {}))
    if cfg.get("fp16"):  # float16 autocast with a GradScaler on CPU (precision="16-mixed" maps to bf16 there)
        from lightning.pytorch.plugins.precision import MixedPrecision

        trainer_kwargs["plugins"] = [MixedPrecision("16-mixed", "cpu")]
        trainer_kwargs["callbacks"].append(ScaleRecorder())
    bs = cfg.get("batch_size", 12)
    if cfg.get("group_data"):
        trainer_kwargs["use_distributed_sampler"] = False
    train_loader = training_loader(cfg, bs, rec, trainer_kwargs)
    trainer = pl.Trainer(**trainer_kwargs)
    in_saves = count_full_tensor_in_saves(trainer) if cfg.get("count_full_tensor") else None
    trainer.fit(
        model, train_loader, loader(bs) if cfg.get("limit_val_batches") else None, ckpt_path=cfg.get("ckpt_path")
    )
    trainer.save_checkpoint(out / "final.ckpt")
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    preds = trainer.predict(model, loader(bs)) if cfg.get("predict") else None
    # what could still run at interpreter exit (a daemon thread inside a C++ call there aborts the process)
    threads = sorted(t.name for t in threading.enumerate() if t is not threading.main_thread())
    try:  # after the run: rank 0's module is the whole trained model; one holding placeholders refuses
        whole = model.state_dict()
        after_run = "whole"
        torch.save(whole, out / f"after_run{trainer.global_rank}.pt")
    except Exception as err:  # noqa: BLE001 - its type is the result
        after_run = type(err).__name__
    result = {
        "after_run": after_run,
        "parameters": rec.held[0],  # what this rank holds (a placeholder holds none)
        "local_parameters": rec.held[1],
        "threads": threads,
        "losses": rec.losses,
        "labels": rec.labels,
        "finite_between_steps": rec.finite,
        "metrics": metrics,
        "rank": trainer.global_rank,
        "preds": torch.cat(preds).tolist() if preds else None,
    }
    if in_saves is not None:
        result["full_tensor_in_saves"] = in_saves
    result["made"] = made  # a model built without memory: the bytes this rank's replay of its build made real
    scales = [c for c in trainer.callbacks if isinstance(c, ScaleRecorder)]  # type: ignore[attr-defined]
    if scales:
        result["scales"] = scales[0].scales
    strategy = trainer.strategy
    loader_seen = trainer.train_dataloader
    result["sampler"] = type(getattr(loader_seen, "sampler", None)).__name__  # what Lightning left on the loader
    if isinstance(strategy, AvgPipeStrategy):
        result["setting"] = [strategy.pipeline.num_microbatches, strategy.config.num_pipelines]
        result["averaging"] = strategy.config.averaging
        result["schedule"] = strategy.config.schedule
        top = strategy.topology
        result["environment"] = type(strategy.cluster_environment).__name__
        result["optimizer"] = type(strategy.optimizers[0]).__name__
        # the optimizer state's elements this rank holds (tensors beyond a scalar step count)
        states = trainer.optimizers[0].state.values()
        result["optimizer_elements"] = sum(
            v.numel() for st in states for v in st.values() if torch.is_tensor(v) and v.dim()
        )
        result["averaging_class"] = type(strategy.pipeline.replicas.elastic).__name__
        # where this rank sits: (node, pipeline group, stage, tensor shard), and its tensor group's global ranks
        result["place"] = [trainer.node_rank, top.group_index, top.stage, top.tensor_rank, top.tensor_ranks]
        # tensor parallelism: the parameters this rank holds as shards (DTensor)
        result["sharded"] = rec.sharded
    else:  # strategy="ddp": Adam's step count on this rank (a resume must carry it on)
        result["optimizer_steps"] = sorted({int(s["step"]) for s in trainer.optimizers[0].state.values()})
        torch.distributed.destroy_process_group()  # Lightning leaves gloo's groups to exit; a DDP user ends them
    if tuner is not None:
        result["tuner"] = {
            "choice": tuner.choice.to_dict() if tuner.choice is not None else None,
            "profile": tuner.profile.to_dict() if tuner.profile is not None else None,
            "files": {k: str(v) for k, v in tuner.files.items()},
            "seconds": tuner.seconds,
            "decisions": tuner.decisions,
        }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))
    who["rank"] = trainer.global_rank  # ends as a user's script does: the strategy closes its process groups at exit


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
