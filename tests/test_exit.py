"""A run under the strategy ends with no gloo worker thread left when the interpreter finalizes.

Such a thread aborts the process (SIGABRT, "terminate called without an active exception") when it drops a
finished collective's tensors after finalization began (lightning_avgpipe/runtime/shutdown.py says how).
``benchmarks/exit_race.py`` reproduces the abort with bare gloo and counts it; this test checks the cause is gone.
Every other multi-process Lightning test checks the same through ``run_lightning``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lightning_avgpipe.runtime import shutdown
from lightning_avgpipe.runtime.shutdown import native_threads
from tests.test_strategy_equivalence import GLOO_THREADS, run_lightning


@pytest.mark.skipif(not native_threads(), reason="needs Linux /proc to list native threads")
@pytest.mark.parametrize(
    ("devices", "strategy"),
    [
        (2, {"num_microbatches": 2, "partition": [2, 4], "num_pipelines": 2}),  # stage groups, elastic all-reduce
        (4, {"num_microbatches": 2, "num_stages": 2, "num_pipelines": 2, "sync_reference": False}),  # D = 2 groups
    ],
    ids=["S2-N2", "D2-S2-overlapped"],
)
def test_no_gloo_thread_is_left_when_the_interpreter_finalizes(
    tmp_path: Path, devices: int, strategy: dict[str, Any]
) -> None:
    run_lightning(tmp_path, devices, strategy, steps=3)  # it asserts no gloo thread was left, for every rank
    for rank in range(devices):
        threads = json.loads((tmp_path / f"rank{rank}.exit.json").read_text())["threads"]
        assert "python" in threads or threads, f"rank {rank}: the exit probe listed no thread at all"
        assert not [t for t in threads if t in GLOO_THREADS], threads


def test_native_threads_lists_this_process() -> None:
    names = native_threads()
    if not names:
        pytest.skip("needs Linux /proc")
    assert len(names) >= 1 and all(isinstance(n, str) and n for n in names)


def test_groups_are_left_alone_once_the_job_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    class Owner:
        def close(self) -> None:
            calls.append("close")

    monkeypatch.setitem(shutdown._state, "failed", False)
    owner = Owner()
    shutdown._at_exit(lambda: owner, "close", id(owner))
    assert calls == ["close"]
    shutdown.mark_failed()
    shutdown._at_exit(lambda: owner, "close", id(owner))
    assert calls == ["close"], "a failed job must not release or destroy (a destroy can wait on a dead rank)"
