"""Stage 2 entry point under torchrun: read the run spec, pick the trainer, train, leave the group.

torchrun --nproc-per-node N -m splitstage.tasks.stage2.worker RUN_DIR/spec.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.pp_trainer import PipelineTrainer
from splitstage.tasks.stage2.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    """Train one rank to the end of the run the spec file describes."""
    argv = sys.argv[1:] if argv is None else argv
    spec = json.loads(Path(argv[0]).read_text())
    pipelined = spec["config"]["train"]["parallelism"] == "pp"
    trainer_cls = PipelineTrainer if pipelined else Trainer
    try:
        trainer_cls(spec).run()
    finally:
        close_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
