"""Train a family's denoiser LoRA for a few steps on one fixed batch, under the job's parallelism.

Run: torchrun --nproc-per-node=N tests/integration/workers/family_fsdp_worker.py CONFIG.json OUT
Every rank sees the same batch and the same draws, so N FSDP ranks must give the one-process
losses and adapter weights: sharding, loading the slices and the gradient reduction are exact.
Writes OUT/result-rank{r}.json (losses), OUT/lora-rank{r}.safetensors (gathered adapters) and,
with [validation] prompts, rank 0's sample grid OUT/samples/update-000003.png.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.process.leaving import leave
from splitstage.tasks.cache.validation_prompts import encode
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.distributed import init_distributed
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.validation import Validator

STEPS = 3


def main() -> None:
    """Build, train STEPS steps with AdamW, write losses and the gathered LoRA tensors."""
    torch.set_num_threads(1)
    config = config_from_dict(json.loads(Path(sys.argv[1]).read_text()))
    out = Path(sys.argv[2])
    info = init_distributed("cpu")
    plan = make_plan(config)
    family = plan.family
    base = config.data.base_path
    rows = load_metadata(base)[: config.train.batch_size]
    batch = collate_samples([family.load_sample(row, base) for row in rows])
    frozen = {name: family.build_model(name, info.device) for name in plan.split.models["stage1"]}
    settings = family.settings()
    run_units(plan.v2_units, StepContext(frozen, info.device, settings=settings), batch)
    stage2 = build_stage2_models(plan, info)
    optimizer = torch.optim.AdamW(stage2.parameters(), lr=1e-3)
    losses = []
    for step in range(STEPS):
        inputs = dict(batch)
        generator = torch.Generator().manual_seed(step)
        ctx = StepContext(stage2.models, info.device, Draws.shared(generator), settings)
        run_units(plan.v1_units, ctx, inputs)
        loss = family.training_loss(ctx, inputs)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if config.validation.enabled:  # sample with the trained model: the same grid on any layout
        validator = Validator(
            plan, stage2.models, info.device, str(out), is_main=info.is_main, log=print
        )
        validator.cached = encode(
            plan, frozen, info.device, config.validation.prompts, config.validation.negatives()
        )
        validator.sample_and_write(STEPS)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    state = get_model_state_dict(stage2.models[family.denoiser], options=options)
    rank = info.rank
    (out / f"result-rank{rank}.json").write_text(json.dumps({"losses": losses}))
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(out / f"lora-rank{rank}.safetensors")
    )
    if dist.is_initialized():
        dist.barrier()  # no rank tears gloo down while a peer still has work in flight
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    leave(0)  # as a rank leaves: no interpreter teardown, where torch threads can abort
