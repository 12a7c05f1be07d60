"""Every schedule's measured bubble and peak activation memory against what the simulator predicts from the same
step's measured costs, on the 8-block GPT of ``benchmarks/throughput.py`` (2 gloo ranks, one thread each).

    PYTHONPATH=. python benchmarks/bubble.py              # about a minute on 2 idle CPU cores
    PYTHONPATH=. python benchmarks/bubble.py --steps 4 --n-layer 2

For each of ``1f1b``, ``zbh1``, ``interleaved`` and ``zbv`` (N = 1, the same cut as the throughput rows), every step
is traced (``measure=True``). The per-unit F, B, I and W times of each rank then feed ``schedules.simulate`` on the
schedule's plan. Both bubbles are ``1 - (busy time of all ranks) / (ranks x the slowest rank's step)``, the
simulator's definition. Also printed: each rank's peak activation bytes (the meter's, ``runtime/trace.py``).
"""

from __future__ import annotations

import collections
import copy
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks import throughput as T  # noqa: E402
from benchmarks.common import make_batches  # noqa: E402
from benchmarks.throughput_rows import WORLD, PipeRow, _lm_loss, v_chunks  # noqa: E402
from examples.gpt_args import model_sizes  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402

SCHEDULES = ("1f1b", "zbh1", "interleaved", "zbv")
COMPUTE = ("F", "B", "I", "W")


def _rank(rank: int, world: int, args: Any, data: torch.Tensor, vocab: int) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    from examples.char_gpt import GPTConfig, gpt_layers

    torch.manual_seed(args.seed)
    base = list(gpt_layers(GPTConfig(vocab_size=vocab, **model_sizes(args), dropout=0.0)))
    batches = make_batches(data, args.block_size, args.batch_size, args.warmup + args.steps, args.seed + 1)
    start, count = sum(args.partition[:rank]), args.partition[rank]
    rows = {}
    for name in SCHEDULES:
        if name in ("interleaved", "zbv"):
            own, sizes = v_chunks(copy.deepcopy(base), rank, "v" if name == "zbv" else "loop")
            rows[name] = PipeRow(name, 1, own, rank, args, batches, sizes)
        else:
            rows[name] = PipeRow(name, 1, copy.deepcopy(base)[start : start + count], rank, args, batches)
    seen: dict[str, dict[str, list[float]]] = {n: collections.defaultdict(list) for n in rows}
    for i in range(args.warmup + args.steps):
        for name, row in rows.items():  # interleaved: background load hits every schedule alike
            torch.distributed.barrier()
            row.opt.zero_grad(set_to_none=True)
            result = row.pipe.train_step([row.batches[i]], _lm_loss, measure=True)
            row.opt.step()
            if i < args.warmup:
                continue
            spent = collections.Counter()
            for span in result.trace.spans:
                spent[span.kind] += span.end - span.start
            for kind in COMPUTE:  # per unit of this rank (all its chunks), ms
                seen[name][kind].append(spent.get(kind, 0.0) / args.microbatches * 1e3)
            seen[name]["busy"].append(sum(spent.get(k, 0.0) for k in (*COMPUTE, "send")) * 1e3)
            seen[name]["step"].append(result.trace.step_time * 1e3)
            seen[name]["peak_mib"].append(result.trace.peak_activation_bytes / 2**20)
    return {n: {k: statistics.median(v) for k, v in d.items()} for n, d in seen.items()}


def main(argv: list[str] | None = None) -> int:
    from examples.text_data import encode, stdlib_docstrings
    from lightning_avgpipe.schedules import build_plan, simulate

    args = T.parse_args(["--n-layer", "8", "--batch-size", "16", "--microbatches", "4", "--steps", "12", *(argv or [])])
    data, chars = encode(stdlib_docstrings(args.corpus_chars))
    ranks = run_distributed(_rank, WORLD, args, data, len(chars), timeout=args.timeout, what="bubble benchmark")
    print(f"{'schedule':<12} {'bubble':>8} {'simulated':>10} {'ratio':>6}  {'peak MiB per rank':<20} step ms per rank")
    for name in SCHEDULES:
        per = [r[name] for r in ranks]
        v = 2 if name in ("interleaved", "zbv") else 1
        split = name in ("zbh1", "zbv")
        f = [p["F"] / v for p in per]  # a chunk's share of its rank's unit
        b = [(p["B"] + p["I"] + p["W"]) / v for p in per]
        w = [p["W"] / v for p in per] if split else None
        sim = simulate(build_plan(name, WORLD, args.microbatches, stages_per_rank=v), f, b, weight_grad_cost=w)
        slowest = max(p["step"] for p in per)
        measured = 1 - sum(p["busy"] for p in per) / (len(per) * slowest)
        peaks = "/".join(f"{p['peak_mib']:.2f}" for p in per)
        steps = "/".join(f"{p['step']:.1f}" for p in per)
        ratio = measured / sim.bubble_fraction if sim.bubble_fraction > 0 else float("nan")
        print(f"{name:<12} {measured:>8.3f} {sim.bubble_fraction:>10.3f} {ratio:>6.2f}  {peaks:<20} {steps}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
