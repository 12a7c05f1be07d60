"""The elastic reference sharded over D pipeline groups (``shard_optimizer_state=True`` with elastic averaging;
``runtime/zero.py`` ShardedReference): the same training as the whole reference, 1/D of the reference, the summed
update and the outer momentum held during the step, and the module whole between steps."""

from __future__ import annotations

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


def _worker(rank: int, world: int, steps: int, options: dict[str, Any]) -> list[dict[str, Any]]:
    """D = 2 groups (one rank each) of one stage, N = 2 elastic replicas, Adam: the whole and the sharded reference."""
    import torch.nn.functional as F

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.runtime.topology import Topology
    from tests.helpers.models import make_batch, make_layers

    top = Topology.build(rank, world, 1)
    out = []
    for shard in (False, True):
        cfg = PipelineConfig(
            1, 2, num_pipelines=2, shard_optimizer_state=shard, sync_reference=True, **options
        )
        pipe = StagePipeline(make_layers(), top, cfg)
        opt = pipe.optimizer(torch.optim.Adam(pipe.reference_params, lr=0.01))
        seen: dict[str, Any] = {"divergence": []}

        def closure(step: int) -> Any:
            batches = [make_batch(4 * step + 2 * rank + n) for n in range(2)]
            opt.zero_grad()
            pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
            elastic = pipe.elastic  # inside the step, after the backward: what the stage holds at its peak
            seen["reference_bytes"] = _count(elastic.reference_params)
            seen["averaging_bytes"] = _count(elastic.buffers()) - _count(t for per in (elastic._offsets or []) for t in per)
            seen["static_bytes"] = pipe.static_bytes([opt])
            seen["finite"] = all(bool(torch.isfinite(p).all()) for p in elastic.reference_params)
            seen["divergence"].append(pipe.divergence())

        for step in range(steps):
            opt.step(lambda step=step: closure(step))
            seen.setdefault("between", []).append([p.detach().clone() for p in pipe.reference_params])
        out.append(
            {
                "kind": type(pipe.elastic).__name__,
                "reference": [p.detach().clone() for p in pipe.reference_params],
                "replicas": [[p.detach().clone() for p in pipe.elastic.replica_params(n)] for n in range(2)],
                "whole_bytes": _count(pipe.elastic.reference_params),
                "state": pipe.elastic.state_dict(),
                **seen,
            }
        )
        pipe.elastic.wait()
    return out


@pytest.mark.parametrize("options", [{}, OUTER], ids=["paper_rule", "outer_nesterov_H2"])
def test_sharded_reference_trains_as_the_whole_one_holding_a_half(options: dict[str, Any]) -> None:
    """Two groups, two replicas each: the sharded reference gives the weights, the replicas, the divergence and the
    outer momentum of the whole one to float tolerance, its module is whole (and finite) between steps, and during
    the step each rank holds half of the reference plus the summed update and the outer momentum."""
    results = run_distributed(_worker, 2, 4, options, timeout=120)
    for rank, (whole, sharded) in enumerate(results):
        assert (whole["kind"], sharded["kind"]) == ("ElasticAveraging", "ShardedReference")
        for a, b in zip(whole["reference"], sharded["reference"]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        for ra, rb in zip(whole["replicas"], sharded["replicas"]):
            for a, b in zip(ra, rb):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.stack(sharded["divergence"]), torch.stack(whole["divergence"]))
        assert whole["finite"] and not sharded["finite"]  # inside the step: NaN placeholders
        for step in sharded["between"]:  # between steps: the whole reference, as every rank has it
            assert all(bool(torch.isfinite(t).all()) for t in step)
        assert sharded["whole_bytes"] == whole["whole_bytes"] == whole["reference_bytes"]
        # in the step: the placeholders share one float32 element, against the whole reference
        assert sharded["reference_bytes"] == 4, sharded["reference_bytes"]
        # the summed update (whole: one flat buffer) and the outer momentum, against one slice each
        per_slice = -(-whole["whole_bytes"] // 4 // 2) * 4
        momentum = 1 if options.get("outer_momentum") else 0
        assert whole["averaging_bytes"] == whole["whole_bytes"] * (1 + momentum)
        assert sharded["averaging_bytes"] == per_slice * (1 + momentum)
        assert sharded["static_bytes"] < whole["static_bytes"]
        if momentum:
            for a, b in zip(whole["state"]["momentum"], sharded["state"]["momentum"]):
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        print(
            f"rank {rank}: reference+update+momentum bytes in the step {whole['reference_bytes'] + whole['averaging_bytes']}"
            f" -> {sharded['reference_bytes'] + sharded['averaging_bytes']}; static {whole['static_bytes']:.0f} -> "
            f"{sharded['static_bytes']:.0f}"
        )
    # the two ranks' references are the same model
    for a, b in zip(results[0][1]["reference"], results[1][1]["reference"]):
        torch.testing.assert_close(a, b)
