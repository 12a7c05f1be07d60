"""``python -m lightning_avgpipe whatif``: predict a larger layout from a tuning report's profile.

    python -m lightning_avgpipe whatif --profile tuning.json --stages 8 --groups 4 \\
        --latency-ms 0.05 --bandwidth-gbs 10 --memory-limit-mb 16000

Loads the ``"profile"`` of a tuning JSON (``TuningTable.write_json``), projects it to S' stages and D groups
(``whatif.project``), runs the search and prints the table and the choice.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_avgpipe.schedules import SCHEDULES
from lightning_avgpipe.schedules.generate import reads_k, splits_backward
from lightning_avgpipe.tuning.model import PipelineProfile
from lightning_avgpipe.tuning.recommend import format_levels, recommend
from lightning_avgpipe.tuning.search import NoFeasibleSettingError, search
from lightning_avgpipe.tuning.sharding import FSDP, LEVELS, REDUCE
from lightning_avgpipe.tuning.tensor_modes import MODES, compare, format_rows
from lightning_avgpipe.tuning.whatif import TensorParallel, project


def int_list(text: str) -> list[int]:
    """One argument of a list option: ``4`` or ``2,4,8`` (``tune`` and ``whatif`` alike)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an int or a comma list of ints (for example 2,4)") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one int")
    return values


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m lightning_avgpipe whatif",
        description="Project a measured profile to more stages and data-parallel groups, then predict every "
        "(M, N) and choose the highest samples/s that fits the memory limit.",
    )
    p.add_argument(
        "--profile",
        required=True,
        metavar="JSON",
        help="a tuning report (written by the tuner) whose 'profile' entry is used",
    )
    p.add_argument("--stages", type=int, required=True, help="pipeline stages S' of the layout to predict")
    p.add_argument("--groups", type=int, default=1, help="data-parallel groups D (default 1)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, help="T, ranks splitting every stage (default 1)")
    p.add_argument(
        "--tensor-fraction",
        type=float,
        default=1.0,
        help="share of a stage's compute, weights and activations the tensor-parallel plan splits (default 1.0)",
    )
    p.add_argument(
        "--tensor-allreduces",
        type=int,
        default=0,
        help="split layer pairs in the whole model: each all-reduces its output forward and backward (default 0)",
    )
    p.add_argument(
        "--tensor-parallel-mode",
        default="1d",
        choices=MODES,
        help="how the T ranks split a stage: '1d' (Megatron), '2d' (a q x q SUMMA grid), '2.5d' (d copies of it); "
        "with T > 1 every mode that fits T is printed side by side (default 1d)",
    )
    p.add_argument("--tensor-parallel-depth", type=int, default=1, help="d of '2.5d' (T = d x q x q; default 1)")
    p.add_argument("--sequence-parallel", action="store_true", help="1d with sequence parallelism (T > 1)")
    p.add_argument(
        "--attention-share",
        type=float,
        default=0.5,
        help="share of a stage's saved activations that its attention keeps (2.5d splits it over q x q, or T)",
    )
    p.add_argument(
        "--attention-heads",
        type=int,
        default=0,
        help="the attention's heads: where T divides them, 2.5d splits the attention over all T (0, the default: "
        "not known, over q x q)",
    )
    p.add_argument("--tensor-latency-ms", type=float, default=None, help="latency between the T ranks of a node")
    p.add_argument("--tensor-bandwidth-gbs", type=float, default=None, help="bandwidth between the T ranks, GB/s")
    p.add_argument(
        "--checkpoint-layers",
        type=int,
        default=None,
        metavar="L",
        help="activation checkpointing of every layer of a model of L layers (default: off)",
    )
    p.add_argument(
        "--latency-ms",
        type=float,
        default=None,
        help="link latency per message in milliseconds (default: the profiled one)",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        default=None,
        help="link bandwidth in GB/s, 1 GB = 1e9 bytes (default: the profiled one)",
    )
    p.add_argument(
        "--memory-limit-mb", type=float, default=None, help="memory per stage in MiB (2**20 bytes); default: no limit"
    )
    p.add_argument(
        "--num-microbatches",
        type=int_list,
        nargs="+",
        default=None,
        metavar="M",
        help="candidate micro-batch counts, each dividing the batch size (default: all divisors)",
    )
    p.add_argument(
        "--num-pipelines",
        type=int_list,
        nargs="+",
        default=None,
        metavar="N",
        help="one value: consider 1..N pipelines; several: exactly those (default: 1..8)",
    )
    p.add_argument(
        "--schedule",
        default=None,
        choices=[*SCHEDULES, "gpipe"],
        help="schedule to predict (default: the profiled one)",
    )
    p.add_argument(
        "--objective",
        default="goodput",
        choices=["goodput", "throughput"],
        help="what the choice maximises, as AvgPipeTuner's objective (default: goodput, as tune)",
    )
    p.add_argument(
        "--schedules",
        nargs="+",
        default=None,
        metavar="NAME",
        help="weigh several schedules side by side (bubble and peak per rank of each); 'all': every schedule the "
        "profile can predict (the split ones where it timed I and W)",
    )
    p.add_argument(
        "--advance-forwards",
        default="auto",
        metavar="K|auto",
        help="early forwards k for --schedule advance: an int >= 0 or 'auto' (default)",
    )
    p.add_argument(
        "--sharding",
        default=None,
        choices=[*LEVELS, "all"],
        help="how the D groups share each stage (ZeRO-0..3; SHARD_GRAD_OP and FULL_SHARD under averaging='exact'), or "
        "'all': also print each level's per-rank memory (between steps and peak), traffic and time at the choice, "
        "and with --memory-limit-mb the lightest level that fits (default: the profiled one)",
    )
    p.add_argument(
        "--reduce-gradients",
        default=None,
        choices=list(REDUCE),
        help="SHARD_GRAD_OP, FULL_SHARD: reduce-scatter every micro-batch's gradients, or accumulate them whole and "
        "reduce once per step (less traffic, ZeRO-1's peak) (default: the profiled one)",
    )
    p.add_argument(
        "--report", metavar="DIR", default=None, help="also write whatif.json and whatif.png (the heat map) into DIR"
    )
    return p


def _load_profile(p: argparse.ArgumentParser, value: str) -> PipelineProfile:
    path = Path(value)
    if not path.is_file():
        p.error(f"--profile {value}: no such file; pass the JSON a tuning run wrote (its 'profile' entry is used).")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        p.error(f"--profile {value}: not readable JSON ({e}); pass the JSON a tuning run wrote.")
    if not isinstance(data, dict) or not isinstance(data.get("profile"), dict):
        p.error(
            f"--profile {value}: has no 'profile' object; pass a tuning report written with its profile "
            "(TuningTable.write_json of a table searched from a profile)."
        )
    try:
        return PipelineProfile.from_dict(data["profile"])
    except (KeyError, TypeError, ValueError) as e:
        p.error(f"--profile {value}: its 'profile' is malformed ({e!r}); re-run the tuner to write a fresh one.")


def _schedules(p: argparse.ArgumentParser, names: list[str] | None, profile: PipelineProfile) -> list[str] | None:
    """``--schedules``: the names, checked; ``all``: every schedule ``profile`` can predict."""
    if names is None:
        return None
    split = all(st.split_profiled for st in profile.stages)
    if names == ["all"]:
        return [n for n in SCHEDULES if split or not splits_backward(n)]
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        p.error(f"--schedules {' '.join(names)}: {unknown} not among {list(SCHEDULES)} (or 'all')")
    if not split and any(splits_backward(n) for n in names):
        p.error(
            f"--schedules {' '.join(names)}: this profile did not time the split backward (input_grad_s, "
            "weight_grad_s); profile with AvgPipeTuner, or leave out zbh1, zbadvance and zbv"
        )
    return names


def _check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The numbers of the command line, each checked."""
    if args.stages < 1:
        p.error(f"--stages {args.stages}: must be at least 1; give the number of pipeline stages to predict.")
    if args.groups < 1:
        p.error(f"--groups {args.groups}: must be at least 1; give the data-parallel groups D (1 for none).")
    if args.latency_ms is not None and not args.latency_ms >= 0:
        p.error(f"--latency-ms {args.latency_ms}: must be >= 0; give the per-message latency in milliseconds.")
    if args.bandwidth_gbs is not None and not args.bandwidth_gbs > 0:
        p.error(f"--bandwidth-gbs {args.bandwidth_gbs}: must be > 0; give the link bandwidth in GB/s (e.g. 10).")
    if args.memory_limit_mb is not None and not args.memory_limit_mb > 0:
        p.error(
            f"--memory-limit-mb {args.memory_limit_mb}: must be > 0; give the memory per stage in MiB "
            "or leave it out for no limit."
        )


def _advice(args: argparse.Namespace, projected: PipelineProfile, keywords: dict[str, Any]) -> None:
    """``--sharding all`` with a memory limit: the lightest level under which a setting fits."""
    advice = recommend(projected, {**keywords, "averaging": ["exact", "elastic"]}) if args.sharding == "all" else None
    if advice is not None:
        print(advice["line"])


def _flags(message: str) -> str:
    """A model error in the command line's words: ``tensor_parallel_size=8`` -> ``--tensor-parallel-size 8``."""
    message = message.replace("sequence_parallel=True", "--sequence-parallel")
    names = (
        "tensor_parallel_size",
        "tensor_parallel_mode",
        "tensor_parallel_depth",
        "attention_share",
        "attention_heads",
    )
    for name in names:
        message = message.replace(f"{name}=", f"--{name.replace('_', '-')} ")
    return message.replace("_", "-")


def _modes(args: argparse.Namespace, profile: PipelineProfile, tensor: TensorParallel, b: float) -> None:
    """Every mode that fits T side by side on the balanced stage at micro-batch size ``b`` (``tensor_modes``)."""
    base = project(
        profile,
        args.stages,
        latency_s=None if args.latency_ms is None else args.latency_ms * 1e-3,
        bandwidth=None if args.bandwidth_gbs is None else args.bandwidth_gbs * 1e9,
    )
    st = base.stages[0]
    rows = compare(
        tensor.size,
        st.param_bytes,
        st.activations(b),
        st.sent(b),
        tensor.allreduces / args.stages,
        base.latency_s if tensor.latency_s is None else tensor.latency_s,
        base.bandwidth if tensor.bandwidth is None else tensor.bandwidth,
        tensor.fraction,
        tensor.attention,
        tensor.heads,
    )
    print(format_rows(rows, tensor.size, b))


def whatif_command(argv: list[str]) -> int:
    """Run the ``whatif`` command; 0 on success, 1 when no setting fits (argparse exits 2 on bad input)."""
    p = _parser()
    args = p.parse_args(argv)
    _check(p, args)
    k: int | str = args.advance_forwards
    if k != "auto":
        try:
            k = int(k)
        except ValueError:
            k = -1
        if k < 0:
            p.error(f"--advance-forwards {args.advance_forwards}: must be an int >= 0 or 'auto'.")
    profile = _load_profile(p, args.profile)
    try:
        tensor = TensorParallel(
            args.tensor_parallel_size,
            args.tensor_fraction,
            args.tensor_allreduces,
            None if args.tensor_latency_ms is None else args.tensor_latency_ms * 1e-3,
            None if args.tensor_bandwidth_gbs is None else args.tensor_bandwidth_gbs * 1e9,
            args.tensor_parallel_mode,
            args.tensor_parallel_depth,
            args.sequence_parallel,
            args.attention_share,
            args.attention_heads,
        )
        projected = project(
            profile,
            args.stages,
            args.groups,
            latency_s=None if args.latency_ms is None else args.latency_ms * 1e-3,
            bandwidth=None if args.bandwidth_gbs is None else args.bandwidth_gbs * 1e9,
            tensor=tensor,
            checkpointed_layers=args.checkpoint_layers,
        )
    except ValueError as e:  # names the value; the flag is its name with dashes
        p.error(_flags(str(e)))
    flat = [
        [v for part in parts for v in part] if parts is not None else None
        for parts in (args.num_microbatches, args.num_pipelines)
    ]
    args.num_microbatches, args.num_pipelines = flat
    pipelines = args.num_pipelines
    if pipelines is not None and len(pipelines) == 1:
        pipelines = pipelines[0]
    limit = None if args.memory_limit_mb is None else args.memory_limit_mb * 2**20
    schedules = _schedules(p, args.schedules, projected)
    level = None if args.sharding in (None, "all") else args.sharding
    keywords = {
        "num_microbatches": args.num_microbatches,
        "num_pipelines": pipelines,
        "memory_limit": limit,
        "schedule": args.schedule,
        "advance_forwards": k,
        "schedules": schedules,
        "objective": args.objective,
        "averaging": ["exact"] if (level or projected.sharding) in FSDP else ["elastic"],
    }
    try:
        table = search(projected, sharding=level, reduce_gradients=args.reduce_gradients, **keywords)
    except NoFeasibleSettingError as e:
        print(f"whatif: {e}", file=sys.stderr)
        _advice(args, projected, keywords)
        return 1
    except ValueError as e:  # candidate validation: names the value and the fix
        option = "--num-microbatches" if "num_microbatches" in str(e) else "--num-pipelines"
        p.error(f"{option}: {str(e).replace(' or None for all of them', ' or leave the option out for all of them')}")
    bw = "inf" if projected.bandwidth == float("inf") else f"{projected.bandwidth / 1e9:g} GB/s"
    print(
        f"what-if: {profile.num_stages} profiled stage(s) -> S={projected.num_stages}, D={projected.num_groups}, "
        f"T={tensor.size}{f' ({tensor.layout.label})' if tensor.mode != '1d' or tensor.sequence_parallel else ''}"
        f"{', every layer checkpointed' if args.checkpoint_layers else ''}, "
        f"B={projected.batch_size}, latency {projected.latency_s * 1e3:g} ms, bandwidth {bw}, "
        f"overhead {projected.iteration_overhead_s * 1e3:.3f} ms/iteration"
        + (
            f", reference all-reduce {projected.reference_allreduce_s * 1e3:.3f} ms"
            + (" (waited for)" if projected.sync_reference else " (overlapped with the next pipeline)")
            if projected.num_groups > 1
            else ""
        )
    )
    print(table.format())
    c = table.choice
    assert c is not None
    print(
        f"choice: num_microbatches={c.num_microbatches} num_pipelines={c.num_pipelines}"
        + (f" schedule={c.schedule}" if schedules else "")
        + (f" advance_forwards={c.advance_forwards}" if reads_k(c.schedule) else "")
        + f": {c.samples_per_sec:.1f} samples/s, {c.step_time * 1e3:.2f} ms/iteration, "
        f"peak {max(c.peak_bytes) / 2**20:.1f} MiB" + (f", sharding={c.sharding}" if projected.num_groups > 1 else "")
    )
    if tensor.size > 1:
        _modes(args, profile, tensor, projected.batch_size / c.num_microbatches)
    if args.sharding == "all":
        print(format_levels(projected, c, limit))
        _advice(args, projected, keywords)
    if args.report:
        from lightning_avgpipe.tuning.report import write_report

        paths = write_report(table, args.report, stem="whatif")
        print("report written to " + " and ".join(str(v) for v in paths.values()))
    return 0
