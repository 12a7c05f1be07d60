"""What the averaging period H saves when the link between pipeline groups is slow (EMULATED), and what that does to
time to accuracy.

D = 2 pipeline groups (2 gloo ranks, one stage each) train a convergence study's model with N = 2 replicas per group,
so N x D = 4 replicas, the convergence benchmark's N = 4 arithmetic. Three ways to combine them, timed step by step
on the same ranks, interleaved:

- ``exact``: ``averaging="exact"``, the N x D batches as one batch. The D groups all-reduce their gradients every
  step and wait for it (data parallelism: pipe-NB of the convergence benchmark).
- ``H=1``: the paper's rule. The D groups all-reduce the reference update every step; the all-reduce overlaps the
  next step's forwards and backwards (``sync_reference=False``).
- ``H=4``: ``averaging_period=4``: the same all-reduce once every 4 steps (period-N of the convergence benchmark).

**The link is emulated.** Every all-reduce of more than 1,000 elements (the gradients or reference updates, nothing
else in these steps) is held back by latency + 2 (D - 1) / D x bytes / bandwidth, a ring all-reduce's traffic over
one link, then run over loopback. An asynchronous one returns at once and its ``wait()`` sleeps until then, so the
delay overlaps compute as a real transfer would. Nothing is measured about a real network: the sleep stands in for
the wire, and the benchmark says so in its output.

Time to target = measured seconds per step x steps to target, the steps from a convergence benchmark JSON
(``--convergence``: each method's mean samples to target over the seeds that reached it, divided by N x B per step).
Without it, only the step times and their ratios are printed.

Run: ``PYTHONPATH=. python benchmarks/group_link.py --convergence runs/convergence3/convergence.json --json
runs/group_link.json``
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.convergence import parse_args  # noqa: E402
from benchmarks.convergence_studies import Data, make_studies  # noqa: E402
from tests.helpers.harness import run_distributed  # noqa: E402

METHODS: dict[
    str, tuple[dict[str, Any], str]
] = {  # name -> (strategy options, the convergence benchmark's method with the same arithmetic)
    "exact": ({"averaging": "exact"}, "pipe-NB"),
    "H=1": ({}, "avgpipe-N"),
    "H=4": ({"averaging_period": 4}, "period-N"),
}
LINKS = {  # name -> (latency s, bytes/s); "loopback" adds nothing
    "loopback": (0.0, float("inf")),
    "1 Gbit/s": (5e-4, 1e9 / 8),
    "100 Mbit/s": (1e-3, 1e8 / 8),
    "10 Mbit/s": (2e-3, 1e7 / 8),
}
GROUPS = 2
REPLICAS = 2
THRESHOLD = 1000  # elements: smaller all-reduces are not delayed


class _Delayed:
    """An all-reduce handle whose ``wait()`` returns no earlier than the emulated wire delivers."""

    def __init__(self, work: Any, ready: float) -> None:
        self.work, self.ready = work, ready

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        left = self.ready - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return time.perf_counter() >= self.ready and bool(self.work.is_completed())


def emulate(latency: float, bandwidth: float, world: int) -> Any:
    """Replace ``torch.distributed.all_reduce`` in this process with the delayed one; returns the original."""
    import torch.distributed as dist

    real = dist.all_reduce

    def all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        async_op = bool(kwargs.pop("async_op", False))
        if tensor.numel() <= THRESHOLD or bandwidth == float("inf"):
            return real(tensor, *args, async_op=async_op, **kwargs)  # type: ignore[misc]
        delay = latency + 2 * (world - 1) / world * tensor.numel() * tensor.element_size() / bandwidth
        ready = time.perf_counter() + delay
        work = real(tensor, *args, async_op=True, **kwargs)  # type: ignore[misc]
        handle = _Delayed(work, ready)
        if async_op:
            return handle
        handle.wait()
        return None

    dist.all_reduce = all_reduce
    return real


def _rank(rank: int, world: int, study: Any, m: int, steps: int, warmup: int, links: list[str]) -> dict[str, Any]:
    import torch.distributed as dist

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline

    data = Data(study)
    layers = list(data.model(0))
    g = torch.Generator().manual_seed(1 + rank)
    b = study.batch

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.randint(0, len(data.x), (b,), generator=g)
        return data.x[idx], data.y[idx]

    def loss(out: torch.Tensor, micro: Any, share: float) -> torch.Tensor:
        return Data.loss(out, micro[1])

    topology = Topology.build(rank, world, 1)  # the stage group: the D ranks the updates are averaged over
    pipes = {}
    for name, (options, _) in METHODS.items():
        cfg = PipelineConfig(num_microbatches=m, num_pipelines=REPLICAS, partition=[len(layers)], **options)
        pipe = StagePipeline(copy.deepcopy(layers), topology, cfg)
        pipes[name] = (pipe, pipe.optimizer(data.optimizer(pipe.reference_params, study.lr_center)))
    params = sum(p.numel() for layer in layers for p in layer.parameters())
    out: dict[str, Any] = {"params": params}
    real = dist.all_reduce
    for link in links:
        latency, bandwidth = LINKS[link]
        emulate(latency, bandwidth, world)
        times: dict[str, list[float]] = {name: [] for name in METHODS}
        order = list(METHODS)
        for name in order:  # a whole period of H = 4 per turn, so each turn has one averaging
            for _ in range(warmup):
                _step(pipes[name], batch, loss)
        for i in range(steps):
            shift = i % len(order)
            for name in order[shift:] + order[:shift]:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(4):
                    _step(pipes[name], batch, loss)
                pipes[name][0].replicas.elastic.wait()  # an update still in flight belongs to this turn
                times[name].append((time.perf_counter() - t0) / 4)
        dist.all_reduce = real
        out[link] = times
    dist.barrier()
    return out


def _step(entry: Any, batch: Any, loss: Any) -> None:
    pipe, opt = entry
    opt.zero_grad(set_to_none=True)
    pipe.train_step([batch() for _ in range(REPLICAS)], loss)
    opt.step()


def _entry(rank: int, world: int, *args: Any) -> dict[str, Any]:
    return _rank(rank, world, *args)


def steps_to_target(path: Path | None, study: str) -> dict[str, dict[str, Any]]:
    """Each method's mean steps to target (samples / (N x B)) in a convergence JSON, and how many seeds got there."""
    if path is None:
        return {}
    methods = json.loads(path.read_text())["studies"][study]["methods"]
    out: dict[str, dict[str, Any]] = {}
    for name, (_, conv) in METHODS.items():
        entry = methods.get(conv, {})
        samples = entry.get("samples_to_target")
        out[name] = {
            "steps": samples["mean"] / entry["samples_per_iteration"] if samples else None,
            "seeds": f"{entry.get('seeds_reaching_target', 0)}/{entry.get('seeds', 0)}",
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--studies", nargs="+", default=["digits", "text"], choices=["digits", "text", "digits-cnn"])
    parser.add_argument("--links", nargs="+", default=list(LINKS), choices=list(LINKS))
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6, help="timed turns of 4 steps per method and link")
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--convergence", type=Path, default=None, help="a convergence.py --json file")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    started = time.perf_counter()
    studies = make_studies(parse_args(["--datasets", ",".join(args.studies), "--pipelines", str(GROUPS * REPLICAS)]))
    print(
        f"group_link: D = {GROUPS} pipeline groups x N = {REPLICAS} replicas (2 gloo ranks x 1 thread, one stage "
        f"each), M = {args.microbatches}; the link between the groups is EMULATED (a sleep per all-reduce of "
        f"latency + 2(D-1)/D x bytes / bandwidth over loopback), not a network"
    )
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    report: dict[str, Any] = {"config": config, "studies": {}}
    for name, study in studies.items():
        got = run_distributed(
            _entry,
            GROUPS,
            study,
            args.microbatches,
            args.steps,
            args.warmup,
            args.links,
            timeout=1800,
            start_method="fork" if "fork" in mp.get_all_start_methods() else "spawn",
            what="group link timing",
        )
        to_target = steps_to_target(args.convergence, name)
        rows: dict[str, Any] = {}
        print(f"\n{name} ({got[0]['params']:,} parameters, {got[0]['params'] * 4 / 2**20:.2f} MiB per all-reduce):")
        head = f"  {'link':<12}" + "".join(f"{m + ' ms/step':>16}" for m in METHODS)
        head += "  H=4 vs H=1" + ("".join(f"{m + ' s to target':>20}" for m in METHODS) if to_target else "")
        print(head)
        for link in args.links:
            step = {
                m: statistics.median(max(got[r][link][m][i] for r in range(GROUPS)) for i in range(args.steps))
                for m in METHODS
            }
            steps_needed = {m: to_target.get(m, {}).get("steps") for m in METHODS}
            target = {m: step[m] * steps_needed[m] if steps_needed[m] else None for m in METHODS}
            reached = {m: t for m, t in target.items() if t is not None}
            fastest = min(reached, key=lambda m: reached[m]) if reached else None
            rows[link] = {"step_s": step, "time_to_target_s": target, "fastest_to_target": fastest}
            line = f"  {link:<12}" + "".join(f"{step[m] * 1e3:>16.1f}" for m in METHODS)
            line += f"  {step['H=1'] / step['H=4']:>9.2f}x"
            if to_target:
                line += "".join(f"{t:>20.2f}" if t is not None else f"{'not reached':>20}" for t in target.values())
                line += f"  fastest: {fastest}" if fastest else ""
            print(line)
        if to_target:
            print(
                "  steps to target (convergence JSON, mean over seeds that reached it): "
                + ", ".join(
                    f"{m} {v['steps']:.0f} ({v['seeds']} seeds)" if v["steps"] else f"{m} none ({v['seeds']} seeds)"
                    for m, v in to_target.items()
                )
            )
        report["studies"][name] = {"params": got[0]["params"], "links": rows, "steps_to_target": to_target}
    report["wall_s"] = time.perf_counter() - started
    print(f"\n{report['wall_s']:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
