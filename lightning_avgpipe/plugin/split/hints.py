"""What the setup says when a model is built or loaded where AvgPipe cannot keep each rank to its own stages.

- :func:`holding_warning`: at the cut, on rank 0, a rank that holds on a real device far more of the model than it
  runs (built in ``__init__`` or ``setup()``, or ``from_pretrained`` under ``torch.device("cpu")``): "far more" is
  over :data:`HELD_RATIO` times what it runs and at least :data:`HELD_MIN_BYTES` more.
- :func:`meta_build_error`: an error of the build on the meta device that reads a value, or ``from_pretrained``
  there, said with what to do instead (``load_pretrained``).
- :func:`note_setup_order`: an ``AttributeError`` in the module's ``setup()`` for an attribute ``configure_model()``
  creates: a note that Lightning calls ``configure_model()`` after ``setup()``.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

import lightning.pytorch as pl
from torch import nn

HELD_RATIO = 1.5
"""A rank holding more than this times the bytes it runs (its stages and what lies outside every layer) is warned."""

HELD_MIN_BYTES = 64 << 20
"""... and at least this many bytes more than it runs (a small model held whole costs nothing worth a word)."""

GUIDE = "docs/guide.md#a-model-larger-than-one-device"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def holding_warning(
    module: nn.Module, layers: Sequence[nn.Module], sizes: Sequence[int], stages: Mapping[int, Sequence[int]]
) -> str | None:
    """What rank 0 says when a rank holds far more of ``module`` than it runs, or ``None``; ``stages[r]``: the model
    stages rank ``r`` runs (``sizes`` layers per model stage), for one rank of each place in the pipeline.

    Computed before this rank makes its own stages real: every rank built the same module (the same script), so
    what is already on a real device is the same on every rank, and rank ``r`` will hold that plus its own stages.
    """
    every = {id(t): t for t in [*module.parameters(), *module.buffers()]}
    nbytes = {key: t.numel() * t.element_size() for key, t in every.items()}
    real = {key for key, t in every.items() if not t.is_meta}
    stage_of = [s for s, size in enumerate(sizes) for _ in range(size)]
    of_layer = [{id(t) for t in [*layer.parameters(), *layer.buffers()]} for layer in layers]
    outside = set(every) - set().union(*of_layer)
    total = sum(nbytes.values())
    held_whole, lines = [], []
    for rank, mine in stages.items():
        runs = outside.union(*(ids for ids, s in zip(of_layer, stage_of) if s in mine))
        held, ran = sum(nbytes[k] for k in real | runs), sum(nbytes[k] for k in runs)
        if held <= HELD_RATIO * ran or held - ran < HELD_MIN_BYTES:
            continue
        if held == total:
            held_whole.append((rank, ran))
        else:
            lines.append(f"rank {rank} holds {_size(held)} of the model's {_size(total)} and runs {_size(ran)} of it")
    if len(held_whole) == 1:
        rank, ran = held_whole[0]
        lines.insert(0, f"rank {rank} holds the whole model ({_size(total)}) and runs {_size(ran)} of it")
    elif held_whole:
        costs = [ran for _, ran in held_whole]
        each = ", ".join(f"rank {r}: {_size(ran)}" for r, ran in held_whole)
        each = each if len(held_whole) <= 4 else f"{_size(min(costs))} to {_size(max(costs))}"
        whole = f"the whole model ({_size(total)})"
        if len(held_whole) == len(stages):
            said = f"every rank holds {whole} and runs only its own stages of it ({each})"
        else:
            ranks = ", ".join(str(r) for r, _ in held_whole)
            said = f"ranks {ranks} each hold {whole} and run only their own stages of it ({each})"
        lines.insert(0, said)
    if not lines:
        return None
    return (
        f"AvgPipe: {'; '.join(lines)}: build the model in configure_model(), and load weights with "
        f"lightning_avgpipe.load_pretrained ({GUIDE}); each rank then holds only what it runs."
    )


# -- the build on the meta device --------------------------------------------------------------------------------


def _frames(tb: TracebackType | None) -> list[Any]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def meta_build_error(err: BaseException) -> RuntimeError | None:
    """The error to raise instead of ``err``, raised by the build on the meta device, when it is one that says why
    and what to do: ``from_pretrained`` there (load weights with ``load_pretrained``), or a value read there
    (``.item()``, ``if`` on a tensor); ``None`` for any other."""
    text = str(err)
    pretrained = next((f for f in _frames(err.__traceback__) if f.f_code.co_name == "from_pretrained"), None)
    if pretrained is not None:  # raised inside a from_pretrained (a message merely naming it is not enough)
        cls = pretrained.f_locals.get("cls")
        name = getattr(cls, "__name__", "Model")
        first = text.strip().splitlines()[0].rstrip(".") if text.strip() else type(err).__name__
        return RuntimeError(
            f"from_pretrained cannot load weights inside configure_model(), which AvgPipe builds on the meta device "
            f"(it said: {first}). Build the model from its config there, {name}(AutoConfig.from_pretrained(path)), "
            "and load its weights with lightning_avgpipe.load_pretrained(model, path): each rank then reads only "
            f"its own stages' tensors ({GUIDE})."
        )
    if isinstance(err, (NotImplementedError, RuntimeError)) and "meta" in text.lower():
        return RuntimeError(
            f"{err}\nAvgPipe builds configure_model() (and trainer.init_module() blocks) on the meta device, "
            "where tensors have shapes but no values: compute values you need in Python there (.item(), "
            "tolist(), if on a tensor) under `with torch.device('cpu'):`, or outside the block. Pretrained "
            f"weights: lightning_avgpipe.load_pretrained(model, path) there ({GUIDE})."
        )
    return None


def build_step(err: BaseException) -> str:
    """What the build that raised ``err`` was, as the console names it: ``configure_model()`` or an
    ``init_module()`` block."""
    inside = any(f.f_code.co_name == "configure_model" for f in _frames(err.__traceback__))
    return "configure_model()" if inside else "a trainer.init_module() block"


# -- setup() before configure_model() ----------------------------------------------------------------------------

_MISSING = re.compile(r"'(\w+)' object has no attribute '(\w+)'")


def note_setup_order(exception: BaseException, module: Any) -> None:
    """Add a note to an ``AttributeError`` raised in ``module.setup()`` for an attribute that ``module``'s own
    ``configure_model()`` creates (``self.name = ...`` there): Lightning calls ``setup()`` first."""
    if not isinstance(exception, AttributeError) or module is None:
        return
    build = getattr(type(module), "configure_model", None)
    if build is None or build is pl.LightningModule.configure_model:  # Lightning's own does nothing
        return
    found = _MISSING.search(str(exception))
    name = exception.name or (found.group(2) if found else None)
    if name is None or (found is not None and found.group(1) != type(module).__name__) or hasattr(module, name):
        return
    if not any(
        f.f_code.co_name == "setup" and f.f_locals.get("self") is module for f in _frames(exception.__traceback__)
    ):
        return
    try:
        source = inspect.getsource(build)
    except (OSError, TypeError):
        source = ""
    if source and not re.search(rf"\bself\.{name}\s*(:[^=]*)?=[^=]", source):
        return
    note = (
        f"lightning_avgpipe: Lightning calls configure_model() after setup(), so `self.{name}`, which "
        "configure_model() builds, does not exist yet in setup(). Load its weights in configure_model(), right "
        f"after building it (lightning_avgpipe.load_pretrained(self.{name}, path); {GUIDE})."
    )
    if hasattr(exception, "add_note"):  # Python 3.11+; before, the message itself
        exception.add_note(note)
    elif exception.args and isinstance(exception.args[0], str):
        exception.args = (f"{exception.args[0]}\n{note}", *exception.args[1:])
