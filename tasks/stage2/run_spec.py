"""The run spec: what the launcher hands every rank of a stage-2 run, typed and versioned; and
what a rank makes of it once (`RankSetup`).

The launcher writes it once (`RunSpec.write`, atomic JSON: no pickle) into the run folder; each
rank reads it (`RunSpec.read`) and does its own set-up from it (`tasks/stage2/rank_setup.py`).
Torch-free, so the launcher stays lean.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from splitstage.config.job import SplitstageConfig
from splitstage.splitter import UserError
from splitstage.tasks.stage2.outputs import RunPlaces

if TYPE_CHECKING:  # what a rank builds from the spec (rank_setup.py): torch, the family
    from splitstage.tasks.cache.key_table import KeyTable
    from splitstage.tasks.job_plan import JobPlan
    from splitstage.tasks.stage2.distributed import DistInfo

RUN_SPEC_VERSION = 1
SPEC_FILE = "spec.json"


class RunSpecError(UserError, ValueError):
    """A run spec this rank cannot read (another splitstage version wrote it, or it is damaged)."""


class RunSpec(BaseModel):
    """One stage-2 run: the job config, the run id, where it writes, and whether this node's
    launcher holds the run's lease (only node 0's does)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal[1] = RUN_SPEC_VERSION
    config: SplitstageConfig
    run_id: str
    places: RunPlaces
    holds_lease: bool = True

    def write(self, path: str | Path) -> Path:
        """Write the spec atomically (a rank reads a whole spec or none)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.tmp-{os.getpid()}")
        partial.write_text(self.model_dump_json(indent=2))
        partial.replace(path)
        return path

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        """The spec at `path`, or one line saying why this rank cannot take it."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"]) or "the file"
            raise RunSpecError(
                f"run spec {path}: {where}: {first['msg']}; the launcher and the ranks must run "
                f"the same splitstage (this rank reads run spec version {RUN_SPEC_VERSION})"
            ) from None


@dataclass(frozen=True)
class RankSetup:
    """What a rank trains with, made once: the spec it was handed, its plan and place in the
    job, the settings every checkpoint records, and the keys to train on (None: the manifest)."""

    spec: RunSpec
    plan: JobPlan
    dist: DistInfo
    settings: dict[str, Any]
    samples: KeyTable | None
