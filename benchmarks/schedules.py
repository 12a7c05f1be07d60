"""AFAB, 1F1B and advance forward propagation (k chosen online, as the strategy does) on 2 and 4 ranks, on loopback
and on an emulated slow link: step time, communication wait, bubble fraction and peak activation stash.

    PYTHONPATH=. python benchmarks/schedules.py                       # defaults: about 2-3 minutes on 2 CPU cores
    PYTHONPATH=. python benchmarks/schedules.py --quick               # smoke run, about 30 s
    PYTHONPATH=. python benchmarks/schedules.py --ranks 2 --json runs/schedules.json

For each world size S in ``--ranks`` one invocation spawns S gloo ranks (1 thread each) that run this project's
step, ``StagePipeline.train_step`` (as ``benchmarks/throughput.py`` and the strategy do), on the character GPT of
``examples/char_gpt.py``, split into S stages. Every row starts from the same weights, sees the same batches in the
same micro-batches and does real AdamW steps. Rows, on each link:

- ``afab``          ``build_plan("afab", S, M)``: all forwards, then all backwards (GPipe); stashes all M units
- ``1f1b``          ``build_plan("1f1b", S, M)``: stashes S - s units on stage s
- ``advance-auto``  ``build_plan("advance", S, M, k)`` with k chosen online by the pipeline's own search
                    (``StepController.observe_k``, what ``strategy="avgpipe"`` runs with ``advance_forwards="auto"``):
                    every iteration all stages' figures are gathered, rank 0 decides and broadcasts (k, settled), and
                    every rank's next step runs the new plan. The k it settled on and its reason are reported.
- ``advance-k<k>``  ``build_plan("advance", S, M, k)`` with a fixed k (``--fixed-k``), for context

Links:

- ``loopback``      gloo over 127.0.0.1
- ``slow``          EMULATION: the same gloo loopback, but every send first passes an in-process delayed transport
                    (``benchmarks/slow_link.py``): a background thread per direction that holds each message for
                    ``--latency-ms`` plus its bytes / ``--bandwidth-mbs`` (one serial wire per direction) before
                    calling the real ``dist.isend``, so the delay overlaps compute as a slow wire would. Used because
                    ``tc netem`` is not available in the sandbox this was written in. It is not a network.

Rows of both links run in the same processes and are interleaved: every round runs one iteration of every row, in
an order that rotates from round to round, each after a barrier, so background load hits all rows alike. Rounds
continue (untimed) until every ``advance-auto`` row has settled (at most ``--search-rounds``), then ``--steps``
timed rounds follow.

What is measured, per row and iteration, with the step's own ``StepTrace`` and ``ActivationMeter``
(``train_step(..., measure=True)``, as the strategy measures its log steps):

- step time: the pipeline's step (plan start to the last send acknowledged) on the slowest stage, as the strategy
  logs and ``AdvanceSearch`` sees it; the optimizer step is not timed (it is the same for every row);
- communication wait: time a stage was blocked on a neighbour (receives, final send acknowledgements); max over
  stages, as the strategy logs ``avgpipe/comm_wait_s``;
- bubble fraction: share of the step a stage was not computing; mean over stages (``avgpipe/bubble_fraction``);
- peak stash: the most activation bytes autograd held for backward at once on each stage, also in units: divided
  by the bytes one unit's forward saves on that stage (measured once per stage, alone). The schedule decides it:
  AFAB M units, 1F1B S - s on stage s, advance S - s + k on stages before the last and 1 on the last
  (docs/how-it-works.md#peak-stash).

Tables report medians over the timed rounds, ratios against AFAB and 1F1B of the same link (of medians, and
"paired": the median over rounds of the ratio within one round), and a simulated step time: the project's
simulator (``lightning_avgpipe.schedules.simulate``) fed with this run's median forward/backward time per unit and
stage and the link's latency and bandwidth (0 for loopback). Every row's first-iteration loss must match (same
weights, same data); the script exits with status 1 otherwise. Absolute times on a shared machine are noise:
compare the ratios within one table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make `examples`, `benchmarks` and this checkout's package importable
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import Tensor, nn  # noqa: E402

from benchmarks.common import apply_layers as _apply  # noqa: E402
from benchmarks.common import lm_loss as _ce  # noqa: E402
from benchmarks.common import make_batches  # noqa: E402
from examples.gpt_args import add_model_args, check_model_args  # noqa: E402
from tests.helpers.harness import init_seconds, run_distributed  # noqa: E402

LINKS = ("loopback", "slow")
SLOW_LABEL = "slow link (EMULATED: in-process delayed transport over gloo loopback, not a network)"
QUICK = dict(
    n_layer=2,
    n_embd=32,
    n_head=2,
    block_size=16,
    batch_size=16,
    microbatches=8,
    steps=3,
    warmup=1,
    search_rounds=4,
    fixed_k="",
    corpus_chars=20_000,
    latency_ms=1.0,
    bandwidth_mbs=50.0,
)


# ---------------------------------------------------------------------------------------------------------------
# arguments and data
# ---------------------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--ranks", default="2,4", help="world sizes (= pipeline stages) to run, comma-separated")
    p.add_argument("--links", default=",".join(LINKS), help=f"links to run, comma-separated, of {LINKS}")
    p.add_argument("--batch-size", type=int, default=32, help="samples per optimizer step")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches per step (must divide the batch)")
    p.add_argument("--steps", type=int, default=20, help="timed rounds (one iteration of every row each)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds before the search / timed rounds")
    p.add_argument(
        "--search-rounds",
        type=int,
        default=40,
        help="most untimed rounds spent waiting for advance-auto to settle (it may stay unsettled)",
    )
    p.add_argument("--fixed-k", default="1", help="advance rows with these fixed k, comma-separated ('' for none)")
    p.add_argument("--latency-ms", type=float, default=5.0, help="emulated slow link: one-way latency per message")
    p.add_argument(
        "--bandwidth-mbs",
        type=float,
        default=20.0,
        help="emulated slow link: MB/s (1e6 bytes) of each direction's wire",
    )
    add_model_args(p, n_layer=6, n_embd=64, n_head=4, block_size=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--corpus-chars", type=int, default=100_000, help="characters of stdlib docstrings to sample from")
    p.add_argument("--rtol", type=float, default=1e-5, help="relative tolerance of the first-iteration loss check")
    p.add_argument("--timeout", type=float, default=600.0, help="kill the ranks after this many seconds")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: tiny model, few rounds (" + ", ".join(f"{k}={v}" for k, v in QUICK.items()) + ")",
    )
    p.add_argument("--json", dest="json_path", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    args.ranks = [int(v) for v in str(args.ranks).split(",") if v.strip()]
    args.links = [v.strip() for v in str(args.links).split(",") if v.strip()]
    args.fixed_k = [int(v) for v in str(args.fixed_k).split(",") if v.strip()]
    if not args.ranks or min(args.ranks) < 2:
        p.error("--ranks must list world sizes >= 2")
    if args.n_layer + 2 < max(args.ranks):
        p.error(f"{max(args.ranks)} stages need at least {max(args.ranks)} layers: --n-layer >= {max(args.ranks) - 2}")
    if not args.links or any(link not in LINKS for link in args.links):
        p.error(f"--links must be a subset of {LINKS}")
    if args.batch_size % args.microbatches:
        p.error(f"--microbatches={args.microbatches} must divide --batch-size={args.batch_size}")
    if args.steps < 1 or args.warmup < 0 or args.search_rounds < 0:
        p.error("--steps must be >= 1, --warmup and --search-rounds >= 0")
    if any(k < 1 for k in args.fixed_k):
        p.error("--fixed-k values must be >= 1 (k = 0 is the 1f1b row)")
    check_model_args(p, args)
    if args.latency_ms < 0 or args.bandwidth_mbs <= 0:
        p.error("--latency-ms must be >= 0 and --bandwidth-mbs > 0")
    return args


def row_names(args: argparse.Namespace) -> list[str]:
    return [
        "afab",
        "1f1b",
        "advance-auto",
        *(f"advance-k{k}" for k in args.fixed_k),
    ]


def make_plan(name: str, stages: int, units: int, k: int) -> Any:
    """The package's plan for a row (what its StagePipeline runs at that k)."""
    from lightning_avgpipe.schedules import build_plan, validate_plan

    schedule = "advance" if name.startswith("advance") else name
    return validate_plan(build_plan(schedule, stages, units, k))


