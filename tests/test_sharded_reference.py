"""The elastic reference sharded over D pipeline groups (``shard_optimizer_state=True`` with elastic averaging;
``runtime/sharding/sharded_reference.py``): the same training as the whole reference, 1/D of the reference, the summed
update and the outer momentum held during the step, and the module whole between steps."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.distributed import run_distributed

pytestmark = pytest.mark.slow

OUTER = {"outer_lr": 0.7, "outer_momentum": 0.9, "averaging_period": 2}


def _count(tensors: Any) -> int:
    """Bytes the storages of ``tensors`` hold, each storage once."""
    from lightning_avgpipe.shards import local

    seen, total = set(), 0
    for t in map(local, tensors):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in seen:
            seen.add(ptr)
            total += t.untyped_storage().nbytes()
    return total


def _train(rank: int, top: Any, shard: bool, steps: int, options: dict[str, Any]) -> dict[str, Any]:
    """Group ``rank``'s stage, N = 2 elastic replicas, Adam, ``steps`` steps: what it held and ended with."""
    import torch.nn.functional as F

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.controller import static_bytes
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from tests.helpers.models import make_batch, make_layers

    cfg = PipelineConfig(1, 2, num_pipelines=2, shard_optimizer_state=shard, sync_reference=True, **options)
    pipe = StagePipeline(make_layers(), top, cfg)
    opt = pipe.optimizer(torch.optim.Adam(pipe.reference_params, lr=0.01))
    elastic = pipe.replicas.elastic
    seen: dict[str, Any] = {"divergence": [], "between": []}

    def closure(step: int) -> None:
        batches = [make_batch(4 * step + 2 * rank + n) for n in range(2)]
        opt.zero_grad()
        pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
        # inside the step, after the backward: what the stage holds where the activations peak
        offsets = _count(t for per in (elastic._offsets or []) for t in per)
        seen["reference_bytes"] = _count(elastic.reference_params)
        seen["averaging_bytes"] = _count(elastic.buffers()) - offsets
        seen["static_bytes"] = static_bytes(pipe, [opt])
        seen["finite"] = all(bool(torch.isfinite(p).all()) for p in elastic.reference_params)
        seen["divergence"].append(pipe.replicas.divergence())

    for step in range(steps):
        opt.step(lambda step=step: closure(step))
        seen["between"].append([p.detach().clone() for p in pipe.reference_params])
    return {
        "kind": type(elastic).__name__,
        "reference": [p.detach().clone() for p in pipe.reference_params],
        "replicas": [[p.detach().clone() for p in elastic.replica_params(n)] for n in range(2)],
        "whole_bytes": _count(elastic.reference_params),
        "state": elastic.state_dict(),
        **seen,
    }


