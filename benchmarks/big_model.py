"""Peak memory per rank of a model larger than one stage, against plain Lightning on one device in the same run.

The model: ``--layers`` blocks of ``Linear(width, width)`` + ``Tanh`` trained with Adam, built in ``__init__`` or in
``configure_model`` (under AvgPipe: on the meta device, each rank making only its own stages real). Each process
reports its peak resident memory (``VmHWM``, reset between phases through ``/proc/self/clear_refs``) above its
baseline after the imports, for each phase: the build and setup up to ``on_fit_start``, the training steps, and a
``trainer.save_checkpoint``; and the save's wall time. Printed as ratios to one device's figure of the same phase.

    python benchmarks/big_model.py                      # width 2048, 8 layers (128 MiB of weights), S = 2
    python benchmarks/big_model.py --width 4096 --stages 2 4

Linux only (``/proc``). Checkpoints still gather every stage to rank 0 (issue 32, part 4 is not done): the save
phase shows it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _status(field: str) -> int:
    """``VmHWM`` or ``VmRSS`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def worker(cfg: dict[str, Any]) -> None:
    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_avgpipe import AvgPipeStrategy

    torch.set_num_threads(1)
    width, layers, late = cfg["width"], cfg["layers"], cfg["late"]
    baseline = _status("VmRSS")
    _reset_peak()
    phases: dict[str, int] = {}

    def blocks() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    class Big(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not late:
                self.layers = blocks()

        def configure_model(self) -> None:
            if not hasattr(self, "layers"):
                self.layers = blocks()

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Phases(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            phases["build + setup"] = _status("VmHWM") - baseline
            _reset_peak()

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            phases["training"] = _status("VmHWM") - baseline
            _reset_peak()

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, width, generator=g), torch.randn(32, width, generator=g))
    strategy: Any = "auto" if cfg["devices"] == 1 else AvgPipeStrategy(num_microbatches=2, partition="parameters")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=cfg["devices"],
        strategy=strategy,
        max_steps=cfg["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[Phases()],
    )
    pl.seed_everything(0, verbose=False)
    trainer.fit(Big(), DataLoader(data, batch_size=8))
    start = time.perf_counter()
    trainer.save_checkpoint(Path(cfg["out"]) / "last.ckpt")
    save_s = time.perf_counter() - start
    phases["save"] = _status("VmHWM") - baseline
    result = {"rank": trainer.global_rank, "phases": phases, "save_s": save_s, "baseline": baseline}
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def run(devices: int, late: bool, args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.harness import launch_ranks

    out = tempfile.mkdtemp(prefix="big-model-")
    cfg = {"out": out, "devices": devices, "late": late, **{k: getattr(args, k) for k in ("width", "layers", "steps")}}
    results = launch_ranks([str(Path(__file__)), "--worker", json.dumps(cfg)], devices, timeout=1200)
    failed = [f"rank {r} exited {code}:\n{text[-2000:]}" for r, (code, text) in enumerate(results) if code != 0]
    if failed:
        raise RuntimeError("\n".join(failed))
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(devices)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(json.loads(args.worker))
        return
    mib = 1 << 20
    weights = args.layers * (args.width * args.width + args.width) * 4
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + Tanh, {weights / mib:.0f} MiB of weights, Adam")
    one = run(1, True, args)[0]
    print("\nphase peaks above each process's import baseline, MiB, and the ratio to one device's")
    print(f"{'run':34} {'rank':>4} " + " ".join(f"{p:>22}" for p in one["phases"]) + f" {'save s':>12}")

    def row(name: str, r: dict[str, Any]) -> None:
        peaks, ones = r["phases"], one["phases"]
        cells = [f"{peaks[p] / mib:8.0f} ({peaks[p] / max(ones[p], 1):5.2f}x)" for p in ones]
        save = f" {r['save_s']:5.1f} ({r['save_s'] / max(one['save_s'], 1e-9):.2f}x)"
        print(f"{name:34} {r['rank']:>4} " + " ".join(f"{c:>22}" for c in cells) + save)

    row("one device (configure_model)", one)
    for stages in args.stages:
        for late in (True, False):
            for r in run(stages, late, args):
                row(f"S={stages}, {'configure_model' if late else '__init__'}", r)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
