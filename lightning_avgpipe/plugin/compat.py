"""Every use of Lightning's private state, in one place (placeholder until the compat module lands)."""

from __future__ import annotations

from typing import Any


def writes_logs(trainer: Any) -> bool:
    """Whether Lightning writes this training step's logs (the same answer on every rank: it counts steps)."""
    connector = getattr(trainer, "_logger_connector", None)
    return bool(getattr(connector, "should_update_logs", True))


def reset_train_dataloader(trainer: Any) -> None:
    """Make the fit loop set up its training loader again (a loader grouped for an old N)."""
    trainer.fit_loop._combined_loader = None


def attached_trainer(module: Any) -> Any:
    """The module's Trainer, or ``None`` (``module.trainer`` raises when there is none)."""
    return getattr(module, "_trainer", None)
