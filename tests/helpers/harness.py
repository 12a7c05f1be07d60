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

It lives with the tests, which stand alone; the benchmarks import it from here (they put the repository root on
``sys.path``). torch is imported inside the functions, so a parent that only starts subprocesses stays light.
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
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]  # the repository root

_T = TypeVar("_T")
_init_s: float | None = None  # in a rank of run_distributed: seconds from its start to its process group


_given: set[int] = set()  # the ports free_port() handed out in this process, never handed out twice
_IN_USE = "EADDRINUSE"  # in a rank's output when its rendezvous port was taken between free_port() and the bind


def _ephemeral() -> tuple[int, int]:
    """The kernel's range for outgoing connections' ports (gloo's many connections take theirs from it)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the rendezvous port of one group of ranks).

    Drawn below the kernel's ephemeral range, so no outgoing connection of the ranks already running (gloo opens
    one per pair of ranks, with a port from that range) can take it before the new group's store binds it; a port
    is handed out once per process. CI saw the kernel's own pick (``bind(0)``, in that range) taken in between.
    """
    low = min(_ephemeral()[0], 32768)
    pick = random.Random()  # not the tests' seeded generator: every draw differs
    for _ in range(200 if low > 20000 else 0):  # a range that starts below 20000 leaves only the kernel's pick
        port = pick.randrange(20000, low)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
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
    env: dict[str, str] | None = None,
) -> None:
    global _init_s
    started = time.perf_counter()
    if env is not None:  # forked from the preloaded server: the caller's environment, as a spawned rank has it
        os.environ.clear()
        os.environ.update(env)
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
    start_method: str = "preloaded",
    grace: float = 20.0,
    what: str = "distributed run",
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; return the results ordered by rank.

    ``"preloaded"`` (default) forks each rank from a server that imported torch, Lightning and the package once
    (:func:`_preloaded`), with the caller's environment: a spawned rank's start without its seconds of imports.
    ``fn`` and ``args`` must be picklable (a module-level function) under ``start_method``; the results travel
    back through ``torch.save``. Each rank runs ``threads`` intra- and inter-op torch threads and starts from
    ``random.seed(seed)`` and ``torch.manual_seed(seed)`` (the same on every rank; ``None``: unseeded).

    Raises ``RuntimeError`` with every failing rank's traceback (the ranks still running ``grace`` seconds after
    the first failure are killed), ``RuntimeError`` when a rank dies without a word, or ``TimeoutError`` when the
    ranks do not finish within ``timeout`` seconds. Every rank is killed on any failure: nothing is left hanging.
    A start whose rendezvous port was taken before rank 0's store bound it (``EADDRINUSE``) is tried again on
    another port, twice at most.
    """
    return _on_a_free_port(
        lambda port: _run_once(port, fn, world_size, args, timeout, threads, seed, start_method, grace, what)
    )


def _on_a_free_port(
    start: Callable[[int], _T], taken: Callable[[_T], bool] = lambda _: False, again: bool = True
) -> _T:
    """``start(port)`` on a port from :func:`free_port`, started again on another one, twice at most (with
    ``again``), where that port was taken before rank 0's store bound it: ``EADDRINUSE`` in what it raised, or
    ``taken(result)``. Nothing ran yet then."""
    for attempt in range(3):
        last = not again or attempt == 2
        try:
            result = start(free_port())
        except (RuntimeError, TimeoutError) as failed:
            if last or _IN_USE not in str(failed):
                raise
            continue
        if last or not taken(result):
            return result
    raise AssertionError("unreachable: the last attempt returns or raises")


def _run_once(
    port: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
    threads: int,
    seed: int | None,
    start_method: str,
    grace: float,
    what: str,
) -> list[Any]:
    """One start of :func:`run_distributed`'s ranks, on rendezvous ``port``."""
    import torch
    import torch.multiprocessing as mp

    preloaded = start_method == "preloaded"
    ctx = _preloaded() if preloaded else mp.get_context(start_method)
    queue = ctx.SimpleQueue()
    env = dict(os.environ) if preloaded else None
    procs = [
        ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, threads, seed, env))
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
# a rank forked from a server that imported torch and Lightning (launch_ranks(preload=True))

_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch", "torchmetrics", "lightning_avgpipe"]
_forkserver: Any = None


def _preloaded() -> Any:
    """The multiprocessing context whose server process imported :data:`_PRELOAD` once (started on first use)."""
    global _forkserver
    if _forkserver is None:
        import multiprocessing

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_PRELOAD)
        _forkserver = ctx
    return _forkserver


def _run_rank(args: list[str], env: dict[str, str], log: str | None) -> None:
    """In the forked rank: the command line ``python *args`` run in this process as a fresh one would run it (from
    the repository root, with the rank's environment, ``PYTHONPATH`` and Lightning's rank)."""
    import atexit
    import runpy
    import types

    os.setsid()
    os.chdir(ROOT)  # as launch_ranks' subprocesses run
    os.environ.clear()
    os.environ.update(env)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if args and args[0] not in ("-m", "-c"):
        entries.insert(0, str(Path(args[0]).resolve().parent))  # a script's folder, as the interpreter puts it first
    sys.path[:0] = [p for p in entries if p not in sys.path]
    if log is not None:
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's own streams
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    import torch
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    rank_zero_only.rank = _get_rank() or 0  # read from this rank's variables (the server imported it as rank 0)
    code: int = 0
    try:
        if args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        elif args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            main = types.ModuleType("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), main.__dict__)
        else:
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as done:
        if isinstance(done.code, int):
            code = done.code
        elif done.code is not None:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what the interpreter's exit would run: the strategy closes its process groups
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _ForkedRank:
    """A rank started by :func:`_run_rank`, with the part of ``subprocess.Popen`` that ``launch_ranks`` uses."""

    def __init__(self, args: list[str], env: dict[str, str], log: str | None) -> None:
        self.process = _preloaded().Process(target=_run_rank, args=(args, env, log), daemon=False)
        self.process.start()
        self.pid = int(self.process.pid or 0)

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self) -> int:
        self.process.join()
        return int(self.process.exitcode or 0)

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode


