"""Elastic averaging: N replicas of a stage pulled toward a reference that moves by their mean update.
(Design: docs/how-it-works.md#elastic-averaging-rule.)

Per iteration, for every replica n (on every stage, in parallel)::

    Δw_n   = what the user's optimizer does to w_n this step (its own state, its own lr schedule)
    w_n   <- w_n + Δw_n - alpha · (w_n - w_ref)          alpha defaults to 1/(N·D)
    w_ref <- w_ref + (1 / (N·D)) · Σ_{n, d} Δw_n

If w_ref is the mean of the replicas, the pulls cancel in the mean and w_ref stays the mean. Only one extra
buffer per replica is kept: the pre-step offset ``d_n = w_n - w_ref``. After the optimizer step, ``w_n' = w_n +
Δw_n``, so ``Σ Δw_n = Σ (w_n' - w_ref - d_n)`` and the pull is ``w_n <- w_n' - alpha · d_n``.

With D pipeline groups the sum of updates is all-reduced over the stage group (the D ranks holding this stage).
``synchronous=False`` starts that all-reduce without waiting and finishes it before the next pull, so the
communication overlaps the next iteration's pipeline (the reference is never more than one iteration stale).

Two generalisations (docs/how-it-works.md#outer-optimizer-and-period), both off by default:

- an *outer optimizer* on the reference: the mean update ``u = (1/(N·D)) Σ Δw_n`` is a pseudo-gradient (SlowMo,
  DiLoCo), and ``w_ref <- w_ref + lr_out · u`` becomes SGD with momentum ``μ`` (Nesterov by default):
  ``v <- μ v + u``, ``U = lr_out · (u + μ v)`` (plain momentum: ``lr_out · v``), ``w_ref <- w_ref + U``, and every
  replica moves by ``U - u`` as well, so the reference stays the replicas' mean. The paper's rule is
  ``lr_out = 1, μ = 0`` (``U = u``).
- an *averaging period* H: replicas take H local optimizer steps between pulls and reference updates. ``d_n`` is
  taken at the start of a period and ``Δw_n`` is then the sum of the period's H updates, so the D-group all-reduce
  runs once every H steps. H = 1 is the rule above.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_avgpipe.checks import is_int, is_number
from lightning_avgpipe.shards import local, locals_, norm_weight


def unique_params(layers: Sequence[nn.Module]) -> list[nn.Parameter]:
    """The parameters of ``layers`` in order, each once (a weight two layers share is one parameter)."""
    seen: set[int] = set()
    out = []
    for layer in layers:
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def default_alpha(num_replicas: int, num_groups: int = 1) -> float:
    """One over the number of replicas averaged: 1 / (N·D)."""
    return 1.0 / (num_replicas * num_groups)


def check_outer(lr: float, momentum: float, period: int) -> None:
    """Validate the outer optimizer's learning rate and momentum and the averaging period (names the argument)."""
    if not is_number(lr) or not 0.0 < float(lr) or not math.isfinite(float(lr)):
        raise ValueError(f"outer_lr={lr!r} must be a positive number (1.0 is the paper's rule; DiLoCo uses 0.7).")
    if not is_number(momentum) or not 0.0 <= float(momentum) < 1.0:
        raise ValueError(
            f"outer_momentum={momentum!r} must be a number in [0, 1) (0 is the paper's rule; DiLoCo uses 0.9)."
        )
    if not is_int(period, 1):
        raise ValueError(
            f"averaging_period={period!r} must be an int >= 1: the local steps between pulls (1 is the paper's rule)."
        )


def check_alpha(alpha: float) -> float:
    if not is_number(alpha) or not 0.0 < float(alpha) <= 1.0:
        raise ValueError(
            f"elastic_alpha={alpha!r} must be a number in (0, 1]: the share of the distance to the reference each "
            "replica moves per step. Use None for the default 1/(num_pipelines x groups)."
        )
    return float(alpha)


