"""A model built without memory, then only a rank's own part of it made real, with the values one process gives it.

A model built on the meta device has shapes and no values. Giving a rank's own layers their values by calling each
layer's ``reset_parameters()`` again would draw from the random generator in another order than building the whole
model did (a rank holding stage 1 skips stage 0's draws), and would miss a custom init (``apply(_init_weights)``,
``weight.data.normal_()``). So the build is recorded instead, and replayed:

- **Record** (:class:`InitRecord`, a ``TorchFunctionMode`` around the build): every torch call that creates a tensor or
  gives one values, in order, with its arguments (meta tensors: no memory). ``torch.nn.init``'s initializers are
  recorded as one call each; those that return early on a meta tensor (``orthogonal_``, ``trunc_normal_``,
  ``sparse_``, ``eye_``, ``dirac_``) are recorded by a wrapper while the build runs, and so is ``torch.manual_seed``.
- **Replay** (:func:`materialize`): from the random generator's state at the start of the build, every recorded call
  runs again on real tensors of ``device``, in order. The tensors to keep (this rank's own parameters and buffers)
  are kept; every other tensor is created when the replay first needs it and freed after its last use, so the
  generator advances exactly as the whole build advanced it and the kept values are bit for bit one process's, for
  every layout. Peak memory: the kept tensors plus the largest set of other tensors alive at once (for
  ``torch.nn`` layers, one tensor).

Where the generator was used between the build and the replay, the kept values are still one process's, but the draws
after the replay are not (said in the report). Pure PyTorch: no Lightning import.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

# calls that read a tensor's metadata, or switch autograd: nothing to replay
_QUERIES = frozenset(
    {
        "__get__",
        "__len__",
        "_is_view",
        "_set_grad_enabled",
        "dim",
        "element_size",
        "get_device",
        "is_complex",
        "is_floating_point",
        "ndimension",
        "numel",
        "size",
        "stride",
        "requires_grad_",
    }
)
# factories that give no values
_EMPTY = frozenset({"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"})
# torch.nn.init's initializers that return early on a meta tensor (no torch-function dispatch of their own)
_META_SKIPPING_INITS = ("orthogonal_", "trunc_normal_", "sparse_", "eye_", "dirac_")


def _storage(t: Tensor) -> int:
    return int(t.untyped_storage()._cdata)


@dataclass
class _Step:
    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any


class InitRecord(TorchFunctionMode):
    """Records a model's build on the meta device (use inside ``torch.device("meta")``).

    ``rng`` is the random generators' state when the build began (CPU, and the current CUDA device's where CUDA is
    initialized), ``rng_end`` when it ended; ``steps`` the recorded calls.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[_Step] = []
        self.rng: dict[str, Tensor] = {}
        self.rng_end: dict[str, Tensor] = {}
        self.dtype = torch.get_default_dtype()
        self._patches: contextlib.ExitStack | None = None

    def __enter__(self) -> InitRecord:
        self.rng = _rng_state()
        self.dtype = torch.get_default_dtype()  # factories without a dtype take it: the replay sets it again
        self._patches = contextlib.ExitStack()
        for name in _META_SKIPPING_INITS:
            original = getattr(nn.init, name, None)
            if original is not None:
                self._patches.enter_context(_patched(nn.init, name, self._recording(original)))
        for owner in (torch, torch.random):  # a build that seeds itself: replayed at its place in the order
            self._patches.enter_context(_patched(owner, "manual_seed", self._recording(owner.manual_seed, True)))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        self.rng_end = _rng_state()  # the build drew nothing; a seeding inside it moved the generator
        if self._patches is not None:
            self._patches.close()
            self._patches = None

    def _recording(self, original: Callable[..., Any], always: bool = False) -> Callable[..., Any]:
        @functools.wraps(original)
        def record(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            out = original(*args, **kwargs)
            if always or any(t.is_meta for t in tensors):
                self.steps.append(_Step(original, args, kwargs, None if always else out))
            return out

        return record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if getattr(func, "__name__", "") not in _QUERIES:
            self.steps.append(_Step(func, tuple(args), dict(kwargs), out))
        return out


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _rng_state() -> dict[str, Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _same_rng(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


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


def materialize(
    module: nn.Module, keep: Callable[[Tensor], bool], record: InitRecord, device: torch.device
) -> Materialized:
    """Give ``module``'s meta parameters and buffers for which ``keep(tensor)`` holds their real values on ``device``,
    by replaying ``record``; the others stay on the meta device. Ties (one parameter under several names) stay one
    tensor. The random generator ends where the whole build left it (unless it was used since the build)."""
    named = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
    replay = _Replay(record, {_storage(t) for _, t in named if t.is_meta and keep(t)}, device)
    now, dtype = _rng_state(), torch.get_default_dtype()
    replay.report.rng_moved = not _same_rng(now, record.rng_end)
    _set_rng_state(record.rng)
    torch.set_default_dtype(record.dtype)
    try:
        for i, step in enumerate(record.steps):
            replay.run(i, step)
    finally:
        torch.set_default_dtype(dtype)
        if replay.report.rng_moved:
            _set_rng_state(now)
    _install(module, named, replay)
    return replay.report


class _Replay:
    """The recorded calls run again on real tensors: ``real`` maps a meta storage to its real one, created when
    first needed; a storage not kept is freed after its last use."""

    def __init__(self, record: InitRecord, kept: set[int], device: torch.device) -> None:
        self.kept, self.device = kept, device
        self.report = Materialized()
        self.real: dict[int, torch.UntypedStorage] = {}
        self.written: set[int] = set()
        self.last_use: dict[int, int] = {}
        for i, step in enumerate(record.steps):
            for t in tree_flatten((step.args, step.kwargs, step.out))[0]:
                if isinstance(t, Tensor) and t.is_meta:
                    self.last_use[_storage(t)] = i

    def new_storage(self, t: Tensor) -> torch.UntypedStorage:
        return torch.empty(t.untyped_storage().nbytes(), dtype=torch.uint8, device=self.device).untyped_storage()

    def as_real(self, t: Any) -> Any:
        """``t`` itself, or for a meta tensor the same view of its real storage."""
        if not (isinstance(t, Tensor) and t.is_meta):
            return t
        s = _storage(t)
        if s not in self.real:
            self.real[s] = self.new_storage(t)
        storage = self.real[s]
        return torch.empty(0, dtype=t.dtype, device=self.device).set_(storage, t.storage_offset(), t.size(), t.stride())

    def run(self, i: int, step: _Step) -> None:
        args, kwargs = tree_map(self.as_real, step.args), tree_map(self.as_real, step.kwargs)
        if isinstance(kwargs.get("device"), (str, torch.device)) and torch.device(kwargs["device"]).type == "meta":
            kwargs["device"] = self.device
        with torch.no_grad(), torch.device(self.device):  # factories without a device: the build's was meta
            out = step.func(*args, **kwargs)
        name = getattr(step.func, "__name__", "")
        for meta_t, real_t in zip(tree_flatten(step.out)[0], tree_flatten(out)[0]):
            if isinstance(meta_t, Tensor) and meta_t.is_meta and isinstance(real_t, Tensor):
                self.real.setdefault(_storage(meta_t), real_t.untyped_storage())
                if name not in _EMPTY:
                    self.written.add(_storage(meta_t))
        if name.endswith("_") or "out" in step.kwargs:  # in place: the first tensor argument got values
            first = next((t for t in tree_flatten((step.args, step.kwargs))[0] if isinstance(t, Tensor)), None)
            if first is not None and first.is_meta:
                self.written.add(_storage(first))
        self.report.steps += 1
        others = sum(st.nbytes() for s, st in self.real.items() if s not in self.kept)
        self.report.peak_other_bytes = max(self.report.peak_other_bytes, others)
        done = [s for s in self.real if s not in self.kept and self.last_use.get(s, -1) <= i]
        freed = sum(self.real[s].nbytes() for s in done)
        for s in done:
            del self.real[s]
        if freed >= 1 << 20:  # glibc keeps a freed block below its (growing) mmap threshold in the process
            _trim_heap()


def _install(module: nn.Module, named: list[tuple[str, Tensor]], replay: _Replay) -> None:
    """Put the replayed values in place of the kept meta tensors (a parameter swapped in place: every module and
    name holding it sees the real one)."""
    done: dict[int, Tensor] = {}
    counted: set[int] = set()
    report = replay.report
    for name, t in named:
        s = _storage(t) if t.is_meta else None
        if s is None or s not in replay.kept or id(t) in done:
            continue
        storage = replay.real.get(s)
        if storage is None:  # never touched by a recorded call: allocated here
            storage = replay.real[s] = replay.new_storage(t)
        if s not in replay.written:
            report.uninitialized.append(name)
        value = torch.empty(0, dtype=t.dtype, device=replay.device)
        value.set_(storage, t.storage_offset(), t.size(), t.stride())
        if s not in counted:
            counted.add(s)
            report.kept_bytes += storage.nbytes()
        if isinstance(t, nn.Parameter):
            torch.utils.swap_tensors(t, nn.Parameter(value, requires_grad=t.requires_grad))
            done[id(t)] = t
        else:
            done[id(t)] = value
    for mod in module.modules():  # buffers are plain tensors: each module's entry replaced (persistence kept)
        for key, buf in list(mod.named_buffers(recurse=False)):
            if id(buf) in done:
                setattr(mod, key, done[id(buf)])


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
