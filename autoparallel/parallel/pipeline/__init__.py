"""Pipeline parallelism: stage splits, schedules as data, their simulation and timeline plots."""
from .schedules import (SCHEDULES, Action, Schedule, bubble_formula, check_communication, fthenb,
                        interleaved_1f1b, make_schedule, one_f_one_b, zb_h1)
from .simulate import PipelineDeadlock, Record, SimResult, bubble_fraction, simulate
from .split import balanced_split, split_at, stage_costs

__all__ = ["SCHEDULES", "Action", "Schedule", "bubble_formula", "check_communication", "fthenb",
           "interleaved_1f1b", "make_schedule", "one_f_one_b", "zb_h1", "PipelineDeadlock", "Record",
           "SimResult", "bubble_fraction", "simulate", "balanced_split", "split_at", "stage_costs",
           "plot_timeline", "plot_schedule", "apply_pp", "PipelineModule", "plan_pipeline"]


def __getattr__(name):                     # plotting pulls in matplotlib, the runtime paddle: load on first use
    if name in ("plot_timeline", "plot_schedule"):
        from . import timeline
        return getattr(timeline, name)
    if name in ("apply_pp", "PipelineModule"):
        from . import runtime
        return getattr(runtime, name)
    if name == "plan_pipeline":
        from . import stage
        return stage.plan_pipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
