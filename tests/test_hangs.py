"""A frozen rank never hangs the job, and the default launcher leaves no rank behind.

A rank is frozen with SIGSTOP and never continued: no thread of it runs, and when it is rank 0 the rendezvous store it
serves stops answering (the kernel still accepts a request; no answer ever comes). Every other rank must end within
``p2p_timeout`` plus a few seconds, naming the neighbour. The test ends the frozen rank afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from tests.helpers.launch import ROOT, job_env, launch_ranks

P2P_TIMEOUT = 5
BOUND = P2P_TIMEOUT + 12  # the neighbour's timeout, a store deadline (2 s), rank 0's wait for acknowledgements (3 s)


def _env(**extra: str) -> dict[str, str]:
    return job_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **extra)


def _report(case: str, who: str, took: float, text: str, pattern: str) -> None:
    """One row of the closing note's table (``pytest -s tests/test_hangs.py``): the case, the rank, the time it took
    to end and the line of its output that names the cause."""
    line = next((ln for ln in text.splitlines() if re.search(pattern, ln)), "(no line matched)")
    print(f"\n[table] {case} | {who} | {took:.1f} s | {line.strip()[:400]}")


def _run_worker(
    cfg: dict, prefix: list[str] | None = None, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], str]:
    """``tests.helpers.lightning_worker`` started as a user starts a script (Lightning's launcher starts the other
    ranks), after ``prefix``; the process and its output."""
    proc = subprocess.run(
        [*(prefix or []), sys.executable, "-m", "tests.helpers.lightning_worker", json.dumps(cfg)],
        cwd=ROOT,
        env=env or _env(),
        capture_output=True,
        text=True,
        timeout=150,
        start_new_session=True,
    )
    return proc, proc.stdout + proc.stderr


def _alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("world", "frozen"), [(2, 0), (2, 1), (3, 1)], ids=["S2-first-frozen", "S2-last-frozen", "S3-middle-frozen"]
)
def test_a_frozen_rank_ends_every_other_rank_within_p2p_timeout(world: int, frozen: int) -> None:
    out = Path(tempfile.mkdtemp())
    cfg = {
        "out": str(out),
        "devices": world,
        "steps": 4,
        "strategy": {"num_microbatches": 2, "p2p_timeout": P2P_TIMEOUT},
        "fault": {"rank": frozen, "step": 1, "kind": "stop", "record": str(out / "stopped")},
    }
    ended: list[float] = []
    # the frozen rank is killed once the others ended; one of them still running after 150 s fails the test
    args = ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)]
    results = launch_ranks(args, world, timeout=150, preload=True, ended=ended, frozen=(frozen,))
    stopped = float((out / "stopped").read_text())
    assert results[frozen][0] == -9  # frozen to the end: the harness killed it
    for r, (code, text) in enumerate(results):
        if r == frozen:
            continue
        took = ended[r] - stopped
        assert code == 1, f"rank {r} exited {code} (-9: was still running) after {took:.1f} s:\n{text[-3000:]}"
        assert took < BOUND, f"rank {r} ended {took:.1f} s after rank {frozen} froze:\n{text[-3000:]}"
        named = set(map(int, re.findall(r"from rank (\d+) \(stage \d+\) did not arrive within 5 s", text)))
        if abs(r - frozen) == 1:  # a neighbour names the frozen rank
            assert frozen in named, text[-3000:]
        else:  # not a neighbour: its own neighbour, or the first failure, names it
            assert f"from rank {frozen} (stage {frozen}) did not arrive" in text, text[-3000:]
        _report(f"S={world}, rank {frozen} frozen", f"rank {r}", took, text, r"^\S*PeerFailureError")


@pytest.mark.slow
def test_the_default_launcher_ends_the_frozen_rank_it_started() -> None:
    """`python train.py`, rank 1 frozen: the launching process fails on the timeout, ends rank 1 (SIGTERM, SIGKILL
    after a grace), says so, and nothing of the job is alive once the command returned."""
    cfg = {
        "out": tempfile.mkdtemp(),
        "devices": 2,
        "steps": 4,
        "strategy": {"num_microbatches": 2, "p2p_timeout": P2P_TIMEOUT},
        "fault": {"rank": 1, "step": 1, "kind": "stop"},
    }
    start = time.monotonic()
    proc, out = _run_worker(cfg)
    _report("default launcher, rank 1 frozen", "the command", time.monotonic() - start, out, "ended local rank 1")
    assert proc.returncode == 1, out[-3000:]
    assert "from rank 1 (stage 1) did not arrive within 5 s" in out, out[-3000:]
    match = re.search(
        r"the launching process \(local rank 0\) failed with PeerFailureError; ended local rank 1 "
        r"\(pid (\d+)\) by (SIGTERM|SIGKILL)",
        out,
    )
    assert match, out[-3000:]
    assert not _alive(int(match.group(1)))  # at once: the launching process waited for it to end


@pytest.mark.slow
def test_a_port_in_use_is_refused_before_any_rank_starts() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    try:
        cfg = {"out": tempfile.mkdtemp(), "devices": 2, "steps": 2, "strategy": {"num_microbatches": 2}}
        start = time.monotonic()
        proc, out = _run_worker(cfg, env=_env(MASTER_PORT=str(port)))
    finally:
        listener.close()
    _report("port in use", "the command", time.monotonic() - start, out, "PortInUseError:")
    assert proc.returncode == 1
    assert f"PortInUseError: MASTER_PORT={port} is already in use" in out, out[-3000:]
    assert "Set MASTER_PORT to another free port, or leave it unset" in out
    assert "GLOBAL_RANK" not in out  # no rank joined a process group: none was started


_ORPHAN = textwrap.dedent(
    """
    import os, sys, time
    from lightning_avgpipe.plugin.process.launcher import LAUNCHER_ENV, watch_launcher
    assert os.environ[LAUNCHER_ENV] == str(os.getppid())
    watch_launcher(poll=0.1)
    print("watching", flush=True)
    time.sleep(120)
    """
)

_LAUNCHER = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from lightning_avgpipe.plugin.process.launcher import LAUNCHER_ENV
    env = dict(os.environ, **{LAUNCHER_ENV: str(os.getpid()), "LOCAL_RANK": "1"})
    log = open(sys.argv[2], "w")
    child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stderr=log, stdout=subprocess.PIPE)
    assert child.stdout.readline().strip() == b"watching"
    print(child.pid, flush=True)
    time.sleep(120)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_a_rank_whose_launching_process_died_ends_itself(tmp_path: Path, stopped: bool) -> None:
    """The launching process SIGKILLed (nothing of it runs to end the others): its started rank notices and ends
    within a second, saying why; one that was stopped too is woken by the parent-death signal and ends as well."""
    log = tmp_path / "child.log"
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, _ORPHAN, str(log)], env=_env(), stdout=subprocess.PIPE, start_new_session=True
    )
    try:
        assert launcher.stdout is not None
        child = int(launcher.stdout.readline())
        if stopped:
            os.kill(child, signal.SIGSTOP)
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child), f"the started rank {child} outlived its launching process"
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert "its launching process" in log.read_text() and "is gone; ending this rank" in log.read_text()


# -- the store's deadline, in process -------------------------------------------------------------------------------


class _FrozenStore:
    """A store whose calls block until it is thawed, as a stopped rank 0's store does."""

    def __init__(self) -> None:
        self.thawed = threading.Event()
        self.value = b""

    def check(self, keys: list[str]) -> bool:
        self.thawed.wait()
        return bool(self.value)

    def get(self, key: str) -> bytes:
        return self.value