def _worker(rank: int, world: int, steps: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """D = 2 groups (one rank each) of one stage: the whole and the sharded reference."""
    from lightning_avgpipe.runtime.comms.topology import Topology

    top = Topology.build(rank, world, 1)
    return [_train(rank, top, shard, steps, options) for shard in (False, True)]


@pytest.mark.parametrize("options", [{}, OUTER], ids=["paper_rule", "outer_nesterov_H2"])
def test_sharded_reference_trains_as_the_whole_one_holding_a_half(options: dict[str, Any]) -> None:
    """Two groups, two replicas each: the sharded reference gives the weights, the replicas, the outer momentum and
    the divergence of the whole one (to float tolerance: it sums the weights where the whole one sums updates), its
    module is whole (and finite) between steps, and during the step each rank holds half of the reference plus the
    summed update and the outer momentum."""
    results = run_distributed(_worker, 2, 4, options, timeout=120)
    for rank, (whole, sharded) in enumerate(results):
        assert (whole["kind"], sharded["kind"]) == ("ElasticAveraging", "ShardedReference")
        pairs = list(zip(whole["reference"], sharded["reference"]))
        pairs += [(a, b) for ra, rb in zip(whole["replicas"], sharded["replicas"]) for a, b in zip(ra, rb)]
        for a, b in pairs:
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        print(f"rank {rank}: max |w_sharded - w_whole| = {max(float((a - b).abs().max()) for a, b in pairs):.2e}")
        torch.testing.assert_close(torch.stack(sharded["divergence"]), torch.stack(whole["divergence"]))
        assert whole["finite"] and not sharded["finite"]  # inside the step: NaN placeholders
        for step in sharded["between"]:  # between steps: the whole reference, as every rank has it
            assert all(bool(torch.isfinite(t).all()) for t in step)
        per_slice = -(-whole["whole_bytes"] // 4 // 2) * 4
        # between steps the parameters are views of the one gathered buffer (two slices)
        assert sharded["whole_bytes"] == 2 * per_slice and whole["whole_bytes"] == whole["reference_bytes"]
        # in the step: the placeholders share one float32 element, against the whole reference
        assert sharded["reference_bytes"] == 4, sharded["reference_bytes"]
        # the summed update (whole: one flat buffer) and the outer momentum, against one slice each
        momentum = 1 if options.get("outer_momentum") else 0
        assert whole["averaging_bytes"] == whole["whole_bytes"] * (1 + momentum)
        assert sharded["averaging_bytes"] == per_slice * (1 + momentum)
        assert sharded["static_bytes"] < whole["static_bytes"]
        if momentum:
            for a, b in zip(whole["state"]["momentum"], sharded["state"]["momentum"]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        held = [r["reference_bytes"] + r["averaging_bytes"] for r in (whole, sharded)]
        print(f"rank {rank}: reference + update + momentum in the step {held[0]} -> {held[1]} bytes; static", end=" ")
        print(f"{whole['static_bytes']:.0f} -> {sharded['static_bytes']:.0f}")
    # the two ranks' references are the same model
    for a, b in zip(results[0][1]["reference"], results[1][1]["reference"]):
        torch.testing.assert_close(a, b)


TP_PLAN = {"layers.3": "colwise", "layers.5": "rowwise"}  # PipeNet's Linear(16, 16) then Linear(16, 4)


@pytest.mark.timeout(400)
def test_through_lightning_the_sharded_reference_equals_the_whole_one_and_resumes_exactly(tmp_path: Path) -> None:
    """D = 2 groups of one stage (2 ranks), N = 2 replicas, DiLoCo's outer Nesterov: shard_optimizer_state=True
    trains as the whole reference does (to float tolerance); a callback sees the whole module after every step; the
    checkpoint holds the whole outer momentum, as the unsharded run's does; a resume from it continues bit for bit,
    and a resume of it without sharding is the same layout and continues as the sharded run does."""
    from tests.helpers.equivalence import final_state, run_lightning

    model = {"optimizer": "adam", "lr": 0.01}
    strategy: dict[str, Any] = {"num_stages": 1, "num_microbatches": 2, "num_pipelines": 2, "outer_lr": 0.7}
    strategy["outer_momentum"] = 0.9
    logs = {"log_every_n_steps": 1}  # the peak memory is logged on the steps that write logs
    whole = run_lightning(
        tmp_path / "whole", 2, {**strategy, "sync_reference": True}, steps=4, model=model, trainer=logs
    )
    sharded_strategy = {**strategy, "shard_optimizer_state": True}
    sharded = run_lightning(
        tmp_path / "sharded", 2, sharded_strategy, steps=4, model=model, every_n_train_steps=2, trainer=logs
    )
    assert "sharded over the 2 groups" in sharded[0]["output"]
    peak = "avgpipe/peak_memory_mb/stage0"  # what a rank holds in the step, logged
    assert sharded[0]["metrics"][peak] < whole[0]["metrics"][peak], (sharded[0]["metrics"], whole[0]["metrics"])
    assert [r["averaging_class"] for r in whole] == ["ElasticAveraging"] * 2
    assert [r["averaging_class"] for r in sharded] == ["ShardedReference"] * 2
    assert all(r["finite_between_steps"] == [True] * 4 for r in sharded)
    torch.testing.assert_close(torch.tensor(sharded[0]["losses"]), torch.tensor(whole[0]["losses"]))
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "sharded")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")

    (midway,) = (tmp_path / "sharded" / "every").glob("*-step=2.ckpt")
    saved = torch.load(midway, weights_only=True)["optimizer_states"][0]
    assert "sharded_reference" not in saved["avgpipe_layout"]  # the format is the unsharded one
    numel = sum(v.numel() for k, v in torch.load(midway, weights_only=True)["state_dict"].items())
    for entry in saved["avgpipe_ranks"]:  # each rank's momentum, gathered whole: as many elements as the model
        assert sum(t.numel() for t in entry["elastic"]["momentum"]) == numel
    rest = run_lightning(
        tmp_path / "resumed", 2, sharded_strategy, steps=4, model=model, ckpt_path=str(midway), trainer=logs
    )
    assert rest[0]["losses"] == sharded[0]["losses"][2:]
    c = final_state(tmp_path / "resumed")
    assert all(torch.equal(b[k], c[k]) for k in b)

    unsharded = run_lightning(
        tmp_path / "unsharded", 2, {**strategy, "sync_reference": True}, steps=4, model=model, ckpt_path=str(midway)
    )
    assert "differs from" not in unsharded[0]["output"]  # replicas, optimizers and momentum carried over
    torch.testing.assert_close(torch.tensor(unsharded[0]["losses"]), torch.tensor(sharded[0]["losses"][2:]))
    d = final_state(tmp_path / "unsharded")
    for key in b:
        torch.testing.assert_close(d[key], b[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


@pytest.mark.timeout(400)
def test_sharded_reference_with_tensor_parallelism_equals_the_whole_one(tmp_path: Path) -> None:
    """D = 2 x T = 2 on one stage (4 ranks), one pipeline per group: each rank shards its tensor-parallel shard's
    reference over the data dimension, and the weights equal the whole reference's."""
    from tests.helpers.equivalence import final_state, run_lightning

    model = {"optimizer": "adam", "lr": 0.01}
    strategy: dict[str, Any] = {"num_stages": 1, "num_microbatches": 2, "tensor_parallel_size": 2}
    strategy["tensor_parallel_plan"] = TP_PLAN
    whole = run_lightning(tmp_path / "whole", 4, {**strategy, "sync_reference": True}, steps=3, model=model)
    sharded = run_lightning(tmp_path / "sharded", 4, {**strategy, "shard_optimizer_state": True}, steps=3, model=model)
    assert [r["averaging_class"] for r in sharded] == ["ShardedReference"] * 4
    assert [r["place"][1:4] for r in sharded] == [[0, 0, 0], [0, 0, 1], [1, 0, 0], [1, 0, 1]]
    assert all(r["finite_between_steps"] == [True] * 3 for r in sharded)
    torch.testing.assert_close(torch.tensor(sharded[0]["losses"]), torch.tensor(whole[0]["losses"]))
    a, b = final_state(tmp_path / "whole"), final_state(tmp_path / "sharded")
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-5, atol=1e-6, msg=lambda m, key=key: f"{key}: {m}")


def test_the_sharded_reference_refuses_an_overlapped_update() -> None:
    from dataclasses import replace

    from lightning_avgpipe.config import PipelineConfig

    with pytest.raises(ValueError, match=r"sync_reference=False with shard_optimizer_state=True.*Leave sync_reference"):
        PipelineConfig(1, 2, num_pipelines=2, shard_optimizer_state=True, sync_reference=False)
    assert PipelineConfig(1, 2, num_pipelines=2, shard_optimizer_state=True).synchronous_reference is True
    assert PipelineConfig(1, 2, num_pipelines=2).synchronous_reference is False
    assert PipelineConfig(1, 2, num_pipelines=2, sync_reference=True).synchronous_reference is True
    # the tuner moves a sharded run from exact to elastic averaging: still valid, and synchronous
    exact = PipelineConfig(1, 2, num_pipelines=2, averaging="exact", shard_optimizer_state=True)
    assert replace(exact, averaging="elastic").synchronous_reference is True


def _edge_worker(rank: int, world: int) -> dict[str, Any]:
    """A stage without parameters steps; a step that fails mid-way leaves the placeholders, and reading is refused."""
    import torch.nn.functional as F
    from torch import nn

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from tests.helpers.models import make_batch, make_layers

    top = Topology.build(rank, world, 1)
    cfg = PipelineConfig(1, 2, num_pipelines=2, shard_optimizer_state=True)
    empty = StagePipeline([nn.ReLU()], top, cfg)
    opt = empty.optimizer(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1))  # nothing of the stage's own

    def loss(out: Any, batch: Any, share: Any) -> Any:
        return out.float().pow(2).mean() * 0 + torch.ones((), requires_grad=True)

    opt.step(lambda: empty.train_step([make_batch(rank + n)[0:1] * 2 for n in range(2)], loss))
    out: dict[str, Any] = {"empty_released": empty.replicas.elastic.released}

    pipe = StagePipeline(make_layers(), top, cfg)
    opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1))

    def failing() -> None:
        pipe.train_step([make_batch(n) for n in range(2)], lambda o, b, s: F.cross_entropy(o, b[1]))
        raise KeyboardInterrupt("stopped mid-step")

    try:
        opt.step(failing)
    except KeyboardInterrupt:
        pass
    out["released"] = pipe.replicas.elastic.released
    out["nan"] = all(bool(torch.isnan(p).all()) for p in pipe.reference_params)
    checks = {
        "save": lambda: pipe.replicas.elastic.state_dict(),
        "enter": pipe.replicas.elastic.enter_step,
        "eval": lambda: pipe.eval_step(make_batch(0), lambda o, b, s: o),
    }
    for what, call in checks.items():
        try:
            call()
            out[what] = None
        except RuntimeError as e:
            out[what] = str(e)
    # a checkpoint loaded after the failure: the parameters get storage again, and training goes on
    pipe.replicas.elastic.reclaim()
    out["reclaimed"] = not pipe.replicas.elastic.released and all(
        p.untyped_storage().nbytes() == 4 * p.numel() for p in pipe.reference_params
    )
    with torch.no_grad():
        for mine, saved in zip(pipe.layers, make_layers()):
            mine.load_state_dict(saved.state_dict())
    pipe.replicas.elastic.reset_replicas()
    opt.step(lambda: pipe.train_step([make_batch(n) for n in range(2)], lambda o, b, s: F.cross_entropy(o, b[1])))
    out["after"] = all(bool(torch.isfinite(p).all()) for p in pipe.reference_params)
    return out


