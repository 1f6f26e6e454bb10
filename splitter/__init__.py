"""splitter: pure-Python V1/V2 split of a training pipeline's units (no torch, no prefect)."""

from splitter.errors import (
    PipelineSpecError,
    SplitterError,
    StageAssignmentError,
    UnknownModelError,
    UserError,
)
from splitter.plan import PIPELINE_INPUT, SplitPlan, plan_split
from splitter.report import plan_rows, plan_table
from splitter.split import Reason, UnitSplit, split_units
from splitter.stages import (
    ModuleLayout,
    assign_stages,
    layout_from_count,
    layout_from_fqns,
    validate_stages,
)
from splitter.units import Pipeline, Unit, parse_trainable, pipeline_from_dict, unit_from_dict

split = plan_split

__all__ = [
    "PIPELINE_INPUT",
    "ModuleLayout",
    "Pipeline",
    "PipelineSpecError",
    "Reason",
    "SplitPlan",
    "SplitterError",
    "StageAssignmentError",
    "Unit",
    "UnitSplit",
    "UnknownModelError",
    "UserError",
    "assign_stages",
    "layout_from_count",
    "layout_from_fqns",
    "parse_trainable",
    "pipeline_from_dict",
    "plan_rows",
    "plan_split",
    "plan_table",
    "split",
    "split_units",
    "unit_from_dict",
    "validate_stages",
]
