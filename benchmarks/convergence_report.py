"""The convergence benchmark's report (``benchmarks/convergence.py``): the tables, the computed verdict and the
figure."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from benchmarks.convergence_studies import COLORS, ELASTIC, TUNER_ROWS


def _fmt(st: dict[str, float] | None, spec: str = ".0f") -> str:
    if st is None:
        return "not reached"
    return f"{st['mean']:{spec}} ({st['min']:{spec}}-{st['max']:{spec}})"


def format_table(summary: dict[str, Any], args: argparse.Namespace) -> str:
    n = args.pipelines
    lines = []
    for s, entry in summary.items():
        st = entry["study"]
        better = ">=" if st["metric"] == "val_acc" else "<="
        lines += [
            "",
            f"== {s}: {st['description']}",
            f"   B = {st['batch']}, N = {n}; budget {st['budget_samples']} samples for every method; evaluated every "
            f"{st['eval_every']} samples; target {st['metric']} {better} {st['target']:g}; {args.seeds} seeds; "
            f"mean (min-max) over seeds at each method's best lr; final = "
            + (
                f"mean of the evaluations in the last {st['final_window']} samples"
                if st["final_window"]
                else "the last evaluation"
            ),
            f"{'method':<10} {'best lr':>8} {'grid':>7} {'reached':>7} {'iterations to target':>21} "
            f"{'samples to target':>21} {'1-proc s to target':>19} {'pipe s (proj)':>19} "
            f"{'final ' + st['metric']:>24}",
        ]
        spec = ".3f" if st["metric"] == "val_acc" else ".3f"
        for m, r in entry["methods"].items():
            inside = "inside" if r["best_lr_inside_grid"] else f"{r['best_lr_edge']} EDGE"
            lines.append(
                f"{m:<10} {r['best_lr']:>8.3g} {inside:>7} {r['seeds_reaching_target']:>4}/{r['seeds']:<2} "
                f"{_fmt(r['iterations_to_target']):>21} {_fmt(r['samples_to_target']):>21} "
                f"{_fmt(r['single_process_s_to_target'], '.1f'):>19} "
                f"{_fmt(r['pipeline_s_to_target_projected'], '.2f'):>19} {_fmt(r['final_metric'], spec):>24}"
            )
        for m, r in entry["methods"].items():
            grid = ", ".join(f"{g['lr']:g}: {_num(g['score_mean_final'])}" for g in r["grid"])
            ext = f"; {'; '.join(r['grid_extensions'])}" if r["grid_extensions"] else ""
            lines.append(f"   {m} lr grid (mean final {st['metric']}): {grid}{ext}")
        pipe = entry["pipeline_step_s"]
        if pipe:
            lines.append(
                "   pipelined step time (StagePipeline 1F1B, 2 gloo ranks x 1 thread; median, period-N: mean over "
                "whole periods): "
                + ", ".join(
                    f"{m} {p['step_s'] * 1e3:.1f} ms ({p['microbatches']} x {p['microbatch_size']})"
                    for m, p in pipe.items()
                )
            )
        for m in ELASTIC:
            div = entry["methods"][m]["replica_divergence_final"]
            if div:
                lines.append(f"   {m} replica divergence at the end, |w_n - w_ref| / |w_ref|: {div['mean']:.4f}")
        lines += format_goodput(entry)
    return "\n".join(lines)


def format_goodput(entry: dict[str, Any]) -> list[str]:
    """The tuner's predicted goodput per method against the measured time to target, and the λ fits."""
    g = entry["goodput"]
    final = entry["methods"]["pipe-B"]["noise_final"]
    implied = g.get("noise_scale_implied")
    lines = [
        f"   goodput, the tuner's model: B_noise = {_num0(g['noise_scale_initial'])} at the initial weights (the "
        f"probe, as the tuner measures it); {_num0(final['mean'] if final else None)} where pipe-B ended; "
        f"{_num0(implied)} implied by pipe-NB / pipe-B samples; lambda = {g['elastic_batch_factor']} "
        "(the paper's rule; "
        + ", ".join(
            f"{m} {r['elastic_factor'] if r['elastic_factor'] is not None else 'inf'}"
            for m, r in g["rows"].items()
            if r.get("elastic_factor_basis") and m != "avgpipe-N"
        )
        + ")",
        f"   {'method':<10} {'B_eff':>7} {'eff (pred)':>10} {'samples/s':>10} {'goodput (pred)':>15} "
        f"{'time to target (proj)':>22}",
    ]
    for m, r in g["rows"].items():
        sps, gp, t = r["samples_per_sec"], r["goodput_predicted"], r["time_to_target_s"]
        beff = f"{r['effective_batch']:.0f}" if r["effective_batch"] is not None else "inf"
        lines.append(
            f"   {m:<10} {beff:>7} {r['efficiency_predicted']:>10.3f} "
            f"{(f'{sps:.0f}' if sps is not None else '-'):>10} {(f'{gp:.0f}' if gp is not None else '-'):>15} "
            f"{(f'{t:.2f} s' if t else 'not all seeds'):>22}"
        )
    if "spearman" in g:
        rho = g["spearman"]
        lines.append(
            f"   Spearman(predicted goodput, 1 / measured time) = {_rho(rho)} "
            f"({'pass' if g['spearman_pass'] else 'FAIL'}, >= 0.8; over the tuner's own candidates "
            f"{', '.join(TUNER_ROWS)}: {_rho(g.get('spearman_tuner_rows'))}); the tuner's pick {g['pick']} took "
            + (
                f"{g['pick_time_ratio']:.2f}x the best measured time ({g['best_measured']}) "
                f"({'pass' if g['pick_pass'] else 'FAIL'}, <= 1.15)"
                if g["pick_time_ratio"] is not None
                else "no measured time (not all seeds reached the target) (FAIL)"
            )
        )
    for m, fit in g["lambda_fits"].items():
        if fit is None:
            lines.append(f"   {m}: did not reach the target: no lambda")
            continue
        lines.append(
            f"   {m}: {fit['samples_vs_exact']:.3f}x the samples of pipe-NB -> lambda {_num(fit['lambda_implied'])} "
            f"(implied B_noise), {_num(fit['lambda_measured'])} (measured B_noise)"
            + (
                f"; samples vs pipe-B predicted {fit['samples_vs_plain_b_predicted']:.2f}x, measured "
                f"{fit['samples_vs_plain_b_measured']:.2f}x"
                if "samples_vs_plain_b_predicted" in fit
                else ""
            )
        )
    return lines


