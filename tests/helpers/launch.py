"""Start processes as a user or an external launcher would: one OS process per rank (torchrun-style env) with a hard
timeout, and a command line (a script, torchrun, the CLI) run from a folder with the repository on the path.

The rank launcher is ``tests/helpers/harness.py``, shared with the benchmarks; the tests import it from here.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.helpers.harness import ROOT, free_port, launch_ranks

__all__ = ["ROOT", "job_env", "launch_ranks", "run_command"]

LAUNCHER_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_PORT", "RANK")


def job_env(**extra: str) -> dict[str, str]:
    """The environment of a job started as a user starts one: this process's without the launcher's variables an
    earlier in-process Trainer may have left, then ``extra``, and a ``MASTER_PORT`` from :func:`free_port` unless
    ``extra`` gives one. Lightning would pick its own with ``bind(0)``, from the kernel's ephemeral range, where a
    concurrent test's gloo connection can take it before the job's store binds it."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    env.setdefault("MASTER_PORT", str(free_port()))
    return env


def run_command(args: list[str], tmp_path: Path, timeout: float = 240) -> str:
    """Run ``args`` in ``tmp_path`` as a user starts a run (no launcher's variables inherited, the repository on
    ``PYTHONPATH``, one OMP thread) and return its output; it must exit 0."""
    env = job_env(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out