def partition(n_layers: int, stages: int) -> list[int]:
    """Layers per stage, as even as possible (the earlier stages take the remainder: Embed is cheap)."""
    base, extra = divmod(n_layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


# ---------------------------------------------------------------------------------------------------------------
# one rank
# ---------------------------------------------------------------------------------------------------------------


class Row:
    """One (link, schedule) row on this rank: its own :class:`StagePipeline` (the strategy's step and k search) over
    its own copy of the stage, optimizer, process group and link."""

    def __init__(
        self,
        link_name: str,
        schedule: str,
        own: list[nn.Module],
        rank: int,
        world: int,
        args: argparse.Namespace,
        batches: list[tuple[Tensor, Tensor]],
        group: Any,
        control: Any,
    ) -> None:
        from lightning_avgpipe.config import PipelineConfig
        from lightning_avgpipe.runtime import Link
        from lightning_avgpipe.runtime.comms.topology import Topology
        from lightning_avgpipe.runtime.controller import StepController
        from lightning_avgpipe.runtime.pipeline import StagePipeline

        self.link_name, self.schedule, self.rank, self.world = link_name, schedule, rank, world
        self.batches = batches
        self.control = control  # the pipeline's ranks: barriers, the figures' gather and the search's broadcast
        prev, nxt = (rank - 1 if rank > 0 else None), (rank + 1 if rank < world - 1 else None)
        if link_name == "slow":
            from benchmarks.slow_link import DelayedLink

            self.link: Link = DelayedLink(
                prev,
                nxt,
                torch.device("cpu"),
                group=group,
                stage=rank,
                latency_s=args.latency_ms * 1e-3,
                bandwidth_bytes_per_s=args.bandwidth_mbs * 1e6,
            )
        else:
            self.link = Link(prev, nxt, torch.device("cpu"), group=group, stage=rank)
        k: int | str = 0
        if schedule == "advance-auto":
            k = "auto"  # the strategy's defaults, no memory limit
        elif schedule.startswith("advance-k"):
            k = int(schedule.removeprefix("advance-k"))
        cfg = PipelineConfig(
            num_stages=world,
            num_microbatches=args.microbatches,
            schedule="advance" if schedule.startswith("advance") else schedule,
            advance_forwards=k,
            p2p="eager",
        )
        topology = Topology(rank, world, world, pipeline_group=control, job_group=control)
        self.pipe = StagePipeline(own, topology, cfg, link=self.link)
        self.controller = StepController(self.pipe)  # advance-auto: the strategy's search, as the strategy runs it
        self.opt = self.pipe.optimizer(torch.optim.AdamW(self.pipe.reference_params, lr=args.lr))
        self.search = self.controller.k_search if k == "auto" else None
        self.frozen = False  # the timed rounds run at whatever k the search reached
        self.history: list[dict[str, Any]] = []  # advance-auto: (k, step time) per iteration while searching
        self.records: list[dict[str, Any]] = []

    @property
    def k(self) -> int:
        return self.pipe.advance_forwards

    @property
    def auto(self) -> bool:
        return self.schedule == "advance-auto"

    @property
    def settled(self) -> bool:
        search = self.controller.k_search
        return search is not None and search.settled

    def step(self, i: int) -> None:
        self.opt.zero_grad(set_to_none=True)
        k = self.k
        batch = [self.batches[i % len(self.batches)]]
        searching = self.auto and not self.settled and not self.frozen
        if searching:  # the controller measures the step, gathers every stage's figures and moves k (rank 0 decides)
            report = self.controller.train_step(batch, _lm_loss, log=False)
            result = report.result
            assert report.figures is not None
            self.history.append({"k": k, "step_s": float(report.figures[:, 0].max())})
        else:
            result = self.pipe.train_step(batch, _lm_loss, measure=True)
        self.opt.step()
        trace = result.trace
        fwd = [s.end - s.start for s in trace.spans if s.kind == "F"]
        bwd = [s.end - s.start for s in trace.spans if s.kind == "B"]
        self.records.append(
            {
                "k": k,
                "step_s": trace.step_time,
                "compute_s": trace.compute_time,
                "wait_s": trace.wait_time,
                "bubble": trace.bubble_fraction,
                "peak_bytes": trace.peak_activation_bytes,
                "fwd_s": statistics.median(fwd),
                "bwd_s": statistics.median(bwd),
                "loss": float(result.loss) if result.loss is not None else None,
            }
        )
        self.search = self.controller.k_search

    def close(self) -> None:
        if hasattr(self.link, "close"):
            self.link.close()  # type: ignore[attr-defined]


def _lm_loss(out: Tensor, batch: tuple[Tensor, Tensor], share: float) -> Tensor:
    return _ce(out, batch[1])


def unit_bytes(base: list[nn.Module], start: int, count: int, last: bool, batch: tuple[Tensor, Tensor], m: int) -> int:
    """Bytes one unit's forward saves for backward on this stage (the executor's meter, one unit alone)."""
    from lightning_avgpipe.runtime.trace import ActivationMeter

    layers = copy.deepcopy(base)
    x, y = batch
    mx, my = torch.tensor_split(x, m)[0], torch.tensor_split(y, m)[0]
    with torch.no_grad():
        inp = _apply(layers[:start], mx)
    if start > 0:
        inp = inp.detach().requires_grad_(True)
    own = layers[start : start + count]
    meter = ActivationMeter([p for layer in own for p in layer.parameters()])
    with meter.unit(0):
        out = _apply(own, inp)
        if last:
            out = _ce(out, my) / m
    return meter.peak


def run_pipeline(rank: int, world: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    """Every row on a pipeline of the first ``world`` ranks; the other ranks only join the group creations."""
    from examples.char_gpt import GPTConfig, gpt_layers

    member = rank < world
    t_setup = time.perf_counter()
    control = dist.new_group(list(range(world)))
    names = row_names(args)
    groups = {(link, name): dist.new_group(list(range(world))) for link in args.links for name in names}
    if not member:
        return {}
    cfg = GPTConfig(
        vocab_size=vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=0.0,
    )
    torch.manual_seed(args.seed)
    base = list(gpt_layers(cfg))  # identical on every rank
    parts = partition(len(base), world)
    start, count = sum(parts[:rank]), parts[rank]
    batches = make_batches(data, args.block_size, args.batch_size, 16, args.seed + 1)
    rows = {
        key: Row(*key, copy.deepcopy(base)[start : start + count], rank, world, args, batches, group, control)
        for key, group in groups.items()
    }
    per_unit = unit_bytes(base, start, count, rank == world - 1, batches[0], args.microbatches)

    setup_s = time.perf_counter() - t_setup
    t_loop = time.perf_counter()
    order = list(rows)
    autos = [row for row in rows.values() if row.auto]
    i, searched, timed = 0, 0, 0
    first_timed = None
    while True:  # every rank takes the same branch: `settled` comes from rank 0's broadcast
        if i < args.warmup:
            pass
        elif any(not row.settled for row in autos) and searched < args.search_rounds:
            searched += 1
        else:
            if first_timed is None:
                first_timed = i
                for row in autos:
                    row.frozen = True
            if timed >= args.steps:
                break
            timed += 1
        shift = i % len(order)
        for key in order[shift:] + order[:shift]:
            dist.barrier(group=control)
            rows[key].step(i)
        i += 1
    dist.barrier(group=control)
    for row in rows.values():
        row.close()
    return {
        "rank": rank,
        "layers": count,
        "unit_bytes": per_unit,
        "setup_s": setup_s,
        "loop_s": time.perf_counter() - t_loop,
        "first_timed": first_timed,
        "rounds": i,
        "rows": {
            f"{link}/{name}": {
                "records": row.records,
                "history": row.history,
                "settled": row.settled if row.auto else None,
                "reason": row.controller.k_search.reason if row.auto and row.controller.k_search is not None else None,
                "final_k": row.k,
            }
            for (link, name), row in rows.items()
        },
    }


def rank_main(rank: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    """One world size after the other, on the same processes (one start-up for all)."""
    out: dict[int, dict[str, Any]] = {}
    for world in args.ranks:
        t0 = time.perf_counter()
        out[world] = run_pipeline(rank, world, args, data, vocab_size)
        dist.barrier()
        if out[world]:
            out[world]["wall_s"] = time.perf_counter() - t0
    return {"worlds": out}


def _rank(rank: int, world: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> dict[str, Any]:
    sys.setswitchinterval(5e-4)  # the emulated wire's thread wakes on time even while the main thread computes
    result = rank_main(rank, args, data, vocab_size)
    result["init_s"] = init_seconds()
    return result


def launch(world: int, args: argparse.Namespace, data: Tensor, vocab_size: int) -> list[dict[str, Any]]:
    """``rank_main`` on ``world`` gloo ranks, 1 thread each; every rank is killed after ``--timeout`` seconds."""
    return run_distributed(
        _rank, world, args, data, vocab_size, timeout=args.timeout, what=f"schedules benchmark ({world} ranks)"
    )


# ---------------------------------------------------------------------------------------------------------------
# figures
# ---------------------------------------------------------------------------------------------------------------
def summarise_world(world: int, args: argparse.Namespace, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    from lightning_avgpipe.schedules import simulate

    first, rounds = per_rank[0]["first_timed"], per_rank[0]["rounds"]
    timed = range(first, rounds)
    unit = [r["unit_bytes"] for r in per_rank]
    m, S = args.microbatches, world
    tables: dict[str, Any] = {}
    for link in args.links:
        rows: list[dict[str, Any]] = []
        for name in row_names(args):
            recs = [r["rows"][f"{link}/{name}"]["records"] for r in per_rank]  # [rank][round]
            step = [max(recs[s][i]["step_s"] for s in range(S)) for i in timed]
            wait = [max(recs[s][i]["wait_s"] for s in range(S)) for i in timed]
            bubble = [statistics.fmean(recs[s][i]["bubble"] for s in range(S)) for i in timed]
            peaks = [max(recs[s][i]["peak_bytes"] for i in timed) for s in range(S)]
            ks = sorted({recs[0][i]["k"] for i in timed})
            fwd = [statistics.median(recs[s][i]["fwd_s"] for i in timed) for s in range(S)]
            bwd = [statistics.median(recs[s][i]["bwd_s"] for i in timed) for s in range(S)]
            row: dict[str, Any] = {
                "name": name,
                "link": link,
                "k": ks[0] if len(ks) == 1 else ks,
                "step_s_median": statistics.median(step),
                "step_s_min": min(step),
                "step_s_max": max(step),
                "step_s": step,
                "comm_wait_s_median": statistics.median(wait),
                "bubble_fraction_median": statistics.median(bubble),
                "peak_stash_bytes": peaks,
                "peak_stash_units": [p / u if u else None for p, u in zip(peaks, unit, strict=True)],
                "peak_stash_bytes_max": max(peaks),
                "forward_s_per_unit": fwd,
                "backward_s_per_unit": bwd,
                "first_loss": recs[-1][0]["loss"],
            }
            if name.endswith("-auto"):
                info = per_rank[0]["rows"][f"{link}/{name}"]
                row["settled"] = info["settled"]
                row["reason"] = info["reason"] or (
                    f"NOT settled within {len(info['history'])} iterations (--search-rounds); the timed rounds ran "
                    f"at k={info['final_k']}, where the search had got to"
                )
                row["search_iterations"] = len(info["history"])
                row["search_history"] = info["history"]
            rows.append(row)
        by = {r["name"]: r for r in rows}
        # the simulator's prediction from this run's compute costs (AFAB's per-unit medians) and the link model
        costs_f, costs_b = by["afab"]["forward_s_per_unit"], by["afab"]["backward_s_per_unit"]
        latency = args.latency_ms * 1e-3 if link == "slow" else 0.0
        act_bytes = args.batch_size // m * args.block_size * args.n_embd * 4
        xfer = act_bytes / (args.bandwidth_mbs * 1e6) if link == "slow" else 0.0

        def sim_of(
            name: str,
            k: int,
            f: list[float] = costs_f,
            b: list[float] = costs_b,
            lat: float = latency,
            xf: float = xfer,
        ) -> Any:
            return simulate(make_plan(name, S, m, k), f, b, latency=lat, transfer_cost=xf)

        # the simulated step time of every k of the advance plans: where the search can climb and where it meets a
        # plateau
        sim_by_k = {"afab": sim_of("afab", 0).step_time, "advance": [sim_of("advance", k).step_time for k in range(m)]}
        for r in rows:
            k = r["k"] if isinstance(r["k"], int) else r["k"][-1]
            sim = sim_of(r["name"], k)
            r["simulated_step_s"] = sim.step_time
            r["simulated_peak_stash_units"] = list(sim.peak_stash)
            for ref in ("afab", "1f1b"):
                base = by[ref]
                r[f"step_vs_{ref}"] = r["step_s_median"] / base["step_s_median"]
                r[f"step_vs_{ref}_paired"] = statistics.median(
                    a / b for a, b in zip(r["step_s"], base["step_s"], strict=True)
                )
                r[f"memory_vs_{ref}"] = r["peak_stash_bytes_max"] / base["peak_stash_bytes_max"]
        label = (
            "loopback (gloo over 127.0.0.1)"
            if link == "loopback"
            else (f"{SLOW_LABEL}: {args.latency_ms:g} ms latency + bytes / {args.bandwidth_mbs:g} MB/s per direction")
        )
        tables[link] = {
            "label": label,
            "emulated": link == "slow",
            "rows": rows,
            "simulated_step_s_by_k": sim_by_k,
            "simulator_inputs": {"forward_s": costs_f, "backward_s": costs_b, "latency_s": latency, "transfer_s": xfer},
        }
    losses = [r["first_loss"] for t in tables.values() for r in t["rows"]]
    ok = all(math.isclose(v, losses[0], rel_tol=args.rtol, abs_tol=args.rtol) for v in losses)
    return {
        "world_size": S,
        "partition": [r["layers"] for r in per_rank],
        "unit_bytes": unit,
        "activation_bytes_per_message": args.batch_size // m * args.block_size * args.n_embd * 4,
        "timed_rounds": len(timed),
        "search_rounds": first - args.warmup,
        "links": tables,
        "first_loss_ok": ok,
        "first_losses": losses,
    }


def format_world(w: dict[str, Any]) -> str:
    S = w["world_size"]
    out = [
        f"== {S} ranks, partition {w['partition']} (layers per stage), bytes per unit "
        f"{[round(b / 1024) for b in w['unit_bytes']]} KiB, {w['activation_bytes_per_message'] / 1024:.0f} KiB per "
        f"activation message; {w['timed_rounds']} timed rounds after {w['search_rounds']} search rounds =="
    ]
    for t in w["links"].values():
        out += [
            "",
            f"link: {t['label']}",
            f"{'row':<14} {'k':>2} {'step ms':>8} {'(min-max)':>11} {'vs AFAB':>8} {'(paired)':>8} "
            f"{'vs 1F1B':>8} {'(paired)':>8} {'wait ms':>8} {'bubble':>7} {'sim ms':>7}  "
            f"{'peak stash units/stage':<24} {'KiB max':>8} {'mem vs AFAB':>11} {'vs 1F1B':>8}",
        ]
        for r in t["rows"]:
            k = r["k"] if isinstance(r["k"], int) else "/".join(map(str, r["k"]))
            spread = f"({r['step_s_min'] * 1e3:.0f}-{r['step_s_max'] * 1e3:.0f})"
            units = " ".join(f"{u:.1f}" for u in r["peak_stash_units"])
            out.append(
                f"{r['name']:<14} {k!s:>2} {r['step_s_median'] * 1e3:8.1f} {spread:>11} {r['step_vs_afab']:7.2f}x "
                f"{r['step_vs_afab_paired']:7.2f}x {r['step_vs_1f1b']:7.2f}x {r['step_vs_1f1b_paired']:7.2f}x "
                f"{r['comm_wait_s_median'] * 1e3:8.1f} {r['bubble_fraction_median']:7.2f} "
                f"{r['simulated_step_s'] * 1e3:7.1f}  {units:<24} {r['peak_stash_bytes_max'] / 1024:8.0f} "
                f"{r['memory_vs_afab']:10.2f}x {r['memory_vs_1f1b']:7.2f}x"
            )
        for r in t["rows"]:
            if r["name"].endswith("-auto"):
                path = " ".join(f"k{h['k']}:{h['step_s'] * 1e3:.0f}" for h in r["search_history"])
                out.append(
                    f"{r['name']}: {r['reason']} [{r['search_iterations']} iterations; ms per iteration "
                    f"while searching: {path}]"
                )
        sims = t["simulated_step_s_by_k"]
        out.append(
            f"simulated ms by k with this run's costs (afab {sims['afab'] * 1e3:.0f}): "
            + "; ".join(
                f"{plan} " + " ".join(f"k{k}:{v * 1e3:.0f}" for k, v in enumerate(sims[plan]))
                for plan in ("advance",)
                if plan in sims
            )
        )
    out.append(
        "first-iteration loss of every row: "
        + ("identical (OK)" if w["first_loss_ok"] else f"MISMATCH {w['first_losses']}")
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from examples.text_data import encode, stdlib_docstrings

    data, chars = encode(stdlib_docstrings(args.corpus_chars))
    started = time.perf_counter()
    per_rank = launch(max(args.ranks), args, data, len(chars))  # one start-up; world sizes run one after the other
    worlds = []
    for world in args.ranks:
        mine = [per_rank[r]["worlds"][world] for r in range(world)]
        summary = summarise_world(world, args, mine)
        summary["wall_s"] = mine[0]["wall_s"]
        summary["setup_s"] = mine[0]["setup_s"]
        worlds.append(summary)
    result = {
        "config": {
            "ranks": args.ranks,
            "links": args.links,
            "threads_per_rank": 1,
            "batch_size": args.batch_size,
            "microbatches": args.microbatches,
            "steps": args.steps,
            "warmup": args.warmup,
            "search_rounds_max": args.search_rounds,
            "fixed_k": args.fixed_k,
            "n_layer": args.n_layer,
            "n_embd": args.n_embd,
            "n_head": args.n_head,
            "block_size": args.block_size,
            "vocab_size": len(chars),
            "optimizer": "AdamW (untimed)",
            "lr": args.lr,
            "seed": args.seed,
            "quick": args.quick,
            "slow_link": {
                "emulated": True,
                "method": "in-process delayed transport (benchmarks/slow_link.py)",
                "latency_ms": args.latency_ms,
                "bandwidth_MB_per_s": args.bandwidth_mbs,
            },
            "torch": torch.__version__,
        },
        "worlds": worlds,
        "wall_s": time.perf_counter() - started,
        "rank_init_s": max(r["init_s"] for r in per_rank),
    }
    c = result["config"]
    print(
        f"GPT n_layer={c['n_layer']} n_embd={c['n_embd']} n_head={c['n_head']} block_size={c['block_size']} "
        f"vocab={c['vocab_size']} | batch {c['batch_size']} in {c['microbatches']} micro-batches | gloo ranks x 1 "
        f"thread | torch {c['torch']} | step = pipeline only (slowest stage), medians over timed rounds; wait = "
        f"max over stages; bubble = mean over stages; stash units = peak bytes / bytes of one unit"
    )
    for w in worlds:
        print()
        print(format_world(w))
    print(f"\nwall time {result['wall_s']:.0f} s")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {path}")
    return 0 if all(w["first_loss_ok"] for w in worlds) else 1


if __name__ == "__main__":
    sys.exit(main())
