"""Stress the end of multi-process Lightning runs: does a rank ever abort (SIGABRT, exit -6) after a good run?

    PYTHONPATH=. python benchmarks/abort_stress.py                  # 200 runs, two at a time (about 10 minutes)
    PYTHONPATH=. python benchmarks/abort_stress.py --runs 40 --json runs/abort_stress.json

A rank that has done its work and written its results, then dies at interpreter exit with "terminate called without
an active exception", is a failed job to any scheduler. This script repeats the configurations of the multi-process
Lightning tests (2 ranks each; two parallel pipelines with Adam, as in the run that aborted, and the others the suite
runs) through ``tests/helpers/lightning_worker.py``, two runs at once on the machine's cores so that the end of one
overlaps the work of the other, and counts every rank's exit code. It is not part of the test suite (it takes
minutes); the suite's ``tests/test_lightning_integration.py`` checks the cause it guards against: no thread of ours is
left running when ``fit`` returns.

It prints the count of runs, of ranks that exited 0, of aborts (-6) and of any other exit, with the configuration and
the last lines of output of every rank that did not exit 0; ``--json`` writes the same. Exit status 1 when any rank
did not exit 0.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: this checkout's tests and package
    sys.path.insert(0, str(ROOT))

from tests.helpers.harness import launch_ranks  # noqa: E402

# The multi-process Lightning tests' shapes of run, 2 ranks each (the first is the one that aborted in CI).
CONFIGS: list[dict[str, Any]] = [
    {
        "steps": 5,
        "strategy": {"num_microbatches": 2, "partition": [2, 4], "num_pipelines": 2, "sync_reference": True},
        "model": {"optimizer": "adam", "lr": 0.01},
    },
    {"steps": 4, "strategy": {"num_microbatches": 4, "schedule": "1f1b", "partition": [3, 3]}},
    {"steps": 4, "strategy": {"num_microbatches": 4, "schedule": "advance", "advance_forwards": 1}, "predict": True},
    {"steps": 4, "strategy": {"num_microbatches": 3, "partition": [1, 3], "num_pipelines": 2}, "tied": True},
    {"steps": 3, "strategy": {"num_microbatches": 2}, "limit_val_batches": 2, "sanity": 1},
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="Lightning runs in all (each of 2 ranks)")
    p.add_argument("--parallel", type=int, default=2, help="runs at once")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one run may take before it is killed")
    p.add_argument("--json", dest="json_path", default=None, help="also write the counts to this JSON file")
    args = p.parse_args(argv)
    if args.runs < 1 or args.parallel < 1:
        p.error("--runs and --parallel must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lock = threading.Lock()
    next_run = [0]
    codes: Counter[int] = Counter()
    failures: list[dict[str, Any]] = []
    started = time.perf_counter()

    def worker() -> None:
        while True:
            with lock:
                if next_run[0] >= args.runs:
                    return
                i = next_run[0]
                next_run[0] += 1
            with tempfile.TemporaryDirectory() as out:
                cfg = {"out": out, "devices": 2, **CONFIGS[i % len(CONFIGS)]}
                try:
                    results = launch_ranks(
                        ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)], 2, timeout=args.timeout
                    )
                except TimeoutError as err:  # a hang is a failure too: counted as exit code 124, as timeout(1) does
                    results = [(124, str(err)), (124, "")]
            with lock:
                for rank, (code, output) in enumerate(results):
                    codes[code] += 1
                    if code != 0:
                        failures.append({"run": i, "rank": rank, "code": code, "config": cfg, "tail": output[-1500:]})
                done = sum(codes.values()) // 2
                if done % 20 == 0:
                    print(f"{done} runs, exit codes {dict(codes)}", flush=True)

    threads = [threading.Thread(target=worker) for _ in range(args.parallel)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    summary = {
        "runs": args.runs,
        "ranks": sum(codes.values()),
        "exit_codes": {str(k): v for k, v in sorted(codes.items())},
        "aborts": codes.get(-6, 0),
        "other_failures": sum(v for k, v in codes.items() if k not in (0, -6)),  # 124: the run timed out
        "wall_s": time.perf_counter() - started,
        "failures": failures,
    }
    print(
        f"{summary['runs']} runs ({summary['ranks']} ranks, {args.parallel} at once, {summary['wall_s']:.0f} s): "
        f"exit codes {summary['exit_codes']}; aborts (-6): {summary['aborts']}; other failures: "
        f"{summary['other_failures']}"
    )
    for f in failures:
        print(f"run {f['run']} rank {f['rank']} exited {f['code']} ({f['config']}):\n{f['tail']}\n")
    if args.json_path:
        path = Path(args.json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=2) + "\n")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
