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
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.convergence_report import _num0, format_table, plot, verdict  # noqa: E402
from benchmarks.convergence_studies import METHODS, data_for, make_studies  # noqa: E402
from benchmarks.convergence_summary import summarise  # noqa: E402
from benchmarks.convergence_timing import measure_pipeline  # noqa: E402
from benchmarks.convergence_train import noise_scale, tune  # noqa: E402
from examples.gpt_args import add_model_args, check_model_args  # noqa: E402


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
