"""A stage sharded with FSDP2 (``sharding_strategy``) of a model built in ``configure_model`` (on the meta device):
each rank shards its layers there and makes real only its own shard of them (``runtime/sharding/fsdp.py``
``shard_on_meta``), and trains as the same model built in ``__init__``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(600)


def _made(out: str) -> tuple[float, float]:
    """Rank 0's "X KiB of Y KiB" from the setup line of a model built without memory."""
    said = re.search(r"rank 0: ([0-9.]+) (B|KiB|MiB) of ([0-9.]+) (B|KiB|MiB)", out)
    assert said is not None, out[-3000:]
    scale = {"B": 1, "KiB": 1024, "MiB": 1 << 20}
    return float(said.group(1)) * scale[said.group(2)], float(said.group(3)) * scale[said.group(4)]


@pytest.mark.parametrize(("stages", "level"), [(1, "FULL_SHARD"), (2, "FULL_SHARD"), (2, "SHARD_GRAD_OP")])
def test_a_sharded_model_built_in_configure_model_makes_real_its_shard_and_trains_as_built_whole(
    tmp_path: Path, stages: int, level: str
) -> None:
    """D = 2 x S under ZeRO-3 and ZeRO-2: the model built in ``configure_model`` gives the losses and weights of the
    same model built in ``__init__``, and rank 0 made real about half of its stage (its shard), not all of it."""
    from tests.helpers.equivalence import final_state, run_lightning

    strategy: dict[str, Any] = {
        "num_stages": stages,
        "num_microbatches": 2,
        "averaging": "exact",
        "sharding_strategy": level,
    }
    run: dict[str, Any] = {"steps": 3, "model": {"optimizer": "adam", "lr": 0.01}}
    whole = run_lightning(tmp_path / "whole", 2 * stages, strategy, **run)
    late = run_lightning(tmp_path / "late", 2 * stages, strategy, late=True, **run)
    torch.testing.assert_close(torch.tensor(late[0]["losses"]), torch.tensor(whole[0]["losses"]))
    want, got = final_state(tmp_path / "whole"), final_state(tmp_path / "late")
    want = {k: v for k, v in want.items() if k.startswith("layers.")}
    assert sorted(k for k in got if k.startswith("layers.")) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, msg=lambda m, key=key: f"{key}: {m}")
    from tests.helpers.models import make_layers

    out = late[0]["output"]
    cut = re.search(r"layers per stage \[([0-9, ]+)\]", out)
    assert cut is not None, out[-3000:]
    first = int(cut.group(1).split(",")[0])  # rank 0's stage: the model's first layers
    stage = sum(p.numel() * p.element_size() for layer in make_layers()[:first] for p in layer.parameters())
    kept, _ = _made(out)
    assert 0.4 * stage <= kept <= 0.6 * stage, (kept, stage)


def test_zero3_of_a_tied_model_built_in_configure_model_trains_as_unsharded(tmp_path: Path) -> None:
    """D = 2 x S = 2, the tied LM (embedding on stage 0, head on stage 1) built in ``configure_model``, clipping that
    bites: FULL_SHARD gives the losses and weights of the unsharded model built in ``__init__`` (the tie's gradients
    summed over the FSDP parameters made real from the meta device)."""
    from tests.helpers.equivalence import final_state, run_lightning

    steps = 3
    strategy: dict[str, Any] = {"num_stages": 2, "num_microbatches": 2, "partition": [2, 2], "averaging": "exact"}
    extra: dict[str, Any] = {"tied": True, "model": {"lr": 0.01}, "trainer": {"gradient_clip_val": 0.05}}
    plain = run_lightning(tmp_path / "plain", 4, strategy, steps=steps, **extra)
    z3 = strategy | {"sharding_strategy": "FULL_SHARD"}
    late = run_lightning(tmp_path / "late", 4, z3, steps=steps, late=True, **extra)
    torch.testing.assert_close(torch.tensor(late[0]["losses"]), torch.tensor(plain[0]["losses"]))
    want, got = final_state(tmp_path / "plain"), final_state(tmp_path / "late")
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")
    from tests.helpers.tied import tied_layers

    stage = sum(p.numel() * p.element_size() for layer in tied_layers()[:2] for p in layer.parameters())
    kept, _ = _made(late[0]["output"])  # rank 0's shard of stage 0 (the tied embedding and a block)
    assert 0.4 * stage <= kept <= 0.6 * stage, (kept, stage)


