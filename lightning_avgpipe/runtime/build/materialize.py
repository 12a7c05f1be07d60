"""A model built without memory, then only a rank's own part of it made real, with the values one process gives it.

A model built on the meta device has shapes and no values. Giving a rank's own layers their values by calling each
layer's ``reset_parameters()`` again would draw from the random generator in another order than building the whole
model did (a rank holding stage 1 skips stage 0's draws), and would miss a custom init (``apply(_init_weights)``,
``weight.data.normal_()``). So the build is recorded instead, and replayed:

- **Record** (:class:`InitRecord`, ``runtime/build/init_record.py``, a ``TorchFunctionMode`` around the build):
  every torch call that creates a tensor or gives one values, in order, with its arguments (meta tensors: no memory).
- **Replay** (:func:`materialize`): from the random generator's state at the start of the build, every recorded call
  runs again on real tensors of ``device``, in order. The tensors to keep (this rank's own parameters and buffers)
  are kept; every other tensor is created when the replay first needs it and freed after its last use, so the
  generator advances exactly as the whole build advanced it and the kept values are bit for bit one process's, for
  every layout. Peak memory: the kept tensors plus the largest set of other tensors alive at once (for
  ``torch.nn`` layers, one tensor).

A tensor to be split (tensor parallelism: ``shards``) is made real whole as its last recorded call leaves it, handed to
its placing function, which keeps its shard, and freed there: a rank never holds more than one such whole tensor.

Where the generator was used between the build and the replay, the kept values are still one process's, but the draws
after the replay are not (said in the report). Pure PyTorch: no Lightning import.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten, tree_map

from lightning_avgpipe.runtime.build.init_record import (
    InitRecord,
    Step,
    rng_state,
    same_rng,
    set_rng_state,
    storage_key,
)
from lightning_avgpipe.runtime.failures.console import mark

# factories that give no values
# draws the CPU makes element by element, which a small buffer can make in chunks (_Replay._chunked_uniform)
_UNIFORM = frozenset({"uniform_", "kaiming_uniform_", "xavier_uniform_"})
_CHUNK = 1 << 16
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})


@dataclass
class Materialized:
    """What :func:`materialize` did: bytes made real and kept, the peak of the others alive at once, the calls
    replayed, the kept tensors no recorded call gave values (left as ``torch.empty`` gave them), and whether the
    random generator was used between the build and the replay."""

    kept_bytes: int = 0
    peak_other_bytes: int = 0
    steps: int = 0
    uninitialized: list[str] = field(default_factory=list)
    rng_moved: bool = False


# a meta tensor of the build to be split, its name, and the function given its whole value that places its shard
# (and returns the tensor it keeps)
Shard = tuple[str, Tensor, Callable[[Tensor], Tensor]]


def materialize(
    module: nn.Module,
    keep: Callable[[Tensor], bool],
    records: InitRecord | Sequence[InitRecord],
    device: torch.device,
    shards: Sequence[Shard] = (),
) -> Materialized:
    """Give ``module``'s meta parameters and buffers that ``records`` created and for which ``keep(tensor)`` holds
    their real values on ``device``, by replaying the records in order; the others stay on the meta device. Ties
    (one parameter under several names) stay one tensor, a parameter keeps its class and attributes, and a module
    attribute that aliases a kept buffer follows it. Each of ``shards`` (tensors of the build no longer in
    ``module``: split on the meta device) is given its whole value once its last recorded call ran, and freed after.

    The generator ends where the whole build left it: a record that began where the previous one ended (nothing
    drew between two builds, an ``init_module()`` block and ``configure_model``) continues from the replay of the
    previous one; one that did not starts from its own recorded state (the draws between are not replayed, and
    ``rng_moved`` says so), as does the state after the replay when the generator was used since the last build."""
    records = [records] if isinstance(records, InitRecord) else list(records)
    report = Materialized()
    if not records:
        return report
    now, dtype = rng_state(), torch.get_default_dtype()
    report.rng_moved = not same_rng(now, records[-1].rng_end)
    try:
        for k, record in enumerate(records):
            if k == 0 or not same_rng(record.rng, records[k - 1].rng_end):
                report.rng_moved |= k > 0
                set_rng_state(record.rng)
            named = [
                (n, t)
                for n, t in [
                    *module.named_parameters(remove_duplicate=False),
                    *module.named_buffers(remove_duplicate=False),
                ]
                if not is_traceable_wrapper_subclass(t)  # already split (a DTensor): its tensor comes through shards
            ]
            created = {storage_key(t) for step in record.steps for t in step.outputs() if t.is_meta}
            kept = {storage_key(t) for _, t in named if t.is_meta and keep(t) and storage_key(t) in created}
            split: dict[int, list[Shard]] = {}
            for shard in shards:
                if shard[1].is_meta and storage_key(shard[1]) in created:
                    split.setdefault(storage_key(shard[1]), []).append(shard)
            replay = _Replay(record, kept, device, report, split)
            torch.set_default_dtype(record.dtype)
            for i, step in enumerate(record.steps):
                try:
                    replay.run(i, step)
                except Exception as err:  # said in short, the user's message first (runtime/failures/console.py)
                    mark(err, "configure_model()'s build, replayed at setup", step.site)
                    raise
            replay.place(len(record.steps))
            _trim_heap()
            _install(module, named, replay)
    finally:
        torch.set_default_dtype(dtype)
        if report.rng_moved:
            set_rng_state(now)
    return report


class _Replay:
    """The recorded calls run again on real tensors: ``real`` maps a meta storage to its real one. Only the calls
    that give values to a kept storage, directly or through what they read, run on real tensors (found backwards
    from the kept storages); a call that only draws from the generator runs on scratch tensors of the same layout,
    so the generator advances as in the build; the rest is skipped. A storage not kept is freed after its last
    use by a call that runs; one to be split (``split``) is placed and freed then."""

    def __init__(
        self,
        record: InitRecord,
        kept: set[int],
        device: torch.device,
        report: Materialized,
        split: dict[int, list[Shard]] | None = None,
    ) -> None:
        self.split = dict(split or {})
        self.kept, self.device = kept | set(self.split), device
        self.report = report
        self.real: dict[int, torch.UntypedStorage] = {}
        self.states: dict[int, Tensor] = {}  # id(a generator state read in the build) -> the replay's reading
        self.written: set[int] = set()
        self.scratch: torch.UntypedStorage | None = None  # the draws' shared scratch storage (as_scratch)
        self.steps = len(record.steps)
        self.needed = _needed(record.steps, self.kept)
        self.last_use: dict[int, int] = {}
        for i, step in enumerate(record.steps):
            if self.needed[i]:
                for t in [*step.inputs(), *step.outputs()]:
                    if t.is_meta:
                        self.last_use[storage_key(t)] = i

    def new_storage(self, t: Tensor) -> torch.UntypedStorage:
        return torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device).untyped_storage()

    def as_real(self, t: Any) -> Any:
        """``t`` itself, a device, or for a meta tensor the same view of its real storage."""
        if _is_meta_device(t):
            return self.device
        if not (isinstance(t, Tensor) and t.is_meta):
            return t
        s = storage_key(t)
        if s not in self.real:
            self.real[s] = self.new_storage(t)
        view = torch.empty(0, dtype=t.dtype, device=self.device)
        return view.set_(self.real[s], t.storage_offset(), t.size(), t.stride())

    def as_scratch(self, t: Any, shared: bool = False) -> Any:
        """A tensor of ``t``'s layout for a call that only draws (its values are not needed): with ``shared``, a view
        of one scratch storage kept for the whole replay (grown to the largest such tensor), so that draws over
        other ranks' layers never hold more than one of them, whatever the allocator keeps of a freed block."""
        if _is_meta_device(t):
            return self.device
        if not (isinstance(t, Tensor) and (t.is_meta or t.device == self.device or t.device.type == "cpu")):
            return t
        if not shared or t.numel() == 0:
            return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=self.device)
        extent = (1 + sum((n - 1) * st for n, st in zip(t.size(), t.stride()))) * t.element_size()
        if self.scratch is None or self.scratch.nbytes() < extent:
            self.scratch = None  # the smaller one freed first
            self.scratch = torch.empty(extent, dtype=torch.uint8, device=self.device).untyped_storage()
        view = torch.empty(0, dtype=t.dtype, device=self.device)
        return view.set_(self.scratch, 0, t.size(), t.stride())

    def _chunked_uniform(self, step: Step) -> bool:
        """A uniform draw on the CPU over a tensor no one keeps, made in chunks of a small buffer: the CPU kernel
        draws element by element in order (a fixed count per element of a dtype), so the generator ends where the
        whole draw leaves it, without a tensor of its size (checked in ``tests/test_materialize.py``)."""
        first = next(iter(step.inputs()), None)
        if self.device.type != "cpu" or step.name not in _UNIFORM or first is None or not first.is_floating_point():
            return False
        generator = step.kwargs.get("generator")
        if generator is None and step.name == "uniform_" and len(step.args) > 3:
            generator = step.args[3]
        if generator is not None and not isinstance(generator, torch.Generator):
            return False
        buffer = torch.empty(min(first.numel(), _CHUNK), dtype=first.dtype)
        self.report.peak_other_bytes = max(self.report.peak_other_bytes, buffer.nbytes)
        left = first.numel()
        with torch.no_grad():
            while left > 0:
                n = min(left, _CHUNK)
                buffer[:n].uniform_(generator=generator)
                left -= n
        return True

    def run(self, i: int, step: Step) -> None:
        if step.always:  # the generator itself: a state read now is the replay's, and is set back as such
            args = tuple(self.states.get(id(a), a) for a in step.args)
            value = step.func(*args, **step.kwargs)
            if step.name == "get_rng_state" and isinstance(step.out, Tensor):
                self.states[id(step.out)] = value
            return
        if not self.needed[i]:
            if step.draws() and self._chunked_uniform(step):
                self.report.steps += 1
                return
            if step.draws():  # only the draws matter: the same layout, scratch values
                first = next(iter(step.inputs()), None)  # what it fills (nn.init passes it by keyword)

                def scratch_of(a: Any) -> Any:
                    return self.as_scratch(a, shared=a is first)

                args, kwargs = tree_map(scratch_of, step.args), tree_map(scratch_of, step.kwargs)
                with torch.no_grad(), torch.device(self.device):
                    step.func(*args, **kwargs)
                self.report.steps += 1
                scratch = self.scratch.nbytes() if self.scratch is not None else 0
                others = sum(st.nbytes() for s, st in self.real.items() if s not in self.kept)
                self.report.peak_other_bytes = max(self.report.peak_other_bytes, others + scratch)
            return
        args, kwargs = tree_map(self.as_real, step.args), tree_map(self.as_real, step.kwargs)
        with torch.no_grad(), torch.device(self.device):  # factories without a device: the build's was meta
            out = step.func(*args, **kwargs)
        for meta_t, real_t in zip(tree_flatten(step.out)[0], tree_flatten(out)[0]):
            if isinstance(meta_t, Tensor) and meta_t.is_meta and isinstance(real_t, Tensor):
                self.real.setdefault(storage_key(meta_t), real_t.untyped_storage())
                if step.name not in _EMPTY:
                    self.written.add(storage_key(meta_t))
        if step.in_place():  # the first tensor argument got values
            first = next(iter(step.inputs()), None)
            if first is not None and first.is_meta:
                self.written.add(storage_key(first))
        del args, kwargs, out
        self.report.steps += 1
        others = sum(st.nbytes() for s, st in self.real.items() if s not in self.kept or s in self.split)
        self.place(i)
        self.report.peak_other_bytes = max(self.report.peak_other_bytes, others)
        self._free([s for s in self.real if s not in self.kept and self.last_use.get(s, -1) <= i])

    def _free(self, storages: list[int]) -> None:
        freed = sum(self.real.pop(s).nbytes() for s in storages if s in self.real)
        if freed >= 1 << 20 and self.device.type == "cpu":  # glibc keeps a freed block below its mmap threshold
            _trim_heap()

    def place(self, i: int) -> None:
        """Hand each tensor to be split whose storage's last call ran (at ``i``; every one left, past the last step)
        its whole value, count what its placing function keeps, and free the whole."""
        ready = [s for s in self.split if i >= self.steps or (s in self.last_use and self.last_use[s] <= i)]
        for s in ready:
            for name, t, place in self.split.pop(s):
                if s not in self.written:
                    self.report.uninitialized.append(name)
                self.report.kept_bytes += place(_real_view(self, t)).untyped_storage().nbytes()
            self.kept.discard(s)
            self._free([s])


