"""The throughput benchmark's figures (``benchmarks/throughput.py``): step times, the ideal step from the compute
probes, the correctness checks, and the printed table."""

from __future__ import annotations

import argparse
import math
import statistics
from typing import Any

import torch

from benchmarks.throughput_rows import AVG_PARTS, AVG_PREFIX, LABELS, ROWS, WORLD, pipelines_of, row_names


def _stage_costs(args: argparse.Namespace, per_rank: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    """Per stage, the medians of the probe's forward+backward and optimizer times (``kind``: "solo" or "both")."""
    w = args.warmup
    stages = []
    for r in per_rank:
        fb = [t[0] for t in r["probe"][kind][w:]]
        opt = [t[1] for t in r["probe"][kind][w:]]
        total = [a + b for a, b in zip(fb, opt, strict=True)]
        stages.append(
            {
                "stage": r["rank"],
                "layers": args.partition[r["rank"]],
                "fwd_bwd_s": statistics.median(fb),
                "optimizer_s": statistics.median(opt),
                "compute_s": statistics.median(total),
            }
        )
    return stages


def _avg_ideal(
    args: argparse.Namespace,
    per_rank: list[dict[str, Any]],
    n: int,
    stages: list[dict[str, Any]],
    stages_both: list[dict[str, Any]],
) -> dict[str, Any]:
    """avgpipe-N's ideal: N times the probe (N*M units + N optimizer steps) plus the elastic update, per stage."""
    timed = range(args.warmup, args.warmup + args.steps)

    def elastic_s(r: dict[str, Any], i: int) -> float:
        return r["elastic_probe"][n][i] if n > 1 else 0.0

    avg_stages = []
    for st, r in zip(stages, per_rank, strict=True):
        avg_stages.append(
            {
                "stage": st["stage"],
                "layers": st["layers"],
                "fwd_bwd_s": n * st["fwd_bwd_s"],
                "optimizer_s": n * st["optimizer_s"],
                "elastic_s": statistics.median(elastic_s(r, i) for i in timed),
                "compute_s": statistics.median(n * sum(r["probe"]["solo"][i]) + elastic_s(r, i) for i in timed),
            }
        )
    units = n * args.microbatches
    return {
        "step_s": max(st["compute_s"] for st in avg_stages),
        "stages": avg_stages,
        "step_s_both_stages_at_once": max(
            n * sb["compute_s"] + st["elastic_s"] for sb, st in zip(stages_both, avg_stages, strict=True)
        ),
        "bubble_bound_1f1b": units / (units + WORLD - 1),
        "per_round": [max(n * sum(r["probe"]["solo"][i]) + elastic_s(r, i) for r in per_rank) for i in timed],
    }


def summarise(args: argparse.Namespace, per_rank: list[dict[str, Any]], vocab_size: int) -> dict[str, Any]:
    w = args.warmup
    names = row_names(args)
    timed = range(w, w + args.steps)
    # step time of a row = the slowest rank's time for that step
    step_times = {name: [max(r["times"][name][i] for r in per_rank) for i in timed] for name in names}
    samples = {name: pipelines_of(name) * args.batch_size for name in names}

    stages, stages_both = _stage_costs(args, per_rank, "solo"), _stage_costs(args, per_rank, "both")
    ideal = max(s["compute_s"] for s in stages)
    ideal_both = max(s["compute_s"] for s in stages_both)
    # paired estimates: within one round all rows ran back to back, so per-round ratios cancel slow load drifts
    ideal_per_round = [max(sum(r["probe"]["solo"][i]) for r in per_rank) for i in timed]
    avg_ideal = {f"{AVG_PREFIX}{n}": _avg_ideal(args, per_rank, n, stages, stages_both) for n in args.pipelines}

    def row_ideal(name: str) -> float:
        return avg_ideal[name]["step_s"] if name in avg_ideal else ideal

    def row_ideal_round(name: str) -> list[float]:
        return avg_ideal[name]["per_round"] if name in avg_ideal else ideal_per_round

    def loss_of(name: str, i: int) -> float:
        v_rows = ("single", "ours-zbv", "ours-zbv-placed", "torch-zbv")
        owner = 0 if name in v_rows else WORLD - 1  # the rank holding the loss (V: 0)
        value = per_rank[owner]["losses"][name][i]
        assert value is not None, f"{name} has no loss on rank {owner}"
        return float(value)

    medians = {name: statistics.median(ts) for name, ts in step_times.items()}
    sps = {name: samples[name] / medians[name] for name in names}
    rows = []
    for name in names:
        n = pipelines_of(name)
        avg = name.startswith(AVG_PREFIX)
        row: dict[str, Any] = {
            "name": name,
            "label": LABELS.get(name, f"AvgPipe, {n} parallel pipeline(s) with elastic averaging, 1F1B over N*M units"),
            "pipelines": n if avg else None,
            "samples_per_step": samples[name],
            "step_s_median": medians[name],
            "step_s_min": min(step_times[name]),
            "step_s_max": max(step_times[name]),
            "step_s": step_times[name],
            "samples_per_s": sps[name],
            "ratio_to_torch_1f1b": sps[name] / sps["torch-1f1b"],
            "speedup_vs_single": sps[name] / sps["single"],
            # the single process has no pipeline: its efficiency is not defined here (null), not 1.0
            "pipeline_efficiency": None if name == "single" else row_ideal(name) / medians[name],
            # samples/s ratio within each round: (samples / t_row) / (B / t_torch)
            "paired_ratio_to_torch_1f1b": statistics.median(
                (samples[name] / args.batch_size) * t / u
                for t, u in zip(step_times["torch-1f1b"], step_times[name], strict=True)
            ),
            "paired_pipeline_efficiency": None
            if name == "single"
            else statistics.median(a / u for a, u in zip(row_ideal_round(name), step_times[name], strict=True)),
            "pipeline_efficiency_vs_both_stages_at_once": None
            if name == "single"
            else (avg_ideal[name]["step_s_both_stages_at_once"] if avg else ideal_both) / medians[name],
            "first_step_loss": loss_of(name, 0),
            "final_loss": loss_of(name, args.warmup + args.steps - 1),
        }
        if avg:
            # medians per stage of the parts of the step timed inside the row
            row["parts_s"] = [
                {part: statistics.median(r["avgpipe_parts"][name][part][i] for i in timed) for part in AVG_PARTS}
                for r in per_rank
            ]
        rows.append(row)

    first = {row["name"]: row["first_step_loss"] for row in rows}

    def close(a: float, b: float) -> bool:
        return math.isclose(a, b, rel_tol=args.rtol, abs_tol=args.rtol)

    mismatches = [name for name in ROWS if not close(first[name], first["single"])]
    if not close(first["ours-1f1b"], first["torch-1f1b"]):
        mismatches.append("ours-1f1b vs torch-1f1b")
    # avgpipe-N: the mean-over-replicas loss of the first steps against a single-process AvgPipe (N = 1: plain
    # training, so avgpipe-N1's first-step loss also equals every other row's)
    reference = per_rank[0]["elastic_reference"]
    check_steps = min(args.check_steps, args.warmup + args.steps)
    avg_checks: dict[str, Any] = {}
    for n in args.pipelines:
        name = f"{AVG_PREFIX}{n}"
        ours = [loss_of(name, i) for i in range(check_steps)]
        ok = all(close(a, b) for a, b in zip(ours, reference[n], strict=True))
        avg_checks[name] = {
            "losses": ours,
            "single_process": reference[n],
            "max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(ours, reference[n], strict=True)),
            "ok": ok,
        }
        if not ok:
            mismatches.append(f"{name} vs single-process AvgPipe (first {check_steps} steps)")
        if n == 1 and not close(first[name], first["single"]):
            mismatches.append(name)
    nonfinite = [
        name for name in names if not all(math.isfinite(loss_of(name, i)) for i in range(args.warmup + args.steps))
    ]
    mismatches += [f"{name}: non-finite loss" for name in nonfinite]
    m, s = args.microbatches, WORLD
    fit: dict[str, Any] | None = None
    if args.fit_rounds:
        # per step, the slowest rank's time of each; per round, the median of the per-step ratios fit / runtime
        def per_step(key: str, i: int) -> list[float]:
            return [max(values) for values in zip(*(r[key][i] for r in per_rank))]

        ratios, fit_s, runtime_s = [], [], []
        for i in range(args.fit_rounds):
            f, r = per_step("fit_rounds", i), per_step("runtime_rounds", i)
            ratios.append(statistics.median(a / b for a, b in zip(f, r, strict=True)))
            fit_s.append(statistics.median(f))
            runtime_s.append(statistics.median(r))
        fit = {
            "rounds": args.fit_rounds,
            "fit_step_s": fit_s,
            "runtime_step_s": runtime_s,
            "fit_over_runtime": ratios,
            "fit_over_runtime_median": statistics.median(ratios),
        }
    return {
        "fit_vs_runtime": fit,
        "config": {
            "world_size": WORLD,
            "threads_per_rank": 1,
            "batch_size": args.batch_size,
            "microbatches": m,
            "steps": args.steps,
            "warmup": args.warmup,
            "n_layer": args.n_layer,
            "n_embd": args.n_embd,
            "n_head": args.n_head,
            "block_size": args.block_size,
            "vocab_size": vocab_size,
            "partition": args.partition,
            "optimizer": "AdamW",
            "lr": args.lr,
            "weight_decay": args.weight_decay,
            "seed": args.seed,
            "torch": torch.__version__,
            "pipelines": args.pipelines,
            "check_steps": check_steps,
        },
        "rows": rows,
        "ideal": {
            "step_s": ideal,
            "definition": "max over stages of the median (forward+backward over all micro-batches + optimizer "
            "step) of that stage's layers alone: no communication, the other rank idle",
            "stages": stages,
            "step_s_both_stages_at_once": ideal_both,
            "stages_both_at_once": stages_both,
            "bubble_bound_1f1b": m / (m + s - 1),
            "avgpipe": {k: {kk: vv for kk, vv in v.items() if kk != "per_round"} for k, v in avg_ideal.items()},
            "avgpipe_definition": "per stage: N x (the probe's forward+backward over M micro-batches + optimizer "
            "step) + the elastic update (begin_step + finish_step on a private N-replica "
            "copy, in the same solo slot); max over stages",
        },
        "checks": {
            "first_step_loss": first,
            "rtol": args.rtol,
            "max_param_diff_ours_vs_torch_1f1b": max(r["param_diff"] for r in per_rank),
            "avgpipe_vs_single_process": avg_checks,
            "ok": not mismatches,
            "mismatches": mismatches,
        },
    }


def format_table(summary: dict[str, Any]) -> str:
    c, ideal, checks = summary["config"], summary["ideal"], summary["checks"]
    lines = [
        f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} block_size={c['block_size']} "
        f"vocab={c['vocab_size']} | batch {c['batch_size']} in {c['microbatches']} micro-batches | "
        f"{c['world_size']} gloo ranks x 1 thread, partition {c['partition']} | AdamW | "
        f"{c['steps']} timed steps after {c['warmup']} warm-up, interleaved | torch {c['torch']}",
        "",
        f"{'row':<20} {'samples':>7} {'step ms':>8} {'(min-max)':>11} {'samples/s':>10} {'vs torch 1F1B':>14} "
        f"{'(paired)':>9} {'vs single':>10} {'pipe eff':>9} {'(paired)':>9}",
    ]

    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}"

    for r in summary["rows"]:
        spread = f"({r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f})"
        lines.append(
            f"{r['name']:<20} {r['samples_per_step']:7d} {r['step_s_median'] * 1e3:8.1f} {spread:>11} "
            f"{r['samples_per_s']:10.1f} "
            f"{r['ratio_to_torch_1f1b']:13.3f}x {r['paired_ratio_to_torch_1f1b']:8.3f}x "
            f"{r['speedup_vs_single']:9.3f}x {fmt(r['pipeline_efficiency']):>9} "
            f"{fmt(r['paired_pipeline_efficiency']):>9}"
        )

    def stage_txt(stages: list[dict[str, Any]]) -> str:
        return ", ".join(
            f"stage {s['stage']} ({s['layers']} layers) {s['fwd_bwd_s'] * 1e3:.1f} + {s['optimizer_s'] * 1e3:.1f} ms"
            for s in stages
        )

    lines += [
        "",
        f"ideal step = slowest stage's compute alone (fwd+bwd over all micro-batches + AdamW, no communication, "
        f"other rank idle): {ideal['step_s'] * 1e3:.1f} ms  [{stage_txt(ideal['stages'])}]",
        f"  (both stages computing at once, no communication: {ideal['step_s_both_stages_at_once'] * 1e3:.1f} ms  "
        f"[{stage_txt(ideal['stages_both_at_once'])}])",
        f"samples/s, vs torch 1F1B, vs single and pipe eff (= ideal / step) use median step times; (paired) = "
        f"median over rounds of the same ratio within one round. single: pipe eff n/a (no pipeline). 1F1B with "
        f"perfectly balanced stages is bounded by M/(M+S-1) = {ideal['bubble_bound_1f1b']:.2f}.",
    ]
    avg_rows = [r for r in summary["rows"] if r["pipelines"] is not None]
    if avg_rows:
        lines += [
            f"avgpipe-N: N replicas per stage, each step N batches of {c['batch_size']} (samples = N*B), 1F1B over "
            f"N*M units; ideal = N x the probe + the elastic update (begin_step + finish_step alone); 1F1B bubble "
            f"bound N*M/(N*M+S-1): "
            + ", ".join(f"N{r['pipelines']} {ideal['avgpipe'][r['name']]['bubble_bound_1f1b']:.2f}" for r in avg_rows),
        ]
        for r in avg_rows:
            ai = ideal["avgpipe"][r["name"]]
            per_stage = "; ".join(
                f"stage {k}: pipeline {p['pipeline'] * 1e3:.1f} + optimizer step ({r['pipelines']} AdamW steps "
                f"and the elastic update) {p['optimizer_step'] * 1e3:.1f} ms"
                f" (the update alone {ai['stages'][k]['elastic_s'] * 1e3:.2f})"
                for k, p in enumerate(r["parts_s"])
            )
            lines.append(f"  {r['name']} ideal {ai['step_s'] * 1e3:.1f} ms; in-step medians {per_stage}")
    lines += [
        "first-step loss: " + ", ".join(f"{k} {v:.6f}" for k, v in checks["first_step_loss"].items()),
        "final loss:      " + ", ".join(f"{r['name']} {r['final_loss']:.6f}" for r in summary["rows"]),
        f"max |w_ours-1f1b - w_torch-1f1b| after all steps: {checks['max_param_diff_ours_vs_torch_1f1b']:.2e}",
        *(
            f"{name} mean-over-replicas loss, first {len(v['losses'])} steps: "
            + " ".join(f"{x:.6f}" for x in v["losses"])
            + " | single-process AvgPipe: "
            + " ".join(f"{x:.6f}" for x in v["single_process"])
            + f" (max rel diff {v['max_rel_diff']:.1e})"
            for name, v in checks["avgpipe_vs_single_process"].items()
        ),
        *(
            []
            if summary.get("fit_vs_runtime") is None
            else [
                "Trainer.fit (strategy='avgpipe', 1F1B, CSV logger) vs the same StagePipeline step alone, paired "
                "step by step (one runtime step between two fit iterations), median of fit/runtime per round: "
                + ", ".join(f"{x:.3f}" for x in summary["fit_vs_runtime"]["fit_over_runtime"])
                + f" (median {summary['fit_vs_runtime']['fit_over_runtime_median']:.3f}; runtime "
                + ", ".join(f"{x * 1e3:.1f}" for x in summary["fit_vs_runtime"]["runtime_step_s"])
                + " ms, fit "
                + ", ".join(f"{x * 1e3:.1f}" for x in summary["fit_vs_runtime"]["fit_step_s"])
                + " ms)"
            ]
        ),
        "correctness: "
        + (
            "OK (first-step losses agree, avgpipe rows match single-process AvgPipe, within "
            f"rtol {checks['rtol']:g}; all losses finite)"
            if checks["ok"]
            else f"MISMATCH {checks['mismatches']}"
        ),
    ]
    return "\n".join(lines)
