"""Pipelined gradients and weights equal plain single-process training with gradient accumulation (no Lightning)."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.helpers.distributed import run_distributed
from tests.helpers.executor import STEPS, cases_worker, reference

# (schedule, partition, micro-batches, batch sizes per step or None, batched p2p[, advance forwards k])
CASES: dict[str, tuple] = {
    "S2-1f1b-even": ("1f1b", [3, 3], 4, None, False),
    "S2-afab-uneven": ("afab", [1, 5], 3, None, False),
    "S2-1f1b-one-microbatch": ("1f1b", [3, 3], 1, None, False),
    "S2-1f1b-shapes-change": ("1f1b", [3, 3], 3, [12, 12, 7, 12], False),
    "S2-advance-batched-p2p": ("advance", [3, 3], 4, [12, 12, 7], True),
    "S4-1f1b-uneven": ("1f1b", [1, 1, 2, 2], 4, None, False),
    "S4-afab": ("afab", [2, 1, 2, 1], 6, None, False),
    "S4-1f1b-fewer-microbatches-than-stages": ("1f1b", [2, 2, 1, 1], 2, None, False),
    "S4-advance": ("advance", [2, 1, 1, 2], 4, None, False),
    "S4-1f1b-batched-p2p": ("1f1b", [1, 2, 2, 1], 4, [12, 12, 7], True),
    # k early forwards on all stages but the last: the last stage receives ahead what the stage before sends ahead
    "S2-advance-k2-batched-p2p": ("advance", [3, 3], 4, [12, 12, 7], True, 2),
    "S4-advance-k3-eager": ("advance", [2, 1, 1, 2], 6, None, False, 3),
    "S4-advance-k2-batched-p2p": ("advance", [1, 2, 2, 1], 6, [12, 12, 7], True, 2),
}


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict]]:
    """Every case's per-rank results: one process launch per world size."""
    results: dict[str, list[dict]] = {}
    for world in (2, 4):
        names = [name for name, case in CASES.items() if len(case[1]) == world]
        runs = run_distributed(cases_worker, world, [CASES[n] for n in names], timeout=300)
        for i, name in enumerate(names):
            results[name] = [runs[r][i] for r in range(world)]
    return results


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_pipeline_matches_plain_training(outcomes: dict[str, list[dict]], name: str) -> None:
    schedule, partition, m, sizes = CASES[name][:4]
    outs = outcomes[name]
    ref_losses, ref_states = reference(m, len(sizes) if sizes else STEPS, sizes)
    torch.testing.assert_close(torch.tensor(outs[-1]["losses"]), torch.tensor(ref_losses))
    seen = 0
    for out in outs:
        for index, state in out["states"].items():
            torch.testing.assert_close(state, ref_states[index])
            seen += 1
    assert seen == len(ref_states)


@pytest.mark.timeout(600)
def test_metadata_is_sent_once_per_shape(outcomes: dict[str, list[dict]]) -> None:
    """Batches of 12, 12, 7, 12 samples in 3 micro-batches: sizes 4 and 3/2 give 3 distinct shapes."""
    outs = outcomes["S2-1f1b-shapes-change"]
    assert outs[0]["meta_sent"] == 3 and outs[1]["meta_received"] == 3


class _FakeLink:
    """Just enough of a Link for a non-first stage's forward: activations of a fixed value arrive at once."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def post_activations(self, unit: int, key: object) -> None:
        pass

    def wait_activations(self, unit: int, training: bool) -> torch.Tensor:
        return self.value.clone().requires_grad_(training)

    def reap_sends(self) -> None:
        pass

    def wait_sends(self) -> None:
        pass


@pytest.mark.skipif(sys.version_info < (3, 11), reason="exception notes need Python 3.11")
def test_boundary_mismatch_names_what_arrived() -> None:
    """Stage 1's first layer takes 16 features; stage 0 sent 8: the layer's error gains a note saying what arrived."""
    from lightning_avgpipe.runtime.executor import StageExecutor
    from lightning_avgpipe.schedules import build_plan

    layer = torch.nn.Linear(16, 4)
    executor = StageExecutor(1, 2, layer, _FakeLink(torch.randn(3, 8)))  # type: ignore[arg-type]
    plan = build_plan("1f1b", 2, 1, 0, training=False)
    with pytest.raises(RuntimeError) as info:
        executor.run(plan.stages[1], ["k"], training=False, head=lambda u, y: y)
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "stage 1 raised this on unit 0, running its first layers on what stage 0 sent: float32 (3, 8)" in notes
    assert "check the order of configure_pipeline() and the partition" in notes
    assert "mat1 and mat2 shapes cannot be multiplied" in str(info.value)  # the layer's own message is kept
