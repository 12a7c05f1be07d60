"""``Trainer(strategy=AvgPipeStrategy(schedule="zbv" | "interleaved"))``: a rank holds several model stages (S·v
chunks), and training still equals plain training with gradient accumulation: for uneven partitions, activation
checkpointing, shared (tied) weights on one rank (ZB-V's V puts the embedding and the head on rank 0) or on two (the
loop), 16-mixed with its one scaler, and N = 2 replicas. The checkpoint keeps the unsplit model's format, so a run
saved with one v resumes under another and loads under plain Lightning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.equivalence import assert_matches, final_state, run_lightning
from tests.helpers.lit import PipeNet, fp16_reference, reference, reference_elastic
from tests.helpers.tied import reference_tied


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [
        {"num_microbatches": 4, "schedule": "zbv", "partition": [1, 2, 1, 2]},
        {"num_microbatches": 3, "schedule": "interleaved", "partition": [2, 1, 1, 2]},
        {"num_microbatches": 2, "schedule": "zbv", "partition": [2, 1, 2, 1], "activation_checkpointing": True},
        {"num_microbatches": 4, "schedule": "interleaved", "partition": [1, 1, 1, 3], "activation_checkpointing": True},
        {"num_microbatches": 4, "schedule": "zbh1", "partition": [1, 5], "activation_checkpointing": ["Linear"]},
        {"num_microbatches": 4, "schedule": "zbv", "partition": [1, 2, 1, 2], "schedule_costs": [1.0, 1.5, 0.4]},
    ],
    ids=[
        "zbv-uneven",
        "interleaved-uneven",
        "zbv-checkpointing",
        "interleaved-checkpointing",
        "zbh1-checkpointing",
        "zbv-placed-by-costs",
    ],
)
def test_chunked_schedules_equal_plain_training(tmp_path: Path, strategy: dict[str, Any]) -> None:
    results = run_lightning(tmp_path, 2, strategy)
    assert_matches(tmp_path, results, strategy["num_microbatches"])
    v = 1 if strategy["schedule"] == "zbh1" else 2
    out = results[0]["output"]
    assert f"AvgPipe: {2 * v} stages" in out, out[-2000:]
    if "schedule_costs" in strategy:  # another order of the same actions (tests/test_chunks.py), said in the log
        assert "placed by F:I:W = 1:1.5:0.4" in out, out[-2000:]
    if strategy.get("activation_checkpointing"):  # the setup log says which layers every rank recomputes
        assert ("rank 0: " if v > 1 else "stage 0: ") in out.split("activation checkpointing recomputes")[1], out
    else:
        assert "activation checkpointing recomputes" not in out


@pytest.mark.slow
def test_zbv_with_two_replicas_equals_elastic_averaging_in_one_process(tmp_path: Path) -> None:
    strategy = {"num_microbatches": 2, "schedule": "zbv", "partition": [1, 2, 1, 2], "num_pipelines": 2}
    results = run_lightning(tmp_path, 2, strategy, steps=3)
    ref_losses, ref_state, _ = reference_elastic(3, 2, 2)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("schedule", "holders"),
    [("zbv", "which rank 0 of each pipeline runs: it holds the weight once"), ("interleaved", "gradients are summed")],
)
def test_tied_embedding_and_head_under_chunks(tmp_path: Path, schedule: str, holders: str) -> None:
    """ZB-V's V puts stages 0 and 3 (embedding and head) on rank 0: one weight there, nothing to sum. The loop puts
    them on ranks 0 and 1: two copies, their gradients summed. Both train as the tied model does in one process."""
    strategy = {"num_microbatches": 3, "schedule": schedule, "partition": [1, 1, 1, 1]}
    results = run_lightning(tmp_path, 2, strategy, steps=4, tied=True)
    ref_losses, ref_state = reference_tied(4, 3)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")
    assert torch.equal(state["layers.0.weight"], state["layers.3.weight"])
    assert holders in results[0]["output"], results[0]["output"][-2000:]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["zbv", "zbh1"])
def test_16_mixed_with_the_backward_split_skips_an_overflow_everywhere(tmp_path: Path, schedule: str) -> None:
    """float16 with one GradScaler: an inf gradient on rank 0 at step 1 (deferred to W under the split) skips that
    step on both ranks and halves the one scale; the weights equal one process with the same scaler."""
    partition = [1, 2, 1, 2] if schedule == "zbv" else [3, 3]
    strategy = {"num_microbatches": 2, "schedule": schedule, "partition": partition}
    fault = {"fault": {"rank": 0, "step": 1, "kind": "inf_grad"}}
    results = run_lightning(tmp_path, 2, strategy, steps=4, fp16=True, **fault)
    scales, ref_state = fp16_reference(4, 2, overflow_at=1)
    assert results[0]["scales"] == results[1]["scales"] == scales
    assert scales[1] == scales[0] / 2
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")


@pytest.mark.slow
def test_a_zbv_checkpoint_resumes_under_1f1b_and_loads_without_the_strategy(tmp_path: Path) -> None:
    """Saved with 2 stages per rank (4 model stages), resumed with one (2 stages): the weights and the optimizer's
    momentum come back by name, so the resumed run ends where an uninterrupted one does; plain Lightning loads it.
    (Saved at an epoch's end: 4 batches an epoch.)"""
    zbv = {"num_microbatches": 2, "schedule": "zbv", "partition": [1, 2, 1, 2]}
    run_lightning(tmp_path / "zbv", 2, zbv, steps=8, every_n_train_steps=4)
    saved = tmp_path / "zbv" / "every" / "epoch=0-step=4.ckpt"
    resumed = {"num_microbatches": 2, "schedule": "1f1b", "partition": [3, 3]}
    run_lightning(tmp_path / "1f1b", 2, resumed, steps=8, ckpt_path=str(saved))
    _, ref_state = reference(8, 2)
    for name in ("zbv", "1f1b"):
        state = final_state(tmp_path / name)
        for key, value in ref_state.items():
            torch.testing.assert_close(state[key], value, msg=lambda msg, key=key, n=name: f"{n} {key}: {msg}")
    model = PipeNet.load_from_checkpoint(saved)
    _, at_four = reference(4, 2)
    for key, value in at_four.items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_a_partition_lists_every_model_stage() -> None:
    from lightning_avgpipe import AvgPipeStrategy

    with pytest.raises(ValueError, match=r"has 2 entries but num_stages=2 x stages_per_rank=2 = 4 stages"):
        AvgPipeStrategy(num_stages=2, schedule="zbv", partition=[3, 3])
    with pytest.raises(ValueError, match="tensor_parallel_size=1 and replica_execution='sequential'"):
        AvgPipeStrategy(schedule="interleaved", replica_execution="batched")
