"""Memory per rank with ``shard_optimizer_state`` over D pipeline groups, whole and sharded side by side in one run.

    PYTHONPATH=. python benchmarks/zero.py                          # about 1 minute on 2 CPU cores
    PYTHONPATH=. python benchmarks/zero.py --groups 2,4 --json runs/zero.json
    PYTHONPATH=. python benchmarks/zero.py --model mlp --groups 2 --averaging exact   # digits MLP, 2 stages x D

Every run trains the character GPT of ``examples/char_gpt.py`` as one stage on D gloo processes (D pipeline groups,
each reading its own batches) with ``StagePipeline`` and AdamW, from the same weights on the same batches, once with
the state whole and once sharded (``runtime/sharding/zero.py``):

- ``elastic``: N = 2 replicas per group, DiLoCo's outer Nesterov (lr 0.7, momentum 0.9): the sharded run keeps a 1/D
  slice of the reference, of the summed update and of the outer momentum during the step;
- ``exact``: one model (``averaging="exact"``): the sharded run keeps the AdamW state of a 1/D part: by flat
  slices, and (a third run, ``tensors``) by whole tensors, as an optimizer not known to be elementwise is split.

``--model mlp`` trains ``examples/digits.py``'s MLP (64 -> 256 x 4 -> 10) over 2 stages x D groups instead, where
one 256 x 256 weight is most of a stage, and prints every stage.

Per run it prints, on the largest rank, what the stage holds inside the step after the backward (where the
activations peak): the outer optimization's state (reference + summed update + outer momentum; 0 for exact), the
optimizer state, and everything static (``static_bytes``: weights, gradients, states, buffers), then
the ratios sharded / whole and the largest difference of the final weights (the sharded run must train the same).

**Functional figures.** D processes share the machine's cores, so no time is printed; the bytes are what each rank
holds, whatever the machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import lm_loss, make_batches  # noqa: E402
from examples.gpt_args import add_model_args, check_model_args, model_sizes  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402

OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="2,4", help="D values, comma-separated (D processes each)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--microbatches", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw", help="sgd: momentum 0.9, lr 0.1")
    p.add_argument("--averaging", default="elastic,exact", help="elastic, exact or both, comma-separated")
    p.add_argument("--model", choices=("gpt", "mlp"), default="gpt", help="mlp: the digits MLP over 2 stages")
    add_model_args(p, n_layer=2, n_embd=64, n_head=4, block_size=32)
    p.add_argument("--corpus-chars", type=int, default=50_000)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", dest="json_path", default=None)
    args = p.parse_args(argv)
    check_model_args(p, args)
    try:
        args.groups = [int(v) for v in args.groups.split(",")]
    except ValueError:
        p.error(f"--groups {args.groups!r}: give D values such as 2,4")
    if any(d < 2 or d > 8 for d in args.groups):
        p.error(f"--groups {args.groups}: each D must be in [2, 8] (D processes)")
    args.averaging = args.averaging.split(",")
    if not args.averaging or any(a not in ("elastic", "exact") for a in args.averaging):
        p.error(f"--averaging {','.join(args.averaging)!r}: give elastic, exact or elastic,exact")
    return args


def _bytes(tensors: Any) -> int:
    """What the storages of ``tensors`` hold, each storage once."""
    from lightning_avgpipe.shards import local

    seen: set[int] = set()
    total = 0
    for t in map(local, tensors):
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


class AdamWByTensor(torch.optim.AdamW):
    """AdamW under another name: not known to step elementwise, so sharded by whole tensors
    (``runtime/sharding/zero.py``)."""


def _layers(cfg: dict[str, Any], stages: int, stage: int) -> list[torch.nn.Module]:
    """The stage's layers: the char GPT (one stage), or the digits MLP cut in ``stages`` (blocks, then the head)."""
    torch.manual_seed(0)
    if cfg["model"] == "gpt":
        from examples.char_gpt import GPTConfig, gpt_layers

        return list(gpt_layers(GPTConfig(vocab_size=cfg["vocab"], **cfg["sizes"])))
    from examples.digits import DigitsMLP

    layers = list(DigitsMLP().layers)
    cut = -(-len(layers) // stages)
    return layers[stage * cut : (stage + 1) * cut]


def _rank(rank: int, world: int, averaging: str, shard: bool | str, cfg: dict[str, Any]) -> dict[str, Any]:
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.controller import static_bytes
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    S = cfg["stages"]
    top = Topology.build(rank, world, S)
    layers = _layers(cfg, S, top.stage)
    elastic = averaging == "elastic"
    options = {"num_pipelines": 2, "sync_reference": True, **OUTER} if elastic else {"averaging": "exact"}
    config = PipelineConfig(S, cfg["m"], shard_optimizer_state=bool(shard), **options)
    pipe = StagePipeline(layers, top, config)
    params = pipe.reference_params
    user = (
        (AdamWByTensor if shard == "tensors" else torch.optim.AdamW)(params, lr=3e-3)
        if cfg["optimizer"] == "adamw"
        else torch.optim.SGD(params, lr=0.1, momentum=0.9)
    )
    opt = pipe.optimizer(user)
    N = config.num_pipelines if elastic else 1
    held: dict[str, float] = {}

    def step(i: int) -> None:
        batches = [cfg["batches"][(i * top.num_groups + top.group_index) * N + n] for n in range(N)]
        opt.zero_grad()
        pipe.train_step(batches, lambda out, b, share: cfg["loss"](out, b[1]))
        if i == cfg["steps"] - 1:  # after the backward, every buffer allocated: what the stage holds at its peak
            av = pipe.replicas.elastic
            offsets = [t for per in (av._offsets or []) for t in per]
            outer = _bytes(av.buffers()) - _bytes(offsets) + _bytes(av.reference_params) if elastic else 0
            inner = [o for o in getattr(opt, "replicas", [opt])]
            states = [v for o in inner for st in o.state.values() for v in st.values()]
            held.update(outer=outer, state=_bytes(states), static=static_bytes(pipe, [opt]))

    for i in range(cfg["steps"]):
        opt.step(lambda i=i: step(i))
    return {**held, "stage": top.stage, "weights": [p.detach().clone() for p in pipe.reference_params]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    sizes = model_sizes(args)
    need = args.steps * max(args.groups) * 2
    cfg: dict[str, Any] = {"sizes": sizes, "m": args.microbatches, "steps": args.steps, "model": args.model}
    cfg["optimizer"] = args.optimizer
    if args.model == "gpt":
        data, chars = encode(stdlib_docstrings(args.corpus_chars))
        cfg.update(vocab=len(chars), stages=1, loss=lm_loss)
        cfg["batches"] = make_batches(data, args.block_size, args.batch_size, need, seed=0)
        what = f"one stage of the character GPT {sizes}"
    else:
        g = torch.Generator().manual_seed(0)
        cfg.update(stages=2, loss=torch.nn.functional.cross_entropy)
        cfg["batches"] = [
            (torch.randn(args.batch_size, 64, generator=g), torch.randint(0, 10, (args.batch_size,), generator=g))
            for _ in range(need)
        ]
        what = "the digits MLP (64 -> 256 x 4 -> 10) over 2 stages"
    print(
        f"shard_optimizer_state on {what}, B={args.batch_size}, {args.optimizer}; FUNCTIONAL figures: bytes per rank "
        "held inside the step (largest rank of each stage), no times"
    )
    print(f"{'D':>2} {'averaging':>9} {'sharded':>7} {'stage':>5} {'outer MB':>9} {'optim MB':>9} {'static MB':>10}")
    rows = []
    for D in args.groups:
        for averaging in args.averaging:
            runs = []
            for shard in (False, True, "tensors") if averaging == "exact" else (False, True):
                world = D * cfg["stages"]
                out = run_distributed(
                    _rank, world, averaging, shard, cfg, timeout=args.timeout, what=f"D={D} {averaging} shard={shard}"
                )
                for s in range(cfg["stages"]):
                    mine = [r for r in out if r["stage"] == s]
                    row = {
                        "D": D,
                        "averaging": averaging,
                        "sharded": shard,
                        "stage": s,
                        **{f"{k}_mb": max(r[k] for r in mine) / 2**20 for k in ("outer", "state", "static")},
                    }
                    runs.append((row, mine))
                    print(
                        f"{D:>2} {averaging:>9} {str(shard):>7} {s:>5} {row['outer_mb']:>9.3f} {row['state_mb']:>9.3f} "
                        f"{row['static_mb']:>10.3f}"
                    )
            for whole, wout in [(r, o) for r, o in runs if r["sharded"] is False]:
                for sharded, sout in [
                    (r, o) for r, o in runs if r["sharded"] is not False and r["stage"] == whole["stage"]
                ]:
                    pairs = [(a, b) for ra, rb in zip(wout, sout) for a, b in zip(ra["weights"], rb["weights"])]
                    diff = max(float((a - b).abs().max()) for a, b in pairs)
                    kinds = ("outer", "state", "static")
                    ratio = {k: sharded[f"{k}_mb"] / whole[f"{k}_mb"] if whole[f"{k}_mb"] else None for k in kinds}
                    sharded["ratio"], sharded["max_weight_diff"] = ratio, diff
                    shown = ", ".join(f"{k} x{v:.3f}" for k, v in ratio.items() if v is not None)
                    how = "by whole tensors" if sharded["sharded"] == "tensors" else "sharded"
                    print(
                        f"   D={D} {averaging} stage {whole['stage']}: {how} / whole: {shown}; final weights differ "
                        f"by at most {diff:.2e}"
                    )
            rows += [r for r, _ in runs]
    result = {"args": {k: v for k, v in vars(args).items()}, "rows": rows}
    if args.json_path:
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
