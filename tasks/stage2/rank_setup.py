"""A rank's set-up, made once per process before any weight loads: the plan, the checks, the
split every rank agrees on.

Every rank plans the job from the run spec; rank 0 alone runs the checks (`preflight`: the
mesh, the models' files, the cache, the batches, the outputs, a resume's settings) while the
others plan, then broadcasts what they found (JSON and the sample keys as raw bytes, no pickle),
with the levers `train.fit = "auto"` chose, which every rank sets on its own config alike.
A refusal is said once: rank 0 and each node's first rank leave its line in the run folder for
their node's launcher (`SetUpRefusedError`), nobody prints it, and every rank exits with 2.
"""

from __future__ import annotations

import json
from typing import Any

from splitstage.splitter import UserError
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.memory.fit import apply_fit
from splitstage.tasks.stage2.distributed import DistInfo, broadcast_bytes, init_distributed
from splitstage.tasks.stage2.outputs import SET_UP, record_rank_error
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.run_spec import RankSetup, RunSpec


class SetUpRefusedError(UserError, RuntimeError):
    """The set-up refused the run on rank 0; its line (and its class) is already recorded."""


def set_up_rank(spec: RunSpec) -> RankSetup:
    """Join the job, plan it and check it once (rank 0), and agree on the outcome."""
    train = spec.config.train  # fit may choose offload: host collectives join the group then
    dist = init_distributed(host_collectives=train.offload != "none" or train.fit == "auto")
    plan, mine, outcome, samples = None, None, {}, None
    try:
        plan = make_plan(spec.config)
        if dist.is_main:
            checks = preflight(plan, spec.places)
            for warning in checks.warnings:
                print(f"warning: {warning}", flush=True)
            for note in checks.notes:
                print(note, flush=True)
            samples = checks.samples
            outcome = {
                "settings": checks.settings,
                "split": plan.split.to_dict(),
                "fit": checks.fit,  # rank 0's choice (train.fit): every rank applies it
            }
    except (UserError, OSError) as error:  # bad input, or storage the checks could not read
        if isinstance(error, OSError) and error.errno is None:
            raise
        mine = error
        outcome = refusal(error)
    if not dist.is_main:
        outcome = {}
    outcome = json.loads(broadcast_bytes(json.dumps(outcome).encode() if dist.is_main else None))
    if "error" in outcome:
        record_refusal(spec, dist, outcome)
        raise SetUpRefusedError(outcome["error"])
    if mine is not None:  # refused here only: another package version on this node
        raise mine if isinstance(mine, UserError) else UserError(str(mine))
    assert plan is not None
    keys = broadcast_bytes(samples.to_bytes() if samples is not None else None)
    if not dist.is_main:
        check_same_split(plan, outcome["split"])
        apply_fit(spec.config, outcome.get("fit") or {})
        samples = KeyTable.from_bytes(keys, "rank 0's sample keys") if keys else None
    return RankSetup(spec, plan, dist, outcome["settings"], samples)


def refusal(error: UserError | OSError) -> dict[str, Any]:
    """What the launcher needs to raise `error` again: its line and the module and name of each
    of its classes (it raises the nearest one it has imported); an OSError's errno and path."""
    record: dict[str, Any] = {
        "error": str(error),
        "classes": [[cls.__module__, cls.__qualname__] for cls in type(error).__mro__],
    }
    if isinstance(error, OSError):
        filename = None if error.filename is None else str(error.filename)
        record["os"] = {"errno": error.errno, "strerror": error.strerror, "filename": filename}
    return record


def record_refusal(spec: RunSpec, dist: DistInfo, outcome: dict[str, Any]) -> None:
    """Leave the refusal in this node's run folder (rank 0 and each node's first rank; the
    first writer wins) for the launcher, which says it as one line."""
    if not (dist.is_main or dist.local_rank == 0):
        return
    record = {"rank": dist.rank, "phase": SET_UP, "message": outcome["error"], **outcome}
    record_rank_error(spec.places.run_dir, record)


def check_same_split(plan: JobPlan, main_split: dict[str, Any]) -> None:
    """A rank trains the split rank 0 checked and showed, or stops: a family whose units or
    models differ between nodes (another package version, an environment-dependent unit) would
    otherwise train a split nobody saw."""
    mine = plan.split.to_dict()
    differing = sorted(
        k for k in ("v1", "v2", "boundary_params", "models") if mine[k] != main_split.get(k)
    )
    if differing:
        raise UserError(
            f"this rank split pipeline {mine['pipeline']!r} differently from rank 0 "
            f"({', '.join(differing)} differ: {mine[differing[0]]} here, "
            f"{main_split.get(differing[0])} on rank 0); install the same splitstage and "
            "family packages on every node"
        )
