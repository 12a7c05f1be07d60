"""The core is Lightning-free: the algorithms, schedules, partitioning, runtime, tuning maths and the ``schedule``
command import neither Lightning nor ``lightning_avgpipe.plugin``; ``strategy="avgpipe"`` still resolves whatever the
import order.

Each check runs in a fresh interpreter (``sys.executable``), since this test process may have Lightning loaded.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.helpers.launch import job_env

ROOT = Path(__file__).resolve().parents[1]

# Every module of these packages (found by walking them, so new modules such as runtime/pipeline.py are covered)
CORE_PACKAGES = [
    "lightning_avgpipe.algorithms",
    "lightning_avgpipe.schedules",
    "lightning_avgpipe.partition",
    "lightning_avgpipe.runtime",
    "lightning_avgpipe.tuning",
]
CORE_MODULES = [
    "lightning_avgpipe",
    "lightning_avgpipe.config",
    "lightning_avgpipe.cpu",
    "lightning_avgpipe.errors",
    "lightning_avgpipe.__main__",
]


def _python(code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    env = job_env(PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_core_modules_import_neither_lightning_nor_the_plugin() -> None:
    """Imported one after another; after each, nothing Lightning-side may be loaded (the first culprit is named)."""
    proc = _python(
        """
        import importlib, json, pkgutil, sys

        def lightning_side():
            return sorted(m for m in sys.modules if m == "lightning" or m.startswith(("lightning.", "pytorch_lightning",
                          "lightning_avgpipe.plugin")))

        names = list(json.loads(sys.argv[1]))
        for package in json.loads(sys.argv[2]):
            names.append(package)
            path = importlib.import_module(package).__path__
            names += [m.name for m in pkgutil.walk_packages(path, package + ".")]
        for name in names:
            importlib.import_module(name)
            loaded = lightning_side()
            assert not loaded, f"importing {name} loaded {loaded[:5]}"
        print(json.dumps(names))
        """,
        json.dumps(CORE_MODULES),
        json.dumps(CORE_PACKAGES),
    )
    checked = set(json.loads(proc.stdout.strip().splitlines()[-1]))
    for name in (
        "lightning_avgpipe.algorithms.elastic",
        "lightning_avgpipe.schedules.simulate",
        "lightning_avgpipe.partition.blockpartition",
        "lightning_avgpipe.runtime.executor",
        "lightning_avgpipe.tuning.model",
        "lightning_avgpipe.tuning.search",
    ):
        assert name in checked


def test_schedule_command_loads_neither_lightning_nor_torch() -> None:
    """``python -m lightning_avgpipe schedule`` stays a fraction of a second (Lightning costs ~4 s, torch ~1.5 s)."""
    proc = _python(
        """
        import runpy, sys

        sys.argv = ["lightning_avgpipe", "schedule", "--stages", "4", "--microbatches", "8"]
        try:
            runpy.run_module("lightning_avgpipe", run_name="__main__", alter_sys=True)
        except SystemExit as exit:
            assert not exit.code, exit.code
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("lightning", "pytorch_lightning", "torch")
                       or m.startswith("lightning_avgpipe.plugin"))
        print("LOADED", heavy[:10])
        """
    )
    assert "schedule=1f1b stages=4 units=8" in proc.stdout
    assert "LOADED []" in proc.stdout, proc.stdout[-500:]


TRAINER = """
    import sys
    {first}
    {second}
    trainer = L.Trainer(strategy="avgpipe", devices=1, accelerator="cpu", logger=False, enable_checkpointing=False)
    from lightning_avgpipe import AvgPipeStrategy, _register
    assert isinstance(trainer.strategy, AvgPipeStrategy), type(trainer.strategy)
    assert AvgPipeStrategy.strategy_name == _register.NAME
    assert not any(isinstance(f, _register._Finder) for f in sys.meta_path), "the import hook did not remove itself"
    print("OK")
"""


def test_strategy_name_resolves_when_the_package_is_imported_before_lightning() -> None:
    proc = _python(
        TRAINER.format(
            first="import lightning_avgpipe; assert 'lightning' not in sys.modules",
            second="import lightning.pytorch as L",
        )
    )
    assert proc.stdout.strip().endswith("OK")


def test_strategy_name_resolves_when_lightning_is_imported_first() -> None:
    proc = _python(TRAINER.format(first="import lightning.pytorch as L", second="import lightning_avgpipe"))
    assert proc.stdout.strip().endswith("OK")


def test_public_api_is_complete() -> None:
    """Every name of ``__all__`` resolves (the Lightning ones on first access) and ``from ... import *`` works."""
    proc = _python(
        """
        import lightning_avgpipe
        from lightning_avgpipe import *  # noqa: F403
        from lightning_avgpipe.plugin import AvgPipeStrategy as S, AvgPipeTuner as T, PipelineContractError as E
        assert (lightning_avgpipe.AvgPipeStrategy, lightning_avgpipe.AvgPipeTuner,
                lightning_avgpipe.PipelineContractError) == (S, T, E)
        missing = [n for n in lightning_avgpipe.__all__ if getattr(lightning_avgpipe, n, None) is None]
        assert not missing, missing
        assert set(lightning_avgpipe.__all__) <= set(dir(lightning_avgpipe))
        try:
            lightning_avgpipe.no_such_name
        except AttributeError:
            print("OK")
        """
    )
    assert proc.stdout.strip().endswith("OK")
