"""Tensor parallelism's memory and traffic per rank, by mode, against the survey's formulas (issue 45, part 4).

    PYTHONPATH=. python benchmarks/tensor_parallel.py                  # T = 4, sequence 512, width 256, 2 blocks
    PYTHONPATH=. python benchmarks/tensor_parallel.py --quick          # a smoke run (T = 2, small sizes)

One stage of GPT-2-like blocks (LayerNorm, attention split by heads, MLP pair) on T ranks, split by the default plan:
1D (Megatron's) without and with sequence parallelism. For each mode and rank it prints the weight bytes it holds,
the bytes autograd saves for the backward of one forward (the activation peak of one micro-batch), the bytes it sends
in the tensor group's collectives per training step, and the median step time; then each figure over 1D's. The
formulas: 1D holds 1/T of the split weights and every activation outside the split matmuls whole; sequence
parallelism holds those at 1/T. 2D and 2.5D are not built yet.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Attention(nn.Module):
    """Fused qkv and a projection, widths read from its attributes (so it splits by heads)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = heads, width
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: Tensor) -> Tensor:
        B, L, _ = x.shape
        q, k, v = self.qkv(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, L, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, -1)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = Attention(width, heads)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def _sent_bytes(T: int) -> list[float]:
    """Count the bytes this process sends in the collectives it calls (patched on ``torch.distributed``), as a ring
    moves them: an all-reduce of n bytes sends 2 (T-1)/T n, an all-gather of n bytes each (T-1) n, a reduce-scatter
    of n bytes (T-1)/T n."""
    import torch.distributed as dist

    sent = [0.0]

    def counted(fn: Any, which: int, factor: float) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = args[which] if len(args) > which else kwargs.get("input_tensor", kwargs.get("tensor"))
            if isinstance(t, Tensor):
                sent[0] += factor * t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return call

    rules = (
        ("all_reduce", 0, 2 * (T - 1) / T),
        ("all_gather_single", 1, T - 1),
        ("reduce_scatter_single", 1, (T - 1) / T),
    )
    for name, which, factor in rules:
        if hasattr(dist, name):
            setattr(dist, name, counted(getattr(dist, name), which, factor))
    return sent


def _worker(rank: int, world: int, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    sent = _sent_bytes(world)  # before the package looks the collectives up
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_avgpipe.runtime.sharding import sequence_parallel as sp
    from lightning_avgpipe.runtime.sharding.head_parallel import Column, Row
    from lightning_avgpipe.runtime.sharding.tensor_parallel import default_plan, parallelize_stage
    from lightning_avgpipe.runtime.trace import saved_bytes
    from lightning_avgpipe.shards import local

    mesh = init_device_mesh("cpu", (world,))
    group = mesh.get_group()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(cfg["batch"], cfg["sequence"], cfg["width"], generator=g)
    out = []
    for mode in ("1D", "1D + sequence parallelism"):
        sequence = mode != "1D"
        torch.manual_seed(0)
        model = nn.Sequential(*(Block(cfg["width"], cfg["heads"]) for _ in range(cfg["blocks"])))
        named = {str(i): b for i, b in enumerate(model)}
        # both modes on the package's own column- and row-wise layers (its collectives are the ones counted)
        plan = {
            k: {"ColwiseParallel": Column(), "RowwiseParallel": Row()}.get(type(v).__name__, v)
            for k, v in default_plan(named).items()
        }
        parallelize_stage(named, plan, mesh, sequence=sequence)
        stage = sp.sequence_stage([list(model)], group) if sequence else None
        weights = sum(local(p).numel() * local(p).element_size() for p in model.parameters())
        saved = saved_bytes(lambda m=model: m(x), list(model.parameters()))
        times, traffic = [], []
        for _ in range(cfg["steps"]):
            start, before = time.perf_counter(), sent[0]
            model(x).square().mean().backward()
            if stage is not None:
                stage.sum_grads(list(model))
            times.append(time.perf_counter() - start)
            traffic.append(sent[0] - before)
            model.zero_grad(set_to_none=True)
        out.append(
            {
                "mode": mode,
                "rank": rank,
                "weights": weights,
                "saved": saved,
                "sent": statistics.median(traffic),
                "step_s": statistics.median(times),
                "layers": sorted(stage.layers) if stage is not None else None,
            }
        )
    return out


def run(cfg: dict[str, Any]) -> list[list[dict[str, Any]]]:
    from tests.helpers.harness import run_distributed

    return run_distributed(_worker, cfg["tensor"], cfg, timeout=1200, what="tensor_parallel benchmark")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", type=int, default=4)
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="T = 2, sequence 32, width 32, 2 steps")
    args = parser.parse_args()
    cfg = vars(args)
    if args.quick:
        cfg.update(tensor=2, sequence=32, width=32, heads=4, steps=2)
    results = run(cfg)
    mib = float(1 << 20)
    print(
        f"T = {cfg['tensor']}, {cfg['blocks']} blocks, width {cfg['width']}, sequence {cfg['sequence']}, "
        f"batch {cfg['batch']}; per rank: weights, activations saved for the backward of one forward, bytes sent per "
        "step in the tensor group's collectives, median step (ratios to 1D's)"
    )
    print(f"{'mode':28} {'rank':>4} {'weights MiB':>12} {'activations MiB':>22} {'sent MiB':>18} {'step s':>16}")
    for rank_rows in results:
        base = rank_rows[0]
        for r in rank_rows:
            cells = [
                f"{r['weights'] / mib:12.2f}",
                f"{r['saved'] / mib:10.2f} ({r['saved'] / base['saved']:5.2f}x)",
                f"{r['sent'] / mib:8.2f} ({r['sent'] / max(base['sent'], 1):5.2f}x)",
                f"{r['step_s']:6.3f} ({r['step_s'] / base['step_s']:5.2f}x)",
            ]
            print(f"{r['mode']:28} {r['rank']:>4} " + " ".join(cells))
    layers = results[0][1]["layers"]
    print(f"blocks on a shard of the sequence: {layers} of {cfg['blocks']}")


if __name__ == "__main__":
    main()
