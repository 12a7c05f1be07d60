"""What ``seed_layers=True`` (each layer's dropout seeded by step, micro-batch and layer: the same masks for every
layout, ``runtime/streams.py``) costs per training step, against ``False`` (each process's own generator), side
by side in one run.

    PYTHONPATH=. python benchmarks/seed_layers.py            # about 1 minute on 2 CPU cores

The character GPT of ``examples/char_gpt.py`` with dropout 0.1 (embedding, attention and MLP) trains with
``StagePipeline`` and AdamW on S gloo processes (S = 1 and 2). Each process alternates the two settings in rounds of
``--steps`` steps (so both see the same load), and prints the median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.common import lm_loss, make_batches  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402


def _rank(rank: int, world: int, cfg: dict[str, Any]) -> dict[str, Any]:
    from examples.char_gpt import GPTConfig, gpt_layers
    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.streams import RandomStreams

    torch.manual_seed(0)
    layers = list(gpt_layers(GPTConfig(vocab_size=cfg["vocab"], dropout=0.1, **cfg["sizes"])))
    top = Topology.build(rank, world, world) if world > 1 else Topology(0, 1, 1)
    n = len(layers)
    first = 1 + (n - 2) // 2 if world == 2 else n
    start, stop = (0, first) if top.stage == 0 else (first, n)
    pipe = StagePipeline(layers[start:stop], top, PipelineConfig(num_stages=world, num_microbatches=cfg["m"]))
    opt = pipe.optimizer(torch.optim.AdamW(pipe.reference_params, lr=3e-3))
    streams = RandomStreams(5, [0, first])
    times: dict[bool, list[float]] = {True: [], False: []}
    step = 0
    for _ in range(cfg["rounds"]):
        for on in (True, False):
            pipe.streams = streams if on else None
            for _ in range(cfg["steps"]):
                streams.step = (step, 0)
                batch = cfg["batches"][step % len(cfg["batches"])]
                t0 = time.perf_counter()
                opt.zero_grad()
                pipe.train_step([batch], lambda out, b, share: lm_loss(out, b[1]))
                opt.step()
                times[on].append(time.perf_counter() - t0)
                step += 1
    return {"on": statistics.median(times[True][1:]), "off": statistics.median(times[False][1:])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5, help="steps per setting per round")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    data, chars = encode(stdlib_docstrings(100_000))
    sizes = {"n_layer": 4, "n_embd": 64, "n_head": 4, "block_size": 32}
    batches = make_batches(data, 32, args.batch_size, 8, seed=0)
    cfg = {"vocab": len(chars), "sizes": sizes, "batches": batches, "m": args.microbatches}
    cfg.update(rounds=args.rounds, steps=args.steps)
    print(f"character GPT {sizes}, dropout 0.1, B={args.batch_size}, M={args.microbatches}; median step time")
    print(f"{'S':>2} {'seed_layers=True':>17} {'False':>9} {'ratio':>7}")
    for S in (1, 2):
        out = run_distributed(_rank, S, cfg, timeout=600, what=f"seed_layers S={S}")
        on, off = max(r["on"] for r in out), max(r["off"] for r in out)  # the slowest stage sets the pace
        print(f"{S:>2} {on * 1e3:>14.1f} ms {off * 1e3:>6.1f} ms {on / off:>6.3f}x")


if __name__ == "__main__":
    main()
