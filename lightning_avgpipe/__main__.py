"""Command line: ``python -m lightning_avgpipe schedule ...`` prints a plan; anything else is LightningCLI.

python -m lightning_avgpipe schedule --stages 4 --microbatches 8 --schedule 1f1b
python -m lightning_avgpipe fit --config cfg.yaml        # LightningCLI with strategy="avgpipe" registered
python -m lightning_avgpipe tune --config cfg.yaml       # AvgPipeTuner's table and choice, no training
python -m lightning_avgpipe whatif --profile tuning.json --stages 8 --groups 4   # project a larger layout
python -m lightning_avgpipe consolidate FOLDER OUT.ckpt   # a sharded checkpoint as one file
"""

from __future__ import annotations

import argparse
import sys

from lightning_avgpipe.schedules import SCHEDULES, build_plan, simulate, timeline_table, validate_plan
from lightning_avgpipe.schedules.generate import reads_k
from lightning_avgpipe.tuning.cli import whatif_command


def schedule_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lightning_avgpipe schedule",
        description="Print a pipeline plan: every stage's actions, and the simulated timeline as a table.",
    )
    p.add_argument("--stages", type=int, default=4, help="pipeline stages S")
    p.add_argument("--microbatches", type=int, default=8, help="micro-batches M per batch")
    p.add_argument("--pipelines", type=int, default=1, help="parallel pipelines N (units = N x M)")
    p.add_argument("--schedule", default="1f1b", choices=[*SCHEDULES, "gpipe"])
    p.add_argument("--advance-forwards", type=int, default=0, help="early forwards k for --schedule advance")
    p.add_argument(
        "--stages-per-rank", type=int, default=None, help="model chunks v per rank (interleaved: default 2; zbv: 2)"
    )
    p.add_argument("--forward-cost", type=float, default=1.0, help="time of one forward in the table")
    p.add_argument("--backward-cost", type=float, default=2.0, help="time of one backward in the table")
    p.add_argument(
        "--weight-grad-cost", type=float, help="of it, the weight gradient's (W) under zbh1/zbadvance; default: half"
    )
    p.add_argument("--latency", type=float, default=0.0, help="time of every message between neighbours")
    p.add_argument("--actions", action="store_true", help="also print the lowered action lists (with comms)")
    p.add_argument("--trace", metavar="PATH", help="write the simulated timeline as a Chrome trace (PATH) and a PNG")
    p.add_argument("--compare", action="store_true", help="a table of every schedule at these sizes and costs instead")
    args = p.parse_args(argv)
    for flag, value, low in (
        ("--stages", args.stages, 1),
        ("--microbatches", args.microbatches, 1),
        ("--pipelines", args.pipelines, 1),
        ("--advance-forwards", args.advance_forwards, 0),
    ):
        if value < low:
            p.error(f"{flag} {value}: must be at least {low}")
    for flag, value in (("--forward-cost", args.forward_cost), ("--backward-cost", args.backward_cost)):
        if not value > 0:
            p.error(f"{flag} {value}: must be a positive time")
    if not args.latency >= 0:
        p.error(f"--latency {args.latency}: must be >= 0")
    try:
        plan = validate_plan(
            build_plan(
                args.schedule,
                args.stages,
                args.microbatches * args.pipelines,
                args.advance_forwards,
                stages_per_rank=args.stages_per_rank,
            )
        )
    except ValueError as err:
        p.error(str(err))
    v = plan.stages_per_rank  # a chunk costs 1/v of a stage: the model's compute is the same as with v = 1
    w = args.weight_grad_cost
    if w is not None and not 0 < w < args.backward_cost:
        p.error(f"--weight-grad-cost {w}: must be a positive time below --backward-cost {args.backward_cost}")
    if args.compare:
        print(
            compare_schedules(args.stages, args.microbatches * args.pipelines, args.forward_cost, args.backward_cost, w)
        )
        return 0
    sim = simulate(
        plan, args.forward_cost / v, args.backward_cost / v, latency=args.latency, weight_grad_cost=w and w / v
    )
    deferred = f", weight gradients waiting {list(sim.peak_deferred)}" if any(sim.peak_deferred) else ""
    chunks = f" stages_per_rank={v}" if v > 1 else ""
    unit = f" (in chunks, 1/{v} of a stage)" if v > 1 else ""
    print(
        f"schedule={plan.schedule} stages={plan.num_stages}{chunks} units={plan.num_units} "
        f"advance_forwards={plan.advance_forwards}: step time {sim.step_time:g}, "
        f"bubble {sim.bubble_fraction:.1%}, peak stash per stage{unit} {list(sim.peak_stash)}{deferred}"
    )
    split = [c for stage in sim.events for e in stage for c in (e.end - e.start,)]
    print(timeline_table(sim, resolution=min([args.forward_cost / v, *split]), chunked=v > 1))
    if args.actions:
        print(plan)
    if args.trace:
        from pathlib import Path

        from lightning_avgpipe.runtime.trace import spans_from_simulation, write_trace

        title = f"simulated {plan.schedule}" + (f" k={plan.advance_forwards}" if reads_k(plan.schedule) else "")
        title += f", S={plan.num_stages}, units={plan.num_units}"
        json_path, png = write_trace(Path(args.trace), spans_from_simulation(sim), title, time_unit="cost units")
        print(f"trace written to {json_path}" + (f" and {png}" if png else ""))
    return 0


