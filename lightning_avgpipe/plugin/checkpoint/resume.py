"""What a ``fit`` is about to restore, known before Lightning restores it.

Under this strategy Lightning restores a checkpoint after ``setup`` and ``on_fit_start``
(``restore_checkpoint_after_setup``), but two decisions made earlier depend on it: the tuner must not re-choose the
setting of a resumed run, and ``partition="balanced"`` must cut the model as the checkpoint was cut (timing noise
would otherwise give another cut, and the optimizer states would be thrown away as belonging to another layout).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_avgpipe.plugin.checkpoint import sharded
from lightning_avgpipe.plugin.compat import (  # the paths are read from Lightning's private state
    interrupted_lasts,
    requested_checkpoint,
    resuming_from,
)

__all__ = ["checkpoint_layout", "refuse_interrupted_last", "resuming_from"]


def refuse_interrupted_last(trainer: Any, strategy: Any) -> None:
    """Collective, at setup: ``ckpt_path="last"`` that Lightning resolved to nothing on some rank because a kill
    interrupted the replace of ``last.ckpt`` (where no launcher of ours finished it before Lightning looked:
    torchrun, or a later ``fit`` in the same process). Rank 0 puts the complete copy back in place, and every rank
    stops with a message to run again, rather than train from step 0."""
    missing = requested_checkpoint(trainer) == "last" and resuming_from(trainer) is None
    if not strategy.reduce_boolean_decision(missing, all=False):
        return
    found = [str(p) for p in interrupted_lasts(trainer)] if strategy.is_global_zero else []
    done = strategy.broadcast([d for d in (sharded.recover(Path(p)) for p in found) if d])
    if not done:  # no interrupted replace: "last" found nothing, as Lightning warned
        return
    raise RuntimeError(
        f'fit(ckpt_path="last") found no last checkpoint: a kill interrupted a save while it replaced it. '
        f"{'; '.join(done)}. Run again to resume from it."
    )


def checkpoint_layout(path: Any) -> dict[str, Any] | None:
    """The ``avgpipe_layout`` (stages, groups, pipelines, partition) a checkpoint was saved with, or ``None``.

    Reads a local file only (memory-mapped where the format allows) with ``weights_only=True``, so it never runs
    code from the file; anything unreadable, or holding more than tensors and plain values, gives ``None`` and the
    full load later reports (or refuses) it.
    """
    try:
        local = Path(path)
        if not local.is_file():
            return None
        try:
            checkpoint = torch.load(local, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:  # an old (non-zip) file cannot be memory-mapped
            checkpoint = torch.load(local, map_location="cpu", weights_only=True)
        states = checkpoint.get("optimizer_states") or []
        layout = states[0].get("avgpipe_layout") if states and isinstance(states[0], dict) else None
        return dict(layout) if isinstance(layout, dict) else None
    except Exception:  # noqa: BLE001 - the real load names what is wrong with the file
        return None
