"""What a ``fit`` is about to restore, known before Lightning restores it.

Under this strategy Lightning restores a checkpoint after ``setup`` and ``on_fit_start``
(``restore_checkpoint_after_setup``), but two decisions made earlier depend on it: the tuner must not re-choose the
setting of a resumed run, and ``partition="balanced"`` must cut the model as the checkpoint was cut (timing noise
would otherwise give another cut, and the optimizer states would be thrown away as belonging to another layout).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch


def resuming_from(trainer: pl.Trainer) -> Any:
    """The checkpoint this ``fit`` is about to restore, or ``None``.

    ``trainer.ckpt_path`` is only set once the checkpoint is loaded, after ``on_fit_start`` under this strategy
    (``restore_checkpoint_after_setup``); until then the path is a local of ``Trainer._run`` (Lightning 2.6), which
    is read from the calling frames.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_run" and frame.f_locals.get("self") is trainer:
            return frame.f_locals.get("ckpt_path")  # this fit's; trainer.ckpt_path may be a previous call's
        frame = frame.f_back  # type: ignore[assignment]
    return trainer.ckpt_path


def checkpoint_layout(path: Any) -> dict[str, Any] | None:
    """The ``avgpipe_layout`` (stages, groups, pipelines, partition) a checkpoint was saved with, or ``None``.

    Reads a local file only (memory-mapped where the format allows); anything unreadable gives ``None`` and the
    full load later reports it.
    """
    try:
        local = Path(path)
        if not local.is_file():
            return None
        try:
            checkpoint = torch.load(local, map_location="cpu", weights_only=False, mmap=True)
        except RuntimeError:  # an old (non-zip) file cannot be memory-mapped
            checkpoint = torch.load(local, map_location="cpu", weights_only=False)
        states = checkpoint.get("optimizer_states") or []
        layout = states[0].get("avgpipe_layout") if states and isinstance(states[0], dict) else None
        return dict(layout) if isinstance(layout, dict) else None
    except Exception:  # noqa: BLE001 - the real load names what is wrong with the file
        return None
