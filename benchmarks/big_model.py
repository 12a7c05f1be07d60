"""Peak memory per rank of a model larger than one stage, against plain Lightning on one device in the same run.

The model: ``--layers`` blocks of ``Linear(width, width)`` + ``Tanh`` trained with Adam, built in ``configure_model``
(under AvgPipe: on the meta device, each rank making only its own stages real) or, for S = 2, also in ``__init__``.
Each process reports its peak resident memory (``VmHWM``, reset between phases through ``/proc/self/clear_refs``)
above its baseline after the imports, for each phase: the build and setup up to ``on_fit_start``, the training
steps, a ``trainer.save_checkpoint`` (one file, streamed to rank 0, or ``save_distributed_checkpoint=True``'s
folder) and a resume of it in a new Trainer and model (the first ones deleted); and the save's and resume's wall
times. Printed as ratios to one device's figure of the same phase.

    python benchmarks/big_model.py                      # width 2048, 8 layers (128 MiB of weights), S = 2 and 4,
                                                        # and S = 2 x T = 2 (each stage split over 2 ranks)
    python benchmarks/big_model.py --cap-gib 2.5 --width 4096 --layers 16   # one device killed by the cap, S = 4 not
    python benchmarks/big_model.py --groups 2 --steps 4  # D = 2 x S = 2 under ZeRO-0..3 and ZeRO-3 once per step
    python benchmarks/big_model.py --groups 2 --steps 4 --mmap-threshold 1048576   # glibc returning freed tensors
    python benchmarks/big_model.py --groups 2 --cap-gib 2 --width 4096 --layers 16 --mmap-threshold 1048576

``--cap-gib`` puts each process in a cgroup (v1 memory controller, root on Linux) of its own with that limit, and
runs one device and S = 4 under it; without the controller it says so and skips. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _status(field: str) -> int:
    """``VmHWM`` or ``VmRSS`` of this process, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


CGROUP = Path("/sys/fs/cgroup/memory")


def cap_self(limit: int, name: str) -> None:
    """Move this process into a memory cgroup of its own capped at ``limit`` bytes (cgroup v1)."""
    group = CGROUP / name
    group.mkdir(exist_ok=True)
    (group / "memory.limit_in_bytes").write_text(str(limit))
    (group / "cgroup.procs").write_text(str(os.getpid()))


def can_cap() -> str | None:
    """Why no cgroup can be made here, or ``None``."""
    if not (CGROUP / "memory.limit_in_bytes").exists():
        return f"no cgroup v1 memory controller at {CGROUP}"
    if not os.access(CGROUP, os.W_OK):
        return f"{CGROUP} is not writable (run as root)"
    return None


def _prepare(cfg: dict[str, Any]) -> None:
    """A worker's process before anything is imported: in its cgroup, and its checksums off where asked."""
    if cfg.get("cap"):
        cap_self(cfg["cap"], f"avgpipe-big-model-{os.getppid()}-{os.getpid()}")
    if cfg.get("checksums") is False:
        _without_checksums()


def _without_checksums() -> None:
    """The save and resume as before issue 42: no file checksummed at the save or checked at the resume."""
    from lightning_avgpipe.plugin.checkpoint import sharded
    from lightning_avgpipe.runtime.files import checksums

    def plain_file_system() -> Any:  # DCP's own: no CRC as the bytes go out
        from torch.distributed.checkpoint.filesystem import FileSystem

        fs: Any = FileSystem()
        fs.written = {}
        return fs

    checksums.checksummed_file_system = plain_file_system
    checksums.file_entry = lambda path, rank: {"crc32": "", "bytes": os.path.getsize(path), "rank": rank}
    checksums.check_file = lambda *a, **k: None
    sharded.check_files = lambda *a, **k: None


def _strategy(cfg: dict[str, Any]) -> Any:
    """The strategy of a run of ``cfg["devices"]`` ranks: D x S x T."""
    from lightning_avgpipe import AvgPipeStrategy

    sdc, T, D = cfg["sharded"], cfg.get("tensor", 1), cfg.get("groups", 1)
    # D > 1: one model over the D groups, each stage shared as cfg["sharding"] says (ZeRO-0..3)
    shared = {"averaging": "exact", "sharding_strategy": cfg["sharding"], "reduce_gradients": cfg["reduce"]}
    # T > 1: each stage's Linears in column-wise then row-wise pairs (Megatron's MLP split)
    plan = {f"layers.{2 * i}": "rowwise" if i % 2 else "colwise" for i in range(cfg["layers"])} if T > 1 else None
    return AvgPipeStrategy(
        num_stages=cfg["devices"] // (T * D),
        num_microbatches=2,
        partition="parameters",
        save_distributed_checkpoint=sdc,
        tensor_parallel_size=T,
        tensor_parallel_plan=plan,
        **(shared if D > 1 else {}),
    )