class ElasticAveraging:
    """Replicas of one stage's layers tied to the reference layers by the rule above.

    Args:
        reference: this stage's layers in the reference model (what evaluation and checkpoints use).
        num_replicas: N, the parallel pipelines.
        num_groups: D, the pipeline groups whose updates are averaged through ``group``.
        alpha: the elastic coefficient; ``None`` for ``1 / (N·D)``.
        group: the stage process group (the D ranks holding this stage); ``None`` when D = 1.
        synchronous: finish the reference update before returning from :meth:`finish_step`.
        share_first: with N·D = 1 the replica *is* the reference (no copy, bit-identical to plain training).
        outer_lr: the outer optimizer's learning rate on the mean update (1.0: the paper's rule).
        outer_momentum: its momentum μ in [0, 1) (0: none).
        nesterov: Nesterov momentum (with ``outer_momentum > 0``).
        period: H, local steps between pulls and reference updates (1: every step).
        tensor_parallel_size: T, when the stage's parameters are shards of a tensor group of T ranks (``shards.py``:
            the divergence's norms then weight whole tensors 1/T).
    """

    def __init__(
        self,
        reference: Sequence[nn.Module],
        num_replicas: int,
        num_groups: int = 1,
        alpha: float | None = None,
        group: Any = None,
        synchronous: bool = True,
        share_first: bool = True,
        device: torch.device | None = None,
        outer_lr: float = 1.0,
        outer_momentum: float = 0.0,
        nesterov: bool = True,
        period: int = 1,
        tensor_parallel_size: int = 1,
    ) -> None:
        if not is_int(num_replicas, 1):
            raise ValueError(f"num_pipelines={num_replicas!r} must be an int >= 1.")
        check_outer(outer_lr, outer_momentum, period)
        self.outer_lr, self.outer_momentum, self.nesterov = float(outer_lr), float(outer_momentum), bool(nesterov)
        self.period = int(period)
        self.local_steps = 0  # optimizer steps taken since the last pull (the period's position)
        self._momentum: list[Tensor] | None = None
        self.reference = list(reference)
        self.num_replicas = num_replicas
        self.num_groups = num_groups
        self.alpha = check_alpha(alpha) if alpha is not None else default_alpha(num_replicas, num_groups)
        self.group = check_group(group, num_groups)
        self.synchronous = synchronous
        self.trivial = share_first and num_replicas * num_groups == 1
        # where tensors that take part in collectives live when this stage has no parameters (NCCL needs CUDA ones)
        self.device = device or next((p.device for m in self.reference for p in m.parameters()), torch.device("cpu"))
        self.replicas: list[list[nn.Module]] = (
            [self.reference]
            if self.trivial
            # the layers copied together, so a weight shared by two of them stays one weight in every replica
            else [list(copy.deepcopy(self.reference)) for _ in range(num_replicas)]
        )
        self._ref_params = unique_params(self.reference)
        self.tensor_parallel_size = tensor_parallel_size
        self._offsets: list[list[Tensor]] | None = None
        self._total: list[Tensor] = []
        self._flat: Tensor | None = None
        self._begun = False
        self._pending: tuple[Any, Tensor] | None = None

    # -- parameters --------------------------------------------------------------------------------------------
    def replica_params(self, n: int) -> list[nn.Parameter]:
        """Replica ``n``'s parameters of this stage, each once, in the order of :attr:`reference_params`."""
        return unique_params(self.replicas[n])

    def all_replica_params(self) -> list[nn.Parameter]:
        return [p for n in range(self.num_replicas) for p in self.replica_params(n)]

    @property
    def reference_params(self) -> list[nn.Parameter]:
        return self._ref_params

    def follow_reference(self) -> None:
        """Give every replica the reference's ``requires_grad`` flags and train/eval modes.

        The replicas are copies made at setup; a fine-tuning callback that freezes or unfreezes layers, or puts
        BatchNorm in eval mode, changes the reference (the user's module) only. Called before every training step.
        """
        if self.trivial:
            return
        ref_params = self._ref_params
        ref_modules = [m for layer in self.reference for m in layer.modules()]
        for n in range(self.num_replicas):
            for p, q in zip(ref_params, self.replica_params(n)):
                if q.requires_grad != p.requires_grad:
                    q.requires_grad_(p.requires_grad)
            for m, r in zip(ref_modules, (m for layer in self.replicas[n] for m in layer.modules())):
                r.training = m.training

    def reset_replicas(self) -> None:
        """Copy the reference into every replica (start of training, or a resume with another layout)."""
        if self.trivial:
            return
        with torch.no_grad():
            for n in range(self.num_replicas):
                for mod, ref in zip(self.replicas[n], self.reference):
                    mod.load_state_dict(ref.state_dict())

    # -- the update --------------------------------------------------------------------------------------------
    def _buffers(self) -> None:
        """Allocate once: one offset buffer per replica, and the summed update as views of one flat tensor."""
        if self._offsets is not None:
            return
        ref = locals_(p.detach() for p in self._ref_params)
        self._allocate_offsets()
        numel = sum(p.numel() for p in ref)
        dtype = ref[0].dtype if ref else torch.float32
        self._flat = torch.empty(numel, dtype=dtype, device=self.device)
        self._total, offset = [], 0
        for p in ref:
            self._total.append(self._flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def _allocate_offsets(self) -> None:
        """One offset buffer per replica, shaped like this rank's part of the reference."""
        ref = locals_(p.detach() for p in self._ref_params)
        self._offsets = [[torch.empty_like(p) for p in ref] for _ in range(self.num_replicas)]

    def _take_offsets(self) -> None:
        """``d_n = w_n - w_ref`` for every replica (a period's start), from the whole reference."""
        assert self._offsets is not None
        ref = locals_(p.detach() for p in self._ref_params)
        if not ref:
            return
        with torch.no_grad():
            for n, offsets in enumerate(self._offsets):
                torch._foreach_copy_(offsets, locals_(p.detach() for p in self.replica_params(n)))
                torch._foreach_sub_(offsets, ref)

    @property
    def paper_rule(self) -> bool:
        """Whether this is the paper's rule: outer SGD with lr 1, no momentum, a pull every step."""
        return self.outer_lr == 1.0 and self.outer_momentum == 0.0 and self.period == 1

    sharded = False  # the reference sharded over the D groups (runtime/sharding/sharded_reference.py)
    released = False  # whether the reference's storage is released (a sharded reference inside a step)

    def require_whole(self, what: str) -> None:
        """Raise when the reference cannot be read (a sharded reference released by a step that failed)."""

    def reclaim(self) -> None:
        """Give a released reference storage again before a checkpoint is loaded into it
        (``runtime/sharding/sharded_reference.py``)."""

    def enter_step(self) -> None:
        """Before the step's forward (a sharded reference, ``runtime/sharding/sharded_reference.py``, is released here);
        nothing here."""

    def leave_step(self) -> None:
        """After :meth:`finish_step` (a sharded reference is gathered whole again); nothing here."""

    def begin_step(self) -> None:
        """Before the optimizers step: at the start of a period, keep each replica's offset ``d_n = w_n - w_ref``."""
        if self.trivial:
            return
        self.wait()
        self._buffers()
        assert self._offsets is not None
        self._begun = True
        if self.local_steps == 0:  # a period's start (inside a period the offsets of its start are kept)
            self._take_offsets()

    def finish_step(self) -> None:
        """After the optimizers stepped: at the end of a period, pull each replica and move the reference.

        ``Σ_n Δw_n = Σ_n w_n' - N·w_ref - Σ_n d_n``, accumulated in place (about 3N + 1 passes over the weights):
        the all-reduce sums updates, not weights, so its rounding is that of the updates. The update is applied at
        :meth:`wait` to the reference as it is then (a change made between steps is kept).
        """
        if self.trivial:
            return
        if not self._begun or self._offsets is None:
            raise RuntimeError("ElasticAveraging.finish_step() without begin_step(); call begin_step() first.")
        self._begun = False
        self.local_steps += 1
        if self.local_steps < self.period:  # a local step: no pull, no reference update, no communication
            return
        self.local_steps = 0
        ref = locals_(p.detach() for p in self._ref_params)
        total = self._total
        with torch.no_grad():
            if ref:
                torch._foreach_copy_(total, ref)
                torch._foreach_mul_(total, -float(self.num_replicas))
            for n, offsets in enumerate(self._offsets):
                w = locals_(p.detach() for p in self.replica_params(n))
                torch._foreach_add_(total, w)
                torch._foreach_sub_(total, offsets)
                torch._foreach_add_(w, offsets, alpha=-self.alpha)  # the elastic pull
        flat = self._flat
        assert flat is not None
        if self.group is not None and self.num_groups > 1:
            work = dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            self._pending = (work, flat)
            if self.synchronous:
                self.wait()
        else:
            self._pending = (None, flat)
            self.wait()

    def wait(self) -> None:
        """Apply a reference update still in flight (before a pull, an evaluation or a checkpoint)."""
        if self._pending is None:
            return
        work, _ = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        with torch.no_grad():
            if self._ref_params:
                scale = 1.0 / (self.num_replicas * self.num_groups)
                ref = locals_(p.detach() for p in self._ref_params)
                if self.outer_lr == 1.0 and self.outer_momentum == 0.0:  # the paper's rule
                    torch._foreach_add_(ref, self._total, alpha=scale)
                else:
                    self._outer_step(ref, list(torch._foreach_mul(self._total, scale)))
            self._average_buffers()

    def _outer_step(self, ref: list[Tensor], mean: list[Tensor]) -> None:
        """The reference steps the mean update ``u`` with the outer optimizer: ``U = lr (u + μ v)`` (Nesterov) or
        ``lr v``. Every replica moves by ``U - u`` too, the part of the step beyond the mean update, so the outer
        optimizer moves the replicas' centre and the reference stays their mean (as SlowMo and DiLoCo restart
        their workers from the new global weights; the elastic pull still governs the spread)."""
        step = self._outer(mean)
        torch._foreach_add_(ref, step)
        extra = list(torch._foreach_sub(step, mean))
        for n in range(self.num_replicas):
            torch._foreach_add_(locals_(p.detach() for p in self.replica_params(n)), extra)

    def _outer(self, mean: list[Tensor]) -> list[Tensor]:
        """The outer optimizer's step ``U`` for the mean update ``u`` (its momentum updated in place)."""
        mu = self.outer_momentum
        if mu > 0.0:
            if self._momentum is None:
                self._momentum = [torch.zeros_like(t) for t in mean]
            torch._foreach_mul_(self._momentum, mu)
            torch._foreach_add_(self._momentum, mean)
            if self.nesterov:  # new tensors: the momentum buffer itself is never scaled
                step = list(torch._foreach_add(mean, self._momentum, alpha=mu))
                torch._foreach_mul_(step, self.outer_lr)
            else:
                step = list(torch._foreach_mul(self._momentum, self.outer_lr))
        else:
            step = list(torch._foreach_mul(mean, self.outer_lr))
        return step

    def _average_buffers(self) -> None:
        """Floating buffers (BatchNorm statistics) of the reference: the mean over all N·D replicas."""
        for i, ref_mod in enumerate(self.reference):
            for name, buf in ref_mod.named_buffers():
                reps = [dict(r[i].named_buffers())[name] for r in self.replicas]
                if not buf.is_floating_point():
                    buf.copy_(reps[0])
                    continue
                mean = torch.stack([b.detach() for b in reps]).mean(0)
                if self.group is not None and self.num_groups > 1:
                    dist.all_reduce(mean, op=dist.ReduceOp.SUM, group=self.group)
                    mean /= self.num_groups
                buf.copy_(mean)

    def buffers(self) -> list[Tensor]:
        """The averaging's own tensors (offsets, the summed update, the outer momentum), for memory accounting."""
        offsets = [t for per_replica in (self._offsets or []) for t in per_replica]
        return offsets + ([self._flat] if self._flat is not None else []) + list(self._momentum or [])

    # -- state a resume needs ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What is not in the weights: the period's position, its offsets (mid-period) and the outer momentum.

        Call after :meth:`wait` (no reference update in flight)."""
        if self._pending is not None:
            raise RuntimeError("ElasticAveraging.state_dict() with a reference update in flight; call wait() first.")
        mid = self.local_steps > 0 and self._offsets is not None
        return {
            "local_steps": self.local_steps,
            "offsets": [[t.detach().clone() for t in per] for per in self._offsets] if mid and self._offsets else None,
            "momentum": [t.detach().clone() for t in self._momentum] if self._momentum is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (same N, D and stage layout)."""
        self.local_steps = int(state.get("local_steps", 0))
        offsets = state.get("offsets")
        if offsets is not None:
            self._buffers()
            assert self._offsets is not None
            with torch.no_grad():
                for mine, saved in zip(self._offsets, offsets):
                    torch._foreach_copy_(mine, [t.to(m.device) for t, m in zip(saved, mine)])
        momentum = state.get("momentum")
        mine = locals_(self._ref_params)
        self._momentum = [t.to(p.device).clone() for t, p in zip(momentum, mine)] if momentum is not None else None

    # -- what the user sees -------------------------------------------------------------------------------------
    def divergence(self) -> list[Tensor]:
        """Per replica, ``‖w_n - w_ref‖² `` and ``‖w_ref‖²`` summed over this stage (add across stages, then sqrt)."""
        weights = self._norm_weights()
        with torch.no_grad():
            ref = [local(p.detach()).float() for p in self._ref_params]
            ref_sq = sum_sq(ref, self.device, weights)
            out = []
            for n in range(self.num_replicas):
                mine = [local(p.detach()).float() for p in self.replica_params(n)]
                diff = torch._foreach_sub(mine, ref) if ref else []
                out.append(torch.stack([sum_sq(diff, self.device, weights), ref_sq]))
        return out

    def _norm_weights(self) -> list[float]:
        return [norm_weight(p, self.tensor_parallel_size) for p in self._ref_params]


def sum_sq(tensors: Sequence[Tensor], device: torch.device, weights: Sequence[float] | None = None) -> Tensor:
    """Σ w‖t‖² over ``tensors`` (float32), one fused norm per tensor list (``weights``: see ``shards.norm_weight``)."""
    if not tensors:
        return torch.zeros((), dtype=torch.float32, device=device)
    squares = torch.stack(torch._foreach_norm(list(tensors))).float().square()
    if weights is not None and any(w != 1.0 for w in weights):
        squares = squares * torch.tensor(list(weights), dtype=squares.dtype, device=squares.device)
    return squares.sum()


def check_group(group: Any, num_groups: int) -> Any:
    """With D > 1 the updates must be averaged over the stage group; without one they would silently stay apart."""
    if num_groups > 1 and group is None:
        raise ValueError(
            f"num_groups={num_groups} pipeline groups need the stage process group (the D ranks holding this stage) to "
            "average over, got group=None; build the topology with Topology.build(rank, world_size, num_stages), "
            "which makes it."
        )
    return group


def average_gradients(
    params: Sequence[nn.Parameter],
    group: Any,
    num_groups: int,
    device: torch.device | None = None,
    bucket_bytes: int = 32 << 20,
) -> None:
    """``averaging="exact"`` with D groups: every group's gradient becomes the mean over the D groups (all-reduces
    over ``group``, the D ranks that hold this stage), as data parallelism does: one flat buffer per bucket of at most
    ``bucket_bytes`` of gradients (a larger gradient alone), not a flat copy of all of them at the step's peak."""
    check_group(group, num_groups)
    if num_groups > 1:
        _reduce_in_buckets(params, group, num_groups, device, bucket_bytes)


def sum_gradients(params: Sequence[nn.Parameter], group: Any, bucket_bytes: int = 32 << 20) -> None:
    """Every rank's gradient becomes the sum over ``group`` (in buckets, as :func:`average_gradients`): weights that
    saw only this rank's share of the tokens (sequence parallelism's norms, runtime/sharding/sequence_parallel.py)."""
    _reduce_in_buckets(params, group, 1, None, bucket_bytes)


def _reduce_in_buckets(
    params: Sequence[nn.Parameter], group: Any, divisor: int, device: torch.device | None, bucket_bytes: int
) -> None:
    grads = [local(p.grad) for p in params if p.grad is not None]  # a tensor-parallel shard: its local part
    bucket: list[Tensor] = []
    size = 0
    for g in grads:
        if bucket and (size + g.numel() * g.element_size() > bucket_bytes or g.dtype != bucket[0].dtype):
            _average_bucket(bucket, group, divisor, device)
            bucket, size = [], 0
        bucket.append(g)
        size += g.numel() * g.element_size()
    if bucket:
        _average_bucket(bucket, group, divisor, device)


def _average_bucket(grads: Sequence[Tensor], group: Any, num_groups: int, device: torch.device | None) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    if device is not None:
        flat = flat.to(device)
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    if num_groups > 1:
        flat /= num_groups
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
