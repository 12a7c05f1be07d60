"""The one launcher of the benchmarks and the tests (``tests/helpers/harness.py``) and the char GPT's shared flags."""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from examples.gpt_args import add_model_args, add_partition_arg, check_model_args, model_sizes, partition_of
from tests.helpers import harness
from tests.helpers.harness import free_port, launch_ranks, run_distributed


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


# ---------------------------------------------------------------------------------------------------------------
# launch_ranks: a command line per rank
# ---------------------------------------------------------------------------------------------------------------
def test_launch_ranks_gives_each_rank_torchrun_variables_and_returns_its_output() -> None:
    code = (
        "import os, sys; print(*(os.environ[k] for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))); "
        "sys.exit(int(os.environ['RANK']))"
    )
    results = launch_ranks(["-c", code], 3, timeout=60)
    assert [c for c, _ in results] == [0, 1, 2]
    assert [out.split() for _, out in results] == [[str(r), str(r), "3"] for r in range(3)]


def test_launch_ranks_kills_every_rank_after_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        launch_ranks(["-c", "print('started', flush=True); import time; time.sleep(120)"], 2, timeout=1)
    assert time.monotonic() - start < 30


def test_launch_ranks_with_grace_stops_the_ranks_left_after_a_failure(tmp_path: Path) -> None:
    code = "import os, sys, time; sys.exit(3) if os.environ['RANK'] == '0' else time.sleep(120)"
    start = time.monotonic()
    results = launch_ranks(["-c", code], 2, timeout=60, grace=0.5, log_dir=tmp_path)
    assert [c for c, _ in results] == [3, -9]
    assert time.monotonic() - start < 30
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rank0.log", "rank1.log"]


# ---------------------------------------------------------------------------------------------------------------
# run_distributed: a function per rank
# ---------------------------------------------------------------------------------------------------------------
def _seeded(rank: int, world: int) -> dict[str, object]:
    import torch.distributed as dist

    return {
        "rank": rank,
        "world": world,
        "draw": torch.rand(3),
        "threads": torch.get_num_threads(),
        "group": dist.get_world_size(),
    }


def _fails_on_rank_1(rank: int, world: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    if rank == 1:
        raise ValueError("boom on rank 1")
    time.sleep(600)  # stuck outside any collective, so nothing fails it: the launcher must kill it


def _sleeps(rank: int, world: int, pid_dir: str) -> None:
    Path(pid_dir, f"rank{rank}").write_text(str(os.getpid()))
    time.sleep(600)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_distributed_returns_results_by_rank_with_fixed_seeds() -> None:
    results = run_distributed(_seeded, 2, timeout=90)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world"] == 2 and r["group"] == 2 and r["threads"] == 1 for r in results)
    expected = torch.Generator().manual_seed(0)
    want = torch.rand(3, generator=expected)
    for r in results:
        torch.testing.assert_close(r["draw"], want, rtol=0, atol=0)  # torch.manual_seed(0) on every rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_distributed_reports_the_traceback_and_kills_the_rank_left_waiting(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        run_distributed(_fails_on_rank_1, 2, str(tmp_path), timeout=90, grace=1.0, what="demo")
    text = str(info.value)
    assert "demo failed" in text and "rank 1:" in text and "ValueError: boom on rank 1" in text
    assert "_fails_on_rank_1" in text  # the traceback, not just the message
    assert "ranks [0] were still running" in text
    assert time.monotonic() - start < 80
    assert all(_gone(int(p.read_text())) for p in tmp_path.iterdir())


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_distributed_kills_every_rank_after_the_timeout(tmp_path: Path) -> None:
    with pytest.raises(TimeoutError, match="did not finish within 8 s"):
        run_distributed(_sleeps, 2, str(tmp_path), timeout=8)
    pids = sorted(tmp_path.iterdir())
    assert [p.name for p in pids] == ["rank0", "rank1"]  # both ran, then were killed
    assert all(_gone(int(p.read_text())) for p in pids)


# ---------------------------------------------------------------------------------------------------------------
# the rendezvous port: below the ephemeral range, never twice, started again where it was taken
# ---------------------------------------------------------------------------------------------------------------
def test_free_port_is_below_the_ephemeral_range_and_never_handed_out_twice() -> None:
    low, _ = harness._ephemeral()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    assert all(20000 <= port < low for port in ports), [port for port in ports if not 20000 <= port < low]


_INIT = "import torch.distributed as d; d.init_process_group('gloo'); d.barrier(); print('joined', d.get_rank())"


@pytest.fixture
def taken_first(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """``free_port`` gives first a port that something listens on (as CI once saw), then free ones."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    real = harness.free_port
    ports = iter([int(holder.getsockname()[1])])
    seen: list[int] = []

    def first_taken() -> int:
        port = next(ports, None)
        port = real() if port is None else port
        seen.append(port)
        return port

    monkeypatch.setattr(harness, "free_port", first_taken)
    yield seen
    holder.close()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_ranks_starts_again_on_another_port_where_the_first_was_taken(taken_first: list[int]) -> None:
    results = launch_ranks(["-c", _INIT], 2, timeout=90, grace=3.0)
    assert [code for code, _ in results] == [0, 0], results
    assert [out.split()[-2:] for _, out in results] == [["joined", "0"], ["joined", "1"]]
    assert len(taken_first) == 2 and taken_first[0] != taken_first[1]


def _joined(rank: int, world_size: int) -> int:
    return rank


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_run_distributed_starts_again_on_another_port_where_the_first_was_taken(taken_first: list[int]) -> None:
    assert run_distributed(_joined, 2, timeout=90, grace=3.0) == [0, 1]
    assert len(taken_first) == 2 and taken_first[0] != taken_first[1]


# ---------------------------------------------------------------------------------------------------------------
# the char GPT's flags
# ---------------------------------------------------------------------------------------------------------------
def test_model_args_take_the_callers_defaults_and_build_the_config() -> None:
    from examples.char_gpt import GPTConfig

    p = argparse.ArgumentParser()
    add_model_args(p, **model_sizes(GPTConfig()))
    args = p.parse_args(["--n-layer", "2"])
    assert model_sizes(args) == {"n_layer": 2, "n_embd": 128, "n_head": 4, "block_size": 64}
    assert GPTConfig(vocab_size=10, **model_sizes(args)).n_layer == 2
    assert model_sizes(vars(args)) == model_sizes(args)


def test_model_args_refuse_a_width_the_heads_do_not_divide(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, n_layer=2, n_embd=64, n_head=4, block_size=32)
    with pytest.raises(SystemExit):
        check_model_args(p, p.parse_args(["--n-head", "5"]))
    assert "--n-embd must be a multiple of --n-head" in capsys.readouterr().err


def test_partition_defaults_to_the_first_half_of_the_blocks_on_stage_0(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_model_args(p, n_layer=4, n_embd=128, n_head=4, block_size=64)
    add_partition_arg(p)
    assert partition_of(p, p.parse_args([])) == [3, 3]
    assert partition_of(p, p.parse_args(["--n-layer", "5"])) == [3, 4]
    assert partition_of(p, p.parse_args(["--partition", "2,4"])) == [2, 4]
    with pytest.raises(SystemExit):
        partition_of(p, p.parse_args(["--partition", "3,4"]))
    assert "summing to n_layer + 2 = 6" in capsys.readouterr().err


@pytest.mark.slow
def test_example_help_lists_the_model_flags() -> None:
    import subprocess

    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "examples" / "char_gpt.py"), "--help"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    for flag in ("--n-layer", "--n-embd", "--n-head", "--block-size", "--batch-size", "--devices", "--tune"):
        assert flag in out.stdout
