"""Reproduce the SIGABRT at exit with bare gloo, and show that destroying the groups before finalization removes it.

    PYTHONPATH=. python benchmarks/exit_race.py                 # 40 runs per mode (about 3 minutes)
    PYTHONPATH=. python benchmarks/exit_race.py --runs 10 --json runs/exit_race.json

Each run is two processes that do three all-reduces on a default group and on a second group, then exit:

- ``keep``: they exit as most scripts do, with their groups alive;
- ``close``: an ``atexit`` handler releases the second group and calls
  ``lightning_avgpipe.runtime.failures.shutdown.destroy_process_groups`` (what ``AvgPipeStrategy`` registers).

One rank's interpreter takes a moment to finalize (an object whose ``__del__`` sleeps 0.5 s), so the ends of the
two processes overlap as they do on a loaded machine. In ``keep`` mode a rank exits -6 with "terminate called
without an active exception" in a good share of runs: a gloo worker thread drops a finished all-reduce's tensors
after finalization began, takes the GIL, is ended by ``pthread_exit`` and the unwinding calls ``std::terminate``
(``gdb`` shows ``ProcessGroupGloo::runLoop`` > ``~AsyncAllreduceWork`` > ``TensorImpl::decref_pyobject`` >
``take_gil`` > ``PyThread_exit_thread``). In ``close`` mode no worker thread is left when finalization starts.

It prints, per mode, the runs, the ranks that exited 0, the aborts (-6) and other exits; ``--json`` writes the same.
Exit status 1 when a rank of the ``close`` mode did not exit 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: this checkout's package
    sys.path.insert(0, str(ROOT))

from tests.helpers.harness import free_port  # noqa: E402

RANK = """
import atexit, sys, time
import torch, torch.distributed as dist
rank, port, mode = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
holder = {"group": dist.new_group([0, 1])}
t = torch.ones(1 << 16)
for _ in range(3):
    dist.all_reduce(t)
    dist.all_reduce(t, group=holder["group"])
if mode == "close":
    from lightning_avgpipe.runtime.failures.shutdown import destroy_process_groups
    atexit.register(lambda: (holder.clear(), destroy_process_groups()))

class SlowToFinalize:
    def __del__(self):
        time.sleep(0.5)

slow = SlowToFinalize() if rank == 1 else None
"""


def one_run(mode: str, timeout: float) -> list[tuple[int, str]]:
    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, str(r), port, mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    out = []
    for p in procs:
        try:
            text, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            text, _ = p.communicate()
        out.append((p.returncode, text))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=40, help="runs per mode (default 40)")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds a run may take (default 60)")
    parser.add_argument("--json", type=Path, default=None, help="write the counts here")
    args = parser.parse_args()
    report: dict[str, dict[str, object]] = {}
    started = time.perf_counter()
    for mode in ("keep", "close"):
        ok = aborts = other = 0
        examples: list[str] = []
        for _ in range(args.runs):
            for code, text in one_run(mode, args.timeout):
                if code == 0:
                    ok += 1
                elif code == -6:
                    aborts += 1
                    if len(examples) < 2:
                        examples.append(text.strip().splitlines()[-1] if text.strip() else "")
                else:
                    other += 1
                    if len(examples) < 2:
                        examples.append(f"exit {code}: {text[-300:]}")
        report[mode] = {"runs": args.runs, "ranks": 2 * args.runs, "ok": ok, "aborts": aborts, "other": other}
        print(
            f"{mode:5s}: {args.runs} runs, {2 * args.runs} ranks: {ok} exited 0, {aborts} aborted (-6), {other} other"
            + (f"  e.g. {examples[0]!r}" if examples else ""),
            flush=True,
        )
    seconds = time.perf_counter() - started
    print(f"{seconds:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"modes": report, "seconds": seconds}, indent=2))
    close = report["close"]
    return 0 if close["ok"] == close["ranks"] else 1


if __name__ == "__main__":
    sys.exit(main())