def _is_meta_device(value: Any) -> bool:
    """Whether ``value`` names the meta device (a ``torch.device`` or the string), as a call's argument may."""
    return (isinstance(value, torch.device) and value.type == "meta") or (isinstance(value, str) and value == "meta")


def _needed(steps: list[Step], kept: set[int]) -> list[bool]:
    """Which steps must run on real tensors: those that write a storage still needed later (kept, or read by a later
    needed step), and every call on the generator itself; found walking back from the end. A step that fills a whole
    storage without reading it (a pretrained tensor read in) ends its need: what wrote it before need not run."""
    live = set(kept)
    needed = [False] * len(steps)
    for i in range(len(steps) - 1, -1, -1):
        step = steps[i]
        reads = {storage_key(t) for t in step.inputs() if t.is_meta}
        outs = {storage_key(t) for t in step.outputs() if t.is_meta}
        first = next(iter(step.inputs()), None)
        filled = {storage_key(first)} if step.overwrites and first is not None and _fills(first) else set()
        reads -= filled
        writes = outs - reads  # a new tensor; a view or the same tensor writes nothing
        if step.in_place() and first is not None and first.is_meta:
            writes.add(storage_key(first))
        if step.always or writes & live or (outs & live and not writes):
            needed[i] = True
            live = (live - filled) | reads
    return needed


