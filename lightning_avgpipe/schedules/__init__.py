"""Schedules as data: generate, lower, validate and simulate per-stage action lists."""

from lightning_avgpipe.schedules.actions import Action, Kind
from lightning_avgpipe.schedules.generate import (
    SCHEDULES,
    Plan,
    build_plan,
    check_schedule_name,
    compute_order,
    max_advance_forwards,
    peak_stash,
)
from lightning_avgpipe.schedules.simulate import DeadlockError, Simulation, simulate, timeline_table
from lightning_avgpipe.schedules.validate import PlanError, plan_errors, validate_plan

__all__ = [
    "SCHEDULES",
    "Action",
    "DeadlockError",
    "Kind",
    "Plan",
    "PlanError",
    "Simulation",
    "build_plan",
    "check_schedule_name",
    "compute_order",
    "max_advance_forwards",
    "peak_stash",
    "plan_errors",
    "simulate",
    "timeline_table",
    "validate_plan",
]
