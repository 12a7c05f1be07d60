"""A model's build on the meta device, recorded call by call, so that ``runtime/build/materialize.py`` can replay it.

Every torch call that creates a tensor or gives one values is recorded, in order, with its arguments (meta tensors: no
memory). ``torch.nn.init``'s initializers are recorded as one call each; those that return early on a meta tensor
(``orthogonal_``, ``trunc_normal_``, ``sparse_``, ``eye_``, ``dirac_``) are recorded by a wrapper while the build runs,
and so is ``torch.manual_seed``. The random generators' state at the start and the end of the build is kept with the
calls. Pure PyTorch: no Lightning import.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from lightning_avgpipe.runtime.failures.console import user_site

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
# torch.nn.init's initializers that return early on a meta tensor (no torch-function dispatch of their own)
_META_SKIPPING_INITS = ("orthogonal_", "trunc_normal_", "sparse_", "eye_", "dirac_")


def storage_key(t: Tensor) -> int:
    """``t``'s storage, as a key (views of one storage share it)."""
    return int(t.untyped_storage()._cdata)


def _snapshot(value: Any) -> Any:
    """``value`` with every tensor detached: the view as it is now (a later ``t_()``, ``.data =`` or ``.to(dtype)`` of
    the same tensor must not change what an earlier call saw), holding no autograd graph or module reference."""
    return tree_map(lambda t: t.detach() if isinstance(t, Tensor) else t, value)


# calls that draw from the random generator (by name; ``torch.nn.init``'s initializers included)
_RANDOM = frozenset(
    {
        "uniform_", "normal_", "random_", "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_",
        "rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal", "bernoulli",
        "multinomial", "poisson", "dropout", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
        "xavier_normal_", "trunc_normal_", "orthogonal_", "sparse_",
    }
)  # fmt: skip


@dataclass
class Step:
    """One recorded call: the function, its arguments and its result as they were then."""

    func: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    out: Any
    always: bool = False  # a call on the generator itself (a seeding, a state set): replayed whatever it touches
    site: str | None = None  # the user's line that asked for it (record_step), named if its replay fails
    overwrites: bool = False  # fills its first argument whole without reading it (a pretrained tensor read in)

    @property
    def name(self) -> str:
        return str(getattr(self.func, "__name__", ""))

    def inputs(self) -> list[Tensor]:
        return [t for t in tree_flatten((self.args, self.kwargs))[0] if isinstance(t, Tensor)]

    def outputs(self) -> list[Tensor]:
        return [t for t in tree_flatten(self.out)[0] if isinstance(t, Tensor)]

    def in_place(self) -> bool:
        return self.name.endswith("_") or "out" in self.kwargs

    def draws(self) -> bool:
        return self.name in _RANDOM


class InitRecord(TorchFunctionMode):
    """Records a model's build on the meta device (use inside ``torch.device("meta")``).

    ``rng`` is the random generators' state when the build began (CPU, and the current CUDA device's where CUDA is
    initialized), ``rng_end`` when it ended; ``steps`` the recorded calls, their tensors as they were then.
    """

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = []
        self.rng: dict[str, Tensor] = {}
        self.rng_end: dict[str, Tensor] = {}
        self.dtype = torch.get_default_dtype()
        self._patches: contextlib.ExitStack | None = None

    def __enter__(self) -> InitRecord:
        _ACTIVE.append(self)
        self.rng = rng_state()
        self.dtype = torch.get_default_dtype()  # factories without a dtype take it: the replay sets it again
        self._patches = contextlib.ExitStack()
        for name in _META_SKIPPING_INITS:
            original = getattr(nn.init, name, None)
            if original is not None:
                self._patches.enter_context(_patched(nn.init, name, self._recording(original)))
        for owner in (torch, torch.random):  # the generator set inside the build: replayed at its place
            for name in ("manual_seed", "get_rng_state", "set_rng_state"):
                self._patches.enter_context(_patched(owner, name, self._recording(getattr(owner, name), True)))
        super().__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        super().__exit__(*exc)
        self.rng_end = rng_state()  # the build drew nothing; a seeding inside it moved the generator
        if self._patches is not None:
            self._patches.close()
            self._patches = None

    def _recording(self, original: Callable[..., Any], always: bool = False) -> Callable[..., Any]:
        @functools.wraps(original)
        def record(*args: Any, **kwargs: Any) -> Any:
            before = _snapshot((args, kwargs))
            out = original(*args, **kwargs)
            if always:  # the objects themselves: a state read here is the one set back later (fork_rng)
                self.steps.append(Step(original, args, kwargs, out, always=True))
            elif any(t.is_meta for t in tree_flatten(before)[0] if isinstance(t, Tensor)):
                self.steps.append(Step(original, before[0], before[1], _snapshot(out)))
            return out

        return record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        before = _snapshot((tuple(args), dict(kwargs))) if name not in _QUERIES else None
        out = func(*args, **kwargs)
        if before is not None:
            self.steps.append(Step(func, before[0], before[1], _snapshot(out)))
        return out


_ACTIVE: list[InitRecord] = []  # the builds being recorded, innermost last


def record_step(func: Callable[..., Any], args: tuple[Any, ...], overwrites: bool = False) -> None:
    """Record ``func(*args)``, a call that fills its first argument (a meta tensor of the build) in place, as a step
    of the build being recorded: the replay runs it on the real tensor where a rank keeps it (its name must end in
    ``_``); with ``overwrites``, the call sets every element without reading any, so the replay need not make the
    tensor real before it. Outside a recorded build, a meta tensor has no replay to wait for: refused."""
    if not _ACTIVE:
        raise RuntimeError(
            f"{getattr(func, '__name__', func)}: the model is on the meta device outside AvgPipeStrategy's recorded "
            "build, so nothing would ever fill it. Call it inside configure_model under AvgPipeStrategy, or once the "
            "model has real tensors."
        )
    before = _snapshot(args)
    _ACTIVE[-1].steps.append(Step(func, before, {}, before[0], site=user_site(), overwrites=overwrites))


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def rng_state() -> dict[str, Tensor]:
    """The random generators' state: the CPU's, and the current CUDA device's where CUDA is initialized."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def same_rng(a: dict[str, Tensor], b: dict[str, Tensor]) -> bool:
    """Whether the generators both states know are in the same state (CUDA may be initialized only later)."""
    return all(torch.equal(a[k], b[k]) for k in a.keys() & b.keys())