def test_a_silent_store_is_given_up_after_the_deadline_and_used_again_once_it_answers() -> None:
    from lightning_avgpipe.runtime.failures.report import StoreSilentError, read_failure, store_call, store_silence

    store = _FrozenStore()
    start = time.monotonic()
    with pytest.raises(StoreSilentError, match=r"did not answer for \d+\.\d s") as silent:
        store_call(lambda s: s.check(["k"]), store, deadline=0.3)
    assert silent.value.silent_for >= 0.3 and time.monotonic() - start < 2.0
    quick = time.monotonic()
    with pytest.raises(StoreSilentError):  # the first call still holds the store: the next fails at once
        store_call(lambda s: s.check(["k"]), store, deadline=0.3)
    assert time.monotonic() - quick < 0.5
    assert store_silence() >= 0.3
    store.value = b"rank 2 (stage 2): RuntimeError: boom"
    store.thawed.set()  # the store answers again (its rank was continued)
    deadline = time.monotonic() + 5
    while store_silence() > 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store_silence() == 0.0
    assert read_failure(store) == "rank 2 (stage 2): RuntimeError: boom"


def test_the_watchdog_ends_a_rank_2_x_grace_after_the_store_fell_silent_and_forgives_a_shorter_silence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning_avgpipe.runtime.failures import report as failures
    from lightning_avgpipe.runtime.failures.watchdog import Watchdog

    monkeypatch.setattr(failures, "STORE_DEADLINE", 0.2)
    store, codes = _FrozenStore(), []
    dog = Watchdog("rank 1 (stage 1)", grace=1.0, store=store, poll=0.05, exit=codes.append).start()
    time.sleep(0.7)  # silent past the store's deadline, but for less than the grace: forgiven once it answers
    assert failures.store_silence() > 0.2
    store.thawed.set()
    time.sleep(1.5)
    assert codes == [] and not dog.fired
    dog.stop()

    frozen, later = _FrozenStore(), []
    start = time.monotonic()
    dog = Watchdog("rank 1 (stage 1)", grace=1.0, store=frozen, poll=0.05, exit=later.append).start()
    while not later and time.monotonic() - start < 10:
        time.sleep(0.02)
    took = time.monotonic() - start
    assert later == [1] and dog.fired
    assert 2.0 <= took < 4.0, took  # 2 x grace after the store fell silent (plus a poll)
    dog.stop()
    frozen.thawed.set()


