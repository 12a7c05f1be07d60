"""What splitting a stage's backward costs: the input gradient (I) plus the weight gradient (W) against the whole
backward (B), on the blocks of the character GPT (``examples/char_gpt.py``), one thread, one process.

    PYTHONPATH=. python benchmarks/split_backward.py                 # about a minute on one CPU core
    PYTHONPATH=. python benchmarks/split_backward.py --blocks 4 --microbatch 4,16 --repeats 30 --json runs/split.json

Three ways, on the same weights and the same micro-batch, run in rotating order and paired per round:

- ``B``: ``autograd.backward`` of the stage's output (what 1F1B runs);
- ``ours``: the same backward inside ``WeightGradQueue.deferring`` (I: input gradients, and the small parameters'),
  then ``WeightGradQueue.run`` (W: the queued Linear weight gradients) -- ``runtime/deferred.py``, what ``zbh1`` runs;
- ``torch``: ``torch.distributed.pipelining``'s split, which walks the autograd graph twice
  (``stage_backward_input`` then ``stage_backward_weight``).

Prints, per micro-batch size, the median time of each part and the median over rounds of (I + W) / B. The forward
is not timed. A zero-bubble schedule gains (S - 1) x (what W costs) per step only if (I + W) / B stays near 1.
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
from torch import nn  # noqa: E402

from examples.char_gpt import Block, GPTConfig  # noqa: E402
from lightning_avgpipe.runtime.deferred import WeightGradQueue  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=4, help="transformer blocks in the stage")
    p.add_argument("--n-embd", type=int, default=128)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--block-size", type=int, default=64, help="sequence length")
    p.add_argument("--microbatch", default="4,16", help="micro-batch sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=30, help="timed rounds per size (after 3 warm-up rounds)")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    args.microbatch = [int(v) for v in str(args.microbatch).split(",")]
    return args


def _stage(args: argparse.Namespace) -> nn.Sequential:
    cfg = GPTConfig(n_layer=args.blocks, n_head=args.n_head, n_embd=args.n_embd, block_size=args.block_size)
    return nn.Sequential(*(Block(cfg) for _ in range(args.blocks)))


def _forward(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    for p in model.parameters():
        p.grad = None
    inp = x.clone().requires_grad_(True)
    out = model(inp)
    return inp, out, torch.ones_like(out) / out.numel()  # the output gradient a next stage would send


def time_whole(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    _, out, g = _forward(model, x)
    t0 = time.perf_counter()
    torch.autograd.backward([out], [g])
    return {"B": time.perf_counter() - t0}


def time_ours(model: nn.Module, queue: WeightGradQueue, x: torch.Tensor) -> dict[str, float]:
    _, out, g = _forward(model, x)
    t0 = time.perf_counter()
    with queue.deferring(0):
        torch.autograd.backward([out], [g])
    t1 = time.perf_counter()
    queue.run(0)
    return {"I": t1 - t0, "W": time.perf_counter() - t1}


def time_torch(model: nn.Module, x: torch.Tensor) -> dict[str, float]:
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    inp, out, g = _forward(model, x)
    t0 = time.perf_counter()
    _, groups = stage_backward_input([out], [g], [inp], model.parameters())
    t1 = time.perf_counter()
    stage_backward_weight(model.parameters(), groups)
    return {"I": t1 - t0, "W": time.perf_counter() - t1}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    base = _stage(args)
    plain, ours, theirs = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    queue = WeightGradQueue([ours])
    report: dict[str, Any] = {"blocks": args.blocks, "n_embd": args.n_embd, "sizes": {}}
    for mb in args.microbatch:
        x = torch.randn(mb, args.block_size, args.n_embd, generator=torch.Generator().manual_seed(mb))
        runs: dict[str, list[dict[str, float]]] = {"B": [], "ours": [], "torch": []}
        order: list[tuple[str, Any]] = [
            ("B", lambda x=x: time_whole(plain, x)),
            ("ours", lambda x=x: time_ours(ours, queue, x)),
            ("torch", lambda x=x: time_torch(theirs, x)),
        ]
        for r in range(3 + args.repeats):
            shift = r % len(order)
            for name, fn in order[shift:] + order[:shift]:
                got = fn()
                if r >= 3:
                    runs[name].append(got)
        med = statistics.median
        whole = [t["B"] for t in runs["B"]]
        row: dict[str, Any] = {"B_ms": med(whole) * 1e3}
        for name in ("ours", "torch"):
            i = [t["I"] for t in runs[name]]
            w = [t["W"] for t in runs[name]]
            row[name] = {
                "I_ms": med(i) * 1e3,
                "W_ms": med(w) * 1e3,
                "I_over_B": med(a / b for a, b in zip(i, whole)),
                "W_over_B": med(a / b for a, b in zip(w, whole)),
                "I_plus_W_over_B": med((a + c) / b for a, c, b in zip(i, w, whole)),
            }
        report["sizes"][str(mb)] = row
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    report = measure(args)
    print(f"{args.blocks} GPT blocks (d {args.n_embd}, seq {args.block_size}), 1 thread; {args.repeats} paired rounds")
    head = ("micro-batch", "B ms", "split", "I ms", "W ms", "I/B", "W/B", "(I+W)/B")
    print("  ".join(f"{h:>{w}}" for h, w in zip(head, (11, 7, 5, 7, 7, 5, 5, 7))))
    for mb, row in report["sizes"].items():
        for name in ("ours", "torch"):
            r = row[name]
            print(
                f"{mb:>11}  {row['B_ms']:7.2f}  {name:>5}  {r['I_ms']:7.2f}  {r['W_ms']:7.2f}  {r['I_over_B']:5.2f}  "
                f"{r['W_over_B']:5.2f}  {r['I_plus_W_over_B']:7.3f}"
            )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
