"""Optimizer state sharded over the D pipeline groups (ZeRO stage 1; docs/parallelism.md#sharded-stages).

With ``averaging="exact"`` the D groups train one model: after the gradient average every group holds the same
gradients, and every group would run the same optimizer step on the same weights, each keeping the whole optimizer
state (Adam: two tensors the size of the weights). Sharded, each of the D ranks that hold a stage (its stage group)
keeps the optimizer state of a part of the stage and steps only it. For torch.optim's elementwise optimizers the
part is a 1/D flat slice of each parameter group (across tensors), and an all-gather shares the updated slices;
for any other, whole tensors balanced by size, each broadcast by its owner. The weights after a step are those of
the unsharded run; the optimizer state per rank is 1/D of it (a few elements of padding), or about 1/D by tensors.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_avgpipe.algorithms.optim import WrappedOptimizer
from lightning_avgpipe.shards import is_dtensor, like, local

# torch >= 2.13 names them *_single and deprecates the older names
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
IN_PLACE_ALL_GATHER = {"nccl"}  # backends whose all-gather into a tensor from a slice of it stages nothing


def assign(params: Sequence[nn.Parameter], parts: int) -> list[int]:
    """Owner (0..parts-1) of each parameter: the largest first, each to the least loaded part (by elements). Sizes
    are the whole tensors' (``DTensor.numel()`` is global), so every shard of a tensor group picks the same owners."""
    load = [0] * parts
    owner = [0] * len(params)
    for i in sorted(range(len(params)), key=lambda i: -params[i].numel()):
        d = min(range(parts), key=lambda d: (load[d], d))
        owner[i] = d
        load[d] += params[i].numel()
    return owner


def elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` updates every element from that element alone (torch.optim's SGD and the Adam family,
    exactly those classes: a subclass may read whole tensors), so a flat slice across tensors steps as they would."""
    from torch import optim

    kinds = (optim.SGD, optim.Adam, optim.AdamW, optim.Adamax, optim.NAdam, optim.RAdam, optim.RMSprop, optim.Adagrad)
    return type(optimizer) in kinds


class _Bucket:
    """The parameters of one group of the user's optimizer (one dtype) as one flat tensor, cut in D equal slices;
    ``param`` is this rank's slice, the parameter its optimizer steps.

    Plain tensors are made views of one flat buffer (``flat``, padded to D whole slices), so ``param`` is a view of
    this rank's slice and the step writes the weights in place: no copy of the slice, and the slices are shared in
    place (:meth:`share`). Tensor-parallel shards stay as they are: ``param`` is then a copy, and the slices are
    gathered into a whole buffer and copied back."""

    def __init__(self, source: int, params: list[nn.Parameter], parts: int, index: int) -> None:
        self.source, self.params = source, params
        self.numel = sum(local(p).numel() for p in params)
        self.slice = -(-self.numel // parts)  # each rank's share, the last one short (padded in the gather)
        lo, hi = index * self.slice, min((index + 1) * self.slice, self.numel)
        self.length = max(0, hi - lo)
        self.pieces: list[tuple[int, int, int, int]] = []  # (parameter, start in it, start in the slice, length)
        offset = 0
        for i, p in enumerate(params):
            n = local(p).numel()
            a, b = max(lo, offset), min(hi, offset + n)
            if a < b:
                self.pieces.append((i, a - offset, a - lo, b - a))
            offset += n
        first = local(params[0])
        self.flat: Tensor | None = None
        if not any(is_dtensor(p) for p in params) and len({p.device for p in params}) == 1:
            self.flat = torch.empty(self.slice * parts, dtype=first.dtype, device=first.device)
            self.bind()
            self.param = nn.Parameter(self.flat[lo : lo + self.length])
        else:
            self.param = nn.Parameter(torch.zeros(self.length, dtype=first.dtype, device=first.device))

    def _views(self) -> list[Tensor]:
        assert self.flat is not None
        out, offset = [], 0
        for p in self.params:
            out.append(self.flat[offset : offset + p.numel()].view(p.shape))
            offset += p.numel()
        return out

    @torch.no_grad()
    def bind(self) -> None:
        """Make the parameters views of ``flat`` again, their values copied in (once at the start, and where
        something gave a parameter new storage since: a ``.data`` assignment), one at a time."""
        for p, view in zip(self.params, self._views()):
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                view.copy_(p.detach())
                p.data = view

    def bound(self) -> bool:
        """Whether every parameter is still its view of ``flat``."""
        return self.flat is not None and all(
            p.data_ptr() == v.data_ptr() and p.shape == v.shape for p, v in zip(self.params, self._views())
        )

    def take(self, of: Callable[[nn.Parameter], Tensor | None], into: Tensor) -> None:
        """Copy this rank's slice of ``of(parameter)`` (a local tensor) into ``into``; zeros where it is None."""
        for i, start, at, length in self.pieces:
            t = of(self.params[i])
            if t is None:
                into[at : at + length].zero_()
            else:
                into[at : at + length].copy_(t.reshape(-1)[start : start + length])

    @torch.no_grad()
    def share(self, group: Any, ranks: Sequence[int]) -> None:
        """Every rank's stepped slice of the weights to the whole group. Views: in place, as one all-gather where
        the backend does it in place (NCCL), else one broadcast per slice (gloo's all-gather would stage the whole
        buffer). Copies: gathered and copied back."""
        if self.flat is None:
            for p, whole in zip(self.params, self.gather(self.param.detach(), group, len(ranks))):
                local(p.detach()).copy_(whole)
            return
        slices = self.flat.chunk(len(ranks))
        if dist.get_backend(group) in IN_PLACE_ALL_GATHER:
            ALL_GATHER(self.flat, slices[ranks.index(dist.get_rank())], group=group)
            return
        for part, src in zip(slices, ranks):
            dist.broadcast(part, src=src, group=group)

    def gather(self, part: Tensor, group: Any, parts: int, dst: int | None = None) -> list[Tensor]:
        """Every rank's slice of a flat tensor like ``part``, put together and cut into the parameters' shapes: on
        every rank, or (``dst``: a global rank) on that one only (``[]`` elsewhere)."""
        padded = torch.zeros(self.slice, dtype=part.dtype, device=part.device)
        padded[: part.numel()].copy_(part)
        whole = torch.empty(self.slice * parts, dtype=part.dtype, device=part.device)
        if dst is None:
            ALL_GATHER(whole, padded, group=group)
        else:
            receiving = dist.get_rank() == dst
            dist.gather(padded, list(whole.chunk(parts)) if receiving else None, dst=dst, group=group)
            if not receiving:
                return []
        out, offset = [], 0
        for p in self.params:
            t = local(p)
            out.append(whole[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()
        return out


def _sliced(value: Any, bucket: _Bucket) -> bool:
    """Whether a state value is a flat tensor over the bucket's slice (Adam's moments), not a scalar (its step)."""
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == bucket.length


class ShardedOptimizer(WrappedOptimizer):
    """The user's optimizer, stepping only this rank's part of the parameters; the parts are then shared.

    An elementwise optimizer (:func:`elementwise`) is balanced by flat slices: each group of its parameters is one
    flat tensor, each rank steps a 1/D slice of it (a copy of its optimizer over that slice, the user's
    hyperparameters copied in before every step, as lr schedulers change them), and an all-gather puts the slices
    back. Any other optimizer (LAMB and Adafactor read whole tensors) keeps whole tensors, each to one owner, the
    largest first to the least loaded, and broadcasts them.

    Args:
        user: the optimizer built over the stage's parameters (its ``param_groups`` and lr schedulers stay its own).
        params: the stage's parameters, in the same order on every rank of ``group``.
        group: the stage group (the D ranks holding this stage).
        ranks: the global ranks of ``group``, group 0 first.
        index: this rank's position in ``ranks``.
    """

    def __init__(
        self, user: Optimizer, params: Sequence[nn.Parameter], group: Any, ranks: Sequence[int], index: int
    ) -> None:
        super().__init__(user)  # the state is the user's optimizer's
        self.params = list(params)
        self.group = group
        self.ranks = list(ranks)
        self.index = index
        self.owner = assign(self.params, len(self.ranks))
        self.whole_because = f"{type(user).__name__} is not one of torch.optim's elementwise optimizers"
        self.buckets = self._buckets() if elementwise(user) else []
        self.flat = bool(self.buckets)
        self.inner: Optimizer | None = None
        self._warned = False
        # ids of the parameters whose gradients nothing reads between this step and the zero_grad that drops them
        # (the caller knows; Lightning's hooks): freed as soon as the step has taken its slice of them
        self.unread_after_step: Collection[int] = ()
        if self.flat:
            groups = [
                {**{k: v for k, v in user.param_groups[b.source].items() if k != "params"}, "params": [b.param]}
                for b in self.buckets
            ]
            accepted = inspect.signature(type(user)).parameters
            self.inner = type(user)(groups, **{k: v for k, v in user.defaults.items() if k in accepted})
            self._scatter_state()  # state the user's optimizer made at construction (Adagrad's sums)

    def _buckets(self) -> list[_Bucket]:
        """Every parameter of the stage in the user's groups (frozen ones too: a gradient decides at each step), a
        bucket per group and dtype; none where a parameter is not contiguous (a slice across tensors copies them)."""
        mine = {id(p) for p in self.params}
        buckets = []
        for g, group in enumerate(self.user.param_groups):
            by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
            for p in group["params"]:
                if id(p) in mine:
                    by_dtype.setdefault(local(p).dtype, []).append(p)
            for ps in by_dtype.values():
                if not all(local(p).is_contiguous() for p in ps):
                    self.whole_because = "a parameter is not contiguous"
                    return []
                buckets.append(_Bucket(g, ps, len(self.ranks), self.index))
        return buckets

    def share(self) -> tuple[int, int, str]:
        """(elements of optimizer state this rank keeps per kind of state, of the stage's, how it is split)."""
        if self.flat:
            how = f"flat slices ({type(self.user).__name__} steps each element alone)"
            return sum(b.length for b in self.buckets), sum(b.numel for b in self.buckets), how
        mine = sum(local(p).numel() for p in self.mine())
        how = f"whole tensors ({self.whole_because})"
        return mine, sum(local(p).numel() for p in self.params), how

    def mine(self) -> list[nn.Parameter]:
        return [p for p, d in zip(self.params, self.owner) if d == self.index]

    @property  # type: ignore[override]
    def state(self) -> Any:  # type: ignore[override]
        """This rank's state: its slices' (flat), else the user's optimizer's (its whole tensors)."""
        return self.inner.state if self.inner is not None else self.user.state

    @state.setter
    def state(self, value: Any) -> None:
        (self.inner or self.user).state = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.user.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        loss = None
        if closure is not None:  # the training step, its backwards and clipping (all gradients present)
            with torch.enable_grad():
                loss = closure()
        if self.inner is not None:
            self._step_slices()
            return loss
        for p, d in zip(self.params, self.owner):
            if d != self.index:
                p.grad = None  # another rank's part: torch.optim skips it and keeps no state for it
        self.user.step()
        self.broadcast()
        return loss

    @torch.no_grad()
    def _step_slices(self) -> None:
        assert self.inner is not None
        kept: list[tuple[_Bucket, int, int]] = []  # slice ranges of parameters without a gradient: torch.optim skips
        for b, group in zip(self.buckets, self.inner.param_groups):
            group.update({k: v for k, v in self.user.param_groups[b.source].items() if k != "params"})
            if b.flat is not None:  # views: only a parameter given new storage since (a load may do it) is copied
                b.bind()
            else:
                b.take(lambda p: local(p.detach()), b.param.data)  # the weights as they are (a checkpoint may load)
            if not any(p.grad is not None for p in b.params):  # no gradient in the group: torch.optim skips it
                b.param.grad = None
                continue
            grad = torch.empty_like(b.param)
            b.take(lambda p: None if p.grad is None else local(p.grad), grad)
            b.param.grad = grad
            kept += [(b, at, length) for i, _, at, length in b.pieces if b.params[i].grad is None]
            for p in b.params:  # taken: a gradient Lightning's zero_grad will drop unread is freed now
                if id(p) in self.unread_after_step:
                    p.grad = None
        if kept and not self._warned:
            self._warned = True
            warnings.warn(
                "AvgPipe: shard_optimizer_state=True: a parameter without a gradient keeps its weights and optimizer "
                "state, as torch.optim skips it, but shares its flat slice's step count (Adam's bias correction).",
                stacklevel=2,
            )
        before = [(b, at, n, b.param.detach()[at : at + n].clone(), self._slice_state(b, at, n)) for b, at, n in kept]
        self.inner.step()
        self.user._opt_called = True  # type: ignore[attr-defined]  # lr schedulers check the user's optimizer stepped
        for b, at, n, weights, state in before:
            b.param.detach()[at : at + n].copy_(weights)
            for k, v in state.items():
                self.inner.state[b.param][k][at : at + n].copy_(v)
        for b in self.buckets:
            b.param.grad = None
            b.share(self.group, self.ranks)

    def _slice_state(self, b: _Bucket, at: int, n: int) -> dict[str, Tensor]:
        """Copies of the elements ``at : at + n`` of the slice's tensor states (none before its first step)."""
        assert self.inner is not None
        state = self.inner.state.get(b.param, {})
        return {k: v[at : at + n].clone() for k, v in state.items() if _sliced(v, b)}

    @torch.no_grad()
    def broadcast(self) -> None:
        """Every owner's updated part to the whole group (one flat broadcast per owner)."""
        for d, src in enumerate(self.ranks):
            part = [local(p.detach()) for p, o in zip(self.params, self.owner) if o == d]
            if not part:
                continue
            flat = torch.cat([t.reshape(-1) for t in part])
            dist.broadcast(flat, src=src, group=self.group)
            if d != self.index:
                offset = 0
                for t in part:
                    t.copy_(flat[offset : offset + t.numel()].view_as(t))
                    offset += t.numel()

    @torch.no_grad()
    def whole_state(self, everywhere: bool = True) -> dict[Tensor, dict[str, Any]]:
        """Every parameter's whole optimizer state, the slices gathered (collective over the stage group; a
        tensor-parallel parameter's as a DTensor of its shards): on every rank, or (``everywhere=False``) on group
        0's only, ``{}`` on the others (a checkpoint needs one copy). Whole tensors: the user's own state."""
        if self.inner is None:
            return dict(self.user.state)
        dst = None if everywhere else self.ranks[0]
        out: dict[Tensor, dict[str, Any]] = {p: {} for b in self.buckets for p in b.params}
        for b in self.buckets:
            for k, v in sorted(self.inner.state.get(b.param, {}).items()):
                if _sliced(v, b):
                    for p, t in zip(b.params, b.gather(v, self.group, len(self.ranks), dst)):
                        out[p][k] = like(t.clone(), p)
                else:  # a scalar (Adam's step), alike on every slice
                    for p in b.params:
                        out[p][k] = v.clone() if isinstance(v, Tensor) else v
        if not everywhere and self.index != 0:
            return {}
        return {p: st for p, st in out.items() if st}

    @torch.no_grad()
    def local_pieces(self) -> dict[Tensor, dict[str, Any]] | None:
        """This rank's part of every parameter's state, without a collective (a sharded checkpoint writes each part
        where it is): for each parameter with a piece in this rank's slices, ``{key: [(start in the parameter's flat
        numbering, flat tensor)]}`` for a sliced state, the value itself for a scalar (Adam's step). ``None`` where
        states are whole (by parameter: :meth:`whole_state` is local) or tensor-parallel."""
        if self.inner is None or any(is_dtensor(p) for b in self.buckets for p in b.params):
            return None
        out: dict[Tensor, dict[str, Any]] = {}
        for b in self.buckets:
            state = self.inner.state.get(b.param, {})
            for i, start, at, length in b.pieces:
                entry = out.setdefault(b.params[i], {})
                for k, v in state.items():
                    if _sliced(v, b):
                        entry.setdefault(k, []).append((start, v[at : at + length]))
                    else:
                        entry[k] = v
        return {p: st for p, st in out.items() if st}

    @torch.no_grad()
    def _scatter_state(self) -> None:
        """Move the user's optimizer's whole state (just loaded, or made at construction) into this rank's slices.
        Parameters without a state (never stepped) get zeros; step counts that differ within a group take the
        largest (one slice has one count), which the log says."""
        assert self.inner is not None
        for b in self.buckets:
            states = [self.user.state.get(p, {}) for p in b.params]
            if not any(states):
                self.inner.state.pop(b.param, None)
                continue
            mine: dict[str, Any] = {}
            for k in dict.fromkeys(k for st in states for k in st):
                values = [st.get(k) for st in states]
                shaped = [v for v in values if isinstance(v, Tensor) and v.dim() > 0]
                if shaped:
                    part = torch.zeros(b.length, dtype=local(shaped[0]).dtype, device=b.param.device)
                    for i, start, at, length in b.pieces:
                        if isinstance(values[i], Tensor) and values[i].dim() > 0:
                            part[at : at + length].copy_(local(values[i]).reshape(-1)[start : start + length])
                    mine[k] = part
                    continue
                present = [v for v in values if v is not None]
                if not present:  # SGD's momentum_buffer without momentum
                    mine[k] = None
                    continue
                scalars = [float(v) for v in present if isinstance(v, (Tensor, int, float))]
                if len(set(scalars)) > 1:
                    warnings.warn(
                        f"AvgPipe: shard_optimizer_state=True: the loaded '{k}' differs between the parameters of one "
                        f"group ({min(scalars):g} to {max(scalars):g}); their flat slice takes the largest.",
                        stacklevel=2,
                    )
                top = max(present, key=lambda v: float(v) if isinstance(v, (Tensor, int, float)) else 0.0)
                mine[k] = top.clone() if isinstance(top, Tensor) else top
            self.inner.state[b.param] = mine
        self.user.state.clear()

    def drop_foreign_state(self) -> None:
        """Forget the state of parameters another rank owns (after loading a whole state dict)."""
        if self.inner is not None:
            self._scatter_state()
            return
        for p, d in zip(self.params, self.owner):
            if d != self.index:
                self.user.state.pop(p, None)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise ValueError(
            "shard_optimizer_state=True does not take parameter groups added during training (a fine-tuning "
            "callback unfreezing layers); build the optimizer over every parameter, or turn sharding off."
        )

    def state_dict(self) -> dict[str, Any]:
        """The user's optimizer's state dict, whole. Flat slices: gathered, a collective over the stage group, so
        every rank of it must call it (not rank 0 alone)."""
        if self.inner is None:
            return self.user.state_dict()
        whole = self.whole_state()
        self.user.state.update(whole)
        try:
            return self.user.state_dict()
        finally:
            self.user.state.clear()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.user.load_state_dict(state_dict)
        self.drop_foreign_state()

    def __repr__(self) -> str:
        how = "flat slice" if self.flat else "part"
        return f"ShardedOptimizer({type(self.user).__name__}, {how} {self.index} of {len(self.ranks)})"
