"""Pure, torch-free schedules: which op runs when, as data."""

from lightning_greedysnake.schedule.plan import (
    Op,
    OpKind,
    Plan,
    PlanError,
    ScheduleKind,
    build_horizontal_plan,
    build_plan,
    build_vertical_plan,
    check_plan,
    weight_loads_per_window,
)

__all__ = [
    "Op",
    "OpKind",
    "Plan",
    "PlanError",
    "ScheduleKind",
    "build_horizontal_plan",
    "build_plan",
    "build_vertical_plan",
    "check_plan",
    "weight_loads_per_window",
]
