"""LightningCLI with lightning_avgpipe imported first, so ``--trainer.strategy avgpipe`` resolves; and ``tune``."""

from __future__ import annotations

import argparse
from typing import Any

from lightning.pytorch.cli import LightningCLI

import lightning_avgpipe  # registers strategy="avgpipe"
from lightning_avgpipe.plugin import compat
from lightning_avgpipe.tuning.cli import int_list


class AvgPipeCLI(LightningCLI):
    """LightningCLI that gives each CPU stage process its share of the cores before the model is built.

    Without it every process Lightning starts begins with torch's thread pool over all cores
    (``lightning_avgpipe.share_cpu_threads``; measured: the char GPT at 5.9 it/s against 9.2 it/s on 2 cores).
    """

    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand) if self.subcommand else self.config
        trainer = (config or {}).get("trainer") or {}
        devices, accelerator = trainer.get("devices"), trainer.get("accelerator")
        if accelerator == "cpu" and isinstance(devices, int) and devices > 0:
            lightning_avgpipe.share_cpu_threads(devices)


def cli_main(args: list[str] | None = None, **kwargs: Any) -> LightningCLI:
    """Run LightningCLI over any LightningModule / LightningDataModule given by class path in a config or flags."""
    kwargs.setdefault("save_config_kwargs", {"overwrite": True})
    return AvgPipeCLI(args=args, **kwargs)


def tune_main(argv: list[str]) -> int:
    """``python -m lightning_avgpipe tune --config cfg.yaml``: profile, print the table and the choice; no training.

    The config is the one ``fit`` takes (trainer with ``strategy: avgpipe``, model, data). The tuner runs exactly
    as ``AvgPipeTuner`` does before ``fit`` trains (``apply=False``), then the run stops before the first step.
    """
    from lightning_avgpipe.plugin.strategy import AvgPipeStrategy
    from lightning_avgpipe.plugin.tuner import AvgPipeTuner
    from lightning_avgpipe.schedules.generate import reads_k

    p = argparse.ArgumentParser(
        prog="python -m lightning_avgpipe tune",
        description="Profile one setting and print the predicted table of (micro-batches, pipelines) without "
        "training. Other arguments (--config cfg.yaml, --trainer.*, --model.*, --data.*) go to LightningCLI.",
    )
    p.add_argument("--memory-limit-mb", type=float, default=None, help="MiB a stage may hold at its peak")
    p.add_argument(
        "--num-pipelines", type=int_list, default=None, help="largest N (one int) or the N values (comma list)"
    )
    p.add_argument(
        "--num-microbatches", type=int_list, default=None, help="M values to consider (comma list of divisors of B)"
    )
    p.add_argument("--profile-steps", type=int, default=3, help="timed pipeline steps per profiled size")
    p.add_argument("--output-dir", default=None, help="where tuning.json and tuning.png go")
    ours, rest = p.parse_known_args(argv)
    if ours.memory_limit_mb is not None and not ours.memory_limit_mb > 0:
        p.error(f"--memory-limit-mb {ours.memory_limit_mb}: must be a positive number of MiB")
    if ours.profile_steps < 1:
        p.error(f"--profile-steps {ours.profile_steps}: must be at least 1 (timed steps per profiled size)")
    pipelines = ours.num_pipelines
    cli = AvgPipeCLI(args=rest, run=False, save_config_callback=None)
    trainer = cli.trainer
    if not isinstance(trainer.strategy, AvgPipeStrategy):
        p.error(
            f"the config's trainer.strategy is {type(trainer.strategy).__name__}; tune needs strategy 'avgpipe' "
            "(trainer: strategy: avgpipe, or class_path: lightning_avgpipe.AvgPipeStrategy)"
        )
    tuner = next((c for c in trainer.callbacks if isinstance(c, AvgPipeTuner)), None)  # type: ignore[attr-defined]
    if tuner is None:
        tuner = AvgPipeTuner()
        trainer.callbacks.append(tuner)  # type: ignore[attr-defined]
    if ours.memory_limit_mb is not None:
        tuner.memory_limit = ours.memory_limit_mb * 2**20
    if pipelines is not None:
        tuner.num_pipelines = pipelines[0] if len(pipelines) == 1 else pipelines
    m = ours.num_microbatches
    if m is not None:
        tuner.num_microbatches = m
    tuner.profile_steps = ours.profile_steps
    if ours.output_dir is not None:
        tuner.output_dir = ours.output_dir
    tuner.apply = False
    tuner.log_table = False  # printed below, once
    tuner.retune_every_n_steps = None  # a retune applies decisions while training; tune only reports the first
    compat.stop_before_training(trainer)  # on_fit_start (the tuner) runs; no training step does
    trainer.num_sanity_val_steps = 0
    trainer.fit(cli.model, datamodule=cli.datamodule)
    if trainer.is_global_zero and tuner.table is not None and tuner.choice is not None:
        c = tuner.choice
        flags = (
            f"--trainer.strategy.init_args.num_microbatches {c.num_microbatches} "
            f"--trainer.strategy.init_args.num_pipelines {c.num_pipelines}"
        )
        if c.schedule != tuner.table.schedule:  # the backward split weighed on or off
            flags += f" --trainer.strategy.init_args.schedule {c.schedule}"
        if reads_k(c.schedule):
            flags += f" --trainer.strategy.init_args.advance_forwards {c.advance_forwards}"
        print(tuner.table.format())
        print(
            f"plan: num_microbatches={c.num_microbatches} num_pipelines={c.num_pipelines} schedule={c.schedule}"
            + (f" advance_forwards={c.advance_forwards}" if reads_k(c.schedule) else "")
            + f": predicted {c.step_time * 1e3:.1f} ms per iteration, {c.samples_per_sec:.1f} samples/s, peak "
            + "/".join(f"{b / 2**20:.1f}" for b in c.peak_bytes)
            + " MiB per stage"
        )
        print(f"to train with it: python -m lightning_avgpipe fit {' '.join(rest)} {flags}")
        print("(tune stopped before the first training step)")
        for kind, path in tuner.files.items():
            print(f"{kind}: {path}")
    return 0
