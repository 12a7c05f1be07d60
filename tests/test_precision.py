"""precision "16-mixed" (float16 autocast and a GradScaler, here on CPU): one loss scale for the whole pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_avgpipe.plugin.steps.precision import agree_on_overflow
from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.lit import fp16_reference

STEPS, M = 4, 2


def test_one_overflow_flag_for_the_job() -> None:
    """One process: the flag the scaler recorded is kept; a stage without gradients gets a flag to step by."""
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    (scaler.scale(w.sum()) * float("inf")).backward()
    scaler.unscale_(opt)
    assert agree_on_overflow(scaler, opt) == 1.0
    empty = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)  # no gradient: unscale_ records nothing
    scaler.unscale_(empty)
    assert agree_on_overflow(scaler, empty) == 0.0
    scaler.step(empty)  # would raise "No inf checks were recorded" without the flag
    scaler.update()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_16_mixed_matches_one_process_and_an_overflow_skips_every_rank(tmp_path: Path) -> None:
    """Two stages: the weights equal one process with the same scaler over 4 steps, where an inf gradient on stage 0
    only at step 1 skips that step on both stages and halves the scale on both (steps 0, 2 and 3 train as usual)."""
    fault = {"fault": {"rank": 0, "step": 1, "kind": "inf_grad"}}
    results = run_lightning(tmp_path, 2, {"num_microbatches": M, "partition": [3, 3]}, steps=STEPS, fp16=True, **fault)
    scales, ref_state = fp16_reference(STEPS, M, overflow_at=1)
    assert results[0]["scales"] == results[1]["scales"] == scales  # one scale on every rank, as in one process
    assert scales[1] == scales[0] / 2  # the skipped step backed off
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda msg, key=key: f"{key}: {msg}")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_16_mixed_with_tensor_parallelism_skips_an_overflow_on_one_shard_everywhere(tmp_path: Path) -> None:
    """T = 2 x S = 2 (4 ranks): an inf gradient on shard 0 of stage 1 only, at step 1, skips that step on every rank
    and halves one shared scale; the weights equal one process with the same scaler (fp16 sums in another order:
    1e-4)."""
    strategy = {  # num_stages left out: 4 devices / T = 2 gives 2 stages (one pipeline group)
        "num_microbatches": M,
        "partition": [3, 3],
        "tensor_parallel_size": 2,
        "tensor_parallel_plan": {"layers.3": "colwise", "layers.5": "rowwise"},
    }
    fault = {"fault": {"rank": 2, "step": 1, "kind": "inf_grad"}}
    results = run_lightning(tmp_path, 4, strategy, steps=STEPS, fp16=True, **fault)
    scales, ref_state = fp16_reference(STEPS, M, overflow_at=1)
    assert [r["scales"] for r in results] == [scales] * 4
    out = results[0]["output"]  # the setup log: every stage's split, and a warning for a stage that splits nothing
    assert "splits, per stage, stage 0: nothing; stage 1: layers.3, layers.5." in out, out[-3000:]
    assert "tensor_parallel_size=2 splits nothing on stage 0, which holds Fork x1, Join x1, Linear x1:" in out
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, rtol=1e-4, atol=1e-4, msg=lambda m, key=key: f"{key}: {m}")
