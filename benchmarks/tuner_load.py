"""Does ``AvgPipeTuner`` choose the same under load? ``tune`` on a quiet machine, then ``--runs`` times with CPU-bound
processes running beside it, comparing each loaded run's choice and predicted ratios with the quiet run's.

    PYTHONPATH=. python benchmarks/tuner_load.py                  # 1 quiet + 5 loaded tunes, 3-5 minutes on 2 cores
    PYTHONPATH=. python benchmarks/tuner_load.py --hogs 3 --runs 5 --json runs/tuner_load.json
    PYTHONPATH=. python benchmarks/tuner_load.py --quick          # a smoke run (not a result)

Each tune is ``python -m lightning_avgpipe tune --config examples/char_gpt.yaml`` (2 gloo ranks, the tuner's profile
and search, no training), its table read from ``tuning.json``. A hog is a Python busy loop, one process each, started
before a loaded tune and killed after it. Per run: the share of a core the profile's processes got (the tuner's own
``cpu_share`` probe, and whether it said the machine was busy), the choice, the chosen row's raw predicted iteration
time, and how far the predicted ratios between candidates moved: for every row, its samples/s over the best row's,
against the same ratio in the quiet run (the largest and the median relative change over rows). The targets (issue
23, item 4): the quiet run's choice in every loaded run, the ratios within 10%. ``--quiet-runs`` more quiet tunes
show how far the figures move without load, against the same first run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# a busy loop that ends with its time, or with this script (a parent killed without cleaning up)
HOG = "import os, time\nend = time.time() + {seconds}\nwhile time.time() < end and os.getppid() == {parent}:\n    pass"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5, help="loaded tunes")
    p.add_argument(
        "--quiet-runs", type=int, default=3, help="quiet tunes: the first the reference, all of them the noise floor"
    )
    p.add_argument("--hogs", type=int, default=2, help="CPU-bound processes running beside each loaded tune")
    p.add_argument("--config", default="examples/char_gpt.yaml")
    p.add_argument("--num-pipelines", default="1", help="the tune's --num-pipelines")
    p.add_argument("--profile-steps", type=int, default=3, help="the tune's --profile-steps (its default: 3)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one tune may take")
    p.add_argument("--json", type=Path, default=None, help="also write everything here")
    p.add_argument("--quick", action="store_true", help="1 loaded run, 1 hog, fewer sizes: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.runs, args.quiet_runs, args.hogs, args.profile_steps = 1, 1, 1, 1
    return args


def tune(args: argparse.Namespace, out: Path, extra: list[str]) -> dict[str, Any]:
    """One ``tune`` into ``out``; its ``tuning.json``, plus the wall time."""
    cmd = [sys.executable, "-m", "lightning_avgpipe", "tune", "--config", args.config, "--output-dir", str(out)]
    cmd += ["--num-pipelines", args.num_pipelines, "--profile-steps", str(args.profile_steps), *extra]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"tune exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    table = json.loads((out / "tuning.json").read_text())
    table["wall_s"] = time.perf_counter() - t0
    return table


def key(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row["schedule"], row["num_microbatches"], row["num_pipelines"], row["averaging"])


def ratios(table: dict[str, Any]) -> dict[tuple[Any, ...], float]:
    """Every feasible row's predicted samples/s over the best row's."""
    rows = [r for r in table["rows"] if r["feasible"]]
    best = max(r["samples_per_sec"] for r in rows)
    return {key(r): r["samples_per_sec"] / best for r in rows}


def median_ratios(tables: list[dict[str, Any]]) -> dict[tuple[Any, ...], float]:
    """Per row, the median of its ratio over ``tables``: the quiet machine's ratios with one run's noise averaged
    out (with several quiet runs)."""
    each = [ratios(t) for t in tables]
    return {k: statistics.median(r[k] for r in each if k in r) for k in each[0]}


def moved(base: dict[tuple[Any, ...], float], table: dict[str, Any]) -> list[float]:
    now = ratios(table)
    return [abs(now[k] / base[k] - 1) for k in base if k in now]


def worst(base: dict[tuple[Any, ...], float], table: dict[str, Any]) -> str:
    """The row whose ratio moved most, and which way: e.g. "zbh1 M=1 -12%"."""
    now = ratios(table)
    k = max((k for k in base if k in now), key=lambda k: abs(now[k] / base[k] - 1))
    return f"{k[0]} M={k[1]} N={k[2]} {now[k] / base[k] - 1:+.0%}"


def summary(quiet: dict[str, Any], table: dict[str, Any]) -> dict[str, Any]:
    base = ratios(quiet)
    change = moved(base, table)
    chosen = table["choice"]
    return {
        "choice_in_quiet_table": base.get(key(chosen), 0.0),  # its samples/s as the quiet run predicts it, of the best
        "cpu_share": table["profile"].get("cpu_share"),
        "busy_said": bool(table["notes"].get("busy_machine")),
        "choice": list(key(chosen)),
        "same_choice": key(chosen) == key(quiet["choice"]),
        "chosen_step_ms": chosen["step_time"] * 1e3,
        "ratio_change_max": max(change),
        "worst_row": worst(base, table),
        "ratio_change_median": statistics.median(change),
        "timing_noise": table["profile"].get("timing_noise"),
        "tie_window": table["notes"].get("tie_window"),
        "rounds": table["profile"].get("rounds"),
        "wall_s": table["wall_s"],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra = ["--num-microbatches", "2,4,8"] if args.quick else []
    runs: list[dict[str, Any]] = []
    quiet_noise: list[dict[str, Any]] = []
    quiet_extra: list[dict[str, Any]] = []
    loaded_all: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        quiet = tune(args, Path(tmp) / "quiet", extra)
        print(
            f"quiet: cpu_share {quiet['profile'].get('cpu_share')}, choice {list(key(quiet['choice']))}, "
            f"{quiet['choice']['step_time'] * 1e3:.1f} ms predicted, timing noise "
            f"{quiet['profile'].get('timing_noise', 0):.1%}, {quiet['wall_s']:.0f} s"
        )
        for i in range(1, args.quiet_runs):  # the same, quiet again: how far noise alone moves the figures
            quiet_extra.append(tune(args, Path(tmp) / f"quiet{i}", extra))
            again = summary(quiet, quiet_extra[-1])
            quiet_noise.append(again)
            print(
                f"quiet {i + 1}: cpu_share {again['cpu_share']}, choice {again['choice']} "
                f"({'same' if again['same_choice'] else 'OTHER'}: "
                f"{again['choice_in_quiet_table']:.3f} of the first's best), timing noise {again['timing_noise']:.1%}, "
                f"worst row {again['worst_row']}, "
                f"ratios moved max {again['ratio_change_max']:.1%} "
                f"median {again['ratio_change_median']:.1%}"
            )
        for i in range(args.runs):
            hogs = [
                subprocess.Popen([sys.executable, "-c", HOG.format(seconds=args.timeout, parent=os.getpid())])
                for _ in range(args.hogs)
            ]
            try:
                table = tune(args, Path(tmp) / f"loaded{i}", extra)
            finally:
                for hog in hogs:
                    hog.kill()
                    hog.wait()
            loaded_all.append(table)
            runs.append(summary(quiet, table))
            r = runs[-1]
            print(
                f"loaded {i + 1} ({args.hogs} hogs): cpu_share {r['cpu_share']}, busy said {r['busy_said']}, choice "
                f"{r['choice']} ({'same' if r['same_choice'] else 'OTHER'}: "
                f"{r['choice_in_quiet_table']:.3f} of the quiet best), "
                f"{r['chosen_step_ms']:.1f} ms predicted "
                f"({r['chosen_step_ms'] / (quiet['choice']['step_time'] * 1e3):.2f}x quiet), {r['rounds']} rounds, "
                f"timing noise {r['timing_noise']:.1%}, ratios moved max {r['ratio_change_max']:.1%} "
                f"({r['worst_row']}) median {r['ratio_change_median']:.1%}, {r['wall_s']:.0f} s"
            )
    # against the quiet runs' median ratios: each quiet run's own distance from it is the noise floor
    quiet_tables, loaded_tables = [quiet, *quiet_extra], loaded_all
    if len(quiet_tables) >= 2:
        floor = median_ratios(quiet_tables)
        quiet_moves = [max(moved(floor, t)) for t in quiet_tables]
        loaded_moves = [max(moved(floor, t)) for t in loaded_tables]
        print(
            f"against the median of the {len(quiet_tables)} quiet runs' ratios: quiet runs moved at most "
            f"{', '.join(f'{m:.1%}' for m in quiet_moves)}; loaded runs {', '.join(f'{m:.1%}' for m in loaded_moves)}"
        )
        for r, m in zip(runs, loaded_moves):
            r["ratio_change_max_vs_quiet_median"] = m
    quiet_choices = sorted({str(list(key(t["choice"]))) for t in quiet_tables})
    print(f"quiet runs chose: {', '.join(quiet_choices)}")
    same = sum(r["same_choice"] for r in runs)
    worst = max(r["ratio_change_max"] for r in runs)
    print(f"same choice in {same} of {len(runs)} loaded runs: {'PASS' if same == len(runs) else 'MISS'} (all)")
    print(f"ratios between candidates moved at most {worst:.1%}: {'PASS' if worst <= 0.10 else 'MISS'} (<= 10%)")
    print(f"busy machine said in {sum(r['busy_said'] for r in runs)} of {len(runs)} loaded runs")
    worst_pick = min(r["choice_in_quiet_table"] for r in runs)
    print(f"every loaded choice at {worst_pick:.3f} or more of the quiet run's best predicted samples/s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        quiet_figures = {"cpu_share": quiet["profile"].get("cpu_share"), "choice": list(key(quiet["choice"]))}
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "quiet": quiet_figures, "runs": runs}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
