"""What the memory plan estimates, measured: the same stage-1 batch and stage-2 micro-step on the
real models (loaded from their files as the workers and ranks load them) and real tensors, under
the same tracker. For the checks of the plan (tests, bench/bench_memory_plan.py)."""

from __future__ import annotations

import torch

from splitstage.pipelines.runtime import collate_samples, split_batch
from splitstage.tasks.device import pick_dtype
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.memory.memory_plan import MemoryPlan, StageMemory
from splitstage.tasks.memory.stage_models import synthetic_sample
from splitstage.tasks.memory.tracked_step import stage1_peak, stage2_peak
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models

ONE_CPU_RANK = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


def measure_memory(plan: JobPlan) -> MemoryPlan:
    """Both stages' measured peaks on one CPU process (real weights, real tensors)."""
    config, family, device = plan.config, plan.family, torch.device("cpu")
    sample = synthetic_sample(plan)
    size = config.preprocess.batch_size
    stage1_models = {name: family.build_model(name, device) for name in plan.split.models["stage1"]}
    batch = collate_samples([dict(sample) for _ in range(size)])
    parts1, batch = stage1_peak(plan.v2_units, stage1_models, batch, device, family.settings())
    del stage1_models
    params = [p for p in plan.split.boundary_params if p in batch]
    cached = split_batch(batch, params, size)[0]
    unsplit = config.train.mode == "unsplit"
    names = list(family.model_names) if unsplit else None
    models = build_stage2_models(plan, ONE_CPU_RANK, names=names, log=lambda line: None).models
    one = dict(sample) if unsplit else cached
    inputs = collate_samples([dict(one) for _ in range(config.train.batch_size)])
    units = list(plan.units) if unsplit else plan.v1_units
    dtype = pick_dtype(config.train.mixed_precision, device)
    seed = config.job.seed
    parts2 = stage2_peak(family, units, models, inputs, config.train, device, dtype, seed)
    measured = "measured by torch's MemTracker on real tensors"
    return MemoryPlan(
        "cpu", StageMemory(parts1, measured), StageMemory(parts2, measured), None, [measured]
    )