def compare_schedules(S: int, U: int, forward: float, backward: float, weight: float | None) -> str:
    """Every schedule at ``S`` ranks and ``U`` units, simulated at one model's costs (a chunk costs 1/v of a stage):
    step time, bubble, and the most activations a rank holds, in units of one 1F1B stage's micro-batch."""
    rows = [f"S={S} units={U} forward={forward:g} backward={backward:g}" + (f" weight={weight:g}" if weight else "")]
    rows.append(f"{'schedule':<16} {'step':>7} {'vs 1f1b':>8} {'bubble':>7} {'peak':>6}")
    base = simulate(build_plan("1f1b", S, U), forward, backward).step_time
    for name in SCHEDULES:
        k = 1 if reads_k(name) else 0
        plan = build_plan(name, S, U, k)
        v = plan.stages_per_rank
        sim = simulate(plan, forward / v, backward / v, weight_grad_cost=weight and weight / v)
        label = name + (f" k={k}" if k else "") + (f" v={v}" if v > 1 else "")
        peak = max(sim.peak_stash) / v
        rows.append(
            f"{label:<16} {sim.step_time:7.2f} {base / sim.step_time:7.3f}x {sim.bubble_fraction:7.1%} {peak:6.1f}"
        )
    return "\n".join(rows)


def consolidate_command(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m lightning_avgpipe consolidate",
        description="Write a sharded checkpoint (save_distributed_checkpoint=True) as one file, the one "
        "save_distributed_checkpoint=False writes: MyModel.load_from_checkpoint and plain Lightning read it. It "
        "streams tensor by tensor: its memory peak is the largest tensor.",
    )
    p.add_argument("folder", help="the checkpoint folder")
    p.add_argument("out", help="the file to write (replaced only once complete)")
    p.add_argument(
        "--trusted",
        action="store_true",
        help="unpickle the folder's metadata in full: only for a folder you wrote yourself (runs code from it)",
    )
    args = p.parse_args(argv)
    from lightning_avgpipe.plugin.checkpoint.sharded import consolidate

    try:
        consolidate(args.folder, args.out, trusted=args.trusted)
    except (ValueError, OSError) as err:
        print(f"consolidate: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}")
    return 0


COMMANDS = """lightning_avgpipe commands (python -m lightning_avgpipe COMMAND --help for each):
  fit, validate, test, predict   LightningCLI with strategy="avgpipe" registered (--config cfg.yaml, --trainer.*)
  tune                           AvgPipeTuner's table and choice for a fit config, without training
  schedule                       print and simulate a pipeline plan (no processes)
  whatif                         project a tuning profile to more stages and groups
  consolidate                    write a sharded checkpoint folder as one file
"""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(COMMANDS)
        if not args:
            return 2
    if args and args[0] == "schedule":
        return schedule_command(args[1:])
    if args and args[0] == "whatif":
        return whatif_command(args[1:])
    if args and args[0] == "consolidate":
        return consolidate_command(args[1:])
    if args and args[0] == "tune":
        from lightning_avgpipe.cli import tune_main

        return tune_main(args[1:])
    from lightning_avgpipe.cli import cli_main

    cli_main(argv)  # None: LightningCLI reads sys.argv itself (and does not warn about explicit args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
