"""What measuring the gradient noise scale costs a training step (``StagePipeline.train_step(noise=True)``).

    PYTHONPATH=. python benchmarks/noise_cost.py                  # about 1-2 minutes on 2 CPU cores
    PYTHONPATH=. python benchmarks/noise_cost.py --steps 40 --json runs/noise_cost.json

The strategy measures the noise scale on the steps whose logs Lightning writes (``docs/how-it-works.md#noise-scale``):

- with N > 1 from the replicas' gradients (N squared norms and a weighted sum over the stage's parameters);
- with one pipeline from the halves of its micro-batches (one copy of the stage's gradients after the first half of
  the backwards, then three squared norms);
- then one all-reduce of two numbers over the job.

This script runs the character GPT of ``benchmarks/throughput.py`` (its defaults: 2 gloo ranks, 1 thread each, 2
stages) through ``StagePipeline`` with and without the measurement. The two are paired step by step (the same batch,
alternating which runs first) on the same weights. For N = 1 and N = 4 it prints the median over steps of the paired
ratio (with / without - 1), and the cost per step at Lightning's default ``log_every_n_steps=50``. The target is at
most 3% of a step.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import throughput  # noqa: E402
from benchmarks.common import make_batches  # noqa: E402
from benchmarks.throughput_rows import WORLD, _lm_loss, _pipeline  # noqa: E402
from lightning_avgpipe.algorithms.noise_scale import NoiseScale  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402


def _rank(rank: int, world: int, args: argparse.Namespace, data: torch.Tensor, vocab: int) -> dict[str, Any]:
    from examples.char_gpt import GPTConfig, gpt_layers
    from examples.gpt_args import model_sizes

    cfg = GPTConfig(vocab_size=vocab, **model_sizes(args), dropout=0.0)
    torch.manual_seed(args.seed)
    base = list(gpt_layers(cfg))
    start, count = sum(args.partition[:rank]), args.partition[rank]
    total = args.warmup + args.steps
    batches = make_batches(data, args.block_size, args.batch_size, total * max(args.pipelines) + 1, args.seed + 1)
    out: dict[str, Any] = {}
    for n in args.pipelines:
        pipe = _pipeline("1f1b", copy.deepcopy(base)[start : start + count], rank, args, n)
        noise_scale = NoiseScale()  # what the controller keeps: the smoothed estimate over the measured steps
        with_, without = [], []
        for i in range(total):
            step = [batches[i * n + r] for r in range(n)]
            order = (True, False) if i % 2 == 0 else (False, True)
            for noise in order:
                for p in pipe.replicas.params:
                    p.grad = None
                dist.barrier()
                t0 = time.perf_counter()
                result = pipe.train_step(step, _lm_loss, noise=noise)
                spent = time.perf_counter() - t0
                if i >= args.warmup:
                    (with_ if noise else without).append(spent)
                assert (result.noise is not None) == noise
                if result.noise is not None:
                    noise_scale.update(result.noise)
        out[str(n)] = {"with": with_, "without": without, "noise_scale": noise_scale.value}
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> int:
    args, report = measure(argv)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


def measure(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict[str, Any]]:
    """Run the paired steps and print the cost per N; ``benchmarks/tuner_accuracy.py`` calls it with its GPT."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="paired steps per N (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--pipelines", default="1,4", help="the N to measure, comma-separated")
    parser.add_argument("--json", type=Path, default=None)
    args, rest = parser.parse_known_args(argv)
    base = throughput.parse_args(rest)  # the char GPT, its partition, batch, micro-batches and data
    for key, value in vars(args).items():
        setattr(base, key, value)
    base.pipelines = [int(v) for v in str(args.pipelines).split(",")]
    from examples.text_data import encode, stdlib_docstrings

    data, chars = encode(stdlib_docstrings(base.corpus_chars))
    vocab = len(chars)
    started = time.perf_counter()
    got = run_distributed(_rank, WORLD, base, data, vocab, timeout=600, what="noise cost")
    report: dict[str, Any] = {}
    print(
        f"noise-scale measurement cost, char GPT on {WORLD} gloo ranks, batch {base.batch_size}, "
        f"{base.microbatches} micro-batches per batch, {args.steps} paired steps"
    )
    for n in base.pipelines:
        per = [got[r][str(n)] for r in range(WORLD)]
        with_ = [max(p["with"][i] for p in per) for i in range(args.steps)]  # the slower rank's step
        without = [max(p["without"][i] for p in per) for i in range(args.steps)]
        ratios = [a / b - 1 for a, b in zip(with_, without)]
        cost = statistics.median(ratios)
        how = "replicas' gradients" if n > 1 else "halves of the micro-batches"
        report[str(n)] = {
            "median_overhead": cost,
            "overhead_at_log_every_50": cost / 50,
            "step_s_without": statistics.median(without),
            "step_s_with": statistics.median(with_),
            "noise_scale": got[0][str(n)]["noise_scale"],
        }
        print(
            f"N = {n} ({how}): step {statistics.median(without) * 1e3:.1f} ms without, "
            f"{statistics.median(with_) * 1e3:.1f} ms with; median paired overhead {100 * cost:+.1f}% of a measured "
            f"step, {100 * cost / 50:+.2f}% per step at log_every_n_steps=50 (target <= 3%)"
        )
    print(f"{time.perf_counter() - started:.0f} s")
    return args, report


if __name__ == "__main__":
    sys.exit(main())
