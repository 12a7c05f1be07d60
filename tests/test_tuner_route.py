"""The tuner's route through the package (docs/how-it-works.md#the-tuners-route): ``AvgPipeTuner.on_fit_start``
traced call by call (property reads, generators and lambdas are not calls of the route), the step itself (inside
``StageProbe.step``) counted as one call into ``tuning/probe.py``.

Each file of the route is entered from at most two other files, and no call climbs a layer
(``tests/helpers/layers.py``): the plugin asks the strategy for a probe, ``tuning/`` measures through it and chooses,
the plugin applies and reports.
"""

from __future__ import annotations

import inspect
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from lightning_avgpipe import AvgPipeStrategy, AvgPipeTuner
from lightning_avgpipe.tuning.probe import StageProbe
from tests.helpers.layers import layer_of
from tests.helpers.lit import PipeNet, loader, quiet_trainer

# the tuner's own files, in the order on_fit_start first enters them (docs/how-it-works.md#the-tuners-route); what
# they call below (tuning/search.py, model.py, profiler.py, busy.py, report.py, the runtime) is shared, entered
# downward only
ROUTE = (
    "plugin/tuner/callback.py",
    "plugin/tuner/run.py",
    "plugin/tuner_surface.py",
    "tuning/measure.py",
    "tuning/probe.py",
    "runtime/controller.py",
)
PACKAGE = Path(__file__).resolve().parents[1] / "lightning_avgpipe"
STEP = StageProbe.step.__code__


def _file(frame: FrameType) -> str | None:
    path = Path(frame.f_code.co_filename)
    return str(path.relative_to(PACKAGE)) if path.is_relative_to(PACKAGE) else None


def _module(file: str) -> str:
    parts = ["lightning_avgpipe", *Path(file).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _not_a_call(frame: FrameType) -> bool:
    """A frame that is no step of the route: a generator resumed or a comprehension or lambda (their code runs where
    they were made), or a property's getter (reading a value)."""
    code = frame.f_code
    if code.co_flags & (inspect.CO_GENERATOR | inspect.CO_COROUTINE) or code.co_name.startswith("<"):
        return True
    owner = frame.f_locals.get("self")
    return owner is not None and isinstance(getattr(type(owner), code.co_name, None), property)


class Route:
    """Cross-file calls between the package's files while tracing: callee -> its callers, in first-call order."""

    def __init__(self) -> None:
        self.callers: dict[str, list[str]] = {}
        self._in_step = 0

    def __call__(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is STEP:
            self._in_step -= 1
        if event != "call" or self._in_step:
            return
        if frame.f_code is STEP:
            self._in_step += 1
        callee = _file(frame)
        if callee is None or _not_a_call(frame):
            return
        caller, up = None, frame.f_back
        while up is not None and caller is None:  # the nearest package frame: Lightning or torch may sit between
            caller, up = _file(up), up.f_back
        if caller is not None and caller != callee and caller not in self.callers.setdefault(callee, []):
            self.callers[callee].append(caller)

    def climbs(self) -> list[tuple[str, str]]:
        """(caller, callee) for each call into a higher layer (``tests/helpers/layers.py``)."""
        return [
            (caller, callee)
            for callee, callers in self.callers.items()
            for caller in callers
            if (layer_of(_module(callee)) or 0) > (layer_of(_module(caller)) or 0)
        ]


def traced_route(tmp_path: Path) -> Route:
    route = Route()
    tuner = AvgPipeTuner(num_pipelines=[1, 2], num_microbatches=[1, 2], profile_steps=1, calibrate_steps=0)
    start = tuner.on_fit_start

    def traced(*args: Any) -> None:
        sys.setprofile(route)
        try:
            start(*args)
        finally:
            sys.setprofile(None)

    tuner.on_fit_start = traced  # type: ignore[method-assign]
    trainer = quiet_trainer(tmp_path, max_steps=1, strategy=AvgPipeStrategy(), callbacks=[tuner])
    trainer.fit(PipeNet(), loader(4, 32))
    return route


@pytest.mark.timeout(120)
def test_the_tuner_enters_each_file_from_at_most_two_others_and_never_climbs(tmp_path: Path) -> None:
    route = traced_route(tmp_path)
    # the route, in the order the tuner first enters each file; it starts in the callback, whichever frame called it
    files = [ROUTE[0], *(f for f in route.callers if f in ROUTE[1:])]
    assert files == list(ROUTE), f"the route changed: {files}; update ROUTE and docs/how-it-works.md with it"
    crowded = {f: c for f, c in route.callers.items() if f in ROUTE and len(c) > 2}
    assert not crowded, f"route files entered from more than two others: {crowded}"
    climbs = route.climbs()
    assert not climbs, f"calls up the layers: {climbs}"


def test_the_route_check_sees_a_climb() -> None:
    route = Route()
    route.callers = {"plugin/strategy.py": ["tuning/measure.py"], "tuning/probe.py": ["plugin/tuner/run.py"]}
    assert route.climbs() == [("tuning/measure.py", "plugin/strategy.py")]  # the call down is not one
