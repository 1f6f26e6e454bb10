"""splitter: pure-Python V1/V2 split of a training pipeline's units (no torch, no prefect)."""

from splitstage.splitter.errors import (
    PipelineSpecError,
    SplitterError,
    StageAssignmentError,
    UnknownModelError,
    UserError,
)
from splitstage.splitter.plan import PIPELINE_INPUT, SplitPlan, plan_split
from splitstage.splitter.report import plan_rows, plan_table
from splitstage.splitter.split import Reason, UnitSplit, split_units
from splitstage.splitter.stages import (
    ModuleLayout,
    assign_stages,
    layout_from_count,
    layout_from_fqns,
    validate_stages,
)
from splitstage.splitter.units import (
    Pipeline,
    Unit,
    parse_trainable,
    pipeline_from_dict,
    unit_from_dict,
)

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
    "split_units",
    "unit_from_dict",
    "validate_stages",
]
