"""Starting ranks on this machine, for the benchmarks and the tests: one launcher, one free port, hard timeouts.

Two ways to start ``world_size`` ranks, both on a free loopback port and both with a hard timeout after which
every rank is killed (a hang is a failure, never a stuck run):

- :func:`run_distributed` runs a Python function in ``world_size`` new processes, each in a gloo process group
  with ``threads`` torch threads and the same fixed seed, and returns the ranks' results ordered by rank, or
  raises with every failing rank's traceback. The benchmarks' rank bodies and ``tests/helpers/distributed.py``
  use it.
- :func:`launch_ranks` runs a command line as ranks 0..world_size-1 with the environment an external launcher
  (torchrun) sets, and returns each rank's exit code and output. The tests' Lightning workers
  (``tests/helpers/launch.py``) and ``benchmarks/tuner_accuracy.py`` use it.

It lives here rather than under ``tests/`` because the benchmarks are scripts users run without the test suite;
the tests import it from here, as they import ``benchmarks.convergence``. torch is imported inside the functions,
so a parent that only starts subprocesses stays light.
"""

from __future__ import annotations

import io
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

_init_s: float | None = None  # in a rank of run_distributed: seconds from its start to its process group


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port of one group of ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------------------
# a function on every rank
# ---------------------------------------------------------------------------------------------------------------
def init_seconds() -> float:
    """In a rank of :func:`run_distributed`: seconds from the process's start to its process group being up."""
    if _init_s is None:
        raise RuntimeError("init_seconds() is only known inside a rank started by run_distributed()")
    return _init_s


def _entry(
    rank: int,
    world_size: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple,
    queue: Any,
    threads: int,
    seed: int | None,
) -> None:
    global _init_s
    started = time.perf_counter()
    try:
        os.setsid()  # its own process group: stopping the rank also stops whatever it started
    except OSError:
        pass
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # already set (a forked process inherits the parent's pool)
        pass
    if seed is not None:
        random.seed(seed)
        torch.manual_seed(seed)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        _init_s = time.perf_counter() - started
        result = fn(rank, world_size, *args)
        buf = io.BytesIO()
        torch.save(result, buf)  # plain bytes: tensors shared by file descriptor die with this process
        queue.put((rank, "ok", buf.getvalue()))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    threads: int = 1,
    seed: int | None = 0,
    start_method: str = "spawn",
    grace: float = 20.0,
    what: str = "distributed run",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results ordered by rank.

    ``fn`` and ``args`` must be picklable (a module-level function) under ``start_method``; the results travel
    back through ``torch.save``. Each rank runs ``threads`` intra- and inter-op torch threads and starts from
    ``random.seed(seed)`` and ``torch.manual_seed(seed)`` (the same on every rank; ``None``: unseeded).

    Raises ``RuntimeError`` with every failing rank's traceback (the ranks still running ``grace`` seconds after
    the first failure are killed), ``RuntimeError`` when a rank dies without a word, or ``TimeoutError`` when the
    ranks do not finish within ``timeout`` seconds. Every rank is killed on any failure: nothing is left hanging.
    """
    import torch
    import torch.multiprocessing as mp

    ctx = mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, threads, seed))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    finished = False
    try:
        while len(results) + len(errors) < world_size:
            if not queue.empty():
                rank, status, payload = queue.get()
                if status == "ok":
                    results[rank] = torch.load(io.BytesIO(payload), weights_only=False)
                else:
                    errors[rank] = payload
                    deadline = min(deadline, time.monotonic() + grace)  # the others should fail fast now
                continue
            if time.monotonic() > deadline:
                if errors:
                    break  # the ranks that did not stop on their own are killed below
                raise TimeoutError(
                    f"{what}: the {world_size} ranks did not finish within {timeout:.0f} s (ranks "
                    f"done: {sorted(results)}); every rank was killed"
                )
            if any(p.exitcode not in (None, 0) for p in procs):
                time.sleep(0.5)  # a result may still be in the pipe
                if queue.empty():
                    codes = [p.exitcode for p in procs]
                    raise RuntimeError(
                        f"{what}: a rank died without a result (exit codes {codes})"
                        + "".join(f"\nrank {r}:\n{e}" for r, e in sorted(errors.items()))
                    )
                continue
            time.sleep(0.02)
        if errors:
            stuck = sorted(set(range(world_size)) - set(results) - set(errors))
            note = f"\n(ranks {stuck} were still running {grace:.0f} s after the first failure and were killed)"
            raise RuntimeError(
                f"{what} failed:\n"
                + "\n".join(f"rank {r}:\n{e}" for r, e in sorted(errors.items()))
                + (note if stuck else "")
            )
        finished = True
        return [results[r] for r in range(world_size)]
    finally:
        for p in procs:
            if finished:
                p.join(timeout=5)
            if p.is_alive():
                _kill(p.pid)  # type: ignore[arg-type]
            p.join()


def _kill(pid: int) -> None:
    """SIGKILL a live rank with its process group (it called setsid), or alone before it had one."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ---------------------------------------------------------------------------------------------------------------
# a command line on every rank
# ---------------------------------------------------------------------------------------------------------------
def launch_ranks(
    args: Sequence[str],
    world_size: int,
    timeout: float = 240.0,
    env: dict[str, str] | None = None,
    *,
    log_dir: Path | None = None,
    echo: Collection[int] = (),
    grace: float | None = None,
) -> list[tuple[int, str]]:
    """Run ``python *args`` as ranks 0..world_size-1 from the repository root; return (exit code, output) per rank.

    Each rank gets torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
    ``NODE_RANK``, ``WORLD_SIZE``), ``OMP_NUM_THREADS=1`` and the repository on ``PYTHONPATH``, then ``env``.
    Its stdout and stderr go to ``log_dir/rank{r}.log`` (a temporary folder by default), whose text is returned;
    the ranks in ``echo`` write to this process's console instead (their output is returned as ``""``).

    Every rank still running after ``timeout`` seconds is killed with its process group and ``TimeoutError`` is
    raised with the ends of the outputs. With ``grace``, the ranks still running ``grace`` seconds after one
    exited non-zero are killed too (exit code -9); without it they are left to stop on their own.
    """
    port = free_port()
    tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="ranks-")
    folder = Path(tmp.name) if tmp is not None else Path(log_dir)  # type: ignore[arg-type]
    procs: list[subprocess.Popen] = []
    logs = []
    timed_out = False
    try:
        for rank in range(world_size):
            penv = dict(
                os.environ,
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                NODE_RANK="0",
                WORLD_SIZE=str(world_size),
                OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            )
            penv.update(env or {})
            log = None if rank in echo else open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [sys.executable, *args],
                    cwd=ROOT,
                    env=penv,
                    stdout=log,
                    stderr=None if log is None else subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        failed_at: float | None = None
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            if now > deadline:
                timed_out = True
                break
            if grace is not None:
                if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                    failed_at = now
                if failed_at is not None and now - failed_at > grace:
                    break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p.pid)
        for p in procs:
            p.wait()
        for log in logs:
            if log is not None:
                log.close()
    outputs = [
        "" if log is None else (folder / f"rank{r}.log").read_text(errors="replace") for r, log in enumerate(logs)
    ]
    if tmp is not None:
        tmp.cleanup()
    if timed_out:
        tails = "\n---\n".join(f"rank {r}:\n{out[-3000:]}" for r, out in enumerate(outputs))
        raise TimeoutError(f"the {world_size} ranks did not finish within {timeout:.0f} s and were killed:\n{tails}")
    return [(int(p.returncode), out) for p, out in zip(procs, outputs)]