def _time_collectives() -> list[float]:
    """Count the seconds this process blocks in the stage group's collectives (FSDP's gathers and reduce-scatters,
    the all-reduces and broadcasts of the gradients and ZeRO-1's slices), looked up on ``torch.distributed`` at each
    call; patched before the package is imported. Point-to-point sends between stages are not counted."""
    import torch.distributed as dist

    spent = [0.0]

    def timed(fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("async_op"):  # its wait is not counted
                return fn(*args, **kwargs)
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        return call

    names = ("all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor")
    for name in (*names, "all_reduce", "broadcast", "all_gather", "reduce_scatter"):
        if hasattr(dist, name):
            setattr(dist, name, timed(getattr(dist, name)))
    return spent


def worker(cfg: dict[str, Any]) -> None:
    collectives = _time_collectives()
    _prepare(cfg)
    import ctypes
    import gc

    import lightning.pytorch as pl
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    torch.set_num_threads(1)
    width, layers, late = cfg["width"], cfg["layers"], cfg["late"]
    baseline = _status("VmRSS")
    _reset_peak()
    phases: dict[str, int] = {}

    def blocks() -> nn.Sequential:
        return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])

    class Big(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            if not late:
                self.layers = blocks()

        def configure_model(self) -> None:
            if not hasattr(self, "layers"):
                self.layers = blocks()

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return F.mse_loss(self(x), y)

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-4)

    class Phases(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            phases["build + setup"] = _status("VmHWM") - baseline
            _reset_peak()

        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            steps.append(-time.perf_counter())
            blocked.append(-collectives[0])

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            steps[-1] += time.perf_counter()
            blocked[-1] += collectives[0]

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            phases["training"] = _status("VmHWM") - baseline
            _reset_peak()

    steps: list[float] = []  # each training step's wall time
    blocked: list[float] = []  # and the seconds of it spent blocked in the stage group's collectives

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(32, width, generator=g), torch.randn(32, width, generator=g))

    def trainer_for(callbacks: list[Any]) -> pl.Trainer:
        strategy: Any = _strategy(cfg) if cfg["devices"] > 1 else "auto"
        return pl.Trainer(
            accelerator="cpu",
            devices=cfg["devices"],
            strategy=strategy,
            max_steps=cfg["steps"],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            callbacks=callbacks,
        )

    trainer = trainer_for([Phases()])
    pl.seed_everything(0, verbose=False)
    trainer.fit(Big(), DataLoader(data, batch_size=8))
    path = Path(cfg["out"]) / "last.ckpt"
    rank = trainer.global_rank
    start = time.perf_counter()
    trainer.save_checkpoint(path)
    save_s = time.perf_counter() - start
    phases["save"] = _status("VmHWM") - baseline
    del trainer
    gc.collect()
    ctypes.CDLL(None).malloc_trim(0)
    _reset_peak()
    start = time.perf_counter()
    resumed = trainer_for([])
    resumed.fit(Big(), DataLoader(data, batch_size=8), ckpt_path=path)  # restored at max_steps: nothing more runs
    load_s = time.perf_counter() - start
    phases["resume"] = _status("VmHWM") - baseline
    result = {"rank": rank, "phases": phases, "save_s": save_s, "load_s": load_s, "baseline": baseline}
    timed = sorted(steps[1:] or steps)  # the first step builds plans and buffers
    result["step_s"] = timed[len(timed) // 2]
    waits = sorted(blocked[1:] or blocked)
    result["collectives_s"] = waits[len(waits) // 2]
    Path(cfg["out"], f"rank{rank}.json").write_text(json.dumps(result))


def run(
    devices: int,
    late: bool,
    args: argparse.Namespace,
    sharded: bool = False,
    cap: int = 0,
    tensor: int = 1,
    checksums: bool = True,
    groups: int = 1,
    sharding: str = "NO_SHARD",
    reduce: str = "per_microbatch",
) -> list[dict[str, Any]]:
    """Every rank's result (``devices`` = S x ``tensor`` ranks); with a ``cap``, a rank killed by it raises
    ``MemoryError`` naming it."""
    import shutil

    from tests.helpers.harness import launch_ranks

    out = tempfile.mkdtemp(prefix="big-model-")
    cfg = {"out": out, "devices": devices, "late": late, "sharded": sharded, "cap": cap, "tensor": tensor}
    cfg.update(checksums=checksums, groups=groups, sharding=sharding, reduce=reduce)
    cfg.update({k: getattr(args, k) for k in ("width", "layers", "steps")})
    try:
        results = launch_ranks([str(Path(__file__)), "--worker", json.dumps(cfg)], devices, timeout=1800)
        killed = [r for r, (code, _) in enumerate(results) if code in (-9, 137)]
        if cap and killed:
            raise MemoryError(f"rank(s) {killed} killed (SIGKILL: the cgroup's out-of-memory killer)")
        failed = [f"rank {r} exited {code}:\n{text[-2000:]}" for r, (code, text) in enumerate(results) if code != 0]
        if failed:
            raise RuntimeError("\n".join(failed))
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(devices)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        for group in CGROUP.glob(f"avgpipe-big-model-{os.getpid()}-*"):  # the ranks' cgroups, empty once they exit
            try:
                group.rmdir()
            except OSError:
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--tensor", type=int, default=2, help="also S = 2 x T = this (tensor parallelism); 1: not")
    parser.add_argument("--cap-gib", type=float, help="one device and S = 4 (or --groups) under this per-process cap")
    parser.add_argument("--quick", action="store_true", help="a smoke run: configure_model only (no __init__ row)")
    parser.add_argument("--checksum-cost", type=int, metavar="N", help="S = 2 folder saves with and without checksums")
    parser.add_argument("--groups", type=int, help="only D = this x S = 2 rows, each sharding (exact averaging)")
    parser.add_argument(
        "--mmap-threshold",
        type=int,
        metavar="BYTES",
        help="glibc's M_MMAP_THRESHOLD for every process, one device included (freed big tensors leave RSS at once)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mmap_threshold:  # the ranks inherit it; glibc reads it at start, so this process's own does not change
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    if args.worker:
        worker(json.loads(args.worker))
        return
    mib = 1 << 20
    weights = args.layers * (args.width * args.width + args.width) * 4
    print(f"model: {args.layers} x Linear({args.width}, {args.width}) + Tanh, {weights / mib:.0f} MiB of weights, Adam")
    if args.cap_gib:
        capped(args, weights)
        return
    if args.checksum_cost:
        checksum_cost(args)
        return
    one = run(1, True, args)[0]
    print("\nphase peaks above each process's import baseline, MiB, and the ratio to one device's")
    print(f"{'run':40} {'rank':>4} " + " ".join(f"{p:>19}" for p in one["phases"]) + f" {'save s':>11} {'load s':>11}")

    def row(name: str, r: dict[str, Any]) -> None:
        peaks, ones = r["phases"], one["phases"]
        cells = [f"{peaks[p] / mib:6.0f} ({peaks[p] / max(ones[p], 1):5.2f}x)" for p in ones]
        times = [f"{r[k]:4.1f} ({r[k] / max(one[k], 1e-9):.2f}x)" for k in ("save_s", "load_s")]
        print(f"{name:40} {r['rank']:>4} " + " ".join(f"{c:>19}" for c in cells) + " " + " ".join(times))

    row("one device (configure_model)", one)
    if args.groups:
        sharded_rows(args, row)
        return
    for stages in args.stages:
        variants = ((True, False), (True, True), (False, False))
        for late, sharded in variants[: 3 if stages == 2 and not args.quick else 2]:
            for r in run(stages, late, args, sharded):
                how = f"S={stages}, {'configure_model' if late else '__init__'}, {'folder' if sharded else 'file'}"
                row(how, r)
    if args.tensor > 1:  # each stage split over T ranks on the meta device, each rank making only its shards real
        for r in run(2 * args.tensor, True, args, True, tensor=args.tensor):
            row(f"S=2 x T={args.tensor}, configure_model, folder", r)


def sharded_rows(args: argparse.Namespace, row: Any) -> None:
    """D = ``--groups`` x S = 2 under each ``sharding_strategy`` (and ZeRO-3 reduced once per step): each rank's
    peaks against one device's, and the median step time against ZeRO-1's in the same run."""
    levels = [("NO_SHARD", "per_microbatch"), ("SHARD_OPTIM", "per_microbatch"), ("SHARD_GRAD_OP", "per_microbatch")]
    levels += [("FULL_SHARD", "per_microbatch"), ("FULL_SHARD", "per_step")]
    D, times = args.groups, {}
    for level, reduce in levels:
        name = f"D={D} x S=2, {level}" + (", per_step" if reduce == "per_step" else "")
        results = run(2 * D, True, args, groups=D, sharding=level, reduce=reduce)
        for r in results:
            row(name, r)
        slowest = max(results, key=lambda r: r["step_s"])  # the slowest rank's median step
        times[name] = slowest["step_s"], slowest["collectives_s"]
    zero1 = times[f"D={D} x S=2, SHARD_OPTIM"][0]
    print("\nstep time (the slowest rank's median step), ratio to ZeRO-1's in this run; of it, the seconds blocked in")
    print("the stage group's collectives (on CPU they block: nothing computes meanwhile)")
    for name, (t, c) in times.items():
        print(f"{name:40} {t:6.2f} s ({t / zero1:.2f}x), collectives {c:5.2f} s ({c / t:4.0%})")


def checksum_cost(args: argparse.Namespace) -> None:
    """S = 2 saving a folder and resuming from it, with the files' checksums (written at the save, checked at the
    resume) and without, interleaved ``--checksum-cost`` times: the slowest rank's save and resume times."""
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for i in range(args.checksum_cost):
        for on in (True, False) if i % 2 == 0 else (False, True):
            results = run(2, True, args, sharded=True, checksums=on)
            times[on].append((max(r["save_s"] for r in results), max(r["load_s"] for r in results)))
    for on in (False, True):
        saves = " ".join(f"{s:.2f}" for s, _ in times[on])
        loads = " ".join(f"{x:.2f}" for _, x in times[on])
        print(f"checksums {'on ' if on else 'off'}: save s {saves}; resume s {loads}")
    mean = {on: [sum(t[k] for t in times[on]) / len(times[on]) for k in (0, 1)] for on in times}
    median = {on: [sorted(t[k] for t in times[on])[len(times[on]) // 2] for k in (0, 1)] for on in times}
    for name, avg in (("means", mean), ("medians", median)):
        print(
            f"with checksums / without: save {avg[True][0] / avg[False][0]:.3f}x, "
            f"resume {avg[True][1] / avg[False][1]:.3f}x ({name} over {args.checksum_cost} runs each)"
        )


def capped(args: argparse.Namespace, weights: int) -> None:
    """Each process under ``--cap-gib``: one device and S = 4 (a sharded save); with ``--groups D``, D x S = 2
    unsharded and under FULL_SHARD (ZeRO-3) instead, each saving a folder and resuming from it."""
    why = can_cap()
    if why is not None:
        print(f"skipped: {why}; no per-process memory cap can be set")
        return
    cap = int(args.cap_gib * (1 << 30))
    state = 4 * weights  # weights, gradients and Adam's two moments
    print(f"training state {state / (1 << 30):.2f} GiB = {state / cap:.2f}x the per-process cap of {args.cap_gib} GiB")
    D = args.groups or 1
    runs = [(1, "one device", {}), (4, "S=4", {})]
    if D > 1:
        runs = [
            (2 * D, f"D={D} x S=2, {level}", {"groups": D, "sharding": level}) for level in ("NO_SHARD", "FULL_SHARD")
        ]
    for devices, name, kw in runs:
        try:
            results = run(devices, True, args, sharded=devices > 1, cap=cap, **kw)
        except MemoryError as err:
            print(f"{name}: {err}")
            continue
        peaks = ", ".join(f"rank {r['rank']} {max(r['phases'].values()) / (1 << 20):.0f} MiB" for r in results)
        saves = max(r["save_s"] for r in results)
        print(f"{name}: trained {args.steps} steps, saved ({saves:.1f} s) and resumed; peaks above baseline {peaks}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
