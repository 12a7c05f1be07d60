"""Statistical efficiency of AvgPipe against plain pipeline training, on real data, with tuned learning rates.

    PYTHONPATH=. python benchmarks/convergence.py                  # defaults: ~5 min on 2 CPU cores (10 when busy)
    PYTHONPATH=. python benchmarks/convergence.py --quick          # a ~30 s smoke run (tiny budgets, not a result)
    PYTHONPATH=. python benchmarks/convergence.py --datasets digits --seeds 5 --json runs/conv.json --png runs/conv.png

Five ways to train the same model on the same stream of samples, side by side:

- ``pipe-B``     plain pipeline training with the user's batch B (one optimizer step per B samples)
- ``pipe-NB``    ``averaging="exact"``: the N batches of a step as one batch of N·B (plain training at N·B), the same
                 samples per iteration as the averaging rows
- ``avgpipe-N``  the paper's rule: N replicas, each on its own batch of B with its own optimizer, tied to the
                 reference model by elastic averaging (``ElasticAveraging``, alpha = 1/N); the reference is evaluated
- ``outer-N``    the same with DiLoCo's outer optimizer on the reference (``outer_lr=0.7, outer_momentum=0.9``)
- ``period-N``   the same with ``averaging_period=4``: four local steps between pulls

on three studies: scikit-learn's digits with the MLP of ``examples/digits.py`` (Adam; metric: validation accuracy),
the standard library's docstrings with the character GPT of ``examples/char_gpt.py`` (AdamW; metric: validation loss
in nats per character), and the digits as 8x8 images with a small CNN (SGD with momentum; validation accuracy).

Goodput. Per study the noise scale is measured as the tuner measures it (the halves of a batch of B, at the initial
weights) and the tuner's model predicts each method's efficiency, and with the pipelined step time its goodput.
The study passes when the rank correlation of predicted goodput with 1 / measured time to target is >= 0.8 and the
method with the highest predicted goodput is within 15% of the best measured time. The λ (``noise.effective_batch``)
each elastic method's samples imply is reported with the error of the fitted λ.

How statistical efficiency is measured. ``tests/test_parallel_pipelines.py`` and
``tests/test_strategy_equivalence.py`` prove that ``AvgPipeStrategy`` computes, to float tolerance, what a single
process computes: plain training with gradient accumulation over the micro-batches (N = 1), and
``tests/helpers/lit.py::reference_elastic`` (N replicas, each with its own clone of the optimizer, then the elastic
rule). Convergence per iteration and per sample therefore does not depend on running the pipeline, so it is
measured here with that single-process arithmetic (whole batches instead of micro-batches: the same gradient up
to float rounding), which lets the study afford a learning-rate grid times several seeds.

Fairness. Every method gets the same budget in *samples*: the same data and the same forward/backward work; an
equal-iteration budget would hand pipe-NB and avgpipe-N N times the data of pipe-B. pipe-B therefore takes N times
as many optimizer steps as the other two, which take the same number. Every method sees the same samples in the same
order (one shuffled stream per seed, cut into batches; avgpipe-N's N batches of an iteration are pipe-NB's batch),
starts from the same weights for a given seed, and is evaluated at the same sample counts. For every method the
learning rate is tuned on a log-spaced grid: each grid point is run with every seed, the best point is the one with
the best mean final validation metric (digits: the mean of the evaluations over the last epoch, because accuracy on
297 images jumps by 1-2% from one evaluation to the next; text: the last evaluation; ties go to the lower
validation loss), and when that point is at an edge of the grid the grid is extended past that edge (and the output
says so) until the best point is inside it or ``--max-extend`` extensions were made.

Reported per method at its best learning rate, as mean and spread (min-max) over seeds: iterations, samples and
time to the target metric (the first evaluation at or past it; its resolution is the evaluation interval), and the
final metric. Two times are reported and labelled:

- ``1-proc s``: the measured wall time of the single-process run (training only, evaluation excluded, one thread);
- ``pipe s (proj)``: a projection for the real pipeline: iterations x the median step time of that configuration
  measured once with this project's ``StagePipeline`` (1F1B) on 2 gloo ranks (1 thread each), 2 stages, each
  replica's batch in ``--microbatches`` micro-batches (pipe-NB uses N times as many micro-batches of the same
  size, so it has AvgPipe's bubble fraction). It ignores everything but the training step (data loading,
  evaluation, Lightning's loop).

The PNG shows the validation metric against samples and against iterations, mean over seeds with the min-max band
shaded, for each method at its best learning rate; ``--json PATH`` writes every run (curves included).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import multiprocessing as mp
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402, N812
from torch import Tensor, nn  # noqa: E402

from benchmarks.common import spearman  # noqa: E402
from examples.gpt_args import add_model_args, check_model_args, model_sizes  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402


@dataclass(frozen=True)
class Method:
    """One way to train on the stream: plain at B, plain at N·B (``averaging="exact"``), or elastic averaging."""

    name: str
    kind: str  # "plain-B", "exact" or "elastic"
    about: str
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    period: int = 1

    def strategy_options(self) -> dict[str, Any]:
        """The ``AvgPipeStrategy`` arguments that train this way (besides ``num_pipelines``)."""
        if self.kind == "exact":
            return {"averaging": "exact"}
        if self.kind == "elastic":
            return {"outer_lr": self.outer_lr, "outer_momentum": self.outer_momentum, "averaging_period": self.period}
        return {}


SPECS = {
    m.name: m
    for m in (
        Method("pipe-B", "plain-B", "plain training at the user's batch B (N = 1)"),
        Method("pipe-NB", "exact", "averaging='exact': the N batches of a step as one batch of N·B"),
        Method("avgpipe-N", "elastic", "the paper's rule: elastic averaging, the reference moves by the mean update"),
        Method(
            "outer-N",
            "elastic",
            "elastic averaging with DiLoCo's outer Nesterov optimizer (outer_lr 0.7, outer_momentum 0.9)",
            outer_lr=0.7,
            outer_momentum=0.9,
        ),
        Method(
            "period-N", "elastic", "elastic averaging with averaging_period H = 4 (the paper's outer step)", period=4
        ),
    )
}
METHODS = tuple(SPECS)
TUNER_ROWS = ("pipe-B", "pipe-NB", "avgpipe-N")  # the settings AvgPipeTuner predicts and chooses among
ELASTIC = tuple(m for m in METHODS if SPECS[m].kind == "elastic")
COLORS = {
    "pipe-B": "tab:blue",
    "pipe-NB": "tab:orange",
    "avgpipe-N": "tab:green",
    "outer-N": "tab:red",
    "period-N": "tab:purple",
}


# ---------------------------------------------------------------------------------------------------------------
# the two studies
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Study:
    """One data set, one model, one optimizer, one budget: everything the three methods share."""

    name: str
    metric: str  # "val_acc" (higher is better) or "val_loss" (lower is better)
    target: float
    batch: int  # B, per pipeline / replica
    budget_samples: int  # equal for every method
    eval_every: int  # samples between evaluations (a multiple of N·B, so every method evaluates at the same points)
    lr_center: float
    lr_ratio: float
    grid_points: int
    final_window: int = 0  # "final" metric = mean of the evaluations in the last final_window samples (0: the last)
    description: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def higher_is_better(self) -> bool:
        return self.metric == "val_acc"

    def reached(self, value: float | None) -> bool:
        if value is None or not math.isfinite(value):
            return False
        return value >= self.target if self.higher_is_better else value <= self.target


def make_studies(args: argparse.Namespace) -> dict[str, Study]:
    n = args.pipelines
    quick = args.quick
    studies = {}
    # digits: 1,200 training images; budget in epochs of them
    b = args.digits_batch
    per_iter = n * b
    epochs = 2 if quick else args.digits_epochs
    budget = _round_up(epochs * 1200, 2 * per_iter)
    studies["digits"] = Study(
        name="digits",
        metric="val_acc",
        target=args.digits_target,
        batch=b,
        budget_samples=budget,
        eval_every=2 * per_iter,
        lr_center=args.digits_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        final_window=0 if quick else 1200,  # accuracy on 297 images jumps by 1-2% between evaluations: one epoch
        description="scikit-learn digits (1,200 train / 297 val images), examples/digits.py DigitsMLP "
        "(64-256x4-10), Adam",
    )
    b = args.text_batch
    per_iter = n * b
    iters = 8 if quick else args.text_iters  # iterations of pipe-NB / avgpipe (N·B windows each)
    every = max(1, iters // (4 if quick else 16)) * per_iter
    studies["text"] = Study(
        name="text",
        metric="val_loss",
        target=args.text_target,
        batch=b,
        budget_samples=_round_up(iters * per_iter, every),
        eval_every=every,
        lr_center=args.text_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        description=f"stdlib docstrings, windows of {args.block_size} characters, examples/char_gpt.py GPT "
        f"(n_layer {args.n_layer}, n_embd {args.n_embd}, n_head {args.n_head}), AdamW(weight_decay=0.01); "
        f"validation loss on {args.text_val_windows} fixed validation windows",
        extra={**model_sizes(args), "corpus_chars": args.corpus_chars, "val_windows": args.text_val_windows},
    )
    b = args.digits_batch
    per_iter = n * b
    epochs = 2 if quick else args.digits_epochs
    studies["digits-cnn"] = Study(
        name="digits-cnn",
        metric="val_acc",
        target=args.digits_target,
        batch=b,
        budget_samples=_round_up(epochs * 1200, 2 * per_iter),
        eval_every=2 * per_iter,
        lr_center=args.cnn_lr,
        lr_ratio=args.lr_ratio,
        grid_points=args.grid,
        final_window=0 if quick else 1200,
        description="scikit-learn digits as 1x8x8 images, a small CNN (conv 16, conv 32, max-pool, linear 64, "
        "linear 10), SGD with momentum 0.9",
    )
    return {name: studies[name] for name in args.datasets}


def digits_cnn() -> nn.Sequential:
    """A convolutional model of the digits: another model family than the MLP and the GPT, and another optimizer."""
    return nn.Sequential(
        nn.Unflatten(1, (1, 8, 8)),
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


class Data:
    """A study's tensors, its model factory, its loss and its evaluation."""

    def __init__(self, study: Study) -> None:
        self.study = study
        if study.name in ("digits", "digits-cnn"):
            from examples.digits import DigitsDataModule

            digits = DigitsDataModule()
            self.x, self.y = digits.train.tensors
            self.vx, self.vy = digits.val.tensors
        else:
            from examples.char_gpt import CharDataModule

            e = study.extra
            text = CharDataModule(block_size=e["block_size"], max_chars=e["corpus_chars"])
            self.vocab = text.vocab_size

            def windows(data: Tensor) -> tuple[Tensor, Tensor]:
                count = (len(data) - 1) // e["block_size"]
                chunks = data[: count * e["block_size"] + 1]
                x = chunks[:-1].view(count, e["block_size"])
                y = chunks[1:].view(count, e["block_size"])
                return x, y  # the windows of examples.text_data.CharDataset, stacked

            self.x, self.y = windows(text.train_data)
            vx, vy = windows(text.val_data)
            pick = torch.linspace(0, len(vx) - 1, min(e["val_windows"], len(vx))).long()  # spread over the text
            self.vx, self.vy = vx[pick], vy[pick]

    def model(self, seed: int) -> nn.Sequential:
        torch.manual_seed(seed)
        if self.study.name == "digits":
            from examples.digits import DigitsMLP

            return DigitsMLP().layers  # its pipeline layers: 4 x (Linear 256 + ReLU), Linear 10
        if self.study.name == "digits-cnn":
            return digits_cnn()
        from examples.char_gpt import GPTConfig, gpt_layers

        e = self.study.extra
        return gpt_layers(GPTConfig(vocab_size=self.vocab, **model_sizes(e), dropout=0.0))

    def optimizer(self, params: Any, lr: float) -> torch.optim.Optimizer:
        if self.study.name == "digits":
            return torch.optim.Adam(params, lr=lr)  # DigitsMLP.configure_optimizers
        if self.study.name == "digits-cnn":
            return torch.optim.SGD(params, lr=lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)  # CharGPT.configure_optimizers

    @staticmethod
    def loss(logits: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def evaluate(self, model: nn.Module) -> tuple[float, float]:
        """(validation loss, validation accuracy) of ``model`` on the whole validation set."""
        with torch.no_grad():
            chunks = [(model(x), y) for x, y in zip(self.vx.split(256), self.vy.split(256))]
        total = sum(self.loss(lg, y).item() * y.numel() for lg, y in chunks) / self.vy.numel()
        correct = sum((lg.argmax(-1) == y).sum().item() for lg, y in chunks) / self.vy.numel()
        return total, correct


def sample_stream(size: int, count: int, seed: int) -> Tensor:
    """The first ``count`` indices of shuffled epochs over ``size`` samples: every method cuts the same stream."""
    g = torch.Generator().manual_seed(10_000 + seed)
    parts, have = [], 0
    while have < count:
        parts.append(torch.randperm(size, generator=g))
        have += size
    return torch.cat(parts)[:count]


# ---------------------------------------------------------------------------------------------------------------
# one training run (single process; the arithmetic the pipelined strategy is proven to reproduce)
# ---------------------------------------------------------------------------------------------------------------
def train_run(data: Data, method: str, lr: float, seed: int, n: int) -> dict[str, Any]:
    from lightning_avgpipe.elastic import ElasticAveraging
    from lightning_avgpipe.optim import clone_optimizer

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
    from lightning_avgpipe.noise_scale import GradientNorms

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


# ---------------------------------------------------------------------------------------------------------------
# learning-rate tuning, with a worker pool
# ---------------------------------------------------------------------------------------------------------------
_DATA: dict[str, Data] = {}
_STUDIES: dict[str, Study] = {}


def _init_worker(studies: dict[str, Study]) -> None:
    torch.set_num_threads(1)
    _STUDIES.update(studies)


def data_for(study: Study) -> Data:
    """The study's data, loaded once per process (forked workers inherit the parent's)."""
    if study.name not in _DATA:
        _DATA[study.name] = Data(study)
    return _DATA[study.name]


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


# ---------------------------------------------------------------------------------------------------------------
# pipelined step time of each configuration: StagePipeline (the strategy's step), 1F1B, 2 gloo ranks
# ---------------------------------------------------------------------------------------------------------------
PIPE_WORLD = 2


def _pipe_rank(rank: int, study: Study, n: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.topology import Topology

    data = data_for(study)
    layers = list(data.model(0))
    cut = -(-len(layers) // 2)  # the first half of the layers (rounded up) on stage 0
    own = layers[:cut] if rank == 0 else layers[cut:]
    b = study.batch
    g = torch.Generator().manual_seed(1)

    def batch(size: int) -> tuple[Tensor, Tensor]:
        idx = torch.randint(0, len(data.x), (size,), generator=g)
        return data.x[idx], data.y[idx]

    def loss(out: Tensor, micro: tuple[Tensor, Tensor], share: float) -> Tensor:
        return Data.loss(out, micro[1])

    class Config:
        """One method's StagePipeline step (what the strategy runs), 1F1B, then the optimizer it wraps."""

        def __init__(self, method: str) -> None:
            spec = SPECS[method]
            self.method = method
            self.replicas = 1 if spec.kind == "plain-B" else n  # batches per step (exact: one model, N batches)
            cfg = PipelineConfig(
                num_microbatches=m,
                num_pipelines=self.replicas,
                sync_reference=True,
                partition=[cut, len(layers) - cut],
                **spec.strategy_options(),
            )
            self.pipe = StagePipeline(copy.deepcopy(own), Topology(rank, PIPE_WORLD, PIPE_WORLD), cfg)
            self.opt = self.pipe.optimizer(data.optimizer(self.pipe.reference_params, study.lr_center))

        def step(self) -> None:
            batches = [batch(b) for _ in range(self.replicas)]
            self.opt.zero_grad(set_to_none=True)
            self.pipe.train_step(batches, loss)
            self.opt.step()

    configs = {name: Config(name) for name in METHODS}
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for i in range(warmup + steps):
        shift = i % len(METHODS)
        for name in METHODS[shift:] + METHODS[:shift]:  # interleaved, rotating: load bursts hit every row alike
            dist.barrier()
            t0 = time.perf_counter()
            configs[name].step()
            if i >= warmup:
                times[name].append(time.perf_counter() - t0)
    dist.barrier()
    return times


def _pipe_entry(rank: int, world: int, study: Study, n: int, m: int, steps: int, warmup: int) -> dict[str, Any]:
    return _pipe_rank(rank, study, n, m, steps, warmup)


def measure_pipeline(study: Study, n: int, m: int, steps: int, warmup: int, timeout: float) -> dict[str, Any]:
    """Median training-step seconds of each method's configuration, run by the real runtime on 2 gloo ranks."""
    got = run_distributed(
        _pipe_entry,
        PIPE_WORLD,
        study,
        n,
        m,
        steps,
        warmup,
        timeout=timeout,
        start_method="fork" if "fork" in mp.get_all_start_methods() else "spawn",
        what="pipeline timing",
    )
    out = {}
    for name in METHODS:
        per_step = [max(got[r][name][i] for r in range(PIPE_WORLD)) for i in range(steps)]  # the slowest rank's
        period = SPECS[name].period
        whole = per_step[: len(per_step) // period * period] or per_step
        out[name] = {
            # with a period H the averaging runs every H steps: the mean over whole periods counts it once per H
            "step_s": statistics.median(per_step) if period == 1 else statistics.fmean(whole),
            "step_s_median": statistics.median(per_step),
            "step_s_min": min(per_step),
            "step_s_max": max(per_step),
            "microbatches": m if name == "pipe-B" else n * m,
            "microbatch_size": study.batch // m,
        }
    return out


# ---------------------------------------------------------------------------------------------------------------
# summary, verdict, figure
# ---------------------------------------------------------------------------------------------------------------
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
    from lightning_avgpipe.noise_scale import ELASTIC_BATCH_FACTOR, effective_batch, efficiency, elastic_factor

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


# ---------------------------------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--datasets", default="digits,text,digits-cnn", help="comma-separated: digits, text, digits-cnn")
    p.add_argument("--pipelines", type=int, default=4, help="N: AvgPipe's replicas, and pipe-NB's batch multiplier")
    p.add_argument("--seeds", type=int, default=3, help="seeds per (method, lr): 0, 1, ..., seeds-1")
    p.add_argument("--grid", type=int, default=5, help="learning rates per method before any extension")
    p.add_argument("--lr-ratio", type=float, default=2.0, help="ratio between neighbouring grid learning rates")
    p.add_argument("--max-extend", type=int, default=3, help="at most this many grid extensions per method")
    p.add_argument("--workers", type=int, default=2, help="training processes in parallel (1 thread each)")
    p.add_argument("--digits-batch", type=int, default=32, help="B for digits")
    p.add_argument("--digits-epochs", type=int, default=10, help="budget for digits, in epochs of 1,200 samples")
    p.add_argument("--digits-target", type=float, default=0.95, help="target validation accuracy")
    p.add_argument("--digits-lr", type=float, default=4e-3, help="centre of the digits lr grid")
    p.add_argument("--cnn-lr", type=float, default=0.05, help="centre of the digits-cnn lr grid (SGD, momentum 0.9)")
    p.add_argument("--text-batch", type=int, default=16, help="B for the character GPT (windows)")
    p.add_argument("--text-iters", type=int, default=128, help="budget for text in iterations of N·B windows")
    p.add_argument("--text-target", type=float, default=2.55, help="target validation loss (nats per character)")
    p.add_argument("--text-lr", type=float, default=8e-3, help="centre of the text lr grid")
    add_model_args(p, n_layer=2, n_embd=64, n_head=4, block_size=32)
    p.add_argument("--text-val-windows", type=int, default=256)
    p.add_argument("--corpus-chars", type=int, default=1_000_000)
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per batch B in the pipelined timing")
    p.add_argument("--pipe-steps", type=int, default=20, help="timed steps per method in the pipelined timing")
    p.add_argument("--no-pipe-timing", action="store_true", help="skip the pipelined timing (no projection)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a ~30 s smoke run: tiny budgets, 3-point grids, 2 seeds, no grid extension",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write every figure and run to this JSON file")
    p.add_argument("--png", default="runs/convergence.png", help="where to draw the curves")
    args = p.parse_args(argv)
    check_model_args(p, args)
    args.datasets = [d.strip() for d in args.datasets.split(",") if d.strip()]
    unknown = set(args.datasets) - {"digits", "text", "digits-cnn"}
    if unknown or not args.datasets:
        p.error(f"--datasets takes digits, text and/or digits-cnn, got {args.datasets}")
    if args.quick:
        args.seeds = min(args.seeds, 2)
        args.grid = 3
        args.max_extend = 0
        args.pipe_steps = 3
        args.corpus_chars = min(args.corpus_chars, 100_000)
        args.text_val_windows = min(args.text_val_windows, 64)
    if args.pipelines < 1 or args.seeds < 1 or args.grid < 1:
        p.error("--pipelines, --seeds and --grid must be >= 1")
    for b in (args.digits_batch, args.text_batch):
        if b % args.microbatches:
            p.error(f"--microbatches={args.microbatches} must divide the batch sizes")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    studies = make_studies(args)
    started = time.perf_counter()

    def log(msg: str) -> None:
        print(msg, flush=True)

    log(
        f"Convergence benchmark: {', '.join(studies)}; methods {', '.join(METHODS)} with N = {args.pipelines}; "
        f"{args.seeds} seeds x {args.grid}-point lr grids (ratio {args.lr_ratio:g}); {args.workers} workers."
        + (" QUICK smoke run: the numbers mean nothing." if args.quick else "")
    )
    log(
        "Statistical efficiency is measured with the single-process computation that the pipelined strategy is "
        "proven (tests/test_parallel_pipelines.py) to equal; wall times are labelled single-process or projected."
    )
    for study in studies.values():
        data_for(study)  # loaded once here; the forked processes below inherit it
    log(f"data loaded ({time.perf_counter() - started:.0f} s)")
    noise = {}
    for s, study in studies.items():  # what the tuner measures: the probe at the initial weights (seed 0)
        data = data_for(study)
        noise[s] = noise_scale(data, data.model(0), study.batch, torch.Generator().manual_seed(30_000), draws=32)
        log(f"noise scale of {s} at the initial weights: {_num0(noise[s]['value'])} samples")
    pipe: dict[str, Any] = {}
    if not args.no_pipe_timing:
        for s, study in studies.items():
            log(f"timing one step of each configuration on 2 gloo ranks ({s}) ...")
            pipe[s] = measure_pipeline(study, args.pipelines, args.microbatches, args.pipe_steps, 3, timeout=300)
    log(f"training ... ({time.perf_counter() - started:.0f} s)")
    tuned = tune(studies, args, log)
    summary = summarise(studies, tuned, pipe, args, noise)
    table = format_table(summary, args)
    text = verdict(summary, args)
    log(table)
    log("")
    log("Verdict (computed from the numbers above):\n" + text)
    elapsed = time.perf_counter() - started
    log(f"\n(total {elapsed:.0f} s)")
    png = Path(args.png)
    plot(summary, png, args)
    log(f"wrote {png}")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "config": {k: v for k, v in vars(args).items()} | {"methods": list(METHODS), "torch": torch.__version__},
            "method": "single-process arithmetic equal to the pipelined strategy (tests/test_parallel_pipelines.py); "
            "pipeline times are projections: iterations x median step time on 2 gloo ranks",
            "studies": summary,
            "verdict": text,
            "wall_s": elapsed,
        }
        path.write_text(json.dumps(_jsonable(doc), indent=1) + "\n")
        log(f"wrote {path}")
    return 0


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


if __name__ == "__main__":
    sys.exit(main())