def _fills(t: Tensor) -> bool:
    """Whether ``t``, a meta tensor, covers its whole storage (filling it leaves nothing of what was there)."""
    return t.is_meta and t.is_contiguous() and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _install(module: nn.Module, named: list[tuple[str, Tensor]], replay: _Replay) -> None:
    """Put the replayed values in place of the kept meta tensors: a parameter swapped in place (every module and
    name holding it sees the real one; its class and attributes kept), a buffer and any module attribute aliasing
    a kept storage replaced by the real view."""
    done: dict[int, Tensor] = {}
    counted: set[int] = set()
    report = replay.report
    for name, t in named:
        s = storage_key(t) if t.is_meta else None
        if s is None or s not in replay.kept or id(t) in done:
            continue
        if s not in replay.written:
            report.uninitialized.append(name)
        value = _real_view(replay, t)
        if s not in counted:
            counted.add(s)
            report.kept_bytes += replay.real[s].nbytes()
        if isinstance(t, nn.Parameter):
            done[id(t)] = _swap_parameter(module, t, value)
        else:
            done[id(t)] = value
    for mod in module.modules():  # buffers and plain tensor attributes (an alias of a buffer) follow
        for key, value in list(vars(mod).items()):
            if (
                isinstance(value, Tensor)
                and not is_traceable_wrapper_subclass(value)
                and value.is_meta
                and storage_key(value) in replay.kept
            ):
                setattr(mod, key, done.get(id(value), _real_view(replay, value)))
        for key, buf in list(mod.named_buffers(recurse=False)):
            if id(buf) in done:
                setattr(mod, key, done[id(buf)])


