"""Trainer(strategy=AvgPipeStrategy(...)) on 2 and 4 gloo processes equals plain training with accumulation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.equivalence import assert_matches, final_state, run_lightning
from tests.helpers.lit import PipeNet, reference


@pytest.mark.slow
@pytest.mark.parametrize(
    ("devices", "strategy"),
    [
        (2, {"num_microbatches": 4, "schedule": "1f1b", "partition": [3, 3]}),
        (2, {"num_microbatches": 3, "schedule": "afab", "partition": [1, 5]}),
        (4, {"num_microbatches": 4, "schedule": "1f1b", "partition": [1, 2, 2, 1]}),
        (
            4,
            {
                "num_microbatches": 4,
                "schedule": "advance",
                "advance_forwards": 1,
                "partition": [2, 1, 1, 2],
                "p2p": "batched",
            },
        ),
    ],
    # (S4 with AFAB and a uniform partition left for CI time: test_runtime_equivalence runs AFAB on 4 stages)
    ids=["S2-1f1b-even", "S2-afab-uneven", "S4-1f1b-uneven", "S4-advance-batched-p2p"],
)
def test_equivalence(tmp_path: Path, devices: int, strategy: dict[str, Any]) -> None:
    results = run_lightning(tmp_path, devices, strategy)
    assert_matches(tmp_path, results, strategy["num_microbatches"])
    # after the run rank 0's module is the whole trained model (the final checkpoint's weights); every other rank's
    # holds placeholders: its state_dict() refuses, the save above not
    assert [r["after_run"] for r in results] == ["whole"] + ["NotWholeError"] * (devices - 1)
    after, final = torch.load(tmp_path / "after_run0.pt", weights_only=True), final_state(tmp_path)
    assert after.keys() == final.keys()
    for key in final:
        assert torch.equal(after[key], final[key]), key


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "partition"),
    [("1f1b", [2, 4]), ("zbh1", [2, 4]), ("zbv", [1, 2, 1, 2]), ("interleaved", [2, 1, 1, 2])],
)
def test_adam_clipping_accumulation_scheduler(tmp_path: Path, schedule: str, partition: list[int]) -> None:
    """Global-norm clipping, accumulate_grad_batches, an lr scheduler and Adam all keep the arithmetic exact (and
    with the backward split, whose weight gradients land in W, before the clipping sees them; and with two stages
    per rank, whose norms the rank sums before the ranks do)."""
    strategy = {"num_microbatches": 2, "partition": partition, "schedule": schedule}
    results = run_lightning(
        tmp_path,
        2,
        strategy,
        steps=3,
        model={"optimizer": "adam", "lr": 0.01, "scheduler": True},
        trainer={"gradient_clip_val": 0.05, "accumulate_grad_batches": 2},
    )
    assert_matches(tmp_path, results, 2, steps=3, optimizer="adam", lr=0.01, scheduler=True, clip=0.05, accumulate=2)


@pytest.mark.slow
def test_checkpoint_loads_without_strategy(tmp_path: Path) -> None:
    run_lightning(tmp_path, 2, {"num_microbatches": 2, "partition": [4, 2]}, steps=2)
    model = PipeNet.load_from_checkpoint(tmp_path / "final.ckpt")
    _, ref_state = reference(2, 2)
    for key, value in ref_state.items():
        torch.testing.assert_close(model.state_dict()[key], value)


@pytest.mark.slow
def test_advance_auto_changes_plans_without_changing_the_arithmetic(tmp_path: Path) -> None:
    """advance_forwards='auto' tries k = 0, 1, ... between iterations; every plan computes the same step."""
    strategy = {"num_microbatches": 4, "schedule": "advance", "partition": [3, 3]}
    results = run_lightning(tmp_path, 2, strategy, steps=10, trainer={"log_every_n_steps": 1})
    assert (
        "advance_forwards='auto' settled on" in results[0]["output"]
        or results[0]["metrics"]["avgpipe/advance_forwards"] >= 1.0
    )  # it moved past k = 0 or decided, within 10 iterations
    assert_matches(tmp_path, results, 4, steps=10)


@pytest.mark.slow
def test_one_group_reads_the_loader_as_one_device_does(tmp_path: Path) -> None:
    """D = 1 with Lightning's defaults (no use_distributed_sampler=False): every rank reads the shuffle=False loader
    in its own order, so the run ends on the weights plain Lightning reaches on one device. With D = 2 Lightning's
    DistributedSampler shards the data, as under DDP."""
    from tests.helpers.lit import loader, quiet_trainer

    results = run_lightning(tmp_path / "pipe", 2, {"num_microbatches": 1, "partition": [3, 3]}, steps=4)
    assert [r["sampler"] for r in results] == ["SequentialSampler"] * 2
    torch.manual_seed(0)
    plain = PipeNet()
    quiet_trainer(tmp_path / "plain", max_steps=4, enable_checkpointing=False).fit(plain, loader(12))
    state = final_state(tmp_path / "pipe")
    for key, value in plain.state_dict().items():
        if key.startswith("layers."):
            torch.testing.assert_close(state[key], value, msg=lambda m, k=key: f"{k}: {m}")
    groups = run_lightning(tmp_path / "groups", 4, {"num_stages": 2, "num_microbatches": 2, "partition": [3, 3]}, 2)
    assert [r["sampler"] for r in groups] == ["DistributedSampler"] * 4


@pytest.mark.slow
def test_a_shuffling_loader_gives_every_stage_the_same_batches(tmp_path: Path) -> None:
    """DataLoader(shuffle=True) with D = 1 and the ranks' global RNGs apart: the sampler is given one seeded
    generator on every rank (and the log says so), so both stages read the same batches, epoch after epoch."""
    results = run_lightning(tmp_path, 2, {"num_microbatches": 2, "partition": [3, 3]}, steps=8, shuffle_default=True)
    assert results[0]["labels"] == results[1]["labels"] and len(results[0]["labels"]) == 8
    assert results[0]["labels"][:4] != results[0]["labels"][4:]  # two epochs, two orders
    assert "draws from a generator seeded 0 on every rank" in results[0]["output"]