def _rho(v: float | None) -> str:
    return "undefined (no method reached the target in every seed)" if v is None else f"{v:.2f}"


def _num0(v: float | None) -> str:
    return "none" if v is None else f"{v:.0f}"


def _num(v: float | None) -> str:
    return "diverged" if v is None else f"{v:.4f}"


def _overlap(x: dict[str, float], y: dict[str, float]) -> bool:
    return x["min"] <= y["max"] and y["min"] <= x["max"]


def verdict(summary: dict[str, Any], args: argparse.Namespace) -> str:
    """An honest paragraph per study, computed from the numbers (nothing in it is fixed text about the outcome)."""
    n = args.pipelines
    parts = []
    for s, entry in summary.items():
        st = entry["study"]
        ms = entry["methods"]
        hib = st["metric"] == "val_acc"
        target = f"{st['metric']} {'>=' if hib else '<='} {st['target']:g}"
        text = [f"{s} ({target}, N={n}):"]
        edges = [m for m, r in ms.items() if not r["best_lr_inside_grid"]]
        if edges:
            text.append(f"caution, the best lr of {', '.join(edges)} is still at an edge of its grid.")
        nb, b = ms["pipe-NB"], ms["pipe-B"]
        # 1. every averaging option against exact averaging (pipe-NB), per sample
        snb = nb["samples_to_target"]
        for m in ELASTIC:
            r = ms[m]
            if r["samples_to_target"] is None:
                text.append(f"{m} did not reach the target in any seed.")
                continue
            sm = r["samples_to_target"]
            partial = (
                f" (in {r['seeds_reaching_target']} of {r['seeds']} seeds)"
                if r["seeds_reaching_target"] < r["seeds"]
                else ""
            )
            if snb is None:
                text.append(f"{m} reached the target after {sm['mean']:.0f} samples{partial}; pipe-NB never did.")
            else:
                text.append(
                    f"{m} needed {100 * sm['mean'] / snb['mean']:.0f}% of pipe-NB's samples{partial} "
                    + ("(seed ranges overlap)." if _overlap(sm, snb) else "(seed ranges do not overlap).")
                )
        if b["samples_to_target"] is not None and snb is not None:
            text.append(
                f"pipe-NB (exact averaging) needed {snb['mean'] / b['samples_to_target']['mean']:.2f}x the samples of "
                "pipe-B (batch B)."
            )
        # 2. time to target, projected for the pipeline: which option pays, if any
        times = {m: r["time_to_target_s"] for m, r in entry["goodput"]["rows"].items() if r["time_to_target_s"]}
        if times:
            fastest = min(times, key=lambda m: times[m])
            ranked = ", ".join(f"{m} {times[m]:.2f} s" for m in sorted(times, key=lambda m: times[m]))
            if fastest == "pipe-B":
                pays = "no N > 1 paid: N = 1 (pipe-B) was the fastest to the target."
            elif fastest == "pipe-NB":
                pays = (
                    f"exact averaging (pipe-NB, N = {n}) paid: {times['pipe-B'] / times[fastest]:.2f}x faster than "
                    "pipe-B; no elastic option beat it."
                    if "pipe-B" in times
                    else "exact averaging (pipe-NB) was the fastest."
                )
            else:
                versus = min((times[m] for m in ("pipe-B", "pipe-NB") if m in times), default=None)
                pays = f"{fastest} paid" + (
                    f": {versus / times[fastest]:.2f}x faster than the better plain row." if versus else "."
                )
            text.append(f"Projected pipelined time to target (all seeds): {ranked}; {pays}")
        # 3. the tuner's model
        g = entry["goodput"]
        if "spearman" in g:
            text.append(
                f"The tuner's predicted goodput ranks the methods with Spearman {_rho(g['spearman'])} against 1 / "
                f"measured time ({'pass' if g['spearman_pass'] else 'FAIL'}; {_rho(g.get('spearman_tuner_rows'))} over "
                f"the settings it chooses among, {', '.join(TUNER_ROWS)}); its pick, {g['pick']}, "
                + (
                    f"took {g['pick_time_ratio']:.2f}x the best time ({'pass' if g['pick_pass'] else 'FAIL'})."
                    if g["pick_time_ratio"] is not None
                    else "has no measured time (FAIL)."
                )
            )
        parts.append(" ".join(text))
    return "\n".join(parts)


