"""Start one OS process per rank as an external launcher would (torchrun-style env), with a hard timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers.distributed import free_port

ROOT = Path(__file__).resolve().parents[2]


def launch_ranks(args: list[str], world_size: int, timeout: float = 240.0, env: dict[str, str] | None = None
                 ) -> list[tuple[int, str]]:
    """Run ``python *args`` as ranks 0..world_size-1; returns (exit code, output) per rank.

    Every process is killed when the group exceeds ``timeout`` seconds, and ``TimeoutError`` is raised.
    """
    port = free_port()
    procs = []
    for rank in range(world_size):
        penv = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank),
                    NODE_RANK="0", WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
                    PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        penv.update(env or {})
        procs.append(subprocess.Popen([sys.executable, *args], cwd=ROOT, env=penv, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    deadline = time.monotonic() + timeout
    outputs: list[str] = []
    try:
        for p in procs:
            left = max(1.0, deadline - time.monotonic())
            out, _ = p.communicate(timeout=left)
            outputs.append(out)
    except subprocess.TimeoutExpired as err:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        texts = []
        for p in procs:
            try:
                texts.append(p.communicate(timeout=5)[0] or "")
            except Exception:  # noqa: BLE001
                texts.append("")
        tails = "\n---\n".join(t[-3000:] for t in texts)
        raise TimeoutError(f"ranks did not finish within {timeout}s:\n{tails}") from err
    return [(p.returncode, out) for p, out in zip(procs, outputs)]
