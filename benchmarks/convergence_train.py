"""The convergence benchmark's training (``benchmarks/convergence.py``): one run in a single process (the arithmetic
the pipelined strategy is proven to reproduce), the noise-scale probe, and the learning-rate tuning over a worker
pool."""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.convergence_studies import METHODS, SPECS, Data, Study, data_for, sample_stream


def train_run(data: Data, method: str, lr: float, seed: int, n: int) -> dict[str, Any]:
    from lightning_avgpipe.algorithms.elastic import ElasticAveraging
    from lightning_avgpipe.algorithms.optim import clone_optimizer

    study = data.study
    spec = SPECS[method]
    elastic_kind = spec.kind == "elastic"
    b = study.batch
    per_iter = b if spec.kind == "plain-B" else n * b
    iterations = study.budget_samples // per_iter
    order = sample_stream(len(data.x), study.budget_samples, seed)
    model = data.model(seed)  # the same initial weights for every method and learning rate of this seed
    if elastic_kind:
        elastic = ElasticAveraging(  # replicas start as copies of the reference
            list(model), num_replicas=n, outer_lr=spec.outer_lr, outer_momentum=spec.outer_momentum, period=spec.period
        )
        template = data.optimizer(list(model.parameters()), lr)
        opts = [clone_optimizer(template, elastic.replica_params(r), elastic.reference_params) for r in range(n)]
        nets = [nn.Sequential(*layers) for layers in elastic.replicas]
    else:
        opt = data.optimizer(model.parameters(), lr)

    def point(it: int, train_s: float, train_loss: float) -> dict[str, Any]:
        model.eval()
        val_loss, val_acc = data.evaluate(model)  # the reference model for avgpipe-N
        model.train()
        return {
            "iteration": it,
            "samples": it * per_iter,
            "train_s": train_s,
            "train_loss": train_loss,
            "val_loss": val_loss,
            "val_acc": val_acc,
        }

    curve = [point(0, 0.0, float("nan"))]
    train_s = 0.0
    recent: list[float] = []
    diverged = False
    for it in range(1, iterations + 1):
        idx = order[(it - 1) * per_iter : it * per_iter]
        t0 = time.perf_counter()
        if elastic_kind:
            losses = []
            for r in range(n):
                part = idx[r * b : (r + 1) * b]
                opts[r].zero_grad(set_to_none=True)
                loss = data.loss(nets[r](data.x[part]), data.y[part])
                loss.backward()
                losses.append(loss.item())
            elastic.begin_step()
            for o in opts:
                o.step()
            elastic.finish_step()
            value = sum(losses) / n
        else:
            opt.zero_grad(set_to_none=True)
            loss = data.loss(model(data.x[idx]), data.y[idx])
            loss.backward()
            opt.step()
            value = loss.item()
        train_s += time.perf_counter() - t0
        recent.append(value)
        if not math.isfinite(value):
            diverged = True
            break
        if (it * per_iter) % study.eval_every == 0:
            curve.append(point(it, train_s, sum(recent) / len(recent)))
            recent = []
    out: dict[str, Any] = {
        "method": method,
        "lr": lr,
        "seed": seed,
        "iterations": iterations,
        "samples_per_iteration": per_iter,
        "diverged": diverged,
        "curve": curve,
        "train_s": train_s,
    }
    tail = [p for p in curve if p["samples"] >= study.budget_samples - study.final_window]
    final = statistics.fmean(p[study.metric] for p in tail) if not diverged else None
    out["final"] = final if final is not None and math.isfinite(final) else None
    out["final_val_loss"] = statistics.fmean(p["val_loss"] for p in tail) if not diverged else None
    out["final_evaluations"] = len(tail)
    hit = next((p for p in curve if study.reached(p[study.metric])), None)
    out["to_target"] = None if hit is None else {k: hit[k] for k in ("iteration", "samples", "train_s")}
    if elastic_kind:
        ratios = [math.sqrt(float(d[0]) / max(float(d[1]), 1e-30)) for d in elastic.divergence()]
        out["replica_divergence"] = sum(ratios) / len(ratios)  # mean over replicas of ‖w_n - w_ref‖ / ‖w_ref‖
    if spec.kind == "plain-B" and not diverged:  # the noise scale where training ended (it grows as training goes)
        out["noise_final"] = noise_scale(data, model, b, torch.Generator().manual_seed(20_000 + seed))
    return out


