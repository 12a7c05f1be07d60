"""Each stage sharded over its stage group with FSDP2 (``sharding_strategy``: ZeRO-2 and ZeRO-3;
``lightning_avgpipe/runtime/sharding/fsdp.py``): the same training as without sharding, each rank holding its share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(600)


def test_zero3_with_a_tie_and_clipping_on_two_groups_of_two_stages_trains_as_unsharded(tmp_path: Path) -> None:
    """Lightning, D = 2 x S = 2 (4 ranks), the tied LM (embedding on stage 0, head on stage 1), Adam, global-norm
    clipping that bites: FULL_SHARD gives the unsharded run's losses and weights."""
    from tests.helpers.equivalence import final_state, run_lightning

    steps = 3
    strategy: dict[str, Any] = {"num_stages": 2, "num_microbatches": 2, "partition": [2, 2], "averaging": "exact"}
    extra: dict[str, Any] = {"tied": True, "model": {"lr": 0.01}, "trainer": {"gradient_clip_val": 0.05}}
    plain = run_lightning(tmp_path / "plain", 4, strategy, steps=steps, **extra)
    z3 = run_lightning(tmp_path / "z3", 4, {**strategy, "sharding_strategy": "FULL_SHARD"}, steps=steps, **extra)
    torch.testing.assert_close(torch.tensor(z3[0]["losses"]), torch.tensor(plain[0]["losses"]))
    want, got = final_state(tmp_path / "plain"), final_state(tmp_path / "z3")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