# ---------------------------------------------------------------------------------------------------------------
# a command line on every rank
# ---------------------------------------------------------------------------------------------------------------
def _wait_ranks(
    procs: list[Any], timeout: float, grace: float | None, ends: list[float | None], frozen: Collection[int] = ()
) -> bool:
    """Wait until every rank but ``frozen`` ended, ``grace`` s passed after one failed, or ``timeout`` (then True);
    ``ends`` gets each rank's end (``time.monotonic()``) as seen."""
    deadline = time.monotonic() + timeout
    failed_at: float | None = None
    while any(p.poll() is None for r, p in enumerate(procs) if r not in frozen):
        now = time.monotonic()
        ends[:] = [e if e is not None or p.poll() is None else now for e, p in zip(ends, procs)]
        if now > deadline:
            return True
        if grace is not None:
            if failed_at is None and any(p.poll() not in (None, 0) for p in procs):
                failed_at = now
            if failed_at is not None and now - failed_at > grace:
                return False
        time.sleep(0.05)
    return False


def launch_ranks(
    args: Sequence[str],
    world_size: int,
    timeout: float = 240.0,
    env: dict[str, str] | Callable[[int], dict[str, str]] | None = None,
    *,
    log_dir: Path | None = None,
    echo: Collection[int] = (),
    grace: float | None = None,
    preload: bool = False,
    ended: list[float] | None = None,
    frozen: Collection[int] = (),
) -> list[tuple[int, str]]:
    """Run ``python *args`` as ranks 0..world_size-1 from the repository root; return (exit code, output) per rank.

    Each rank gets torchrun's variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``,
    ``NODE_RANK``, ``WORLD_SIZE``), ``OMP_NUM_THREADS=1`` and the repository on ``PYTHONPATH``, then ``env``
    (a dict, or rank -> dict: another launcher's variables set by hand, SLURM's for example). Where the
    rendezvous port :func:`free_port` gave was taken before rank 0's store bound it (``EADDRINUSE`` in an output;
    nothing ran yet), the ranks are started again on another port, twice at most.
    Its stdout and stderr go to ``log_dir/rank{r}.log`` (a temporary folder by default), whose text is returned;
    the ranks in ``echo`` write to this process's console instead (their output is returned as ``""``).

    Every rank still running after ``timeout`` seconds is killed with its process group and ``TimeoutError`` is
    raised with the ends of the outputs. With ``grace``, the ranks still running ``grace`` seconds after one
    exited non-zero are killed too (exit code -9); without it they are left to stop on their own.

    ``preload=True`` forks each rank from a server process that has imported torch and Lightning already
    (:func:`_preloaded`), instead of starting an interpreter: the same command, environment, output and exit code,
    without the 5 s of imports per rank. The rank ends with ``os._exit`` after its ``atexit`` handlers, so what only
    a fresh interpreter's finalization shows (``tests/test_exit.py``) needs ``preload=False``.

    ``ended``, a list, receives each rank's end as ``time.monotonic()`` seen here (within 50 ms; one clock for every
    process of the machine), for tests that bound when each rank stopped. The ranks in ``frozen`` (stopped by the
    test) are not waited for: once every other rank ended, they are killed (exit code -9).
    """
    return _on_a_free_port(
        lambda port: _launch_once(port, args, world_size, timeout, env, log_dir, echo, grace, preload, ended, frozen),
        lambda results: any(code != 0 and _IN_USE in out for code, out in results),
        again="MASTER_PORT" not in ((env(0) if callable(env) else env) or {}),  # not where the caller gave it
    )


def _launch_once(
    port: int,
    args: Sequence[str],
    world_size: int,
    timeout: float,
    env: dict[str, str] | Callable[[int], dict[str, str]] | None,
    log_dir: Path | None,
    echo: Collection[int],
    grace: float | None,
    preload: bool,
    ended: list[float] | None,
    frozen: Collection[int],
) -> list[tuple[int, str]]:
    """One start of :func:`launch_ranks`'s ranks, on rendezvous ``port``."""
    tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="ranks-")
    folder = Path(tmp.name) if tmp is not None else Path(log_dir)  # type: ignore[arg-type]
    procs: list[Any] = []
    logs = []
    timed_out = False
    ends: list[float | None] = [None] * world_size
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
            penv.update((env(rank) if callable(env) else env) or {})
            log = None if rank in echo else open(folder / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
            logs.append(log)
            if preload:
                path = None if log is None else str(folder / f"rank{rank}.log")
                procs.append(_ForkedRank(list(args), penv, path))
                continue
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
        timed_out = _wait_ranks(procs, timeout, grace, ends, frozen)
    finally:
        for p in procs:
            if p.poll() is None:
                _kill(p.pid)
        if ended is not None:
            now = time.monotonic()
            ended[:] = [now if e is None else e for e in ends]
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