class Scale(torch.nn.Module):
    """A learnable 0-dim scalar (a temperature, ReZero's alpha)."""

    def __init__(self) -> None:
        super().__init__()
        self.alpha = torch.nn.Parameter(torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.alpha


def _scalar_worker(rank: int, world: int) -> list[list[torch.Tensor]]:
    """A stage with a 0-dim parameter, whole and sharded: 3 steps each."""
    import torch.nn.functional as F

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from tests.helpers.models import make_batch

    top = Topology.build(rank, world, 1)
    out = []
    for shard in (False, True):
        torch.manual_seed(0)
        layers = [torch.nn.Linear(8, 4), Scale()]
        cfg = PipelineConfig(1, 2, num_pipelines=2, shard_optimizer_state=shard, sync_reference=True)
        pipe = StagePipeline(layers, top, cfg)
        opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1))
        for step in range(3):
            batches = [make_batch(4 * step + 2 * rank + n) for n in range(2)]
            opt.step(lambda b=batches, pipe=pipe: pipe.train_step(b, lambda o, bb, s: F.cross_entropy(o, bb[1])))
        out.append([p.detach().clone() for p in pipe.reference_params])
    return out


def test_a_stage_without_parameters_steps_and_a_failed_step_refuses_to_save() -> None:
    """A failed step leaves NaN placeholders: saving, evaluating and stepping again are refused with the reason;
    a checkpoint load (``reclaim``) gives the parameters storage again and training goes on."""
    for r in run_distributed(_edge_worker, 2, timeout=120):
        assert r["empty_released"] is False
        assert r["released"] and r["nan"]
        assert "the step did not finish (it failed)" in r["save"] and "Resume from the last checkpoint" in r["save"]
        assert r["eval"].startswith("Evaluating the model: the reference is sharded")
        assert "never reached leave_step()" in r["enter"]
        assert r["reclaimed"] and r["after"]


