"""Memory per rank and samples/s of (S, T) layouts, pipeline stages x tensor shards, side by side in one run.

    PYTHONPATH=. python benchmarks/layouts.py                       # about 1 minute on 2 CPU cores
    PYTHONPATH=. python benchmarks/layouts.py --json runs/layouts.json --layouts 1x1,2x1,1x2,2x2

Every layout trains the character GPT of ``examples/char_gpt.py`` (Embed, ``n_layer`` Blocks, Head) from the same
weights on the same batches with ``StagePipeline`` and AdamW, on S x T gloo processes: S stages (the partition of
``--partition``, default Embed + half the blocks first) whose Blocks' MLPs are split over T ranks by the default
plan (``runtime/sharding/tensor_parallel.py``). Per layout it prints the largest rank's weights + gradients + optimizer
state (``runtime/controller.py static_bytes``) and activation stash (the meter's peak), samples/s, and the first step's
loss (every layout's must equal the 1 x 1 one: the same training).

**These are functional figures.** Up to 4 processes share 2 CPU cores, so samples/s says nothing about speed on
real devices; the memory per rank is what each rank holds, whatever the machine. The end of the output projects
the 1 x 1 layout's profile (measured here, on this CPU) to GPU-like layouts with ``whatif``'s model
(``tuning/whatif.py``): that is arithmetic on a CPU profile, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import lm_loss, make_batches  # noqa: E402
from examples.gpt_args import add_model_args, add_partition_arg, check_model_args, model_sizes  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", default="1x1,2x1,1x2,2x2", help="S x T layouts, comma-separated (at most 4 ranks)")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8, help="timed steps per layout")
    p.add_argument("--warmup", type=int, default=2)
    add_model_args(p, n_layer=4, n_embd=64, n_head=4, block_size=32)
    add_partition_arg(p)
    p.add_argument("--corpus-chars", type=int, default=100_000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    check_model_args(p, args)
    try:
        args.layouts = [tuple(int(v) for v in item.lower().split("x")) for item in args.layouts.split(",")]
    except ValueError:
        p.error(f"--layouts {args.layouts!r}: give S x T pairs such as 1x1,2x2")
    for S, T in args.layouts:
        if S < 1 or T < 1 or S > 2 or S * T > 4:
            p.error(f"--layouts: {S}x{T} is not S in (1, 2), S x T <= 4 ranks")
    return args


def _rank(rank: int, world: int, S: int, T: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from examples.char_gpt import GPTConfig, gpt_layers
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.controller import static_bytes
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.sharding.tensor_parallel import default_plan, parallelize_stage

    torch.manual_seed(0)
    layers = list(gpt_layers(GPTConfig(vocab_size=cfg["vocab"], **cfg["sizes"])))
    top = Topology.build(rank, world, S, tensor_parallel_size=T) if world > 1 else Topology(0, 1, 1)
    n = len(layers)
    first = cfg["first"] if S == 2 else n
    start, stop = (0, first) if top.stage == 0 else (first, n)
    own = {str(i): layers[i] for i in range(start, stop)}
    split = parallelize_stage(own, default_plan(own), top.tensor_mesh) if T > 1 else []
    pipe = StagePipeline(list(own.values()), top, PipelineConfig(num_stages=S, num_microbatches=cfg["m"]))
    opt = pipe.optimizer(torch.optim.AdamW(pipe.reference_params, lr=3e-3))
    times, first_loss, stash = [], None, 0
    for i, batch in enumerate(cfg["batches"]):
        t0 = time.perf_counter()
        opt.zero_grad()
        result = pipe.train_step([batch], lambda out, b, share: lm_loss(out, b[1]), measure=i == 0)
        opt.step()
        times.append(time.perf_counter() - t0)
        if i == 0:
            first_loss = float(result.loss) if result.loss is not None else None
            stash = int(result.trace.peak_activation_bytes or 0)
    return {
        "stage": top.stage,
        "shard": top.tensor_rank,
        "static_bytes": static_bytes(pipe, [opt]),
        "stash_bytes": stash,
        "step_s": statistics.median(times[cfg["warmup"] :]),
        "first_loss": first_loss,
        "split": split,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    data, chars = encode(stdlib_docstrings(args.corpus_chars))
    sizes = model_sizes(args)
    batches = make_batches(data, args.block_size, args.batch_size, args.warmup + args.steps, seed=0)
    first = 1 + args.n_layer // 2 if args.partition is None else int(str(args.partition).split(",")[0])
    cfg = {"vocab": len(chars), "sizes": sizes, "batches": batches, "m": args.microbatches, "warmup": args.warmup}
    cfg["first"] = first
    print(
        f"(S, T) layouts of the character GPT {sizes}, B={args.batch_size}, M={args.microbatches}; "
        "FUNCTIONAL figures: up to 4 processes on this machine's cores say nothing about speed"
    )
    print(f"{'S x T':>6} {'ranks':>5} {'static MB':>10} {'stash MB':>9} {'samples/s':>10} {'first loss':>11}  split")
    rows = []
    for S, T in args.layouts:
        out = run_distributed(_rank, S * T, S, T, cfg, timeout=args.timeout, what=f"layout {S}x{T}")
        loss = next(r["first_loss"] for r in out if r["first_loss"] is not None)
        row = {
            "S": S,
            "T": T,
            "static_mb": max(r["static_bytes"] for r in out) / 2**20,
            "stash_mb": max(r["stash_bytes"] for r in out) / 2**20,
            "samples_per_sec": args.batch_size / max(r["step_s"] for r in out),
            "first_loss": loss,
            "split_modules": sorted({m for r in out for m in r["split"]}),
        }
        rows.append(row)
        print(
            f"{S:>4}x{T} {S * T:>5} {row['static_mb']:>10.3f} {row['stash_mb']:>9.3f} {row['samples_per_sec']:>10.1f} "
            f"{loss:>11.6f}  {len(row['split_modules'])} modules"
        )
    base = rows[0]
    for row in rows[1:]:
        print(
            f"{row['S']}x{row['T']} vs {base['S']}x{base['T']}: static memory per rank x"
            f"{row['static_mb'] / base['static_mb']:.2f}, stash x{row['stash_mb'] / max(base['stash_mb'], 1e-12):.2f}, "
            f"first loss differs by {abs(row['first_loss'] - base['first_loss']):.2e}"
        )
    result = {"args": {k: v for k, v in vars(args).items() if k != "layouts"}, "rows": rows}
    result["projection"] = project_gpu(rows, args)
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return result


def project_gpu(rows: list[dict[str, Any]], args: argparse.Namespace) -> list[dict[str, Any]]:
    """``whatif``'s arithmetic on a profile built from the 1 x 1 row's measured step: GPU-like links, not measured."""
    from lightning_avgpipe.tuning.model import PipelineProfile, StageProfile, predict
    from lightning_avgpipe.tuning.whatif import TensorParallel, project

    base = next((r for r in rows if (r["S"], r["T"]) == (1, 1)), None)
    if base is None:
        return []
    b = args.batch_size / args.microbatches
    step = args.batch_size / base["samples_per_sec"]
    hidden = b * args.block_size * args.n_embd * 4  # one boundary activation, float32
    stage = StageProfile(
        forward_s={b: step / args.microbatches / 3},
        backward_s={b: 2 * step / args.microbatches / 3},
        activation_bytes={b: base["stash_mb"] * 2**20 / args.microbatches},
        send_bytes={b: hidden},
        param_bytes=base["static_mb"] * 2**20 / 4,  # weights, grads and two Adam moments
        optimizer_state_bytes=base["static_mb"] * 2**20 / 2,
        optimizer_step_s=0.0,
    )
    profile = PipelineProfile([stage], batch_size=args.batch_size, latency_s=5e-6, bandwidth=25e9)
    print(
        "whatif projection of the 1x1 profile (CPU-measured compute; NVLink-like 200 GB/s inside a node, 25 GB/s "
        "between nodes): arithmetic, not a measurement"
    )
    out = []
    for S, T in [(1, 1), (2, 1), (1, 2), (2, 2), (4, 2)]:
        tp = TensorParallel(size=T, fraction=0.7, allreduces=args.n_layer, latency_s=2e-6, bandwidth=200e9)
        p = predict(project(profile, S, tensor=tp), args.microbatches, 1)
        out.append({"S": S, "T": T, "samples_per_sec": p.samples_per_sec, "peak_mb": max(p.peak_bytes) / 2**20})
        print(f"  {S}x{T}: {p.samples_per_sec:8.1f} samples/s predicted, peak {max(p.peak_bytes) / 2**20:.3f} MB/rank")
    return out


if __name__ == "__main__":
    main()
