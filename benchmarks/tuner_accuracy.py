"""How well ``AvgPipeTuner`` predicts: its predictions for every (M, N) against an exhaustive measured sweep.

    PYTHONPATH=. python benchmarks/tuner_accuracy.py             # defaults: 15 settings x 3 sweeps, ~4 min on 2 cores
    PYTHONPATH=. python benchmarks/tuner_accuracy.py --repeats 1 --json runs/tuner_accuracy.json   # one sweep
    PYTHONPATH=. python benchmarks/tuner_accuracy.py --quick     # a tiny smoke run (not a result)

One invocation starts 2 CPU ranks (gloo, 1 thread each, torchrun-style environment variables, so Lightning treats
the processes as created externally and every ``Trainer`` of the script reuses them). Both ranks run, in order:

1. a warm-up ``Trainer`` (a few untimed steps: process-group set-up, lazy imports, first-call caches);
2. for each of ``--repeats`` rounds:

   a. the tuner: one ``Trainer(callbacks=[AvgPipeTuner(num_microbatches=<grid M>, num_pipelines=<grid N>,
      apply=True)])`` fitted for ``--tuner-steps`` steps; tuner time = ``tuner.seconds`` (its ``on_fit_start``:
      profiling, prediction, search, ``reconfigure``); the whole ``Trainer``'s wall time is reported too;
   b. the sweep: for every (M, N) of the grid (``--microbatches`` x ``--pipelines``, B = ``--batch-size`` samples per
      pipeline), in a shuffled order, a fresh ``CharGPT`` of ``examples/char_gpt.py`` (same seed, same data order)
      trained by a fresh ``Trainer(strategy=AvgPipeStrategy(num_microbatches=M, num_pipelines=N,
      partition=<fixed>))`` for ``--warmup + --steps + 1`` iterations, with ``gc.collect()`` after each.

Each round's sweep is compared with the tuner that ran just before it (paired): on this machine the measurements of
one process rise through a run (the last third 7.5-15% slower than the first in four runs), and a tuner can
only predict the machine it profiled. The unpaired figure (the first tuner against each cell's median over all
rounds) is reported too.

What is measured per setting, by a small callback:

- iteration time: the time between consecutive ``on_train_batch_start`` calls (so it includes the data fetch, the
  pipeline, the N optimizer steps and the elastic update, and Lightning's own per-iteration work: logging, hooks);
  the median over the ``--steps`` iterations after the first ``--warmup`` (the last iteration is not timed: it has
  no next start);
- peak memory per stage: what the strategy logs, after the last (untimed) iteration, as
  ``avgpipe/peak_memory_mb/stage{s}`` (on CPU: the stage's counted tensors -- weights, gradients, optimizer states,
  averaging buffers -- plus the activation peak measured with saved-tensor hooks; mirrored on every rank);
- measured samples/s = N * B / iteration time (the same unit as the tuner's ``samples_per_sec``);
- wall time: from creating the model and the ``Trainer`` to the end of ``fit`` (the cost of trying the setting).

Reported: per setting measured vs predicted iteration time (per cell the median over rounds of each round's
signed error), peak MiB per stage and samples/s; the median and worst absolute error of iteration time (over
settings) and of peak memory (over settings x stages); the unpaired error; the drift (each measurement over its
cell's median, averaged over each third of the run); Spearman's rank correlation of predicted and measured
samples/s; each tuner's pick and its measured samples/s as a fraction of the best measured (the median tuner's is
the headline, the worst is printed beside it); mean tuner time as a fraction of one sweep's wall time (and of the
sweep's timed iterations only, for context). The issue's targets are printed with PASS/MISS: median time error <=
10%, pick >= 95% of the best, tuner time <= 5% of the sweep. ``--json PATH`` writes the configuration, every
measurement, the summary and every tuner's whole table (profile included).

The partition is fixed (``--partition``, default Embed + the first half of the blocks on stage 0) so that every
setting and the tuner see the same pipeline; ``partition="balanced"`` would profile anew in every ``Trainer``.
Absolute times on a shared machine are noise: the errors are ratios within one run, but load that comes and goes
between the tuner's profile and a setting's measurement shows up as error.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `benchmarks` and `examples` importable
    sys.path.insert(0, str(ROOT))

from benchmarks.common import spearman  # noqa: E402
from examples.gpt_args import add_model_args, add_partition_arg, check_model_args, model_sizes, partition_of  # noqa: E402
from tests.helpers.harness import launch_ranks  # noqa: E402

WORLD = 2
TARGETS = {
    "median_time_error": 0.10,
    "pick_fraction_of_best": 0.95,
    "tuner_fraction_of_sweep": 0.05,
    "repeatability": 0.10,  # two tuners back to back: median over candidates of |t1 - t2| / mean
}


# ---------------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return sorted({int(v) for v in str(text).split(",") if v.strip()})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--microbatches", default="1,2,4,8,16", help="M values of the grid (divisors of the batch size)")
    p.add_argument("--pipelines", default="1,2,4", help="N values of the grid")
    p.add_argument("--batch-size", type=int, default=32, help="B: samples per pipeline per iteration")
    p.add_argument("--steps", type=int, default=6, help="timed iterations per setting")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations per setting before the timed ones")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="run the sweep this many times (shuffled order each time); per-setting median over repeats",
    )
    p.add_argument(
        "--tuner-steps",
        type=int,
        default=7,
        help="training steps of the tuner's Trainer after tuning (its calibration times steps 2-5)",
    )
    p.add_argument("--profile-steps", type=int, default=2, help="AvgPipeTuner(profile_steps=...)")
    p.add_argument(
        "--noise-steps",
        type=int,
        default=10,
        help="paired steps of benchmarks/noise_cost.py on this GPT (M = 4; N = 1 and 4) after the sweep; 0: skip",
    )
    p.add_argument(
        "--again-objective",
        choices=["goodput", "throughput"],
        default="goodput",
        help="objective of the second tuner of each round (the repeatability check); the first is 'throughput', "
        "whose pick the sweep's samples/s judges",
    )
    add_model_args(p, n_layer=4, n_embd=128, n_head=4, block_size=64)
    add_partition_arg(p)
    p.add_argument("--corpus-chars", type=int, default=1_000_000, help="characters of stdlib docstrings")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=1800.0, help="kill the ranks after this many seconds")
    p.add_argument(
        "--out-dir",
        default=None,
        help="the tuner's tuning.json/png and the ranks' logs go here (default: a temporary folder)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write everything to this JSON file")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a tiny model and grid (M 1,2,4 x N 1,2, B 8, 1 timed step): a smoke run, not a result",
    )
    p.add_argument("--_rank-config", dest="rank_config", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_config:
        return args
    if args.quick:
        args.microbatches, args.pipelines, args.batch_size = "1,2,4", "1,2", 8
        args.steps, args.warmup, args.repeats = 1, 1, 1
        args.n_layer, args.n_embd, args.n_head, args.block_size = 2, 16, 2, 16
        args.corpus_chars = min(args.corpus_chars, 60_000)
        args.profile_steps = 1
    try:
        args.microbatches, args.pipelines = _ints(args.microbatches), _ints(args.pipelines)
    except ValueError:
        p.error("--microbatches and --pipelines must be comma-separated ints")
    if not args.microbatches or not args.pipelines or min(args.microbatches + args.pipelines) < 1:
        p.error("--microbatches and --pipelines need positive values")
    bad = [m for m in args.microbatches if args.batch_size % m]
    if bad:
        p.error(f"--microbatches {bad} do not divide --batch-size={args.batch_size}")
    check_model_args(p, args)
    args.partition = partition_of(p, args)
    if args.steps < 1 or args.warmup < 0 or args.repeats < 1 or args.tuner_steps < 0 or args.profile_steps < 1:
        p.error("--steps, --repeats, --profile-steps must be >= 1; --warmup, --tuner-steps >= 0")
    return args


# ---------------------------------------------------------------------------------------------------------------
# one rank: every Trainer of the benchmark
# ---------------------------------------------------------------------------------------------------------------
def rank_main(cfg: dict[str, Any]) -> None:
    sys.path.insert(0, str(ROOT))
    import logging
    import warnings

    import lightning.pytorch as pl
    import torch

    from examples.char_gpt import CharDataModule, CharGPT
    from lightning_avgpipe import AvgPipeStrategy, AvgPipeTuner

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "lightning_avgpipe"):
        logging.getLogger(name).setLevel(logging.WARNING)
    rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))

    def say(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    B, seed = cfg["batch_size"], cfg["seed"]
    dm = CharDataModule(block_size=cfg["block_size"], batch_size=B, max_chars=cfg["corpus_chars"])

    class Timer(pl.Callback):
        """Start time of every iteration; the logged per-stage peak memory after the last (untimed) iteration, the
        one log step (``log_every_n_steps=max_steps``: the strategy measures its figures on log steps only).

        ``trainer.callback_metrics`` assembles every logged value (several ms per call on this machine), so it is
        read only once the timed iterations are over: the peaks are the same every iteration of one setting (the
        plan and the shapes do not change).
        """

        def __init__(self, stages: int, last: int) -> None:
            self.starts: list[float] = []
            self.peaks: list[float] = []
            self.stages = stages
            self.last = last

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.starts.append(time.perf_counter())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if len(self.starts) < self.last:
                return
            metrics = trainer.callback_metrics
            self.peaks = [
                float(metrics.get(f"avgpipe/peak_memory_mb/stage{s}", float("nan"))) for s in range(self.stages)
            ]

    def fit(m: int, n: int, max_steps: int, callbacks: list[Any]) -> tuple[pl.Trainer, float]:
        started = time.perf_counter()
        pl.seed_everything(seed, verbose=False)
        model = CharGPT(vocab_size=dm.vocab_size, **model_sizes(cfg))
        strategy = AvgPipeStrategy(
            num_microbatches=m, num_pipelines=n, partition=list(cfg["partition"]), timeout=cfg["collective_timeout"]
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=WORLD,
            strategy=strategy,
            callbacks=callbacks,
            max_steps=max_steps,
            log_every_n_steps=max_steps,  # the step figures (the peaks read above) are measured on the last step
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            enable_model_summary=False,
            default_root_dir=cfg["out_dir"],
        )
        trainer.fit(model, train_dataloaders=dm.train_dataloader())
        return trainer, time.perf_counter() - started

    ms, ns = cfg["microbatches"], cfg["pipelines"]
    warmup, steps = cfg["warmup"], cfg["steps"]
    result: dict[str, Any] = {"settings": [], "warmup_fit": {}, "tuners": []}

    # 1. warm-up: one-time costs (process group, imports, first-call caches) land on no measurement
    _, wall = fit(ms[len(ms) // 2], 1, 3, [])
    result["warmup_fit"] = {"wall_s": wall}
    say(f"warm-up Trainer: {wall:.1f} s")

    # 2. per repeat: the tuner, then the sweep. Each sweep is compared with the tuner that ran just before it, so
    # the machine's drift over the run (later Trainers measured up to 10% slower) is not counted as model error.
    grid = [(m, n) for n in ns for m in ms]
    result["tuners"] = []
    for r in range(cfg["repeats"]):
        # samples/s is what this benchmark checks against the sweep (which runs the strategy's default averaging)
        tuner = AvgPipeTuner(
            num_microbatches=ms,
            num_pipelines=ns,
            apply=True,
            profile_steps=cfg["profile_steps"],
            output_dir=str(Path(cfg["out_dir"], "tuning", f"repeat{r}")),
            objective="throughput",
        )
        trainer, wall = fit(ms[0], ns[0], cfg["tuner_steps"], [tuner])
        assert tuner.table is not None and tuner.choice is not None
        choice = tuner.choice
        applied = (trainer.strategy.pipeline.num_microbatches, trainer.strategy.config.num_pipelines)
        result["tuners"].append(
            {
                "seconds": tuner.seconds,
                "wall_s": wall,
                "choice": [choice.num_microbatches, choice.num_pipelines],
                "applied": list(applied),
                "table": tuner.table.to_dict(),
            }
        )
        del trainer
        gc.collect()
        say(
            f"repeat {r} tuner: {tuner.seconds:.2f} s in on_fit_start ({wall:.1f} s whole Trainer), chose "
            f"M={choice.num_microbatches} N={choice.num_pipelines}, strategy now M={applied[0]} N={applied[1]}"
        )
        # a second tuner right after the first, on the same configuration: run-to-run repeatability
        again = AvgPipeTuner(
            num_microbatches=ms,
            num_pipelines=ns,
            apply=False,
            calibrate_steps=0,
            profile_steps=cfg["profile_steps"],
            output_dir=str(Path(cfg["out_dir"], "tuning", f"repeat{r}-again")),
            objective=cfg["again_objective"],  # the default, goodput: its profile also measures the noise
        )
        trainer, _ = fit(ms[0], ns[0], 1, [again])
        assert again.table is not None
        result["tuners"][-1]["again"] = again.table.to_dict()
        result["tuners"][-1]["again_seconds"] = again.seconds
        del trainer
        gc.collect()
        order = list(grid)
        random.Random(seed + r).shuffle(order)
        for m, n in order:
            timer = Timer(len(cfg["partition"]), warmup + steps + 1)
            trainer, wall = fit(m, n, warmup + steps + 1, [timer])
            intervals = [b - a for a, b in zip(timer.starts, timer.starts[1:])]
            timed = intervals[warmup : warmup + steps]
            if len(timed) != steps or len(timer.peaks) != len(cfg["partition"]):
                raise RuntimeError(f"M={m} N={n}: {len(timer.starts)} iterations seen, expected {warmup + steps + 1}")
            row = {
                "num_microbatches": m,
                "num_pipelines": n,
                "repeat": r,
                "iteration_s": timed,
                "iteration_s_median": statistics.median(timed),
                "timed_s": sum(timed),
                "wall_s": wall,
                "peak_mib": list(timer.peaks),
                "config_seen": [trainer.strategy.pipeline.num_microbatches, trainer.strategy.config.num_pipelines],
            }
            del trainer
            gc.collect()  # the old Trainer's cycles go now, not in a collection inside a later setting's timing
            result["settings"].append(row)
            say(
                f"repeat {r} M={m:>2} N={n}: {row['iteration_s_median'] * 1e3:8.1f} ms/iteration, peak MiB "
                + "/".join(f"{v:.1f}" for v in row["peak_mib"])
                + f", {wall:.1f} s wall"
            )
    if rank == 0:
        Path(cfg["result_path"]).write_text(json.dumps(result))


# ---------------------------------------------------------------------------------------------------------------
# the launcher: 2 ranks, a hard timeout, every process ends
# ---------------------------------------------------------------------------------------------------------------
def launch(cfg: dict[str, Any], timeout: float, log_dir: Path) -> None:
    """Run ``rank_main(cfg)`` in 2 processes; raise with rank 1's log tail when one fails or time runs out.

    Rank 0's progress lines go to the console; rank 1's output is kept in ``log_dir/rank1.log``. A rank still
    running 30 s after the other failed is killed.
    """
    argv = [str(Path(__file__).resolve()), "--_rank-config", json.dumps(cfg)]
    results = launch_ranks(argv, WORLD, timeout=timeout, log_dir=log_dir, echo=(0,), grace=30.0)
    codes = [code for code, _ in results]
    if any(codes):
        raise RuntimeError(f"a rank failed (exit codes {codes}); rank 1's log ends:\n{results[1][1][-4000:]}")


# ---------------------------------------------------------------------------------------------------------------
# analysis
# ---------------------------------------------------------------------------------------------------------------
def analyse(raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Each repeat's sweep against the tuner that ran just before it (paired), then medians over repeats."""
    tuners = raw["tuners"]

    def rows(t: dict[str, Any], key: str) -> dict[tuple[int, int], dict[str, Any]]:
        table = t["table"]
        return {
            (r["num_microbatches"], r["num_pipelines"]): r
            for r in (table.get(key) or table["rows"])
            if r.get("averaging", "elastic") == "elastic"  # the sweep runs the strategy's default averaging
        }

    predicted = [rows(t, "raw_rows") for t in tuners]  # the model's own numbers
    calibrated = [rows(t, "rows") for t in tuners]  # scaled by each tuner's calibration
    factors = [t["table"].get("notes", {}).get("calibration_factor") for t in tuners]
    B = args.batch_size
    cells = []
    for n in args.pipelines:
        for m in args.microbatches:
            runs = {s["repeat"]: s for s in raw["settings"] if (s["num_microbatches"], s["num_pipelines"]) == (m, n)}
            reps = sorted(runs)
            it = statistics.median(runs[r]["iteration_s_median"] for r in reps)
            stages = len(runs[reps[0]]["peak_mib"])
            peak = [statistics.median(runs[r]["peak_mib"][k] for r in reps) for k in range(stages)]
            pred_r = [predicted[r][(m, n)]["step_time"] for r in reps]
            cal_r = [calibrated[r][(m, n)]["step_time"] for r in reps]
            err_r = [p / runs[r]["iteration_s_median"] - 1 for p, r in zip(pred_r, reps)]
            cal_err_r = [p / runs[r]["iteration_s_median"] - 1 for p, r in zip(cal_r, reps)]
            first = predicted[0][(m, n)]
            pred_peak = [b / 2**20 for b in first["peak_bytes"]]
            pred = statistics.median(pred_r)
            cells.append(
                {
                    "num_microbatches": m,
                    "num_pipelines": n,
                    "measured_iteration_s": it,
                    "predicted_iteration_s": pred,
                    "time_error": statistics.median(err_r),  # paired: repeat r's tuner against repeat r's sweep
                    "time_error_per_repeat": err_r,
                    "time_error_unpaired": (first["step_time"] - it) / it,  # the first tuner against the medians
                    "calibrated_iteration_s": statistics.median(cal_r),
                    "calibrated_time_error": statistics.median(cal_err_r),
                    "measured_peak_mib": peak,
                    "predicted_peak_mib": pred_peak,
                    "peak_error": [(p - q) / q for p, q in zip(pred_peak, peak)],
                    "measured_samples_per_sec": n * B / it,
                    "predicted_samples_per_sec": statistics.median(p[(m, n)]["samples_per_sec"] for p in predicted),
                    "predicted_iteration_s_per_repeat": pred_r,
                    "predicted_pipeline_s": first["pipeline_time"],
                    "predicted_update_s": first["update_time"],
                    "iteration_s_per_repeat": [runs[r]["iteration_s_median"] for r in reps],
                    "wall_s_per_repeat": [runs[r]["wall_s"] for r in reps],
                    "configured_as": runs[reps[0]]["config_seen"],
                }
            )
    time_err = [abs(c["time_error"]) for c in cells]
    unpaired = [abs(c["time_error_unpaired"]) for c in cells]
    cal_err = [abs(c["calibrated_time_error"]) for c in cells]
    mem_err = [abs(e) for c in cells for e in c["peak_error"]]
    by_key = {(c["num_microbatches"], c["num_pipelines"]): c for c in cells}
    best = max(cells, key=lambda c: c["measured_samples_per_sec"])
    picks = [tuple(t["choice"]) for t in tuners]
    fractions = [by_key[p]["measured_samples_per_sec"] / best["measured_samples_per_sec"] for p in picks]
    median_pick = sorted(range(len(picks)), key=lambda i: fractions[i])[(len(picks) - 1) // 2]
    pick = by_key[picks[median_pick]]
    # run-to-run: each round's two tuners back to back, per candidate |t1 - t2| / mean(t1, t2) of the model's own
    # predicted iteration time; the median over candidates, per round
    repeat_spread = []
    for t in tuners:
        if "again" not in t:
            continue
        first_rows = rows(t, "raw_rows")
        second = {
            (r["num_microbatches"], r["num_pipelines"]): r
            for r in t["again"]["rows"]
            if r.get("averaging", "elastic") == "elastic"
        }
        spreads = [
            abs(first_rows[k]["step_time"] - second[k]["step_time"])
            / ((first_rows[k]["step_time"] + second[k]["step_time"]) / 2)
            for k in first_rows
            if k in second
        ]
        repeat_spread.append(statistics.median(spreads))
    sweep_wall = sum(s["wall_s"] for s in raw["settings"]) / args.repeats  # one exhaustive sweep
    sweep_timed = sum(s["timed_s"] for s in raw["settings"]) / args.repeats
    tuner_s = statistics.fmean(t["seconds"] for t in tuners)
    thirds = drift(raw["settings"])
    summary = {
        "time_error_median": statistics.median(time_err),
        "time_error_worst": max(time_err),
        "time_error_signed_median": statistics.median(c["time_error"] for c in cells),
        "time_error_unpaired_median": statistics.median(unpaired),
        "time_error_unpaired_worst": max(unpaired),
        "calibration_factors": factors,
        "calibrated_time_error_median": statistics.median(cal_err),
        "calibrated_time_error_worst": max(cal_err),
        "peak_error_median": statistics.median(mem_err),
        "peak_error_worst": max(mem_err),
        "spearman_samples_per_sec": spearman(
            [c["predicted_samples_per_sec"] for c in cells], [c["measured_samples_per_sec"] for c in cells]
        ),
        "picks": [list(p) for p in picks],
        "pick_fractions_of_best": fractions,
        "pick": list(picks[median_pick]),
        "pick_measured_samples_per_sec": pick["measured_samples_per_sec"],
        "best": [best["num_microbatches"], best["num_pipelines"]],
        "best_measured_samples_per_sec": best["measured_samples_per_sec"],
        "pick_fraction_of_best": fractions[median_pick],
        "pick_fraction_of_best_worst": min(fractions),
        "tuner_seconds": tuner_s,
        "tuner_seconds_per_repeat": [t["seconds"] for t in tuners],
        "tuner_trainer_wall_s": statistics.fmean(t["wall_s"] for t in tuners),
        "sweep_wall_s": sweep_wall,
        "sweep_timed_s": sweep_timed,
        "tuner_fraction_of_sweep": tuner_s / sweep_wall,
        "tuner_fraction_of_sweep_timed": tuner_s / sweep_timed,
        "drift_by_third": thirds,
        "repeatability_per_round": repeat_spread,
        "repeatability_median": statistics.median(repeat_spread) if repeat_spread else None,
        "again_objective": args.again_objective,
    }
    summary["targets"] = {
        "median_time_error": {
            "target": f"<= {TARGETS['median_time_error']:.0%}",
            "value": summary["time_error_median"],
            "ok": summary["time_error_median"] <= TARGETS["median_time_error"],
        },
        "pick_fraction_of_best": {
            "target": f">= {TARGETS['pick_fraction_of_best']:.0%}",
            "value": summary["pick_fraction_of_best"],
            "ok": summary["pick_fraction_of_best"] >= TARGETS["pick_fraction_of_best"],
        },
        "tuner_fraction_of_sweep": {
            "target": f"<= {TARGETS['tuner_fraction_of_sweep']:.0%}",
            "value": summary["tuner_fraction_of_sweep"],
            "ok": summary["tuner_fraction_of_sweep"] <= TARGETS["tuner_fraction_of_sweep"],
        },
    }
    if summary["repeatability_median"] is not None:
        summary["targets"]["repeatability"] = {
            "target": f"<= {TARGETS['repeatability']:.0%}",
            "value": summary["repeatability_median"],
            "ok": summary["repeatability_median"] <= TARGETS["repeatability"],
        }
    return {"cells": cells, "summary": summary}


def drift(settings: list[dict[str, Any]]) -> list[float]:
    """Mean of (a measurement / its cell's median over repeats) over each third of the run, in run order."""
    by_cell: dict[tuple[int, int], list[float]] = {}
    for s in settings:
        by_cell.setdefault((s["num_microbatches"], s["num_pipelines"]), []).append(s["iteration_s_median"])
    medians = {k: statistics.median(v) for k, v in by_cell.items()}
    ratios = [s["iteration_s_median"] / medians[(s["num_microbatches"], s["num_pipelines"])] for s in settings]
    k = max(1, len(ratios) // 3)
    parts = [ratios[:k], ratios[k : 2 * k], ratios[2 * k :]]
    return [statistics.fmean(p) for p in parts if p]


def format_report(report: dict[str, Any]) -> str:
    cells, s = report["cells"], report["summary"]
    lines = [
        f"{'M':>3} {'N':>2} {'meas ms':>9} {'pred ms':>9} {'err':>7}  {'meas MiB':>13} {'pred MiB':>13} "
        f"{'err':>13}  {'meas smp/s':>10} {'pred smp/s':>10}"
    ]
    for c in cells:
        picked = s["picks"].count([c["num_microbatches"], c["num_pipelines"]])
        mark = f" <- tuner x{picked}" if picked else ""
        mark += " <- best measured" if [c["num_microbatches"], c["num_pipelines"]] == s["best"] else ""
        lines.append(
            f"{c['num_microbatches']:>3} {c['num_pipelines']:>2} {c['measured_iteration_s'] * 1e3:>9.1f} "
            f"{c['predicted_iteration_s'] * 1e3:>9.1f} {c['time_error']:>+7.1%}  "
            f"{'/'.join(f'{v:.1f}' for v in c['measured_peak_mib']):>13} "
            f"{'/'.join(f'{v:.1f}' for v in c['predicted_peak_mib']):>13} "
            f"{'/'.join(f'{e:+.0%}' for e in c['peak_error']):>13}  "
            f"{c['measured_samples_per_sec']:>10.1f} {c['predicted_samples_per_sec']:>10.1f}{mark}"
        )
    t = s["targets"]

    def verdict(key: str) -> str:
        return "PASS" if t[key]["ok"] else "MISS"

    factors = [f for f in s["calibration_factors"] if f]
    lines += [
        "",
        f"iteration time error (the model's own predictions, each repeat's tuner against that repeat's sweep; per "
        f"cell the median over repeats): median {s['time_error_median']:.1%}, worst {s['time_error_worst']:.1%}, "
        f"median signed {s['time_error_signed_median']:+.1%}",
        f"  unpaired (the first tuner against each cell's median over all repeats): median "
        f"{s['time_error_unpaired_median']:.1%}, worst {s['time_error_unpaired_worst']:.1%}",
        (
            f"iteration time error after the tuners' calibration (x{', x'.join(f'{f:.3f}' for f in factors)}, from the "
            f"chosen setting's first training iterations): median {s['calibrated_time_error_median']:.1%}, worst "
            f"{s['calibrated_time_error_worst']:.1%}"
        )
        if factors
        else "no calibration (--tuner-steps < 6)",
        "drift: measured / cell median over the run's thirds: " + ", ".join(f"{v:.3f}" for v in s["drift_by_third"]),
        f"peak memory error:    median {s['peak_error_median']:.1%}, worst {s['peak_error_worst']:.1%}"
        " (over settings x stages)",
        f"rank correlation (Spearman) of predicted and measured samples/s: {s['spearman_samples_per_sec']:.3f}",
        "tuners' picks: "
        + ", ".join(f"M={p[0]} N={p[1]} {f:.1%}" for p, f in zip(s["picks"], s["pick_fractions_of_best"]))
        + f" of the best measured (M={s['best'][0]} N={s['best'][1]}, {s['best_measured_samples_per_sec']:.1f} "
        f"samples/s); the median pick M={s['pick'][0]} N={s['pick'][1]}: {s['pick_measured_samples_per_sec']:.1f} "
        f"samples/s = {s['pick_fraction_of_best']:.1%}, the worst {s['pick_fraction_of_best_worst']:.1%}",
        f"tuner time {s['tuner_seconds']:.2f} s, mean of {len(s['tuner_seconds_per_repeat'])} (its whole Trainer: "
        f"{s['tuner_trainer_wall_s']:.1f} s) = "
        f"{s['tuner_fraction_of_sweep']:.1%} of one sweep's wall time ({s['sweep_wall_s']:.1f} s); "
        f"{s['tuner_fraction_of_sweep_timed']:.0%} of the sweep's timed iterations alone ({s['sweep_timed_s']:.1f} s)",
        f"target median time error <= 10%:  {verdict('median_time_error')} ({s['time_error_median']:.1%}, the model's "
        f"own; after calibration {s['calibrated_time_error_median']:.1%})",
        f"target pick >= 95% of best:       {verdict('pick_fraction_of_best')} ({s['pick_fraction_of_best']:.1%}, the "
        f"median tuner's; the worst {s['pick_fraction_of_best_worst']:.1%})",
        f"target tuner <= 5% of the sweep:  {verdict('tuner_fraction_of_sweep')} ({s['tuner_fraction_of_sweep']:.1%})",
    ]
    if s.get("repeatability_median") is not None:
        per = ", ".join(f"{v:.1%}" for v in s["repeatability_per_round"])
        lines.append(
            f"target repeatability <= 10%:      {verdict('repeatability')} ({s['repeatability_median']:.1%}: two "
            f"tuners back to back, the second with objective='{s.get('again_objective', 'throughput')}', median over "
            f"candidates of |t1 - t2| / mean; per round {per})"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return 0
    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="tuner_accuracy-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = {
        "microbatches": args.microbatches,
        "pipelines": args.pipelines,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "tuner_steps": args.tuner_steps,
        "profile_steps": args.profile_steps,
        "again_objective": args.again_objective,
        "n_layer": args.n_layer,
        "n_embd": args.n_embd,
        "n_head": args.n_head,
        "block_size": args.block_size,
        "partition": args.partition,
        "corpus_chars": args.corpus_chars,
        "seed": args.seed,
        "out_dir": str(out_dir.resolve()),
        "result_path": str((out_dir / "raw.json").resolve()),
        "collective_timeout": max(60.0, min(args.timeout, 600.0)),
    }
    grid = len(args.microbatches) * len(args.pipelines)
    print(
        f"tuner accuracy: GPT {args.n_layer} blocks x {args.n_embd} wide, block {args.block_size}, B = "
        f"{args.batch_size}, partition {args.partition}, M in {args.microbatches} x N in {args.pipelines} "
        f"({grid} settings), {args.warmup} + {args.steps} iterations each, {args.repeats} repeat(s); 2 ranks",
        flush=True,
    )
    started = time.perf_counter()
    launch(cfg, args.timeout, out_dir)
    raw = json.loads((out_dir / "raw.json").read_text())
    report = analyse(raw, args)
    print()
    print(format_report(report))
    if args.noise_steps > 0:  # the noise scale's cost per step, on this benchmark's GPT (benchmarks/noise_cost.py)
        from benchmarks import noise_cost

        print()
        gpt = ["--n-layer", str(args.n_layer), "--n-embd", str(args.n_embd), "--n-head", str(args.n_head)]
        gpt += ["--block-size", str(args.block_size), "--batch-size", str(args.batch_size), "--microbatches", "4"]
        _, report["summary"]["noise_cost"] = noise_cost.measure(["--steps", str(args.noise_steps), *gpt])
    print(f"({time.perf_counter() - started:.0f} s in all; the tuner's files are in {out_dir / 'tuning'})")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        config = {k: v for k, v in cfg.items() if k != "result_path"}
        path.write_text(
            json.dumps(
                {
                    "config": config,
                    "cells": report["cells"],
                    "summary": report["summary"],
                    "measurements": raw["settings"],
                    "warmup_fit": raw["warmup_fit"],
                    "tuners": raw["tuners"],
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
