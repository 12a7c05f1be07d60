"""A run under the strategy ends with no gloo worker thread left when the interpreter finalizes.

Such a thread aborts the process (SIGABRT, "terminate called without an active exception") when it drops a
finished collective's tensors after finalization began (lightning_avgpipe/runtime/failures/shutdown.py says how).
``benchmarks/exit_race.py`` reproduces the abort with bare gloo and counts it. That the cause is gone is checked on
every multi-process Lightning test, by ``run_lightning``; this file checks that the check is in place, and the parts.
"""

from __future__ import annotations

import pytest

from lightning_avgpipe.runtime.failures import shutdown
from lightning_avgpipe.runtime.failures.shutdown import native_threads
from tests.helpers.equivalence import GLOO_THREADS


def test_every_lightning_run_is_checked_for_gloo_threads_at_finalization() -> None:
    """The check itself lives in ``run_lightning``: every multi-process Lightning test (equivalence, parallel
    pipelines, tied weights, the tuner, checkpoints) reads the probe its ranks wrote as the last exit handler and fails
    on a ``pt_gloo_runloop`` or ``gloo_tcp_loop`` thread. Here: the probe is registered first, so it runs last."""
    import inspect

    from tests.helpers import lightning_worker
    from tests.helpers.equivalence import run_lightning as runner

    main = inspect.getsource(lightning_worker.main)
    assert main.index("atexit.register(exit_probe") < main.index("pl.Trainer(")
    assert "GLOO_THREADS" in inspect.getsource(runner)
    assert set(GLOO_THREADS) == {"pt_gloo_runloop", "gloo_tcp_loop"}


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
    monkeypatch.setitem(shutdown._state, "owners", [])
    monkeypatch.setitem(shutdown._state, "hooked", True)  # no real atexit hook from a test
    owner = Owner()
    shutdown.close_at_exit(owner)
    shutdown.close_at_exit(owner)  # once per owner
    shutdown._at_exit()
    assert calls == ["close"]
    shutdown.close_at_exit(owner)
    shutdown.mark_failed()
    shutdown._at_exit()
    assert calls == ["close"], "a failed job must not release or destroy (a destroy can wait on a dead rank)"


def test_an_owner_that_is_gone_is_forgotten_and_a_new_one_at_its_address_registers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    monkeypatch.setitem(shutdown._state, "failed", False)
    monkeypatch.setitem(shutdown._state, "owners", [])
    monkeypatch.setitem(shutdown._state, "hooked", True)
    closed: list[int] = []

    class Owner:
        def close(self) -> None:
            closed.append(id(self))

    first = Owner()
    shutdown.close_at_exit(first)
    del first
    gc.collect()
    second = Owner()  # may reuse the first one's id
    shutdown.close_at_exit(second)
    shutdown._at_exit()
    assert closed == [id(second)]
