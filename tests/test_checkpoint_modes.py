"""Checkpoints of the tensor-parallel modes (issue 45, part 5): a 2D (SUMMA, q = 2) or 2.5D (d = 2, q = 2) run
trains as plain Lightning does, its single file holds the whole, unsplit weights and Adam's state under their names,
and plain Lightning resumes it exactly; a 1D checkpoint resumes under 2D and a 2D one under 1D; a folder
(``save_distributed_checkpoint=True``) of 2D or of 2.5D resumes in one process. Each resumed run equals the
uninterrupted one (weights and Adam's state)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lightning_avgpipe import AvgPipeStrategy
from tests.helpers.checkpoints import assert_states_close
from tests.helpers.equivalence import run_lightning
from tests.helpers.seqnet import assert_like_plain, fit_seq

ORDER = {"use_distributed_sampler": False}  # every run reads the batches in the loader's order
WEIGHTS = 34  # SeqNet's parameters: the Linear in, 2 blocks of 15 (no key bias), the head
GRID = {"num_stages": 1, "num_microbatches": 2, "tensor_parallel_size": 4, "tensor_parallel_mode": "2d"}


def launch(root: Path, strategy: dict[str, Any], steps: int, **extra: Any) -> list[dict[str, Any]]:
    """SeqNet (Adam, lr 0.01) under ``strategy`` on its ranks, checkpointed every 4 steps (a file each)."""
    devices = strategy["tensor_parallel_size"]
    model = {"lr": 0.01}
    return run_lightning(
        root, devices, strategy, steps=steps, seq=True, model=model, every_n_train_steps=4, trainer=ORDER, **extra
    )


def step_file(root: Path, step: int) -> Path:
    return root / "every" / f"epoch={step // 4 - 1}-step={step}.ckpt"


def assert_split(results: list[dict[str, Any]]) -> None:
    """Every rank held every weight as a DTensor on the grid, under a third of the model's elements (1/q² of the
    matrices, 1/q of the biases and norms)."""
    for r in results:
        assert len(r["sharded"]) == WEIGHTS and r["local_parameters"] * 3 < r["parameters"], r


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_2d_checkpoint_is_plain_lightnings_and_resumes_under_1d_and_in_one_process(tmp_path: Path) -> None:
    """2D, q = 2 (4 ranks, one stage): its file at step 4 resumes in plain Lightning and under 1D (T = 4), its
    folder in one process, and a 1D file under 2D, each equal to the uninterrupted run."""
    plain_trainer, plain = fit_seq(tmp_path / "plain", 8)  # the uninterrupted runs, plain Lightning
    longer_trainer, longer = fit_seq(tmp_path / "longer", 12)

    # 2D, q = 2 (4 ranks): trains as plain Lightning; its files hold the whole weights and Adam's state
    grid = tmp_path / "grid"
    results = launch(grid, GRID, 8, folder_at=4)
    assert_split(results)
    assert_like_plain(grid / "final.ckpt", plain_trainer, plain)
    # 2D -> plain Lightning, from the file saved at step 4
    fit_seq(tmp_path / "resumed", 8, str(step_file(grid, 4)))
    assert_like_plain(step_file(tmp_path / "resumed", 8), plain_trainer, plain)

    # 2D folder -> one process under AvgPipeStrategy
    folder = grid / "folder" / "step=4"
    assert len(list(folder.glob("*.distcp"))) == 4  # each rank wrote its part
    _, resumed = fit_seq(tmp_path / "one", 8, str(folder), AvgPipeStrategy(num_microbatches=2))
    assert_states_close(resumed.state_dict(), plain.state_dict())
    assert_like_plain(step_file(tmp_path / "one", 8), plain_trainer, plain)

    # 2D file (step 4) -> 1D, T = 4, to step 12; its file at step 8 -> 2D, to step 12
    megatron = tmp_path / "megatron"
    results = launch(megatron, {**GRID, "tensor_parallel_mode": "1d"}, 12, ckpt_path=str(step_file(grid, 4)))
    assert 0 < len(results[0]["sharded"]) < WEIGHTS and len(results[0]["losses"]) == 8  # Megatron's split: no norm
    assert_like_plain(megatron / "final.ckpt", longer_trainer, longer)
    back = tmp_path / "back"
    results = launch(back, GRID, 12, ckpt_path=str(step_file(megatron, 8)))
    assert len(results[0]["losses"]) == 4
    assert_like_plain(back / "final.ckpt", longer_trainer, longer)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_2_5d_file_and_folder_are_plain_lightnings_and_resume_there(tmp_path: Path) -> None:
    """2.5D (d = 2, q = 2: 8 ranks, one stage): the file holds the whole weights, and plain Lightning resumes it; its
    folder (each rank's part) resumes in one process. Both equal the uninterrupted run."""
    plain_trainer, plain = fit_seq(tmp_path / "plain", 8)
    deep = tmp_path / "deep"
    strategy = {**GRID, "tensor_parallel_size": 8, "tensor_parallel_mode": "2.5d", "tensor_parallel_depth": 2}
    assert_split(launch(deep, strategy, 4, folder_at=4))
    _, resumed = fit_seq(tmp_path / "resumed", 8, str(step_file(deep, 4)))
    assert_states_close(resumed.state_dict(), plain.state_dict())
    assert_like_plain(step_file(tmp_path / "resumed", 8), plain_trainer, plain)

    folder = deep / "folder" / "step=4"
    assert len(list(folder.glob("*.distcp"))) == 8
    _, resumed = fit_seq(tmp_path / "one", 8, str(folder), AvgPipeStrategy(num_microbatches=2))
    assert_states_close(resumed.state_dict(), plain.state_dict())
    assert_like_plain(step_file(tmp_path / "one", 8), plain_trainer, plain)
