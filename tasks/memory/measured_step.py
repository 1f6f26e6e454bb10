"""What the memory plan estimates, measured: the same stage-1 batch and stage-2 micro-step on the
real models (loaded from their files as the workers and ranks load them) and real tensors, under
the same tracker. For the checks of the plan (tests, bench/bench_memory_plan.py)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp import FSDPModule

from splitstage.pipelines.runtime import collate_samples, split_batch
from splitstage.tasks.device import pick_dtype
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.memory.memory_plan import MemoryPlan, StageMemory
from splitstage.tasks.memory.sharded_step import fsdp_world
from splitstage.tasks.memory.stage_models import synthetic_sample
from splitstage.tasks.memory.tracked_step import stage1_peak, stage2_peak
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models

ONE_CPU_RANK = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")


def measure_stage1(plan: JobPlan, device: torch.device) -> tuple[dict[str, int], dict]:
    """Stage 1's parts on one `preprocess` batch of the real models, and the cached params of
    one sample (what stage 2 reads); the models are gone when it returns."""
    config, family = plan.config, plan.family
    size = config.preprocess.batch_size
    models = {name: family.build_model(name, device) for name in plan.split.models["stage1"]}
    batch = collate_samples([dict(synthetic_sample(plan)) for _ in range(size)])
    parts, batch = stage1_peak(plan.v2_units, models, batch, device, family.settings())
    del models
    params = [p for p in plan.split.boundary_params if p in batch]
    return parts, split_batch(batch, params, size)[0]


def measure_stage2(
    plan: JobPlan, cached: dict, device: torch.device, rank: DistInfo | None = None
) -> dict[str, int]:
    """Stage 2's parts on one micro-step of the real models, built as a one-rank job builds
    them on `device` (or as `rank` of an open process group does: an FSDP model's micro-step
    is then tracked by FSDPMemTracker), from `cached` (the sample itself in unsplit mode)."""
    config, family = plan.config, plan.family
    unsplit = config.train.mode == "unsplit"
    names = list(family.model_names) if unsplit else None
    if rank is None:
        rank = ONE_CPU_RANK if device.type == "cpu" else DistInfo(0, 0, 1, device, "nccl")
    built = build_stage2_models(plan, rank, names=names, log=lambda line: None)
    models = built.models
    roots = [models[name] for name in built.trained if isinstance(models[name], FSDPModule)]
    sharded = roots[0] if len(roots) == 1 and fsdp_world(config) is not None else None
    one = dict(synthetic_sample(plan)) if unsplit else cached
    inputs = collate_samples([dict(one) for _ in range(config.train.batch_size)])
    units = list(plan.units) if unsplit else plan.v1_units
    dtype = pick_dtype(config.train.mixed_precision, device)
    seed = config.job.seed
    return stage2_peak(
        family, units, models, inputs, config.train, device, dtype, seed, sharded=sharded
    )


def measure_memory(plan: JobPlan, device: torch.device | None = None) -> MemoryPlan:
    """Both stages' measured peaks on one process (real weights, real tensors; CPU default)."""
    device = device or torch.device("cpu")
    parts1, cached = measure_stage1(plan, device)
    parts2 = measure_stage2(plan, cached, device)
    measured = "measured by torch's MemTracker on real tensors"
    return MemoryPlan(
        str(device), StageMemory(parts1, measured), StageMemory(parts2, measured), None, [measured]
    )
