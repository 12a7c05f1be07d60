"""The convergence benchmark's summary per study (``benchmarks/convergence.py``): each method at its best learning
rate, and the tuner's goodput model against the measured times."""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from benchmarks.common import spearman
from benchmarks.convergence_studies import ELASTIC, METHODS, SPECS, TUNER_ROWS, Study
from benchmarks.convergence_train import pick


def _stats(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def summarise(
    studies: dict[str, Study],
    tuned: dict[str, Any],
    pipe: dict[str, Any],
    args: argparse.Namespace,
    noise: dict[str, Any] | None = None,
) -> dict[str, Any]:
    noise = noise or {}
    out: dict[str, Any] = {}
    for s, study in studies.items():
        methods = {}
        for m in METHODS:
            by_lr = tuned["results"][(s, m)]
            best, edge = pick(by_lr, study.higher_is_better)
            runs = sorted(by_lr[best], key=lambda r: r["seed"])
            reached = [r for r in runs if r["to_target"] is not None]
            step_s = pipe[s][m]["step_s"] if pipe.get(s) else None
            grid = [
                {
                    "lr": lr,
                    "score_mean_final": _mean_or_none([r["final"] for r in by_lr[lr]]),
                    "finals": [r["final"] for r in sorted(by_lr[lr], key=lambda r: r["seed"])],
                    "diverged": sum(r["diverged"] for r in by_lr[lr]),
                }
                for lr in sorted(by_lr)
            ]
            methods[m] = {
                "best_lr": best,
                "best_lr_inside_grid": edge is None,
                "best_lr_edge": edge,
                "grid": grid,
                "grid_extensions": tuned["extensions"][(s, m)],
                "samples_per_iteration": runs[0]["samples_per_iteration"],
                "seeds": len(runs),
                "seeds_reaching_target": len(reached),
                "iterations_to_target": _stats([r["to_target"]["iteration"] for r in reached]),
                "samples_to_target": _stats([r["to_target"]["samples"] for r in reached]),
                "single_process_s_to_target": _stats([r["to_target"]["train_s"] for r in reached]),
                "pipeline_s_to_target_projected": None
                if step_s is None
                else _stats([r["to_target"]["iteration"] * step_s for r in reached]),
                "final_metric": _stats([r["final"] if r["final"] is not None else math.nan for r in runs]),
                "single_process_s_total": _stats([r["train_s"] for r in runs]),
                "replica_divergence_final": _stats([r["replica_divergence"] for r in runs])
                if SPECS[m].kind == "elastic"
                else None,
                "noise_final": _stats(
                    [r["noise_final"]["value"] for r in runs if (r.get("noise_final") or {}).get("value")]
                )
                if m == "pipe-B"
                else None,
                "runs": runs,
            }
        out[s] = {"study": asdict(study), "methods": methods, "pipeline_step_s": pipe.get(s)}
        out[s]["goodput"] = goodput_check(study, methods, pipe.get(s), noise.get(s), args.pipelines)
    return out


def goodput_check(
    study: Study, methods: dict[str, Any], pipe: dict[str, Any] | None, noise: dict[str, Any] | None, n: int
) -> dict[str, Any]:
    """The tuner's model against what the study measured.

    Per method: the efficiency the tuner predicts (``noise.efficiency`` at the noise scale measured at the initial
    weights, each method's effective batch by ``noise.effective_batch``), samples/s from the pipelined step time,
    their product (predicted goodput) and the measured projected time to target. Pass marks: the Spearman rank
    correlation of predicted goodput with 1 / measured time >= 0.8, and the method with the highest predicted
    goodput within 15% of the best measured time. Also the λ each elastic method's samples imply.
    """
    from lightning_avgpipe.algorithms.noise_scale import (
        ELASTIC_BATCH_FACTOR,
        effective_batch,
        efficiency,
        elastic_factor,
    )

    b = study.batch
    b_noise = (noise or {}).get("value")
    rows: dict[str, dict[str, Any]] = {}
    for m, r in methods.items():
        spec = SPECS[m]
        batches = 1 if spec.kind == "plain-B" else n
        averaging = "exact" if spec.kind != "elastic" else "elastic"
        factor, basis = elastic_factor(spec.period, spec.outer_lr, spec.outer_momentum)  # the tuner's λ for it
        b_eff = effective_batch(averaging, batches, b, factor=factor)
        eff = efficiency(b_noise, b, b_eff)
        step = pipe[m]["step_s"] if pipe else None
        sps = batches * b / step if step else None
        t = r["pipeline_s_to_target_projected"]
        all_reached = r["seeds_reaching_target"] == r["seeds"]
        rows[m] = {
            "effective_batch": b_eff if math.isfinite(b_eff) else None,  # None: modelled as learning nothing
            "elastic_factor": (factor if math.isfinite(factor) else None) if spec.kind == "elastic" else None,
            "elastic_factor_basis": basis if spec.kind == "elastic" else None,
            "efficiency_predicted": eff,
            "samples_per_sec": sps,
            "goodput_predicted": sps * eff if sps is not None else None,
            "time_to_target_s": t["mean"] if t is not None and all_reached else None,  # None: some seed never got there
        }
    out: dict[str, Any] = {"noise_scale_initial": b_noise, "elastic_batch_factor": ELASTIC_BATCH_FACTOR, "rows": rows}
    usable = [m for m, r in rows.items() if r["goodput_predicted"] is not None]
    if len(usable) >= 3:
        pred = [rows[m]["goodput_predicted"] for m in usable]
        speed = [1.0 / rows[m]["time_to_target_s"] if rows[m]["time_to_target_s"] else 0.0 for m in usable]
        rho: float | None = spearman(pred, speed)
        rho = None if rho is None or math.isnan(rho) else rho  # every method tied on one side
        pick_m = max(usable, key=lambda m: rows[m]["goodput_predicted"])
        times = {m: rows[m]["time_to_target_s"] for m in usable if rows[m]["time_to_target_s"]}
        best = min(times, key=lambda m: times[m]) if times else None
        ratio = times[pick_m] / times[best] if best is not None and pick_m in times else None
        # the rows the tuner chooses among (it predicts outer-N and period-N with the paper's λ, not their own)
        cands = [m for m in TUNER_ROWS if m in usable]
        rho_c = spearman([rows[m]["goodput_predicted"] for m in cands], [speed[usable.index(m)] for m in cands])
        out.update(
            spearman=rho,
            spearman_pass=rho is not None and rho >= 0.8,
            spearman_tuner_rows=None if math.isnan(rho_c) else rho_c,
            pick=pick_m,
            best_measured=best,
            pick_time_ratio=ratio,
            pick_pass=ratio is not None and ratio <= 1.15,
        )
    # λ implied by the samples to target: pipe-NB / pipe-B gives B_noise, each elastic method / pipe-NB its λ
    sb, snb = methods["pipe-B"]["samples_to_target"], methods["pipe-NB"]["samples_to_target"]
    fits: dict[str, Any] = {}
    if sb and snb:
        r_e = snb["mean"] / sb["mean"]
        implied = b * (n - r_e) / (r_e - 1) if 1 < r_e < n else None
        out["noise_scale_implied"] = implied
        for m in ELASTIC:
            sm = methods[m]["samples_to_target"]
            if sm is None:
                fits[m] = None
                continue
            ratio_m = sm["mean"] / snb["mean"]
            fit = {"samples_vs_exact": ratio_m}
            for label, bn in (("implied", implied), ("measured", b_noise)):
                fit[f"lambda_{label}"] = (ratio_m * (bn + n * b) - bn) / (n * b) if bn is not None else None
            lam = rows[m]["elastic_factor"]
            if b_noise is not None and lam is not None:  # how well the tuner's λ predicts its samples vs pipe-B
                predicted = (b_noise + lam * n * b) / (b_noise + b)
                fit["samples_vs_plain_b_predicted"] = predicted
                fit["samples_vs_plain_b_measured"] = sm["mean"] / sb["mean"]
            fits[m] = fit
    out["lambda_fits"] = fits
    return out


def _mean_or_none(values: Sequence[float | None]) -> float | None:
    if any(v is None for v in values):
        return None
    return statistics.fmean(values)  # type: ignore[arg-type]
