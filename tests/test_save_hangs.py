"""A rank frozen in a checkpoint save ends the job within ``p2p_timeout``, naming it; a slow write is not failed.

Rank 1 freezes itself (SIGSTOP, never continued) in the save at step 2: before it writes its part of a folder, while
it writes it, at the save's last wait, or before a single file's transfer. Rank 0 must exit non-zero within
``p2p_timeout`` plus a few seconds, naming rank 1 and the save; the test kills rank 1 afterwards. A write that sleeps
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
FROZEN = {
    "folder, before its write": (FOLDER, "stop_before_write"),
    "folder, during its write": (FOLDER, "stop_in_write"),
    "folder, at the final wait": (FOLDER, "stop_at_end"),
    "single file, before the transfer": ({}, "stop_in_save"),
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


def _launch_all(cfgs: dict[str, dict[str, Any]], frozen: tuple[int, ...]) -> dict[str, Any]:
    """Every job of ``cfgs`` at once: case -> (results, ends) of ``launch_ranks``."""
    done: dict[str, Any] = {}

    def run(case: str, cfg: dict[str, Any]) -> None:
        ended: list[float] = []
        args = ["-m", "tests.helpers.lightning_worker", json.dumps(cfg)]
        try:
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
        case: _cfg(outs[case], strategy, {"rank": 1, "kind": kind, "record": str(outs[case] / "stopped")})
        for case, (strategy, kind) in FROZEN.items()
    }
    done = _launch_all(cfgs, frozen=(1,))
    for case in FROZEN:
        assert not isinstance(done[case], BaseException), f"{case}: {done[case]!r}"
        ((code0, out0), (code1, _)), ended = done[case]
        assert (outs[case] / "stopped").exists(), f"{case}: rank 1 never froze:\n{out0[-3000:]}"
        took = ended[0] - float((outs[case] / "stopped").read_text())
        line = next((ln for ln in out0.splitlines() if re.match(r"^\S*PeerFailureError: ", ln)), "(none)")
        print(f"\n[table] rank 1 frozen in a save, {case} | rank 0 | {took:.1f} s | {line.strip()[:400]}")
        assert code1 == -9, f"{case}: rank 1 exited {code1}, it was not frozen to the end"
        assert code0 == 1, f"{case}: rank 0 exited {code0} (-9: still running) after {took:.1f} s:\n{out0[-3000:]}"
        assert took < BOUND, f"{case}: rank 0 ended {took:.1f} s after rank 1 froze:\n{out0[-3000:]}"
        assert re.search(r"rank 0: a .*checkpoint.* did not complete.*rank 1 ", line), f"{case}:\n{out0[-3000:]}"


@pytest.mark.slow
def test_a_write_slower_than_p2p_timeout_saves_a_whole_checkpoint() -> None:
    from lightning_avgpipe.plugin import sharded

    folder, file = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    cfgs = {
        "folder, rank 1 writes slowly": _cfg(folder, FOLDER, {"rank": 1, "kind": "slow_write", "seconds": SLEEP}),
        "single file, rank 0 writes slowly": _cfg(file, {}, {"rank": 0, "kind": "slow_file", "seconds": SLEEP}),
    }
    start = time.monotonic()
    done = _launch_all(cfgs, frozen=())
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
