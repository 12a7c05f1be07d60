"""Throughput of this project's pipeline runtime against torch.distributed.pipelining and plain training.

    PYTHONPATH=. python benchmarks/throughput.py                      # defaults: about 1.5 minutes on 2 idle CPU cores
    PYTHONPATH=. python benchmarks/throughput.py --steps 20 --pipelines 1,2 --json runs/throughput.json

One invocation spawns 2 gloo ranks (1 thread each) that train the same character GPT (``examples/char_gpt.py``)
from the same initial weights, on the same batches, split into the same micro-batches, with the same layer
partition and AdamW doing real optimizer steps, with:

- ``ours-1f1b``   this project's ``StageExecutor`` + ``Link`` running ``build_plan("1f1b", ...)``
- ``ours-afab``   the same runtime running ``build_plan("afab", ...)``
- ``ours-zbh1``   the same runtime running ``build_plan("zbh1", ...)``: the backward split, weight gradients deferred
- ``torch-1f1b``  ``torch.distributed.pipelining.Schedule1F1B`` over a hand-built ``PipelineStage`` per rank
- ``torch-gpipe`` ``torch.distributed.pipelining.ScheduleGPipe`` over the same stages
- ``torch-interleaved``, ``torch-interleaved-zb``, ``torch-zbv``: torch's ``ScheduleInterleaved1F1B``,
                  ``ScheduleInterleavedZeroBubble`` (loop) and ``ScheduleZBVZeroBubble`` (V), two stages per rank, over
                  the cut ``ours-interleaved`` and ``ours-zbv`` run
- ``ours-zbv-placed``: ``ours-zbv`` with its plan placed by the measured costs (``schedule_costs``: one unit's F, I
                  and W, summed over the ranks, from three traced steps of a copy before the timed rounds), as
                  ``AvgPipeTuner`` places it from its profile
- ``single``      the whole model in one process (rank 0, 1 thread) with gradient accumulation over the same
                  micro-batches; the other rank idles meanwhile
- ``avgpipe-N``   AvgPipe with N parallel pipelines (``--pipelines``, default 1,2,4): the same executor running
                  ``build_plan("1f1b", 2, N*M)`` over N*M units (replica-major: unit n*M + m is replica n's micro-batch
                  m, run through replica n's layers via ``stage_fn_for``), N replicas per stage tied by
                  ``ElasticAveraging`` (alpha = 1/N; N = 1 is the trivial case, the replica is the reference), one
                  AdamW per replica (``clone_optimizer``); each step consumes N batches of the same size B as the
                  other rows, then ``begin_step()``, the N optimizer steps, ``finish_step()``

Rows are interleaved: every round runs one training step of every row (in a rotating order), so a burst of
background load on a shared machine hits all rows alike (``single`` always runs last among the rows, before the
probes). The first ``--warmup`` rounds are not timed. A step is timed from a barrier to the end of
``optimizer.step()`` (for avgpipe rows: of ``finish_step()``) on each rank; the step time is the slowest rank's.
samples/s = samples per step (B, or N*B for avgpipe-N) / median step time.

Pipeline efficiency = ideal step time / measured step time, where the ideal is the slowest stage's compute alone:
each round also runs a *compute probe* per stage in which that rank alone (the other one idles) runs its own
stage's layers (a private copy, with its own AdamW) forward and backward over all micro-batches and then the
optimizer step, without any communication (stage inputs and output gradients are precomputed). The same probe with
both stages computing at once is reported too (it shows how much the two ranks slow each other down on this
machine). The ideal ignores the pipeline bubble, so even a perfect 1F1B with balanced stages is bounded by
M / (M + S - 1). The single-process row has no pipeline and its efficiency is reported as n/a (``null`` in JSON).
For avgpipe-N the ideal is N times the probe (N*M units' forward+backward and N optimizer steps) plus the elastic
update (``begin_step()`` + ``finish_step()`` on a private N-replica copy of the stage, timed in the same solo slot);
the 1F1B bubble bound becomes N*M / (N*M + S - 1).

Correctness is checked, not assumed: every row's first-step loss (same weights, same data) must match the
single-process loss within float tolerance, and ours-1f1b and torch-1f1b must agree on the first step; the final
losses and the largest weight difference between ours-1f1b and torch-1f1b after all steps are reported. Each
avgpipe-N row's loss (mean over its replicas) over the first ``--check-steps`` steps must match a single-process
AvgPipe (the whole model, N replicas, the same batches, clone optimizers and ``ElasticAveraging``, as in
``tests/helpers/lit.py::reference_elastic``) computed on rank 0 after the timed run; for N = 1 that is plain
training, so avgpipe-N1's first-step loss equals every other row's. Every loss must be finite. The script exits
with status 1 when a check fails (after printing the table).

Absolute times are noise on a shared machine; compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

from benchmarks.throughput_rank import launch  # noqa: E402
from benchmarks.throughput_report import format_table, summarise  # noqa: E402
from benchmarks.throughput_rows import WORLD  # noqa: E402
from examples.gpt_args import add_model_args, add_partition_arg, check_model_args, partition_of  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--microbatches", type=int, default=4, help="micro-batches per step (must divide the batch)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per row before the timed ones")
    add_model_args(p, n_layer=4, n_embd=128, n_head=4, block_size=64)
    add_partition_arg(p)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-chars", type=int, default=200_000, help="characters of stdlib docstrings to sample from")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the first-step loss checks")
    p.add_argument("--timeout", type=float, default=900.0, help="kill the ranks after this many seconds")
    p.add_argument(
        "--pipelines",
        default="1,2,4",
        help="N values of the avgpipe-N rows (N parallel pipelines with elastic averaging), "
        "comma-separated; 'none' for no avgpipe rows",
    )
    p.add_argument(
        "--check-steps",
        type=int,
        default=3,
        help="steps of every avgpipe-N row compared with a single-process AvgPipe (at least 1)",
    )
    p.add_argument(
        "--fit-rounds",
        type=int,
        default=3,
        help="rounds of (the runtime row's steps, then a Trainer.fit of as many steps) compared pairwise; 0 to skip",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    text = str(args.pipelines).strip().lower()
    try:
        args.pipelines = [] if text in ("", "none") else sorted({int(v) for v in text.split(",")})
    except ValueError:
        p.error(f"--pipelines must be comma-separated ints, got {args.pipelines!r}")
    if any(n < 1 for n in args.pipelines):
        p.error(f"--pipelines values must be >= 1, got {args.pipelines}")
    if args.check_steps < 1:
        p.error("--check-steps must be >= 1")
    check_model_args(p, args)
    args.partition = partition_of(p, args)
    if args.batch_size % args.microbatches:
        p.error(
            f"--microbatches={args.microbatches} must divide --batch-size={args.batch_size} (torch's schedules "
            "and ours would otherwise weight uneven micro-batches differently)"
        )
    if args.microbatches < WORLD:
        p.error(f"--microbatches must be >= {WORLD} (torch's Schedule1F1B needs at least one per stage)")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    text = stdlib_docstrings(args.corpus_chars)
    data, chars = encode(text)
    if len(data) < args.block_size + 2:
        raise SystemExit(f"the corpus has {len(data)} characters, fewer than block_size + 2")
    started = time.perf_counter()
    per_rank = launch(args, data, len(chars))
    summary = summarise(args, per_rank, len(chars))
    summary["wall_s"] = time.perf_counter() - started
    print(format_table(summary))
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if summary["checks"]["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
