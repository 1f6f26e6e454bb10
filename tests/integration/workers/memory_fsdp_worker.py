"""Measure one stage-2 micro-step per rank of an FSDP job, as the memory plan estimates it.

Run: torchrun --nproc-per-node=2 tests/integration/workers/memory_fsdp_worker.py CONFIG.json OUT
Each rank builds its stage-2 models as a training rank does (sharded, its slices loaded), runs
the plan's micro-step on real tensors under torch's FSDPMemTracker and writes its parts to
OUT/parts-rank{r}.json.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from splitstage.config.job import config_from_dict
from splitstage.process.leaving import leave
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.measured_step import measure_stage1, measure_stage2
from splitstage.tasks.stage2.distributed import init_distributed


def main() -> None:
    """Stage 1's batch (for the cached inputs), then this rank's measured stage-2 parts."""
    torch.set_num_threads(1)
    config = config_from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    info = init_distributed("cpu")
    plan = make_plan(config)
    _, cached = measure_stage1(plan, info.device)
    parts = measure_stage2(plan, cached, info.device, rank=info)
    (out / f"parts-rank{info.rank}.json").write_text(json.dumps(parts))
    dist.barrier()  # no rank tears gloo down while a peer still has work in flight
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