def plot(summary: dict[str, Any], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = len(summary)
    fig, axes = plt.subplots(rows, 2, figsize=(13, 4.2 * rows), squeeze=False)
    for row, (s, entry) in enumerate(summary.items()):
        st = entry["study"]
        for col, x_key in enumerate(("samples", "iteration")):
            ax = axes[row][col]
            for m, r in entry["methods"].items():
                curves = [run["curve"] for run in r["runs"] if not run["diverged"]]
                if not curves:
                    continue
                length = min(len(c) for c in curves)
                first = 1 if x_key == "iteration" else 0  # a log axis has no 0: start at the first evaluation
                xs = [p[x_key] for p in curves[0][first:length]]
                ys = torch.tensor([[p[st["metric"]] for p in c[first:length]] for c in curves])
                mean = ys.mean(0).tolist()
                label = f"{m.replace('-N', f'-{args.pipelines}')}  lr {r['best_lr']:g}"
                ax.plot(xs, mean, color=COLORS[m], label=label, lw=1.8)
                ax.fill_between(xs, ys.min(0).values.tolist(), ys.max(0).values.tolist(), color=COLORS[m], alpha=0.2)
            ax.axhline(st["target"], color="black", ls="--", lw=1, label=f"target {st['target']:g}")
            if x_key == "iteration":  # pipe-B takes N times as many iterations: a log axis shows all three
                ax.set_xscale("log")
            ax.set_xlabel("training samples" if x_key == "samples" else "iterations (optimizer steps; log scale)")
            ax.set_ylabel("validation accuracy" if st["metric"] == "val_acc" else "validation loss (nats/char)")
            if st["metric"] == "val_acc":
                ax.set_ylim(max(0.0, st["target"] - 0.25), 1.0)
            else:
                finals = [r["final_metric"]["mean"] for r in entry["methods"].values() if r["final_metric"]]
                lo = min(finals + [st["target"]])
                ax.set_ylim(lo - 0.15, lo + 1.5)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8, loc="lower right" if st["metric"] == "val_acc" else "upper right")
            ax.set_title(
                f"{s}: B={st['batch']}, N={args.pipelines}, mean and min-max over {args.seeds} seeds", fontsize=10
            )
    fig.suptitle(
        "AvgPipe vs plain pipeline training: validation metric at each method's tuned lr "
        "(single-process arithmetic = the pipeline's)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
