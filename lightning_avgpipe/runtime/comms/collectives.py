"""What crosses a pipeline besides the step's activations: the link to the neighbouring stages, and the collectives
over the stages of one pipeline (results from the last stage, rows from every stage, the replicas' divergence).

Each function takes the rank's :class:`~lightning_avgpipe.runtime.comms.topology.Topology` and is a collective over the
pipeline group (every stage of this rank's pipeline calls it); with one stage each is a no-op.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_avgpipe.runtime.comms.p2p import Link
from lightning_avgpipe.runtime.comms.topology import Topology
from lightning_avgpipe.runtime.failures.report import PeerFailureError, first_failure
from lightning_avgpipe.runtime.sharding.tensor_parallel import TensorParallelLink


def stage_link(topology: Topology, device: torch.device, carry: tuple[bool, bool] = (False, False)) -> Link | None:
    """The transfers to the neighbouring stages over the default process group (``None`` with one stage). Under
    tensor parallelism shard 0 of each stage carries them for its tensor group, or each shard its own part to its
    counterpart in a direction that ``carry`` marks (the input's, the output's; sequence parallelism)
    (``runtime/sharding/tensor_parallel.py``)."""
    stage, S, T = topology.stage, topology.num_stages, topology.tensor_parallel_size
    if S == 1:
        return None
    name = f"stage {stage} (rank {topology.rank})"
    leader = topology.rank_of(topology.group_index, stage, 0)
    inner = None
    if topology.rank == leader or any(carry):
        g, t = topology.group_index, topology.tensor_rank
        inner = Link(
            topology.rank_of(g, stage - 1, t) if stage > 0 else None,
            topology.rank_of(g, stage + 1, t) if stage < S - 1 else None,
            device,
            name=name,
            stage=stage,
        )
    if T == 1:
        return inner
    return TensorParallelLink(inner, topology.tensor_group, leader, device, name, stage, carry)


def _lost_results(topology: Topology, src: int, err: RuntimeError) -> PeerFailureError:
    return PeerFailureError(
        f"stage {topology.stage} (rank {topology.rank}): the step's results from rank {src} (stage "
        f"{topology.num_stages - 1}, the last) did not arrive: a rank of this pipeline failed, was killed or is "
        f"stuck. {first_failure()}({str(err).splitlines()[0][:160]})"
    )


def share(topology: Topology, payload: Any, holder: int = -1) -> Any:
    """``payload`` from this pipeline's last stage (its rank ``holder``: the last, or rank 0 under ZB-V), on every
    stage."""
    if topology.num_stages == 1:
        return payload
    box = [payload]
    src = topology.pipeline_ranks[holder]
    try:
        dist.broadcast_object_list(box, src=src, group=topology.pipeline_group)
    except RuntimeError as err:
        raise _lost_results(topology, src, err) from err
    return box[0]


def share_tensor(topology: Topology, tensor: Tensor, holder: int = -1) -> Tensor:
    """``tensor`` of this pipeline's last stage (on its rank ``holder``), in place on every stage."""
    if topology.num_stages > 1:
        src = topology.pipeline_ranks[holder]
        try:
            dist.broadcast(tensor, src=src, group=topology.pipeline_group)
        except RuntimeError as err:
            raise _lost_results(topology, src, err) from err
    return tensor


def gather(topology: Topology, obj: Any) -> list[Any] | None:
    """``obj`` of every stage of this pipeline, on its first stage (``None`` elsewhere)."""
    if topology.num_stages == 1:
        return [obj]
    dst = topology.pipeline_ranks[0]
    out: list[Any] | None = [None] * topology.num_stages if topology.rank == dst else None
    dist.gather_object(obj, out, dst=dst, group=topology.pipeline_group)
    return out


def stage_rows(topology: Topology, row: Tensor) -> Tensor:
    """``(S, len(row))``: every stage's ``row``, in stage order, on every stage (on the CPU)."""
    rows = [row]
    if topology.num_stages > 1:
        rows = [torch.zeros_like(row) for _ in range(topology.num_stages)]
        dist.all_gather(rows, row, group=topology.pipeline_group)
    return torch.stack(rows).cpu()


def pipeline_divergence(topology: Topology, sums: Tensor) -> Tensor:
    """``(N,)`` relative distances ``‖w_n − w_ref‖ / ‖w_ref‖`` from this stage's ``(N, 2)`` squared norms
    (``ElasticAveraging.divergence``), summed over the stage's tensor shards and the pipeline's stages."""
    if topology.tensor_parallel_size > 1:  # the stage's shards (whole tensors weighted 1/T: shards.py)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=topology.tensor_group)
    if topology.num_stages > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=topology.pipeline_group)
    return sums[:, 0].sqrt() / sums[:, 1].sqrt().clamp_min(1e-12)