def test_a_scalar_parameter_is_sharded_too() -> None:
    """A 0-dim parameter gets a placeholder like any other and trains as with the whole reference."""
    for whole, sharded in run_distributed(_scalar_worker, 2, timeout=120):
        assert sharded[-1].dim() == 0
        for a, b in zip(whole, sharded):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(400)
def test_the_tuner_keeps_elastic_averaging_with_a_sharded_reference(tmp_path: Path) -> None:
    """shard_optimizer_state leaves the tuner its averaging: asked for elastic, it searches N = 1, 2
    with the sharded reference, applies its choice on both ranks, and trains with whole weights between steps."""
    from tests.helpers.equivalence import run_lightning

    tuner = {"num_pipelines": [1, 2], "output_dir": str(tmp_path / "t"), "calibrate_steps": 2, "averaging": "elastic"}
    strategy = {"num_stages": 1, "num_microbatches": 2, "shard_optimizer_state": True}
    results = run_lightning(tmp_path, 2, strategy, steps=5, tuner=tuner)
    choice = results[0]["tuner"]["choice"]
    assert choice["averaging"] == "elastic"
    for r in results:
        assert r["tuner"]["choice"] == choice and r["averaging_class"] == "ShardedReference"
        assert r["finite_between_steps"] == [True] * 5
    table = json.loads((tmp_path / "t" / "tuning.json").read_text())
    assert table["profile"]["shard_optimizer_state"] is True
    assert {row["num_pipelines"] for row in table["rows"]} == {1, 2}
