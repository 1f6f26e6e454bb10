"""Stage 2's rank: read the run spec, set up once, train, leave the group.

    torchrun --nproc-per-node N -m splitstage.tasks.stage2.worker RUN_DIR/spec.json

(A one-process job runs the same command without torchrun's agent:
`splitstage/process/torchrun.py`.)
The set-up (`rank_setup.set_up_rank`: plan, checks on rank 0, the split every rank agrees on)
runs before any weight loads; a refusal there is left in RUN_DIR/error.json for the launcher to
say once. A rank that stops later on bad input (a `UserError`: a diverged loss, a cache it cannot
read) says its one-line reason, leaves it in RUN_DIR/error.json and exits with 2.
"""

from __future__ import annotations

import faulthandler
import os
import sys

from splitstage.process.leaving import leave
from splitstage.process.unused_imports import skip_unused_libraries
from splitstage.splitter import UserError
from splitstage.tasks.stage2.outputs import record_rank_error
from splitstage.tasks.stage2.run_spec import RunSpec, RunSpecError


def report_error(run_dir: str, error: UserError) -> None:
    """Leave the reason for the launcher (the first rank to write wins), then say it."""
    rank = int(os.environ.get("RANK", "0"))
    print(f"[rank{rank}] splitstage: error: {error}", file=sys.stderr, flush=True)
    record_rank_error(run_dir, {"rank": rank, "message": str(error)})


def machine_error(error: BaseException) -> str | None:
    """The one line for a write that failed for want of space or a read-only disk (ENOSPC,
    EDQUOT, EFBIG, EROFS) anywhere in the rank, naming the file; None for anything else."""
    import errno

    from splitstage.storage.files import StorageError, translate_error
    from splitstage.tasks.stage2.safe_dcp import write_cause

    cause = write_cause(error, [])
    machine = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS)
    if cause is None or cause.errno not in machine:
        return None
    mapped = translate_error(cause, str(cause.filename or "a file"), "write")
    return str(mapped) if isinstance(mapped, StorageError) else None


def main(argv: list[str] | None = None) -> int:
    """Train this rank of the run the spec file describes; 2 on bad input."""
    argv = sys.argv[1:] if argv is None else argv
    faulthandler.enable(all_threads=True)  # a rank killed by a signal shows where it was
    try:
        spec = RunSpec.read(argv[0])
    except RunSpecError as error:  # another splitstage wrote it: one line, no traceback
        print(f"splitstage: error: {error}", file=sys.stderr, flush=True)
        return 2
    skip_unused_libraries(spec.config.model_dump(mode="json"))  # this process serves this one job
    from torch.distributed.checkpoint.api import CheckpointException

    from splitstage.tasks.stage2.distributed import close_distributed
    from splitstage.tasks.stage2.rank_setup import SetUpRefusedError, set_up_rank

    try:
        setup = set_up_rank(spec)
        if spec.config.train.parallelism == "pp":  # torch's pipelining: ~1 s of imports
            from splitstage.tasks.stage2.pp_trainer import PipelineTrainer as trainer_cls
        else:
            from splitstage.tasks.stage2.trainer import Trainer as trainer_cls
        trainer_cls(setup).run()
        close_distributed(barrier=True)
    except SetUpRefusedError:  # rank 0's refusal: recorded for the launcher, said once
        return 2
    except UserError as error:
        report_error(spec.places.run_dir, error)
        return 2
    except (Exception, CheckpointException) as error:  # DCP's is a BaseException
        # a write into a folder deleted mid-run, or a full / read-only disk: one line
        gone = spec.places.deleted(spec.holds_lease)
        full = machine_error(error) if gone is None else None
        if gone is None and full is None:
            raise
        reason = full or f"the folder {gone} was deleted while training ({type(error).__name__})"
        report_error(spec.places.run_dir, UserError(reason))
        return 2
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    leave(main())