# -- messages that name the rank ------------------------------------------------------------------------------------


def _run_ranks(cfg: dict, world: int = 2, grace: float = 15, ended: list[float] | None = None) -> list[tuple[int, str]]:
    args = ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)]
    return launch_ranks(args, world, timeout=150, preload=True, grace=grace, ended=ended)


@pytest.mark.slow
def test_a_rank_that_never_arrives_at_a_setup_collective_is_named() -> None:
    """Rank 1 sleeps in a callback's ``setup``; rank 0 waits in the strategy's setup until ``timeout`` (15 s here,
    30 minutes by default) and then names rank 1 and where it last was, not only gloo's "Timed out waiting"."""
    cfg = {
        "out": tempfile.mkdtemp(),
        "devices": 2,
        "steps": 2,
        "strategy": {"num_microbatches": 2, "timeout": 15, "p2p_timeout": 5},
        "setup_fault": {"rank": 1, "stall": 300},
    }
    start = time.monotonic()
    ended: list[float] = []
    (code0, out0), (code1, out1) = _run_ranks(cfg, ended=ended)
    for r, text in enumerate((out0, out1)):
        _report("setup stall on rank 1, timeout=15", f"rank {r}", ended[r] - start, text, "did not complete|watchdog")
    assert time.monotonic() - start < 90
    assert code0 == 1, out0[-3000:]
    assert re.search(
        r"rank 0: .* did not complete: rank 1 \(whose last point was the barrier 'pre_setup', \d+ s ago\) did ", out0
    ), out0[-3000:]
    assert "did not arrive" in out0
    assert code1 == 1, out1[-3000:]  # its watchdog ended it, quoting rank 0's failure
    assert "lightning_avgpipe watchdog: rank 1" in out1 and "First failure: rank 0 (setup)" in out1, out1[-3000:]


@pytest.mark.slow
def test_a_rank_killed_during_a_save_is_named_by_the_survivor() -> None:
    cfg = {
        "out": tempfile.mkdtemp(),
        "devices": 2,
        "steps": 4,
        "every_n_train_steps": 2,
        "strategy": {"num_microbatches": 2, "p2p_timeout": 5},
        "fault": {"rank": 1, "step": 0, "kind": "kill_in_save"},
    }
    ended: list[float] = []
    (code0, out0), (code1, _) = _run_ranks(cfg, ended=ended)
    _report("rank 1 killed in a save (time after the kill)", "rank 0", ended[0] - ended[1], out0, "did not complete")
    assert code1 == -9 and code0 == 1, (code0, code1)
    assert re.search(r"rank 0: .* did not complete: rank 1 \(pid \d+\) has exited or was killed", out0), out0[-3000:]


@pytest.mark.slow
def test_a_rank_killed_writing_a_folder_leaves_the_previous_checkpoint_whole() -> None:
    """save_distributed_checkpoint=True, rank 1 killed as it writes its part of the second checkpoint: rank 0 ends
    naming it, the first checkpoint is whole, the second only a folder marked incomplete."""
    from lightning_avgpipe.plugin.checkpoint import sharded

    out = Path(tempfile.mkdtemp())
    cfg = {
        "out": str(out),
        "devices": 2,
        "steps": 4,
        "every_n_train_steps": 2,
        "strategy": {"num_microbatches": 2, "p2p_timeout": 5, "save_distributed_checkpoint": True},
        "fault": {"rank": 1, "step": 4, "kind": "kill_in_write"},
    }
    ended: list[float] = []
    (code0, out0), (code1, _) = _run_ranks(cfg, ended=ended)
    _report("rank 1 killed writing a folder (time after the kill)", "rank 0", ended[0] - ended[1], out0, "rank 1")
    assert code1 == -9 and code0 == 1, (code0, code1)
    assert re.search(r"rank 0: .*rank 1 \(pid \d+\) has exited or was killed", out0), out0[-3000:]
    sharded.check_folder(out / "every" / "epoch=0-step=2.ckpt")  # whole: raises otherwise
    assert not (out / "every" / "epoch=0-step=4.ckpt").exists()
    assert (out / "every" / f".epoch=0-step=4.ckpt{sharded.INCOMPLETE}").is_dir()


