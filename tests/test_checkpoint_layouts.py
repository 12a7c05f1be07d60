"""A checkpoint that moves between layouts: the optimizer state is saved as the unsplit model's ``torch.optim`` state
dict with parameter names, so plain Lightning on one device and AvgPipe under another layout resume it with their
optimizer state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_avgpipe import AvgPipeStrategy
from tests.helpers.checkpoints import PLAIN_ORDER, STEPS, TP, TP_PLAN, assert_states_close, fit_with_checkpoints
from tests.helpers.equivalence import run_lightning
from tests.helpers.lit import PipeNet


@pytest.fixture(scope="module")
def two_stage_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """STEPS steps on 2 stages (Adam), saved as one checkpoint."""
    root = tmp_path_factory.mktemp("two_stages")
    strategy = {"num_microbatches": 2, "partition": [3, 3]}
    model = {"optimizer": "adam", "lr": 0.01}
    run_lightning(root, 2, strategy, steps=STEPS, model=model, every_n_train_steps=STEPS, trainer=PLAIN_ORDER)
    return root / "every" / f"epoch=0-step={STEPS}.ckpt"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_stages_resume_on_plain_lightning_and_on_one_stage(two_stage_checkpoint: Path, tmp_path: Path) -> None:
    saved = torch.load(two_stage_checkpoint, weights_only=True)["optimizer_states"][0]
    group = saved["param_groups"][0]
    # the unsplit torch.optim form: every parameter once, in the model's order, named
    assert group["param_names"] == [n for n, _ in PipeNet().named_parameters()]
    assert group["params"] == list(range(len(group["param_names"])))
    assert set(saved["state"]) == set(group["params"]) and "exp_avg" in saved["state"][0]
    _, plain = fit_with_checkpoints(tmp_path / "plain", 2 * STEPS)  # the uninterrupted run, plain Lightning

    # plain Lightning (SingleDeviceStrategy) takes the checkpoint as it is: no KeyError 'param_groups'
    trainer, resumed = fit_with_checkpoints(tmp_path / "resumed", 2 * STEPS, str(two_stage_checkpoint))
    state = trainer.optimizers[0].state_dict()
    assert all(int(s["step"]) == 2 * STEPS for s in state["state"].values())  # Adam's count went on from 4
    assert_states_close(resumed.state_dict(), plain.state_dict())

    # AvgPipe on one process (S = 1): another layout, the optimizer state moved by name (exact: one model)
    trainer, one_stage = fit_with_checkpoints(
        tmp_path / "one_stage", 2 * STEPS, str(two_stage_checkpoint), AvgPipeStrategy(num_microbatches=2)
    )
    assert all(int(s["step"]) == 2 * STEPS for s in trainer.optimizers[0].state_dict()["state"].values())
    assert_states_close(one_stage.state_dict(), plain.state_dict())


@pytest.mark.timeout(120)
def test_a_plain_checkpoint_with_names_resumes_under_avgpipe(tmp_path: Path) -> None:
    """Plain Lightning's checkpoint of an optimizer built from named parameters splits by name; without names the
    refusal says how to get them."""
    _, plain = fit_with_checkpoints(tmp_path / "plain", 2 * STEPS)
    fit_with_checkpoints(tmp_path / "named", STEPS, named=True)
    named = tmp_path / "named" / "every" / f"epoch=0-step={STEPS}.ckpt"
    _, resumed = fit_with_checkpoints(tmp_path / "resumed", 2 * STEPS, str(named), AvgPipeStrategy(num_microbatches=2))
    assert_states_close(resumed.state_dict(), plain.state_dict())

    fit_with_checkpoints(tmp_path / "unnamed", STEPS)
    unnamed = tmp_path / "unnamed" / "every" / f"epoch=0-step={STEPS}.ckpt"
    with pytest.raises(ValueError, match=r"names no parameters .* build the optimizer from\s+self.named_parameters"):
        fit_with_checkpoints(tmp_path / "refused", 2 * STEPS, str(unnamed), AvgPipeStrategy(num_microbatches=2))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ddp_resumes_a_two_stage_checkpoint(two_stage_checkpoint: Path, tmp_path: Path) -> None:
    """strategy="ddp" on 2 processes loads the one-device optimizer state on every rank and trains on from it."""
    results = run_lightning(
        tmp_path,
        2,
        "ddp",
        steps=STEPS + 2,
        model={"optimizer": "adam", "lr": 0.01},
        ckpt_path=str(two_stage_checkpoint),
    )
    for r in results:
        assert r["optimizer_steps"] == [STEPS + 2] and len(r["losses"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_tensor_parallel_trains_as_one_device_and_resumes_across_t(two_stage_checkpoint: Path, tmp_path: Path) -> None:
    """T = 2, S = 2 (4 ranks) trains as plain Lightning does; its checkpoint (shards saved whole) resumes on one
    device with Adam's state, and a T = 1 checkpoint resumes under T = 2: each equals the uninterrupted run."""
    _, plain = fit_with_checkpoints(tmp_path / "plain", 2 * STEPS)
    model = {"optimizer": "adam", "lr": 0.01}
    tp = {**TP, "tensor_parallel_plan": TP_PLAN}
    results = run_lightning(
        tmp_path / "tp", 4, tp, steps=2 * STEPS, model=model, every_n_train_steps=STEPS, trainer=PLAIN_ORDER
    )
    split = ["layers.3.bias", "layers.3.weight", "layers.5.bias", "layers.5.weight"]
    assert [r["sharded"] for r in results] == [[], [], split, split]  # stage 1's two shards; stage 0 has no pair
    final = torch.load(tmp_path / "tp" / "final.ckpt", weights_only=True)
    assert final["optimizer_states"][0]["avgpipe_layout"]["tensor_parallel"] == 2
    assert_states_close({k: v for k, v in final["state_dict"].items() if k.startswith("layers.")}, plain.state_dict())

    # T = 2 -> one device (plain Lightning): the whole weights and Adam's state, exact
    mid = tmp_path / "tp" / "every" / f"epoch=0-step={STEPS}.ckpt"
    trainer, resumed = fit_with_checkpoints(tmp_path / "resumed", 2 * STEPS, str(mid))
    assert all(int(s["step"]) == 2 * STEPS for s in trainer.optimizers[0].state_dict()["state"].values())
    assert_states_close(resumed.state_dict(), plain.state_dict())

    # T = 1 (S = 2) -> T = 2: each shard takes its part of the whole state by name
    run_lightning(
        tmp_path / "back", 4, tp, steps=2 * STEPS, model=model, ckpt_path=str(two_stage_checkpoint), trainer=PLAIN_ORDER
    )
    back = torch.load(tmp_path / "back" / "final.ckpt", weights_only=True)["state_dict"]
    assert_states_close({k: v for k, v in back.items() if k.startswith("layers.")}, plain.state_dict())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tensor_parallel_replicas_match_one_process_and_resume_exactly(tmp_path: Path) -> None:
    """T = 2 on one stage with N = 2 elastic replicas (2 ranks): the AvgPipe rule as one process computes it, and a
    resume with the same mesh continues bit for bit (every rank's replicas and optimizers saved as local shards)."""
    from tests.helpers.checkpoints import replicas_from_checkpoint
    from tests.helpers.equivalence import final_state
    from tests.helpers.lit import reference_elastic

    model = {"optimizer": "adam", "lr": 0.01}
    strategy = {"num_stages": 1, "num_microbatches": 2, "num_pipelines": 2, "tensor_parallel_size": 2}
    strategy["tensor_parallel_plan"] = TP_PLAN  # type: ignore[assignment]
    straight = tmp_path / "straight"
    full = run_lightning(straight, 2, strategy, steps=4, model=model, every_n_train_steps=2)
    assert full[1]["sharded"] == ["layers.3.bias", "layers.3.weight", "layers.5.bias", "layers.5.weight"]
    ref_losses, ref_state, _ = reference_elastic(4, 2, 2, lr=0.01, optimizer="adam")
    torch.testing.assert_close(torch.tensor(full[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(straight)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")

    resumed = tmp_path / "resumed"
    rest = run_lightning(
        resumed, 2, strategy, steps=4, model=model, ckpt_path=str(straight / "every" / "epoch=0-step=2.ckpt")
    )
    assert rest[0]["losses"] == full[0]["losses"][2:]
    a, b = final_state(straight), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = replicas_from_checkpoint(straight / "final.ckpt"), replicas_from_checkpoint(resumed / "final.ckpt")
    assert ra.keys() == rb.keys() == {0, 1}
    assert ra[0][0][3]["weight"].shape == (8, 16)  # replica 0's Linear(16, 16): shard 0's half of the rows
    for rank in ra:  # each rank's replicas, as its local shards
        for la, lb in zip(ra[rank], rb[rank]):
            for sa, sb in zip(la, lb):
                assert all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sharded_optimizer_state_trains_as_one_device_and_saves_the_whole_state(tmp_path: Path) -> None:
    """D = 2 groups, exact averaging, shard_optimizer_state=True (2 ranks reading the same batches): the weights of
    plain Lightning, a checkpoint whose optimizer state is whole (each group's half put together), and a resume of it
    on one device equal to the uninterrupted run."""
    _, plain = fit_with_checkpoints(tmp_path / "plain", 2 * STEPS)
    strategy = {"num_stages": 1, "num_microbatches": 2, "averaging": "exact", "shard_optimizer_state": True}
    model = {"optimizer": "adam", "lr": 0.01}
    results = run_lightning(
        tmp_path / "zero", 2, strategy, steps=2 * STEPS, model=model, every_n_train_steps=STEPS, trainer=PLAIN_ORDER
    )
    assert [r["optimizer"] for r in results] == ["ShardedOptimizer"] * 2
    final = torch.load(tmp_path / "zero" / "final.ckpt", weights_only=True)
    assert_states_close({k: v for k, v in final["state_dict"].items() if k.startswith("layers.")}, plain.state_dict())
    state = final["optimizer_states"][0]
    assert set(state["state"]) == set(state["param_groups"][0]["params"])  # every parameter's state, from its owner
    assert all("exp_avg" in s and int(s["step"]) == 2 * STEPS for s in state["state"].values())
    mid = tmp_path / "zero" / "every" / f"epoch=0-step={STEPS}.ckpt"
    trainer, resumed = fit_with_checkpoints(tmp_path / "resumed", 2 * STEPS, str(mid))
    assert_states_close(resumed.state_dict(), plain.state_dict())
    # the setup log: every group's share of every stage (flat slices: a half each, to a few elements)
    out = results[0]["output"]
    said = r"over 2 groups by flat slices \(Adam steps each element alone\); each group keeps, of a stage's: "
    shares = re.search(said + r"stage 0: group 0 ([0-9.]+)%, group 1 ([0-9.]+)%\.", out)
    assert shares is not None and all(abs(float(v) - 50) < 0.5 for v in shares.groups()), out[-3000:]
    # resumed sharded again: the whole saved state cut into each group's slices
    run_lightning(
        tmp_path / "zero_resumed", 2, strategy, steps=2 * STEPS, model=model, trainer=PLAIN_ORDER, ckpt_path=str(mid)
    )
    assert_states_close(
        {k: v for k, v in torch.load(tmp_path / "zero_resumed" / "final.ckpt")["state_dict"].items() if "layers." in k},
        plain.state_dict(),
    )
