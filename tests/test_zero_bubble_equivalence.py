"""The split-backward schedules (``zbh1``, ``zbadvance``) train exactly as their unsplit orders do (1F1B, the advance
forward), and so as plain training with gradient accumulation: on 2 and 4 gloo processes, after every step, for
uneven partitions, tuples between stages, activation checkpointing, N = 2 replicas with either averaging, the
advance forward and NCCL's batched transfers. All cases of one world size run in one launch of its ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.distributed import run_distributed
from tests.helpers.executor import reference

STEPS = 3
UNSPLIT = {"zbh1": "1f1b", "zbadvance": "advance"}


def _train(
    rank: int,
    world: int,
    schedule: str,
    partition: list[int],
    m: int,
    n: int = 1,
    averaging: str = "elastic",
    checkpointing: Any = False,
    k: int = 0,
    v: int = 1,
    p2p: str = "eager",
) -> dict[str, Any]:
    """``partition``: layers per stage, ``world x v`` of them with ``v`` stages per rank."""
    from torch import nn

    from lightning_avgpipe.config import PipelineConfig
    from lightning_avgpipe.runtime.comms.topology import Topology
    from lightning_avgpipe.runtime.pipeline import StagePipeline
    from lightning_avgpipe.schedules.chunks import stages_of
    from tests.helpers.models import make_batch, make_layers

    layers = make_layers() + [nn.Identity() for _ in range(max(0, sum(partition) - 6))]
    bounds = [sum(partition[:j]) for j in range(len(partition) + 1)]
    mine = stages_of(rank, world, v, "v" if schedule == "zbv" else "loop") if v > 1 else [rank]
    own = [layer for j in mine for layer in layers[bounds[j] : bounds[j + 1]]]
    index = [i for j in mine for i in range(bounds[j], bounds[j + 1])]
    cfg = PipelineConfig(
        num_stages=world,
        num_microbatches=m,
        schedule=schedule,
        advance_forwards=k,
        num_pipelines=n,
        averaging=averaging,
        activation_checkpointing=checkpointing,
        p2p=p2p,
        stages_per_rank=v if v > 1 else None,
    )
    sizes = [partition[j] for j in mine] if v > 1 else None
    pipe = StagePipeline(own, Topology(rank, world, world), cfg, chunks=sizes)
    opt = pipe.optimizer(torch.optim.SGD(pipe.reference_params, lr=0.1, momentum=0.9)) if pipe.replicas.params else None
    losses, queued, ran = [], [], [0]
    queue = pipe.executor.weight_grads
    if queue is not None:  # count the weight gradients W computes (none if I took them all)
        run = queue.run

        def counting(key: Any) -> None:
            ran[0] += queue.pending(key)
            run(key)

        queue.run = counting  # type: ignore[method-assign]
    for step in range(STEPS):
        if opt is not None:
            opt.zero_grad()
        batches = [make_batch(step * n + r) for r in range(n)]
        result = pipe.train_step(batches, lambda out, batch, share: F.cross_entropy(out, batch[1]))
        queued.append(queue.pending_bytes() if queue is not None else 0)
        if opt is not None:
            opt.step()
        losses.append(float(result.loss) if result.loss is not None else None)
    served = len(pipe.executor.weight_grads.patched) if pipe.executor.weight_grads is not None else 0
    return {
        "losses": losses,
        "states": {i: {key: t.clone() for key, t in layer.state_dict().items()} for i, layer in zip(index, own)},
        "queued_after_step": queued,
        "served": served,
        "deferred": ran[0],
    }


def _cases(rank: int, world: int, cases: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Each case under its split (or chunked) schedule and under its unsplit order (chunked: 1F1B over the same
    layers, cut into one stage per rank), in the same processes."""
    out = []
    for schedule, kwargs in cases:
        plain = dict(kwargs)
        v = plain.pop("v", 1)
        if v > 1:
            p = plain["partition"]
            plain["partition"] = [sum(p[r * v : (r + 1) * v]) for r in range(world)]
        out.append(
            {
                "split": _train(rank, world, schedule, **kwargs),
                "unsplit": _train(rank, world, UNSPLIT[schedule], **plain),
            }
        )
    return out


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "S2-zbh1-even": ("zbh1", {"partition": [3, 3], "m": 4}),
    "S2-zbh1-uneven": ("zbh1", {"partition": [1, 5], "m": 3}),
    "S2-zbh1-one-microbatch": ("zbh1", {"partition": [3, 3], "m": 1}),
    "S2-zbh1-checkpointing": ("zbh1", {"partition": [3, 3], "m": 4, "checkpointing": True}),
    "S2-zbh1-N2-elastic": ("zbh1", {"partition": [3, 3], "m": 2, "n": 2}),
    "S2-zbh1-N2-exact": ("zbh1", {"partition": [3, 3], "m": 2, "n": 2, "averaging": "exact"}),
    "S2-zbadvance-k2": ("zbadvance", {"partition": [3, 3], "m": 4, "k": 2}),
    "S4-zbh1-uneven": ("zbh1", {"partition": [1, 1, 2, 2], "m": 4}),
    "S4-zbh1-checkpointing-N2": ("zbh1", {"partition": [2, 1, 1, 2], "m": 4, "n": 2, "checkpointing": ["Linear"]}),
    "S4-zbadvance-k1": ("zbadvance", {"partition": [2, 1, 1, 2], "m": 6, "k": 1}),
    # several stages per rank: a V (ZB-V) and a loop (interleaved 1F1B) of the 6 layers, padded with identities
    "S2-zbv": ("zbv", {"partition": [1, 2, 1, 2], "m": 4, "v": 2}),
    "S2-zbv-checkpointing-N2": ("zbv", {"partition": [2, 1, 2, 1], "m": 2, "n": 2, "v": 2, "checkpointing": True}),
    "S2-interleaved": ("interleaved", {"partition": [2, 1, 1, 2], "m": 3, "v": 2}),
    "S4-zbv": ("zbv", {"partition": [1] * 8, "m": 4, "v": 2}),
    # NCCL's form (batched transfers, every pair of ranks posting its messages in one order), here over gloo
    "S2-zbv-batched-p2p": ("zbv", {"partition": [1, 2, 1, 2], "m": 4, "v": 2, "p2p": "batched"}),
    "S4-interleaved-batched-p2p": ("interleaved", {"partition": [1] * 8, "m": 6, "v": 2, "p2p": "batched"}),
    "S4-interleaved-exact-N2": ("interleaved", {"partition": [1] * 8, "m": 4, "v": 2, "n": 2, "averaging": "exact"}),
}
UNSPLIT.update({"zbv": "1f1b", "interleaved": "1f1b"})


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[dict[str, Any]]]:
    results: dict[str, list[dict[str, Any]]] = {}
    for world in (2, 4):
        names = [name for name, (_, kw) in CASES.items() if len(kw["partition"]) == world * kw.get("v", 1)]
        runs = run_distributed(_cases, world, [CASES[n] for n in names], timeout=300)
        for i, name in enumerate(names):
            results[name] = [runs[r][i] for r in range(world)]
    return results


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CASES))
def test_split_schedule_trains_as_its_unsplit_order(outcomes: dict[str, list[dict[str, Any]]], name: str) -> None:
    ranks = outcomes[name]

    def losses(run: str) -> list[float]:  # from the rank holding the loss (the last; rank 0 under ZB-V)
        return next(r[run]["losses"] for r in ranks if r[run]["losses"][0] is not None)

    def states(run: str) -> dict[int, Any]:
        return {i: state for r in ranks for i, state in r[run]["states"].items()}

    torch.testing.assert_close(torch.tensor(losses("split")), torch.tensor(losses("unsplit")))
    theirs = states("unsplit")
    for index, state in states("split").items():
        torch.testing.assert_close(state, theirs[index], msg=lambda m, i=index: f"layer {i}: {m}")
    assert all(r["split"]["queued_after_step"] == [0] * STEPS for r in ranks)  # every W ran within its step
    split = CASES[name][0] in ("zbh1", "zbadvance", "zbv")
    assert (sum(r["split"]["served"] for r in ranks) > 0) == split
    # every rank holding a Linear ran its weight gradients in W: one per Linear call, unit and step
    deferred = [r["split"]["deferred"] for r in ranks if r["split"]["served"]]
    assert all(d > 0 for d in deferred), deferred
    assert all(r["unsplit"]["deferred"] == 0 for r in ranks)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", [n for n, (_, kw) in CASES.items() if kw.get("n", 1) == 1])
def test_split_schedule_equals_plain_training(outcomes: dict[str, list[dict[str, Any]]], name: str) -> None:
    """One pipeline: plain single-process training with gradient accumulation over the same micro-batches."""
    m = CASES[name][1]["m"]
    ref_losses, ref_states = reference(m, STEPS)
    ranks = outcomes[name]
    got = next(r["split"]["losses"] for r in ranks if r["split"]["losses"][0] is not None)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses))
    for rank in ranks:
        for index, state in rank["split"]["states"].items():
            if index < len(ref_states):  # the identities that pad a model to more stages hold nothing
                torch.testing.assert_close(state, ref_states[index])
