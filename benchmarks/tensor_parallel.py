"""Tensor parallelism's memory and traffic per rank, by mode, against the survey's formulas (issue 45, part 4).

    PYTHONPATH=. python benchmarks/tensor_parallel.py          # 4 and 8 ranks, sequence 512, width 256, 2 blocks
    PYTHONPATH=. python benchmarks/tensor_parallel.py --quick  # a smoke run (4 and 8 ranks, small sizes)

One stage of GPT-2-like blocks (LayerNorm, attention, MLP pair) on ``--tensor`` ranks (T = q², default 4) under 1D
(Megatron's plan on the package's column and row layers, split by heads) without and with sequence parallelism and
2D (SUMMA on a q x q grid, ``grid_stage`` converting the whole layers); then on ``--depth`` x T ranks (default 8)
1D at T = 8 against 2.5D (d x q x q). Each rank count is one launch that runs all its modes. For each mode and rank
it prints the weight bytes it holds, the bytes autograd saves for the backward of one forward (the activation peak
of one micro-batch), the bytes it sends per training step, and the median step time; each over 1D's at the same
number of ranks, beside the formula's ratio (the blocks are alike: per block, a figure is the stage's / blocks):

- weights: 1D and sequence parallelism hold 1/T of the split weights (the column layers' weights and biases, the
  row layers' weights) and the rest whole; 2D and 2.5D 1/q² of all of them.
- activations, of the unsplit stage's A = O + I: O (outside the split matmuls: the norms' inputs and statistics
  and the column layers' inputs, B L (4 w + 4) per block) and I (the rest, measured whole minus O). 1D holds
  O + I/T; sequence parallelism (O + I)/T; 2D (O + I)/q²; 2.5D (O + I)/(d q²).

Bytes sent, per rank, each collective counted with its own group's size g (a ring, or a pipelined tree): an
all-reduce of n bytes sends 2 (g-1)/g n, an all-gather of n bytes from each rank (g-1) n (the (g-1)/g of its
output), a reduce-scatter of n bytes in (g-1)/g n, a broadcast or a reduce of n bytes (g-1)/g n on average over the
group. Collectives are counted by patching ``torch.distributed`` and the package's aliases of them (SUMMA's
``grid.BROADCAST`` and ``grid.REDUCE``, ``zero.ALL_GATHER``, ``REDUCE_SCATTER``).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import statistics
import time
from pathlib import Path
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


# collective -> (the tensor argument counted, bytes sent per rank over its size n for a group of g ranks)
RULES: dict[str, tuple[str, Any]] = {
    "all_reduce": ("tensor", lambda g: 2 * (g - 1) / g),
    "all_gather_into_tensor": ("input_tensor", lambda g: g - 1),
    "all_gather_single": ("input_tensor", lambda g: g - 1),
    "all_gather": ("tensor", lambda g: g - 1),
    "reduce_scatter_tensor": ("input", lambda g: (g - 1) / g),
    "reduce_scatter_single": ("input", lambda g: (g - 1) / g),
    "broadcast": ("tensor", lambda g: (g - 1) / g),
    "reduce": ("tensor", lambda g: (g - 1) / g),
}
MODES = ("1D", "1D + sequence parallelism", "2D", "2.5D")


def _sent_bytes() -> tuple[list[float], dict[int, Any]]:
    """Count the bytes this process sends in the collectives it calls (patched on ``torch.distributed``; the module
    docstring's convention, each with ``dist.get_world_size`` of its own group). Returns the running count and the
    wrappers by the id of the function each replaces (:func:`_rebind` puts them over the package's aliases)."""
    import torch.distributed as dist

    sent = [0.0]
    wrappers: dict[int, Any] = {}

    def counted(fn: Any, which: str, factor: Any) -> Any:
        signature = inspect.signature(fn)

        def call(*args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(*args, **kwargs).arguments
            t = bound.get(which)
            if isinstance(t, Tensor):
                g = dist.get_world_size(bound.get("group"))
                sent[0] += factor(g) * t.numel() * t.element_size()
            return fn(*args, **kwargs)

        return call

    for name, (which, factor) in RULES.items():
        fn = getattr(dist, name, None)
        if fn is not None and id(fn) not in wrappers:
            wrappers[id(fn)] = counted(fn, which, factor)
            setattr(dist, name, wrappers[id(fn)])
    return sent, wrappers


def _rebind(wrappers: dict[int, Any], *modules: Any) -> None:
    """The modules' own names for a collective (``BROADCAST = dist.broadcast``, bound at their import) counted too."""
    for module in modules:
        for name, value in list(vars(module).items()):
            if id(value) in wrappers:
                setattr(module, name, wrappers[id(value)])


def _model(cfg: dict[str, Any]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(cfg["width"], cfg["heads"]) for _ in range(cfg["blocks"])))


def _input(cfg: dict[str, Any]) -> Tensor:
    return torch.randn(cfg["batch"], cfg["sequence"], cfg["width"], generator=torch.Generator().manual_seed(1))


def _worker(rank: int, world: int, cfg: dict[str, Any], modes: list[str]) -> list[dict[str, Any]]:
    sent, wrappers = _sent_bytes()  # before the package looks the collectives up
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_avgpipe.runtime.sharding import grid, head_parallel, zero
    from lightning_avgpipe.runtime.sharding import sequence_parallel as sp
    from lightning_avgpipe.runtime.sharding.grid_stage import grid_stage
    from lightning_avgpipe.runtime.sharding.head_parallel import Column, Row
    from lightning_avgpipe.runtime.sharding.tensor_parallel import default_plan, parallelize_stage
    from lightning_avgpipe.runtime.trace import saved_bytes
    from lightning_avgpipe.shards import local

    _rebind(wrappers, grid, head_parallel, zero, sp)  # in case a module was imported before the patch
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tensor",))
    q = math.isqrt(cfg["tensor"])
    x = _input(cfg)
    out = []
    for mode in modes:
        model = _model(cfg)
        stage: Any = None
        if mode.startswith("1D"):
            sequence = mode != "1D"
            named = {str(i): b for i, b in enumerate(model)}
            # on the package's own column- and row-wise layers (its collectives are the ones counted)
            plan = {
                k: {"ColwiseParallel": Column(), "RowwiseParallel": Row()}.get(type(v).__name__, v)
                for k, v in default_plan(named).items()
            }
            parallelize_stage(named, plan, mesh, sequence=sequence)
            stage = sp.sequence_stage([list(model)], mesh.get_group()) if sequence else None
        else:  # the whole layers onto the grid: 2D on q² ranks, 2.5D on depth x q² ranks
            stage = grid_stage([list(model)], grid.grid_mesh(mesh, q, world // (q * q)))
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
                "ranks": world,
                "rank": rank,
                "weights": weights,
                "saved": saved,
                "sent": statistics.median(traffic),
                "step_s": statistics.median(times),
                "layers": sorted(stage.layers) if stage is not None else None,
                "left": dict(getattr(stage, "left", {})) if stage is not None else {},
            }
        )
    return out


def formulas(cfg: dict[str, Any]) -> dict[str, Any]:
    """The unsplit stage's weights (split by 1D: S, the rest: R) and activations (O outside the split matmuls, I
    inside), bytes, measured here in one process; and each mode's expected weights and activations per rank."""
    from lightning_avgpipe.runtime.trace import saved_bytes

    model, x = _model(cfg), _input(cfg)
    split = {"attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight", "mlp.0.weight", "mlp.0.bias", "mlp.2.weight"}
    S = R = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if name.partition(".")[2] in split:
            S += size
        else:
            R += size
    A = saved_bytes(lambda: model(x), list(model.parameters()))
    outside = cfg["blocks"] * cfg["batch"] * cfg["sequence"] * (4 * cfg["width"] + 4) * x.element_size()
    inside = A - outside
    T, d = cfg["tensor"], cfg["depth"]
    q2 = math.isqrt(T) ** 2

    def expected(mode: str, ranks: int) -> tuple[float, float]:
        if mode == "1D":
            return S / ranks + R, outside + inside / ranks
        if mode == "1D + sequence parallelism":
            return S / ranks + R, A / ranks
        return (S + R) / q2, A / ranks  # 2D: ranks = q², 2.5D: ranks = d q²

    table = {
        (mode, ranks): expected(mode, ranks)
        for mode, ranks in [("1D", T), ("1D + sequence parallelism", T), ("2D", T), ("1D", d * T), ("2.5D", d * T)]
    }
    return {"S": S, "R": R, "A": A, "O": outside, "I": inside, "expected": table}


def run(cfg: dict[str, Any]) -> list[list[dict[str, Any]]]:
    """One launch per rank count, each running all its modes: the rows of every rank, by rank count."""
    from tests.helpers.harness import run_distributed

    T, d = cfg["tensor"], cfg["depth"]
    launches = [(T, ["1D", "1D + sequence parallelism", "2D"]), (d * T, ["1D", "2.5D"])]
    rows = []
    for world, modes in launches:
        results = run_distributed(_worker, world, cfg, modes, timeout=1800, what="tensor_parallel benchmark")
        rows.append([r for rank_rows in results for r in rank_rows])
    return rows


def _label(r: dict[str, Any], cfg: dict[str, Any]) -> str:
    q = math.isqrt(cfg["tensor"])
    return {"2D": f"2D (q = {q})", "2.5D": f"2.5D (q = {q} x d = {cfg['depth']})"}.get(r["mode"], r["mode"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensor", type=int, default=4, help="ranks of the first launch: T of 1D, q² of 2D")
    parser.add_argument("--depth", type=int, default=2, help="2.5D's d: the second launch has d x T ranks")
    parser.add_argument("--sequence", type=int, default=512)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", type=Path, help="write the rows and the acceptance figures here")
    parser.add_argument("--quick", action="store_true", help="sequence 32, width 32, 2 steps")
    args = parser.parse_args()
    cfg = vars(args)
    if args.quick:
        cfg.update(sequence=32, width=32, steps=2)
    T, d = cfg["tensor"], cfg["depth"]
    q = math.isqrt(T)
    if q * q != T or cfg["heads"] % (d * T) or cfg["sequence"] % (d * q) or cfg["width"] % cfg["heads"]:
        parser.error("--tensor must be a square q², --heads divide by depth x T, --sequence by depth x q")
    f = formulas(cfg)
    launches = run(cfg)
    mib = float(1 << 20)
    print(
        f"{cfg['blocks']} blocks, width {cfg['width']}, {cfg['heads']} heads, sequence {cfg['sequence']}, batch "
        f"{cfg['batch']}; per rank (per block: / {cfg['blocks']}): weights, activations saved for the backward of one "
        "forward, bytes sent per step, median step; (measured ratio to 1D at the same ranks, the formula's)"
    )
    print(
        f"unsplit stage: weights {(f['S'] + f['R']) / mib:.2f} MiB (1D splits {f['S'] / mib:.2f}), activations "
        f"{f['A'] / mib:.2f} MiB (outside the split matmuls O = {f['O'] / mib:.2f}, inside I = {f['I'] / mib:.2f})"
    )
    print(
        f"{'mode':25} {'ranks':>5} {'rank':>4} {'weights MiB':>24} {'activations MiB':>24} {'sent MiB':>16} "
        f"{'step s':>14}"
    )
    figures, worst = [], {}
    for rows in launches:
        base = {r["rank"]: r for r in rows if r["mode"] == "1D"}
        for r in sorted(rows, key=lambda r: (MODES.index(r["mode"]), r["rank"])):
            b = base[r["rank"]]
            w_exp, a_exp = f["expected"][(r["mode"], r["ranks"])]
            w_base, a_base = f["expected"][("1D", r["ranks"])]
            ratios = {
                "weights_ratio": r["weights"] / b["weights"],
                "weights_formula": w_exp / w_base,
                "activations_ratio": r["saved"] / b["saved"],
                "activations_formula": a_exp / a_base,
                "sent_ratio": r["sent"] / max(b["sent"], 1),
                "step_ratio": r["step_s"] / b["step_s"],
            }
            cells = [
                f"{r['weights'] / mib:8.3f} ({ratios['weights_ratio']:5.2f}x, {ratios['weights_formula']:5.2f}x)",
                f"{r['saved'] / mib:8.2f} ({ratios['activations_ratio']:5.2f}x, {ratios['activations_formula']:5.2f}x)",
                f"{r['sent'] / mib:8.2f} ({ratios['sent_ratio']:5.2f}x)",
                f"{r['step_s']:6.3f} ({ratios['step_ratio']:5.2f}x)",
            ]
            print(f"{_label(r, cfg):25} {r['ranks']:>5} {r['rank']:>4} " + " ".join(cells))
            figures.append(
                {
                    "mode": _label(r, cfg),
                    "ranks": r["ranks"],
                    "rank": r["rank"],
                    "weights_mib": round(r["weights"] / mib, 3),
                    "activations_mib": round(r["saved"] / mib, 2),
                    "sent_mib": round(r["sent"] / mib, 2),
                    "step_s": round(r["step_s"], 3),
                    **{k: round(v, 2) for k, v in ratios.items()},
                }
            )
            key = (r["mode"], r["ranks"])
            worst[key] = {k: max(worst.get(key, {}).get(k, 0), r[k]) for k in ("weights", "saved")}
    sp = next(r for r in launches[0] if r["mode"] == "1D + sequence parallelism")
    grid = [r for rows in launches for r in rows if r["mode"] in ("2D", "2.5D")]
    print(f"blocks on a shard of the sequence: {sp['layers']} of {cfg['blocks']}")
    print(
        f"blocks on the grid: 2D {grid[0]['layers']}, 2.5D {grid[-1]['layers']} of {cfg['blocks']}; left whole: "
        f"{grid[0]['left'] or 'none'}"
    )
    # acceptance, each over the worst rank
    one, sp_, two, half = (worst[k] for k in [("1D", T), ("1D + sequence parallelism", T), ("2D", T), ("2.5D", d * T)])
    a = sp_["saved"] / one["saved"]
    bw, ba = two["weights"] / one["weights"], two["saved"] / one["saved"]
    c = half["saved"] / two["saved"]
    expect = f["expected"]
    checks = [
        (
            f"(a) sequence parallelism's activations <= 0.4x 1D's at T = {T}, sequence {cfg['sequence']}",
            a <= 0.4,
            f"{a:.2f}x",
            f"formula (O + I) / (T O + I) = {expect[('1D + sequence parallelism', T)][1] / expect[('1D', T)][1]:.2f}x:"
            " I is cut by T in both",
        ),
        (
            f"(b) 2D's weights <= 0.3x 1D's at {T} ranks",
            bw <= 0.3,
            f"{bw:.2f}x",
            f"formula {expect[('2D', T)][0] / expect[('1D', T)][0]:.2f}x: both hold 1/{T} of the matrices",
        ),
        (
            f"(b) 2D's activations <= 0.3x 1D's at {T} ranks",
            ba <= 0.3,
            f"{ba:.2f}x",
            f"formula (O + I) / (q² O + I) = {expect[('2D', T)][1] / expect[('1D', T)][1]:.2f}x",
        ),
        (
            f"(c) 2.5D's activations <= 0.55x 2D's (d = {d})",
            c <= 0.55,
            f"{c:.2f}x",
            f"formula 1/d = {1 / d:.2f}x; an attention whose heads divide by d q² is split over every rank",
        ),
    ]
    for what, met, figure, why in checks:
        print(f"{what}: {'met' if met else 'missed'}, {figure} ({why})")
    if args.json:
        accepted = [{"check": w, "met": m, "figure": x, "formula": y} for w, m, x, y in checks]
        args.json.write_text(
            json.dumps({"cfg": cfg | {"json": str(args.json)}, "figures": figures, "acceptance": accepted}, indent=1)
            + "\n"
        )


if __name__ == "__main__":
    main()