@pytest.mark.slow
def test_an_empty_batch_is_named_on_every_rank() -> None:
    cfg = {"out": tempfile.mkdtemp(), "devices": 2, "steps": 4, "strategy": {"num_microbatches": 4}, "empty_batch": 1}
    start, ended = time.monotonic(), list[float]()
    results = _run_ranks(cfg, ended=ended)
    for r, (code, out) in enumerate(results):
        _report("empty batch 1", f"rank {r}", ended[r] - start, out, "is empty")
        assert code == 1, out[-3000:]
        assert "The training batch 1 of epoch 0 is empty: its tensors have 0 samples" in out, out[-3000:]
        assert "num_microbatches=0" not in out


@pytest.mark.slow
def test_an_unwritable_checkpoint_directory_is_named() -> None:
    """chmod 500, and the process without the capability to bypass it (root runs it under setpriv): Lightning's
    save swallows the PermissionError and writes nothing; the strategy says which directory, instead of a
    FileNotFoundError about its temporary file."""
    prefix: list[str] = []
    if os.geteuid() == 0:
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("root without setpriv (util-linux) cannot drop CAP_DAC_OVERRIDE")
        prefix = [setpriv, "--bounding-set", "-dac_override,-dac_read_search", "--"]
    out = Path(tempfile.mkdtemp())
    locked = out / "every"
    locked.mkdir()
    locked.chmod(0o500)
    cfg = {"out": str(out), "devices": 2, "steps": 4, "every_n_train_steps": 2, "strategy": {"p2p_timeout": 5}}
    start = time.monotonic()
    try:
        proc, text = _run_worker(cfg, prefix)
    finally:
        locked.chmod(0o700)
    _report("unwritable checkpoint directory", "the command", time.monotonic() - start, text, "Cannot save")
    assert proc.returncode == 1, text[-3000:]
    assert (
        f"Cannot save the checkpoint {locked}/epoch=0-step=2.ckpt: nothing could be written in its directory "
        f"{locked}, which is not writable by this process" in text
    ), text[-3000:]
    assert "FileNotFoundError" not in text
    assert list(locked.iterdir()) == []


def _busy_main_thread_worker(rank: int, world: int) -> list[int]:
    """The main thread waits 6 s on the process group's store (as ``new_group`` or NCCL's setup do), holding its
    client; the watchdog, with a 1 s grace, reads through its own connection and must not take that for silence."""
    import threading as th
    from datetime import timedelta

    from lightning_avgpipe.runtime.failures import report as failures
    from lightning_avgpipe.runtime.failures.watchdog import Watchdog

    codes: list[int] = []
    dog = Watchdog("rank 0 (stage 0)", grace=1.0, poll=0.1, exit=codes.append).start()
    store = failures.default_store()
    blocked = th.Thread(target=lambda: store.check(["x"]), daemon=True)  # queued behind the wait below
    try:
        blocked.start()
        store.wait(["never"], timedelta(seconds=6))  # holds the group's client for 6 s
    except Exception:  # noqa: BLE001 - the wait times out, as intended
        pass
    dog.stop()
    assert failures.failure_store() is not store
    return codes


def test_the_watchdog_reads_its_own_connection_while_the_main_thread_waits_on_the_store() -> None:
    from tests.helpers.distributed import run_distributed

    assert run_distributed(_busy_main_thread_worker, 1, timeout=60) == [[]]


def test_the_port_check_runs_only_on_the_node_that_hosts_the_rendezvous(monkeypatch: pytest.MonkeyPatch) -> None:
    """Node 1 reaches node 0's store at MASTER_ADDR:MASTER_PORT, which is listening by then: no PortInUseError."""
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment

    from lightning_avgpipe.plugin.compat import _GuardedScriptLauncher
    from lightning_avgpipe.plugin.process.launcher import PortInUseError

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))  # Lightning's launcher sets it otherwise
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("WORLD_SIZE", "2")
    try:
        for node, refused in (("1", False), ("0", True)):
            monkeypatch.setenv("NODE_RANK", node)
            monkeypatch.delenv("LOCAL_RANK", raising=False)  # set by the launch: restored by monkeypatch after
            launcher = _GuardedScriptLauncher(LightningEnvironment(), 1, 2)  # one process per node: none started
            if refused:
                with pytest.raises(PortInUseError, match=f"MASTER_PORT={port}"):
                    launcher.launch(lambda: "ran")
            else:
                assert launcher.launch(lambda: "ran") == "ran"
    finally:
        listener.close()