def _share(shape: torch.Size, tensor_dim: int | None, d: int, t: int, D: int = 2, T: int = 2) -> int:
    """The bytes of a float32 weight of ``shape`` that rank (d, t) holds under FSDP2 over D on top of a T-way tensor
    split on ``tensor_dim`` (None: whole on the tensor group): ``torch.chunk`` over T on that dim, then over D on dim
    0, the storage padded to the first chunk's size (as FSDP2 pads its shards)."""
    whole = torch.empty(shape, device="meta")
    split = whole if tensor_dim is None else torch.chunk(whole, T, dim=tensor_dim)[t]
    chunks = torch.chunk(split, D, dim=0)
    return (chunks[0].numel() if d < len(chunks) else 0) * 4


def test_zero3_over_tensor_shards_of_a_model_built_in_configure_model_makes_real_each_ranks_piece(
    tmp_path: Path,
) -> None:
    """D = 2 x S = 1 x T = 2 under FULL_SHARD, a plan with a column-wise and a row-wise Linear: the model built in
    ``configure_model`` trains as the same model built in ``__init__``, and each rank's replay of the build made real
    only its (data, tensor) piece of the stage: 1/(D x T) of a split weight, 1/D of one whole on the tensor group.
    One stage is enough: the layout of the pieces depends on D, T and the plan, not on S (with S = 2, rank 0's stage
    would hold neither split layer); four ranks instead of eight keep the run short."""
    from tests.helpers.checkpoints import TP_PLAN
    from tests.helpers.equivalence import final_state, run_lightning
    from tests.helpers.models import make_layers

    strategy: dict[str, Any] = {
        "num_stages": 1,
        "num_microbatches": 2,
        "averaging": "exact",
        "sharding_strategy": "FULL_SHARD",
        "tensor_parallel_size": 2,
        "tensor_parallel_plan": TP_PLAN,
    }
    run: dict[str, Any] = {"steps": 3, "model": {"optimizer": "adam", "lr": 0.01}}
    whole = run_lightning(tmp_path / "whole", 4, strategy, **run)
    late = run_lightning(tmp_path / "late", 4, strategy, late=True, **run)
    torch.testing.assert_close(torch.tensor(late[0]["losses"]), torch.tensor(whole[0]["losses"]), rtol=1e-5, atol=0)
    want, got = final_state(tmp_path / "whole"), final_state(tmp_path / "late")
    want = {k: v for k, v in want.items() if k.startswith("layers.")}
    assert sorted(k for k in got if k.startswith("layers.")) == sorted(want)
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=0, msg=lambda m, key=key: f"{key}: {m}")
    # the plan's tensor split of each weight (dim; None: whole on the tensor group): colwise cuts a weight's rows and
    # its bias, rowwise a weight's columns
    splits = {"3.weight": 0, "3.bias": 0, "5.weight": 1}
    layers = make_layers()
    named = [(f"{i}.{n}", p) for i, layer in enumerate(layers) for n, p in layer.named_parameters()]
    stage = sum(p.numel() * p.element_size() for _, p in named)
    assert sorted({r["place"][1] * 2 + r["place"][3] for r in late}) == [0, 1, 2, 3]  # every (data, tensor) place
    for r in late:
        d, t = r["place"][1], r["place"][3]
        piece = sum(_share(p.shape, splits.get(n), d, t) for n, p in named)
        assert r["made"] == [piece], (r["rank"], d, t, r["made"], piece, stage)
        assert piece < 0.35 * stage  # about 1/D of the whole weights and 1/(D x T) of the split ones
    assert _made(late[0]["output"])[0] == late[0]["made"][0]  # the setup line says the same for rank 0