def noise_scale(data: Data, model: nn.Module, batch: int, g: torch.Generator, draws: int = 16) -> dict[str, Any]:
    """B_simple at ``model``'s weights as the tuner measures it: per batch of B, the gradients of its two halves
    and of the whole (``GradientNorms``), averaged over ``draws`` batches; ``value`` is None when not positive."""
    from lightning_avgpipe.algorithms.noise_scale import GradientNorms

    params = [p for p in model.parameters() if p.requires_grad]

    def grad(idx: Tensor) -> list[Tensor]:
        return list(torch.autograd.grad(data.loss(model(data.x[idx]), data.y[idx]), params))

    def sq(gs: Sequence[Tensor]) -> float:
        return float(sum(x.double().square().sum() for x in gs))

    grad_sq, trace = [], []
    half = batch // 2
    for _ in range(draws):
        idx = torch.randint(0, len(data.x), (batch,), generator=g)
        g1, g2 = grad(idx[:half]), grad(idx[half:])
        whole = [(a * half + c * (batch - half)) / batch for a, c in zip(g1, g2)]
        est = GradientNorms((sq(g1) + sq(g2)) / 2, 2 / (1 / half + 1 / (batch - half)), sq(whole), batch).estimates()
        grad_sq.append(est[0])
        trace.append(est[1])
    mg, mt = statistics.fmean(grad_sq), statistics.fmean(trace)
    return {"value": mt / mg if mg > 0 and mt > 0 else None, "grad_sq": mg, "trace": mt, "draws": draws}


_STUDIES: dict[str, Study] = {}


def _init_worker(studies: dict[str, Study]) -> None:
    torch.set_num_threads(1)
    _STUDIES.update(studies)


def _job(name: str, method: str, lr: float, seed: int, n: int) -> dict[str, Any]:
    result = train_run(data_for(_STUDIES[name]), method, lr, seed, n)
    result["study"] = name
    return result


def lr_grid(center: float, ratio: float, points: int) -> list[float]:
    first = -(points // 2)
    return [_clean(center * ratio ** (first + k)) for k in range(points)]


def _clean(lr: float) -> float:
    return float(f"{lr:.4g}")


def score(results: Sequence[dict[str, Any]], higher_is_better: bool) -> float:
    """Mean final metric over seeds, signed so that larger is better; a diverged seed is the worst possible."""
    values = [r["final"] for r in results]
    if any(v is None for v in values):
        return -math.inf
    mean = sum(values) / len(values)
    return mean if higher_is_better else -mean


def pick(by_lr: dict[float, list[dict[str, Any]]], higher_is_better: bool) -> tuple[float, str | None]:
    """The best learning rate, and which edge of the grid it sits on (None when it is inside)."""
    lrs = sorted(by_lr)

    def key(lr: float) -> tuple[float, float]:  # ties (equal accuracy) go to the lower validation loss
        rs = by_lr[lr]
        losses = [r["final_val_loss"] for r in rs]
        tie = -sum(losses) / len(losses) if all(v is not None for v in losses) else -math.inf
        return score(rs, higher_is_better), tie

    best = max(lrs, key=key)
    edge = "low" if best == lrs[0] else "high" if best == lrs[-1] else None
    return best, edge


def tune(studies: dict[str, Study], args: argparse.Namespace, log: Callable[[str], None]) -> dict[str, Any]:
    """Run every (study, method, lr, seed), extending each method's grid past an edge that holds its best lr."""
    seeds = list(range(args.seeds))
    grids = {(s, m): lr_grid(st.lr_center, st.lr_ratio, st.grid_points) for s, st in studies.items() for m in METHODS}
    results: dict[tuple[str, str], dict[float, list[dict[str, Any]]]] = {k: {} for k in grids}
    extensions: dict[tuple[str, str], list[str]] = {k: [] for k in grids}
    pending = [(s, m, lr) for (s, m), grid in grids.items() for lr in grid]
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    workers = max(1, args.workers)
    from concurrent.futures import ProcessPoolExecutor, as_completed

    started = time.perf_counter()
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker, initargs=(studies,)) as pool:
        round_no = 0
        while pending:
            # the slowest runs first, so the pool's workers finish together
            jobs = sorted(
                ((s, m, lr, seed) for s, m, lr in pending for seed in seeds),
                key=lambda j: (j[0] != "text", SPECS[j[1]].kind != "elastic"),
            )
            futures = {pool.submit(_job, s, m, lr, seed, args.pipelines): (s, m, lr) for s, m, lr, seed in jobs}
            done = 0
            for fut in as_completed(futures):
                s, m, lr = futures[fut]
                results[(s, m)].setdefault(lr, []).append(fut.result())
                done += 1
                if done % max(1, len(jobs) // 10) == 0 or done == len(jobs):
                    log(f"  [round {round_no}] {done}/{len(jobs)} runs done, {time.perf_counter() - started:.0f} s")
            pending = []
            for (s, m), by_lr in results.items():
                best, edge = pick(by_lr, studies[s].higher_is_better)
                if edge is None:
                    continue
                if len(extensions[(s, m)]) >= args.max_extend:
                    if round_no == len(extensions[(s, m)]):  # say it once
                        log(
                            f"  {s} {m}: best lr {best:g} is still at the {edge} edge of the grid after "
                            f"{args.max_extend} extension(s); reported as EDGE"
                        )
                    continue
                lrs = sorted(by_lr)
                ratio = studies[s].lr_ratio
                new = _clean(lrs[0] / ratio) if edge == "low" else _clean(lrs[-1] * ratio)
                extensions[(s, m)].append(f"best lr {best:g} at the {edge} edge: added {new:g}")
                log(f"  {s} {m}: best lr {best:g} is at the {edge} edge of the grid; extending it with {new:g}")
                pending.append((s, m, new))
            round_no += 1
    return {"results": results, "extensions": extensions, "grids": grids}
