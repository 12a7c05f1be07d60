"""``python -m lightning_avgpipe schedule ...`` as a user runs it: a fresh interpreter, from the repository root."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def schedule_output(*args: str) -> str:
    """What ``python -m lightning_avgpipe schedule *args`` prints (it must exit 0)."""
    return subprocess.run(
        [sys.executable, "-m", "lightning_avgpipe", "schedule", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
