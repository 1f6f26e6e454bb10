"""Build a job's stage-2 models (meta -> parallelize -> each rank reads its slices) and write the
trained model's gathered state dict, to compare a single-file load with a folder load.

Run: torchrun --nproc-per-node=N tests/integration/workers/single_file_worker.py CONFIG.json OUT
Writes OUT/state-rank0.safetensors (rank 0 only) and OUT/report-rank{r}.json (bytes read).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from splitstage.config.job import config_from_dict
from splitstage.process.leaving import leave
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.distributed import init_distributed
from splitstage.tasks.stage2.models import build_stage2_models


def main() -> None:
    """Build the models as stage 2 does; gather and write the trained one."""
    torch.set_num_threads(1)
    config = config_from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    info = init_distributed("cpu")
    plan = make_plan(config)
    stage2 = build_stage2_models(plan, info, log=lambda line: None)
    model = stage2.models[stage2.trained[0]]
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if info.rank == 0:
        save_file({k: v.contiguous() for k, v in state.items()}, out / "state-rank0.safetensors")
    (out / f"report-rank{info.rank}.json").write_text(json.dumps({"mode": stage2.mode}))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
