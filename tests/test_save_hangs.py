"""A rank frozen in a checkpoint save ends the job within ``p2p_timeout``, naming it; a slow write is not failed.

A rank freezes itself (SIGSTOP, never continued) in the save at step 2: rank 1 before it writes its part of a folder,
while it writes it, at the save's last wait, before a single file's transfer or as it sends its tensors; rank 0 as it
writes (then the store it serves falls silent too). The other rank must exit non-zero within ``p2p_timeout`` plus a
few seconds, naming the frozen rank and the save; the test kills the frozen rank afterwards. A write that sleeps
twice ``p2p_timeout`` (rank 1's part of a folder, rank 0's single file) saves a whole checkpoint. The cases of a
test run at once, each a job of two ranks, to keep the suite short.
"""

from __future__ import annotations

import json
import re
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.helpers.launch import launch_ranks

P2P_TIMEOUT = 5
BOUND = P2P_TIMEOUT + 15  # the wait, its look at the store (0.5 s), a store deadline (2 s), rank 0's exit (3 s)
SLEEP = 2 * P2P_TIMEOUT

FOLDER = {"save_distributed_checkpoint": True}
FROZEN = {  # case -> (strategy, the frozen rank, where)
    "folder, rank 1 before its write": (FOLDER, 1, "stop_before_write"),
    "folder, rank 1 during its write": (FOLDER, 1, "stop_in_write"),
    "folder, rank 1 at the final wait": (FOLDER, 1, "stop_at_end"),
    "folder, rank 0 during its write": (FOLDER, 0, "stop_in_write"),  # the store it serves falls silent
    "single file, rank 1 before the transfer": ({}, 1, "stop_in_save"),
    "single file, rank 1 as it sends": ({}, 1, "stop_in_transfer"),
    "single file, rank 0 as it writes": ({}, 0, "stop_in_file"),
}


def _cfg(out: Path, strategy: dict[str, Any], fault: dict[str, Any]) -> dict[str, Any]:
    return {
        "out": str(out),
        "devices": 2,
        "steps": 4,
        "every_n_train_steps": 2,
        "strategy": {"num_microbatches": 2, "p2p_timeout": P2P_TIMEOUT, **strategy},
        "fault": {"step": 2, **fault},
    }


def _launch_all(cfgs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Every job of ``cfgs`` at once: case -> (results, ends) of ``launch_ranks``; a rank ``cfg["frozen"]`` names
    is killed once the other ended."""
    done: dict[str, Any] = {}

    def run(case: str, cfg: dict[str, Any]) -> None:
        ended: list[float] = []
        args = ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)]
        try:
            frozen = cfg.get("frozen", ())
            done[case] = (launch_ranks(args, 2, timeout=150, preload=True, ended=ended, frozen=frozen), ended)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            done[case] = err

    threads = [threading.Thread(target=run, args=item) for item in cfgs.items()]
    for thread in threads:
        thread.start()
        time.sleep(0.2)
    for thread in threads:
        thread.join()
    return done


@pytest.mark.slow
def test_a_rank_frozen_in_a_save_is_named_within_p2p_timeout() -> None:
    outs = {case: Path(tempfile.mkdtemp()) for case in FROZEN}
    cfgs = {
        case: {
            **_cfg(outs[case], strategy, {"rank": frozen, "kind": kind, "record": str(outs[case] / "stopped")}),
            "frozen": [frozen],
        }
        for case, (strategy, frozen, kind) in FROZEN.items()
    }
    done = _launch_all(cfgs)
    for case, (_, frozen, _) in FROZEN.items():
        assert not isinstance(done[case], BaseException), f"{case}: {done[case]!r}"
        results, ended = done[case]
        other = 1 - frozen
        code, out = results[other]
        assert (outs[case] / "stopped").exists(), f"{case}: rank {frozen} never froze:\n{out[-3000:]}"
        took = ended[other] - float((outs[case] / "stopped").read_text())
        line = next((ln for ln in out.splitlines() if re.match(r"^\S*PeerFailureError: ", ln)), "(none)")
        print(f"\n[table] frozen in a save: {case} | rank {other} | {took:.1f} s | {line.strip()[:400]}")
        assert results[frozen][0] == -9, f"{case}: rank {frozen} exited {results[frozen][0]}, it was not frozen"
        assert code == 1, f"{case}: rank {other} exited {code} (-9: still running) after {took:.1f} s:\n{out[-3000:]}"
        assert took < BOUND, f"{case}: rank {other} ended {took:.1f} s after rank {frozen} froze:\n{out[-3000:]}"
        named = rf"rank {other}: a .*checkpoint.* did not complete.*: rank {frozen} (did not (arrive|send)|\(pid)"
        assert re.search(named, line), f"{case}:\n{out[-3000:]}"


@pytest.mark.slow
def test_a_write_slower_than_p2p_timeout_saves_a_whole_checkpoint() -> None:
    from lightning_avgpipe.plugin.checkpoint import sharded

    folder, file = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    cfgs = {
        "folder, rank 1 writes slowly": _cfg(folder, FOLDER, {"rank": 1, "kind": "slow_write", "seconds": SLEEP}),
        "single file, rank 0 writes slowly": _cfg(file, {}, {"rank": 0, "kind": "slow_file", "seconds": SLEEP}),
    }
    start = time.monotonic()
    done = _launch_all(cfgs)
    for case, result in done.items():
        assert not isinstance(result, BaseException), f"{case}: {result!r}"
        results, ended = result
        for r, (code, out) in enumerate(results):
            assert code == 0, f"{case}: rank {r} exited {code}:\n{out[-3000:]}"
        print(f"\n[table] {case} ({SLEEP} s) | the job | {max(ended) - start:.1f} s | saved, exit 0")
    for step in (2, 4):
        sharded.check_folder(folder / "every" / f"epoch=0-step={step}.ckpt")  # whole: raises otherwise
        loaded = torch.load(file / "every" / f"epoch=0-step={step}.ckpt", weights_only=True)
        assert loaded["global_step"] == step and loaded["state_dict"]
