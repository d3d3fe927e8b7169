"""Pure, torch-free schedules: which op runs when, as data."""

from lightning_greedysnake.schedule.plan import (
    Op,
    OpKind,
    Plan,
    PlanError,
    ScheduleKind,
    WindowFacts,
    build_horizontal_plan,
    build_plan,
    build_vertical_plan,
    check_plan,
    gradient_spills,
    live_microbatches,
    weight_loads_per_window,
    window_facts,
)

__all__ = [
    "Op",
    "OpKind",
    "Plan",
    "PlanError",
    "ScheduleKind",
    "WindowFacts",
    "build_horizontal_plan",
    "build_plan",
    "build_vertical_plan",
    "check_plan",
    "gradient_spills",
    "live_microbatches",
    "weight_loads_per_window",
    "window_facts",
]
