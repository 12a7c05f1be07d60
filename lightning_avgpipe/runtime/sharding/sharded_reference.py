"""The elastic-averaging reference sharded over the D pipeline groups: ZeRO-1 for the outer optimization
(docs/parallelism.md#sharded-reference). The optimizer state of one model sharded over the groups is
``runtime/sharding/zero.py``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.algorithms.elastic import ElasticAveraging, sum_sq
from lightning_avgpipe.runtime.sharding.zero import ALL_GATHER, REDUCE_SCATTER
from lightning_avgpipe.shards import locals_, set_local


class ShardedReference(ElasticAveraging):
    """Elastic averaging with the reference sharded over the D groups (ZeRO-1 for the outer optimization;
    docs/parallelism.md#sharded-reference).

    The reference (the stage's layers in the user's module), the summed update and the outer optimizer's momentum
    are the state of the outer optimization, the same on every group. Each of the D ranks that hold a stage keeps a
    1/D slice of them: the stage's local tensors (tensor-parallel shards under T > 1), flattened in parameter order.

    - :meth:`enter_step`, before the forward: at a period's start each replica's offset ``d_n = w_n - w_ref`` is taken
      from the whole reference (and the divergence with it); the rank copies its slice of the reference, then
      releases the reference's storage. Until :meth:`leave_step` (the user's ``training_step``, the backward hooks,
      clipping, the optimizers) the parameters of the user's module are NaN placeholders of the right shape, all
      views of one element.
    - :meth:`finish_step`, after the replicas' optimizers: every replica is pulled, ``w_n <- w_n' - alpha d_n``, and
      ``Σ_n (w_n' - d_n)`` is reduce-scattered over the stage group, in float32 at least; the rank moves its slice by
      the mean update ``u = Σ_{n,d} (w_n' - d_n) / (N·D) - w_ref`` (or the outer optimizer's step on ``u``, its
      momentum sharded).
    - :meth:`leave_step`: the slices are all-gathered into one flat buffer whose views become the reference's
      parameters again, whole for everything that runs between steps (hooks, evaluation, checkpoints).

    The whole reference all-reduces ``Σ_n Δw_n``; this one reduce-scatters ``Σ_n (w_n' - d_n)``, the size of the
    weights (the reference is not there to subtract), so the sum is taken in float32 or wider and the two agree to
    float tolerance, not bit for bit. The reduce-scatter and the all-gather move what one all-reduce moves. With a
    period H > 1 the reference is gathered after every step (its slices do not change inside a period): one
    all-gather per step instead of one all-reduce per H steps. The update is synchronous: the gather needs the
    reduce-scatter's result.
    """

    sharded = True

    def __init__(self, reference: Sequence[nn.Module], num_replicas: int, num_groups: int, **kwargs: Any) -> None:
        super().__init__(reference, num_replicas, num_groups, share_first=False, **kwargs)
        if self.group is None or num_groups < 2:
            raise ValueError(f"ShardedReference needs D >= 2 pipeline groups and their stage group; D={num_groups}.")
        if not self.synchronous:
            raise ValueError(
                "shard_optimizer_state=True with elastic averaging gathers the reference at the end of every step, so "
                "the reference update cannot overlap the next step: leave sync_reference None (or True)."
            )
        ref = locals_(p.detach() for p in self._ref_params)
        dtypes = {t.dtype for t in ref}
        if len(dtypes) > 1:
            raise ValueError(
                f"shard_optimizer_state=True with elastic averaging needs one dtype per stage (one flat slice), got "
                f"{sorted(map(str, dtypes))}; cast the model to one dtype, or turn sharding off."
            )
        for p, t in zip(self._ref_params, ref):
            if not t.is_contiguous():
                raise ValueError(f"ShardedReference needs contiguous parameters; one of shape {tuple(p.shape)} is not.")
        self.dtype = ref[0].dtype if ref else torch.float32
        self.sum_dtype = torch.promote_types(self.dtype, torch.float32)  # Σ (w' - d) is the size of the weights
        self.shapes = [t.shape for t in ref]
        self.numel = sum(t.numel() for t in ref)
        self.index = dist.get_rank(self.group)
        self.slice = -(-self.numel // num_groups)  # each rank's share, the last one padded
        lo, hi = self.index * self.slice, min((self.index + 1) * self.slice, self.numel)
        self.pieces: list[tuple[int, int, int, int]] = []  # (parameter, start in it, start in the slice, length)
        offset = 0
        for i, t in enumerate(ref):
            a, b = max(lo, offset), min(hi, offset + t.numel())
            if a < b:
                self.pieces.append((i, a - offset, a - lo, b - a))
            offset += t.numel()
        self.shard = torch.zeros(self.slice, dtype=self.dtype, device=self.device)
        self.released = False
        self._divergence: list[Tensor] | None = None

    def _buffers(self) -> None:
        """The offsets only: the summed update is a transient of :meth:`finish_step`."""
        if self._offsets is None:
            self._allocate_offsets()

    def _views(self, flat: Tensor) -> list[Tensor]:
        """``flat``'s first elements as tensors shaped like this stage's local parameters, in order."""
        out, offset = [], 0
        for shape in self.shapes:
            n = math.prod(shape)
            out.append(flat[offset : offset + n].view(shape))
            offset += n
        return out

    def enter_step(self) -> None:
        if self.released:
            raise RuntimeError(
                "ShardedReference.enter_step() twice: the previous step never reached leave_step() (it failed)."
            )
        self._buffers()
        assert self._offsets is not None
        ref = locals_(p.detach() for p in self._ref_params)
        with torch.no_grad():
            if self.local_steps == 0:  # a period's start: d_n = w_n - w_ref, and the divergence from them
                self._take_offsets()
                weights = self._norm_weights()
                ref_sq = sum_sq(ref, self.device, weights)
                self._divergence = [
                    torch.stack([sum_sq(list(offsets), self.device, weights), ref_sq]) for offsets in self._offsets
                ]
            else:
                self._divergence = super().divergence()
            for i, start, at, length in self.pieces:
                self.shard[at : at + length].copy_(ref[i].reshape(-1)[start : start + length])
            self.released = True  # before the first placeholder: a failure from here on is one require_whole sees
            placeholder = torch.full((), float("nan"), dtype=self.dtype, device=self.device)  # expands to any shape
            for p, shape in zip(self._ref_params, self.shapes):
                set_local(p, placeholder.expand(shape))

    def begin_step(self) -> None:
        if not self.released:
            raise RuntimeError("ShardedReference.begin_step() without enter_step(); call enter_step() first.")
        self._begun = True

    def finish_step(self) -> None:
        if not self._begun or self._offsets is None:
            raise RuntimeError("ElasticAveraging.finish_step() without begin_step(); call begin_step() first.")
        self._begun = False
        self.local_steps += 1
        if self.local_steps < self.period:
            return
        self.local_steps = 0
        if self.numel == 0:  # a stage without parameters (every rank of its group alike): buffers only
            self._average_buffers()
            return
        flat = torch.zeros(self.slice * self.num_groups, dtype=self.sum_dtype, device=self.device)
        total = self._views(flat)
        with torch.no_grad():
            for n, offsets in enumerate(self._offsets):
                w = locals_(p.detach() for p in self.replica_params(n))
                torch._foreach_add_(total, w)
                torch._foreach_sub_(total, offsets)
                torch._foreach_add_(w, offsets, alpha=-self.alpha)  # the elastic pull
            mean = torch.empty(self.slice, dtype=self.sum_dtype, device=self.device)
            REDUCE_SCATTER(mean, flat, op=dist.ReduceOp.SUM, group=self.group)
            del flat, total
            mean.mul_(1.0 / (self.num_replicas * self.num_groups)).sub_(self.shard)  # u on this slice
            if self.outer_lr == 1.0 and self.outer_momentum == 0.0:
                self.shard.add_(mean)
            else:
                mean = mean.to(self.dtype)
                (step,) = self._outer([mean])
                self.shard.add_(step)
                extra = self._views(self._gather(step.sub_(mean)))  # every replica moves by U - u, whole
                for n in range(self.num_replicas):
                    torch._foreach_add_(locals_(p.detach() for p in self.replica_params(n)), extra)
            self._average_buffers()

    def _gather(self, part: Tensor) -> Tensor:
        """Every rank's slice, concatenated (padded: ``slice x D`` elements)."""
        whole = torch.empty(self.slice * self.num_groups, dtype=part.dtype, device=self.device)
        ALL_GATHER(whole, part.contiguous(), group=self.group)
        return whole

    def leave_step(self) -> None:
        if not self.released:
            return
        with torch.no_grad():  # the parameters become views of one gathered buffer: no second copy of the stage
            for p, t in zip(self._ref_params, self._views(self._gather(self.shard)) if self.numel else []):
                set_local(p, t)
        self.released = False

    def reclaim(self) -> None:
        """Give released parameters storage again, NaN-filled, so a checkpoint can be loaded into them (after a
        step that failed); nothing when the reference is whole."""
        if not self.released:
            return
        with torch.no_grad():
            for p, shape in zip(self._ref_params, self.shapes):
                set_local(p, torch.full(shape, float("nan"), dtype=self.dtype, device=self.device))
        self._offsets, self._divergence, self.local_steps, self._begun = None, None, 0, False
        self.released = False

    def wait(self) -> None:
        """The update is applied inside :meth:`finish_step`: nothing is ever in flight."""

    def divergence(self) -> list[Tensor]:
        if self.released:  # inside the step: taken at enter_step, from the whole reference
            assert self._divergence is not None
            return self._divergence
        return super().divergence()

    def require_whole(self, what: str) -> None:
        """Refuse to read the reference while it is released (a step that failed between enter and leave)."""
        if self.released:
            raise RuntimeError(
                f"{what}: the reference is sharded over the D groups inside a training step, and the step did not "
                "finish (it failed), so the module holds placeholders. Resume from the last checkpoint."
            )

    def reset_replicas(self) -> None:
        self.require_whole("Copying the reference into the replicas")
        super().reset_replicas()

    def buffers(self) -> list[Tensor]:
        return [t for per in (self._offsets or []) for t in per] + [self.shard] + list(self._momentum or [])

    def state_dict(self) -> dict[str, Any]:
        """As the unsharded state (the same format: a resume may turn sharding on or off), the outer momentum
        gathered whole (collective over the stage group)."""
        self.require_whole("Saving the averaging's state")
        state = super().state_dict()
        if self._momentum is not None:  # this rank's slice -> the whole momentum, shaped as the parameters
            state["momentum"] = [t.clone() for t in self._views(self._gather(self._momentum[0]))]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        momentum = state.get("momentum")
        super().load_state_dict({**state, "momentum": None})
        if momentum is not None:
            flat = torch.cat([t.reshape(-1) for t in momentum]).to(self.device, self.dtype)
            mine = torch.zeros(self.slice, dtype=self.dtype, device=self.device)
            lo = self.index * self.slice
            part = flat[lo : lo + self.slice]
            mine[: part.numel()].copy_(part)
            self._momentum = [mine]
