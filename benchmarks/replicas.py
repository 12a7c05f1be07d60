"""Sequential vs batched replica execution: N replicas of a stage run one after another, or as one torch.func.vmap.

    python benchmarks/replicas.py                # GPT blocks, N in 1 2 4, micro-batches of 1, 2 and 8 sequences
    python benchmarks/replicas.py --model mlp --micro 1,8,64

Times forward + backward of one stage (two GPT blocks of examples/char_gpt.py) for N replicas on the same
micro-batch size, in one process with one thread, and prints the ratio batched / sequential (below 1: batching is
faster). Weights are stacked once per iteration in batched mode; that cost is included.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from examples.char_gpt import Block, GPTConfig  # noqa: E402
from lightning_avgpipe.algorithms.replicas import BatchedReplicas, stack  # noqa: E402


def measure(n: int, micro: int, cfg: GPTConfig, repeats: int, model: str) -> tuple[float, float]:
    torch.manual_seed(0)
    if model == "gpt":
        base: list[nn.Module] = [Block(cfg), Block(cfg)]
        xs = [torch.randn(micro, cfg.block_size, cfg.n_embd) for _ in range(n)]
    else:  # the digits example's MLP stage: Linear + ReLU blocks of width 256
        base = [nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(3)]
        xs = [torch.randn(micro, 256) for _ in range(n)]
    replicas = [[copy.deepcopy(m) for m in base] for _ in range(n)]

    def sequential() -> None:
        for layers, x in zip(replicas, xs):
            nn.Sequential(*layers)(x).square().mean().backward()

    batched = BatchedReplicas(replicas)

    def vmapped() -> None:
        batched.begin()
        batched(stack(xs)).square().mean().backward()
        batched.finish()

    times = {}
    for name, fn in (("sequential", sequential), ("batched", vmapped)):
        fn()  # warm-up
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = statistics.median(samples)
    return times["sequential"], times["batched"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipelines", default="1,2,4")
    p.add_argument("--micro", default="1,2,8", help="sequences per micro-batch")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args()
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=96, block_size=64, n_layer=2, n_head=4, n_embd=128)
    rows = []
    what = "2 GPT blocks (n_embd 128, block 64)" if args.model == "gpt" else "3 Linear(256)+ReLU blocks"
    print(f"stage = {what}, forward + backward, 1 thread; median of {args.repeats}")
    print(f"{'N':>3} {'micro':>6} {'sequential ms':>14} {'batched ms':>11} {'batched/sequential':>19}")
    for n in map(int, args.pipelines.split(",")):
        for micro in map(int, args.micro.split(",")):
            seq, bat = measure(n, micro, cfg, args.repeats, args.model)
            rows.append({"pipelines": n, "micro": micro, "sequential_s": seq, "batched_s": bat, "ratio": bat / seq})
            print(f"{n:>3} {micro:>6} {seq * 1e3:>14.2f} {bat * 1e3:>11.2f} {bat / seq:>19.2f}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
