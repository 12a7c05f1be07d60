"""Soak run: thousands of tiny pipelined steps under Lightning; resident memory of every rank must stay flat.

    python benchmarks/soak.py                 # 3000 steps, 2 ranks, N = 2 parallel pipelines
    python benchmarks/soak.py --steps 500 --json runs/soak.json

Each rank samples its resident set size (RSS, from /proc/self/statm) every ``--every`` steps; the script prints
the samples, the growth from the first sample after warm-up to the last, and the least-squares slope in KiB per
1000 steps. A leak in the per-step path (plans, metadata caches, traces, logged values) shows as a steady slope.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(cfg: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT))
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader

    from lightning_avgpipe import AvgPipeStrategy
    from tests.helpers.lit import PipeNet, dataset

    torch.set_num_threads(1)

    class Sampler(pl.Callback):
        def __init__(self) -> None:
            self.samples: list[tuple[int, int]] = []

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step % cfg["every"] == 0:
                self.samples.append((trainer.global_step, rss_bytes()))

    sampler = Sampler()
    data = DataLoader(dataset(n=480), batch_size=12, shuffle=True)
    strategy = AvgPipeStrategy(num_microbatches=2, partition=[3, 3], num_pipelines=cfg["pipelines"])
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=cfg["steps"],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        callbacks=[sampler],
        log_every_n_steps=50,
    )
    trainer.fit(PipeNet(optimizer="adam", lr=1e-3), data)
    Path(cfg["out"], f"rank{trainer.global_rank}.json").write_text(json.dumps(sampler.samples))


def slope_kib_per_1000(samples: list[tuple[int, int]]) -> float:
    xs = [s for s, _ in samples]
    ys = [r / 1024 for _, r in samples]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    den = sum((x - mx) ** 2 for x in xs) or 1.0
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--pipelines", type=int, default=2)
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--_rank-config", dest="rank_config", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return
    import subprocess

    out = tempfile.mkdtemp()
    cfg = {"steps": args.steps, "every": args.every, "pipelines": args.pipelines, "out": out}
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # Lightning's own launcher starts rank 1 by re-running this command line.
    subprocess.run([sys.executable, __file__, "--_rank-config", json.dumps(cfg)], check=True, env=env, cwd=ROOT)
    report: dict[str, Any] = {"steps": args.steps, "pipelines": args.pipelines, "ranks": {}}
    print(f"soak: {args.steps} steps, 2 ranks, N = {args.pipelines}, RSS sampled every {args.every} steps")
    for rank in (0, 1):
        samples = [tuple(s) for s in json.loads(Path(out, f"rank{rank}.json").read_text())]
        steady = samples[1:] if len(samples) > 2 else samples  # the first sample includes warm-up allocations
        growth = (steady[-1][1] - steady[0][1]) / 2**20
        slope = slope_kib_per_1000(steady)  # type: ignore[arg-type]
        report["ranks"][rank] = {"samples": samples, "growth_mib": growth, "slope_kib_per_1000_steps": slope}
        mib = " ".join(f"{r / 2**20:.1f}" for _, r in samples)
        print(f"rank {rank}: RSS MiB at steps {[s for s, _ in samples]}: {mib}")
        print(f"rank {rank}: growth after warm-up {growth:+.2f} MiB, slope {slope:+.1f} KiB per 1000 steps")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
