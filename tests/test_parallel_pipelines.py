"""N parallel pipelines with elastic averaging under Lightning equal AvgPipe computed on one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.checkpoints import replicas_from_checkpoint
from tests.helpers.distributed import run_distributed
from tests.helpers.equivalence import final_state, run_lightning
from tests.helpers.lit import reference, reference_elastic

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("optimizer", ["sgd", "adam", "adamw"])
def test_two_pipelines_match_single_process_avgpipe(tmp_path: Path, optimizer: str) -> None:
    lr = 0.1 if optimizer == "sgd" else 0.01
    strategy: dict[str, Any] = {"num_microbatches": 2, "partition": [2, 4], "num_pipelines": 2, "sync_reference": True}
    results = run_lightning(tmp_path, 2, strategy, steps=5, model={"optimizer": optimizer, "lr": lr})
    ref_losses, ref_state, ref_replicas = reference_elastic(5, 2, 2, lr=lr, optimizer=optimizer)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
    # every replica of every stage, and the reference is their mean
    saved = replicas_from_checkpoint(tmp_path / "final.ckpt")
    offsets = {0: 0, 1: 2}  # first layer index of each stage for partition [2, 4]
    for rank, replicas in saved.items():
        assert len(replicas) == 2
        for n, layers in enumerate(replicas):
            for i, layer_state in enumerate(layers):
                for name, value in layer_state.items():
                    key = f"layers.{offsets[rank] + i}.{name}"
                    torch.testing.assert_close(value, ref_replicas[n][key])
    for key in ref_state:
        mean = (ref_replicas[0][key] + ref_replicas[1][key]) / 2
        torch.testing.assert_close(state[key], mean)


@pytest.mark.parametrize("sync", [False], ids=["overlapped"])  # sync is the overlapped update waited for at once
def test_two_groups_equal_two_pipelines_in_one_group(tmp_path: Path, sync: bool) -> None:
    """D = 2, S = 2 with one pipeline per group (4 processes) == D = 1, S = 2, N = 2, fed the same batches.

    The overlapped reference update finishes before the next pull, so it gives the same numbers as the synchronous
    one; what it changes is only when the all-reduce's time is paid.
    """
    model = {"optimizer": "adam", "lr": 0.01}
    one_group = tmp_path / "one_group"
    two_groups = tmp_path / "two_groups"
    a = run_lightning(
        one_group,
        2,
        {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2, "sync_reference": True},
        steps=4,
        model=model,
        group_data=True,
    )
    b = run_lightning(
        two_groups,
        4,
        {"num_stages": 2, "num_microbatches": 2, "partition": [3, 3], "sync_reference": sync},
        steps=4,
        model=model,
        group_data=True,
    )
    sa, sb = final_state(one_group), final_state(two_groups)
    for key in sa:
        torch.testing.assert_close(sb[key], sa[key], msg=lambda m, key=key: f"{key}: {m}")
    ra, rb = replicas_from_checkpoint(one_group / "final.ckpt"), replicas_from_checkpoint(two_groups / "final.ckpt")
    for rank, replicas in rb.items():  # rank = d * S + s holds group d's only replica of stage s
        d, s = divmod(rank, 2)
        for got, want in zip(replicas[0], ra[s][d]):
            for name in want:
                torch.testing.assert_close(got[name], want[name])
    # each group's loss is its own pipeline's; their mean is the N = 2 run's loss
    losses_b = torch.tensor([b[0]["losses"], b[2]["losses"]]).mean(0)
    torch.testing.assert_close(losses_b, torch.tensor(a[0]["losses"]))


def test_resume_with_replicas_is_exact_and_another_layout_starts_from_the_reference(tmp_path: Path) -> None:
    model = {"optimizer": "adam", "lr": 0.01}
    strategy: dict[str, Any] = {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2}
    straight = tmp_path / "straight"
    full = run_lightning(straight, 2, strategy, steps=4, model=model, every_n_train_steps=2)
    midway = straight / "every" / "epoch=0-step=2.ckpt"
    resumed = tmp_path / "resumed"
    rest = run_lightning(resumed, 2, strategy, steps=4, model=model, ckpt_path=str(midway))
    assert rest[0]["losses"] == full[0]["losses"][2:]
    a, b = final_state(straight), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    ra, rb = replicas_from_checkpoint(straight / "final.ckpt"), replicas_from_checkpoint(resumed / "final.ckpt")
    for rank in ra:
        for la, lb in zip(ra[rank], rb[rank]):
            for sa, sb in zip(la, lb):
                assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # another N: weights restored, replicas restart from the reference, and the run says so
    other = run_lightning(
        tmp_path / "other", 2, {**strategy, "num_pipelines": 3}, steps=3, model=model, ckpt_path=str(midway)
    )
    assert "the replicas start from the reference" in other[0]["output"]


def test_batched_replica_execution_matches(tmp_path: Path) -> None:
    """replica_execution='batched' (one vmap over stacked weights per unit) computes the same AvgPipe step."""
    strategy: dict[str, Any] = {
        "num_microbatches": 2,
        "partition": [3, 3],
        "num_pipelines": 2,
        "replica_execution": "batched",
    }
    results = run_lightning(tmp_path, 2, strategy, steps=4, model={"optimizer": "adam", "lr": 0.01})
    ref_losses, ref_state, _ = reference_elastic(4, 2, 2, lr=0.01, optimizer="adam")
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_same_seed_same_setting_gives_identical_weights(tmp_path: Path) -> None:
    strategy: dict[str, Any] = {"num_microbatches": 2, "partition": [3, 3], "num_pipelines": 2, "schedule": "afab"}
    for name in ("a", "b"):
        run_lightning(tmp_path / name, 2, strategy, steps=3, model={"optimizer": "adam", "lr": 0.01})
    a, b = final_state(tmp_path / "a"), final_state(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_grouped_batches_take_n_consecutive_batches_and_seed_the_loaders_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lightning.fabric.utilities.data import _auto_add_worker_init_fn
    from torch.utils.data import DataLoader

    from lightning_avgpipe.plugin.steps.data import GroupedBatches

    loader = DataLoader(list(range(10)), batch_size=2)  # 5 batches
    grouped = GroupedBatches(loader, 2)
    assert len(grouped) == 2  # the incomplete last group (batch 5) is dropped
    assert [[b.tolist() for b in group] for group in grouped] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert grouped.batch_size == 2 and grouped.dataset is loader.dataset  # the loader's attributes show through
    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # what seed_everything(workers=True) sets
    _auto_add_worker_init_fn(grouped, rank=1)
    assert loader.worker_init_fn is not None and loader.worker_init_fn.keywords == {"rank": 1}
    assert "worker_init_fn" not in vars(grouped)  # on the DataLoader, whose workers call it


def test_exact_averaging_equals_plain_training_at_batch_n_b(tmp_path: Path) -> None:
    """averaging="exact", N = 2 on 2 stages: the 2 batches of B = 12 train as one batch of 24 (pipe-NB)."""
    strategy = {"num_microbatches": 2, "partition": [2, 4], "num_pipelines": 2, "averaging": "exact"}
    results = run_lightning(tmp_path, 2, strategy, steps=4, model={"optimizer": "adam", "lr": 0.01})
    ref_losses, ref_state = reference(4, 4, lr=0.01, optimizer="adam", batch_size=24)
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
    saved = torch.load(tmp_path / "final.ckpt", weights_only=True)["optimizer_states"][0]
    assert "avgpipe_ranks" not in saved or all(not e.get("replicas") for e in saved["avgpipe_ranks"])


def _exact_groups_worker(rank: int, world: int, steps: int) -> dict[str, torch.Tensor]:
    """Rank d is group d of D = 2 one-stage pipelines, N = 2 batches each, averaging="exact"."""
    import torch.nn.functional as F

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from tests.helpers.models import make_batch, make_layers

    cfg = PipelineConfig(num_stages=1, num_microbatches=2, num_pipelines=2, averaging="exact")
    pipe = StagePipeline(make_layers(), Topology.build(rank, world, 1), cfg)
    opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1, momentum=0.9))
    for step in range(steps):
        batches = [make_batch(4 * step + 2 * rank + n) for n in range(2)]  # group d's two batches of this step
        opt.zero_grad()
        pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
        opt.step()
    return {f"{i}.{k}": v.clone() for i, layer in enumerate(pipe.layers) for k, v in layer.state_dict().items()}


def test_exact_averaging_over_two_groups_equals_one_batch_of_all_four(tmp_path: Path) -> None:
    """D = 2 groups x N = 2 batches, gradients averaged over the groups: plain training on the 4 batches at once."""
    import torch.nn.functional as F
    from torch import nn

    from tests.helpers.distributed import run_distributed
    from tests.helpers.models import make_batch, make_layers

    steps = 3
    got = run_distributed(_exact_groups_worker, 2, steps, timeout=120)
    layers = make_layers()
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        parts = [make_batch(4 * step + i) for i in range(4)]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    want = {f"{i}.{k}": v for i, layer in enumerate(layers) for k, v in layer.state_dict().items()}
    for rank_state in got:  # both groups hold the same weights: one model
        for key, value in want.items():
            torch.testing.assert_close(rank_state[key], value, msg=lambda m, key=key: f"{key}: {m}")


def test_outer_optimizer_and_period_match_single_process(tmp_path: Path) -> None:
    """DiLoCo's outer Nesterov and H = 2 together on 2 ranks (tests/test_elastic.py checks each alone by hand)."""
    options = {"outer_lr": 0.7, "outer_momentum": 0.9, "averaging_period": 2}
    elastic = {"outer_lr": 0.7, "outer_momentum": 0.9, "period": 2}
    strategy: dict[str, Any] = {"num_microbatches": 2, "partition": [2, 4], "num_pipelines": 2, **options}
    results = run_lightning(tmp_path, 2, strategy, steps=4, model={"optimizer": "adam", "lr": 0.01})
    ref_losses, ref_state, ref_replicas = reference_elastic(4, 2, 2, lr=0.01, optimizer="adam", **elastic)
    torch.testing.assert_close(torch.tensor(results[0]["losses"]), torch.tensor(ref_losses))
    state = final_state(tmp_path)
    for key, value in ref_state.items():
        torch.testing.assert_close(state[key], value, msg=lambda m, key=key: f"{key}: {m}")
    offsets = {0: 0, 1: 2}  # first layer index of each stage for partition [2, 4]
    for rank, replicas in replicas_from_checkpoint(tmp_path / "final.ckpt").items():
        for n, layers in enumerate(replicas):
            for i, layer_state in enumerate(layers):
                for name, value in layer_state.items():
                    torch.testing.assert_close(value, ref_replicas[n][f"layers.{offsets[rank] + i}.{name}"])