def _real_view(replay: _Replay, t: Tensor) -> Tensor:
    s = storage_key(t)
    if s not in replay.real:  # kept but never touched by a call that ran: allocated here
        replay.real[s] = replay.new_storage(t)
    return torch.empty(0, dtype=t.dtype, device=replay.device).set_(
        replay.real[s], t.storage_offset(), t.size(), t.stride()
    )


def _swap_parameter(module: nn.Module, param: nn.Parameter, value: Tensor) -> nn.Parameter:
    """``param`` made real in place (``swap_tensors``), keeping its class and attributes; where something else holds
    a reference to it (a hook, ``weight_norm``), a new parameter of the same class and attributes is set under every
    name the module gives it instead."""
    cls, attrs = type(param), dict(vars(param))
    fresh = nn.Parameter(value, requires_grad=param.requires_grad)
    try:
        torch.utils.swap_tensors(param, fresh)
        result = param
    except RuntimeError:
        for mod in module.modules():
            for key, p in list(mod.named_parameters(recurse=False, remove_duplicate=False)):
                if p is param:
                    setattr(mod, key, fresh)
        result = fresh
    if type(result) is not cls:
        result.__class__ = cls
    vars(result).update(attrs)
    return result


@functools.cache
def _libc() -> Any:
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _trim_heap() -> None:
    """Give freed heap memory back to the system (glibc's ``malloc_trim``; nothing elsewhere): a replay frees
    another rank's tensor after each use, and glibc would keep it resident, raising this rank's peak."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def is_meta_module(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` is on the meta device (built without memory)."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])
