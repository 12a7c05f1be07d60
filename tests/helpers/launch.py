"""Start processes as a user or an external launcher would: one OS process per rank (torchrun-style env) with a hard
timeout, and a command line (a script, torchrun, the CLI) run from a folder with the repository on the path.

The rank launcher is ``tests/helpers/harness.py``, shared with the benchmarks; the tests import it from here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.harness import ROOT, launch_ranks

__all__ = ["ROOT", "launch_ranks", "run_command"]


def run_command(args: list[str], tmp_path: Path, timeout: float = 240) -> str:
    """Run ``args`` in ``tmp_path`` as a user starts a run (no launcher's variables inherited, the repository on
    ``PYTHONPATH``, one OMP thread) and return its output; it must exit 0."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out