def test_resume_mid_period_with_outer_momentum_is_exact(tmp_path: Path) -> None:
    """H = 3 and Nesterov momentum: a checkpoint one step into a period resumes bit-identically (the period's
    position, its offsets and the outer momentum are in the checkpoint). The checkpoint is at an epoch's end (two
    iterations per epoch): Lightning restarts an unfinished epoch's DataLoader from its start, with or without
    this strategy."""
    model = {"optimizer": "adam", "lr": 0.01}
    strategy: dict[str, Any] = {
        "num_microbatches": 2,
        "partition": [3, 3],
        "num_pipelines": 2,
        "outer_lr": 0.7,
        "outer_momentum": 0.9,
        "averaging_period": 3,
    }
    straight = tmp_path / "straight"
    full = run_lightning(straight, 2, strategy, steps=6, model=model, every_n_train_steps=4)
    (midway,) = (straight / "every").glob("*-step=4.ckpt")  # the end of epoch 1, one step into the second period
    saved = torch.load(midway, weights_only=True)["optimizer_states"][0]["avgpipe_ranks"]
    assert all(e["elastic"]["local_steps"] == 1 and e["elastic"]["momentum"] is not None for e in saved)
    resumed = tmp_path / "resumed"
    rest = run_lightning(resumed, 2, strategy, steps=6, model=model, ckpt_path=str(midway))
    assert rest[0]["losses"] == full[0]["losses"][4:]
    a, b = final_state(straight), final_state(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


class _AdamByTensor(torch.optim.Adam):
    """An Adam subclass: not known to step elementwise (it might read whole tensors), so sharded by whole tensors."""


def _optimizer(kind: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    if kind == "adam-groups":  # two groups, their own lr and weight decay: a flat slice per group
        return torch.optim.AdamW(
            [{"params": params[:2], "lr": 0.02}, {"params": params[2:], "weight_decay": 0.1}], lr=0.01
        )
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    return (_AdamByTensor if kind == "adam-subclass" else torch.optim.Adam)(params, lr=0.01)


def _sharded_worker(rank: int, world: int, steps: int) -> list[dict[str, Any]]:
    """D = 2 groups of one stage, N = 2, averaging="exact", without and with shard_optimizer_state: the tests' model
    with Adam; an MLP one of whose weights (64 x 64) is 82% of it, with AdamW in two groups, SGD (Nesterov) and an
    Adam subclass."""
    import torch.nn.functional as F

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.controller import static_bytes
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from tests.helpers.models import make_batch, make_layers

    def mlp() -> list[torch.nn.Module]:
        torch.manual_seed(0)
        return [
            torch.nn.Linear(8, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 64),
            torch.nn.ReLU(),
            torch.nn.Linear(64, 4),
        ]

    top = Topology.build(rank, world, 1)
    out = []
    kinds = [(make_layers, "adam"), (mlp, "adam-groups"), (mlp, "sgd"), (mlp, "adam-subclass"), (mlp, "adam-frozen")]
    for layers, kind in kinds:
        for shard in (False, True):
            cfg = PipelineConfig(1, 2, num_pipelines=2, averaging="exact", shard_optimizer_state=shard)
            model = layers()
            if kind == "adam-frozen":  # a parameter without gradients: torch.optim skips it, and so do the slices
                model[0].bias.requires_grad_(False)
            pipe = StagePipeline(model, top, cfg)
            opt = pipe.optimizer(_optimizer(kind, list(pipe.reference_params)))
            for step in range(steps):
                if shard and step == steps - 1:  # the state dict round trip: gathered whole, then cut into slices
                    opt.load_state_dict(opt.state_dict())
                batches = [make_batch(4 * step + 2 * rank + n) for n in range(2)]
                opt.zero_grad()
                pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
                opt.step()
            states = [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
            whole = opt.whole_state() if shard else {}
            out.append(
                {
                    "weights": [p.detach().clone() for p in pipe.reference_params],
                    "state_bytes": sum(v.numel() * v.element_size() for v in states),
                    "static_bytes": static_bytes(pipe, [opt]),
                    "kind": repr(opt) if shard else type(opt).__name__,
                    "share": opt.share() if shard else None,
                    "whole": [{k: v for k, v in whole.get(p, {}).items()} for p in pipe.reference_params],
                    "plain_state": [] if shard else [dict(opt.state.get(p, {})) for p in pipe.reference_params],
                }
            )
    return out


def test_sharded_optimizer_state_trains_the_same_with_half_the_state() -> None:
    """ZeRO-1 over D = 2 groups (exact averaging): the same weights as unsharded, bit for bit, and each rank keeps
    at most 1/D + 5% of the optimizer state, by flat slices across tensors, also where one tensor is 82% of the
    stage; gathered, the slices are the unsharded state. An optimizer not known to be elementwise (a subclass) keeps
    whole tensors, and says so."""
    results = run_distributed(_sharded_worker, 2, 3, timeout=180)
    for runs in results:
        for c in range(0, len(runs), 2):
            plain, sharded = runs[c], runs[c + 1]
            for a, b in zip(plain["weights"], sharded["weights"]):
                assert torch.equal(a, b)
            assert sharded["static_bytes"] < plain["static_bytes"]
            if "flat" not in sharded["kind"]:  # whole tensors: each rank holds its own tensors' state only
                continue
            for a, b in zip(plain["plain_state"], sharded["whole"]):  # the gathered slices: the unsharded state
                if not a:  # a frozen parameter torch.optim never stepped: its slice kept zero moments
                    assert all(not v.any() for k, v in b.items() if k != "step"), b
                    continue
                assert a.keys() == b.keys() and all(
                    torch.equal(torch.as_tensor(a[k]), torch.as_tensor(b[k])) for k in a
                )
    kinds = [r["kind"] for r in results[0][1::2]]
    flat = [f"ShardedOptimizer({k}, flat slice 0 of 2)" for k in ("Adam", "AdamW", "SGD")]
    assert kinds == [*flat, "ShardedOptimizer(_AdamByTensor, part 0 of 2)", flat[0]]
    for c in range(1, 8, 2):
        whole = results[0][c - 1]["state_bytes"]
        halves = [r[c]["state_bytes"] for r in results]
        mine, total, how = results[0][c]["share"]
        if "flat" in results[0][c]["kind"]:
            assert sum(halves) == whole and all(h <= (1 / 2 + 0.05) * whole for h in halves), (c, whole, halves)
            assert how.startswith("flat slices") and mine <= total / 2 + 1
        else:  # whole tensors: the 64 x 64 weight's owner keeps most of it
            assert sum(halves) == whole and max(halves) > 0.8 * whole, (whole, halves)
            assert how.startswith("whole tensors (_AdamByTensor is not one of torch.optim's elementwise")
