"""The memory plan: each stage's peak device memory per rank, by part, before launch.

Computed, not guessed: the stage's models built on the meta device from the folder's configs,
made fake, and one stage-1 batch and one stage-2 micro-step of the ranks' own code run under
torch's FakeTensorMode with its MemTracker (`tracked_step`). FSDP is estimated on the trained
model as `fully_shard` shards it over a fake process group, under torch's FSDPMemTracker
(`sharded_step`); tensor parallelism alone (and FSDP where that cannot run) divides the sharded
parts by the ranks that share them; a fixed allowance stands for the CUDA context and the
allocator on a GPU.
"""

from __future__ import annotations

import contextlib
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from splitstage.config.job import SplitstageConfig
from splitstage.pipelines.runtime import collate_samples, split_batch
from splitstage.tasks.device import pick_device, pick_dtype
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.memory.sharded_step import fake_world, fsdp_world, shard_trained
from splitstage.tasks.memory.stage_models import (
    fake,
    quantize_base,
    stage_models,
    synthetic_sample,
)
from splitstage.tasks.memory.tracked_step import stage1_peak, stage2_peak, storage_bytes
from splitstage.tasks.stage2.block_swap import swapped_blocks, swapped_frozen
from splitstage.tasks.stage2.models import parallel_mode
from splitstage.tasks.stage2.parallelize import find_blocks

GIB = 2**30
# The CUDA context, cuBLAS/cuDNN workspaces and the caching allocator's rounding, per process
# on a GPU (measured contexts are 0.3-0.6 GiB; the rest is headroom for fragmentation).
CUDA_ALLOWANCE_BYTES = GIB
SHARDED_PARTS = ("trained_params", "gradients", "optimizer_state", "ema")
PART_ORDER = (
    "frozen_weights",
    "trained_params",
    "gradients",
    "optimizer_state",
    "ema",
    "gathered_blocks",
    "activations",
    "inputs",
    "offload_window",
    "cuda_context",
)


@dataclass
class StageMemory:
    """One stage's estimated peak per rank (or worker) and its parts, in bytes."""

    parts: dict[str, int]
    settings: str  # what it was estimated for: 'batch 2 of 512x512, ...'

    @property
    def peak_bytes(self) -> int:
        """The sum of the parts at the peak."""
        return sum(self.parts.values())

    def largest_part(self) -> tuple[str, int]:
        """(name, bytes) of the largest part."""
        return max(self.parts.items(), key=lambda item: item[1])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: peak_bytes, parts, settings."""
        return {"peak_bytes": self.peak_bytes, "parts": dict(self.parts), "settings": self.settings}


@dataclass
class MemoryPlan:
    """Both stages' estimates, the device they are for, and the budget (None: no limit)."""

    device: str
    stage1: StageMemory | None
    stage2: StageMemory | None
    budget_bytes: int | None
    notes: list[str] = field(default_factory=list)
    fit: Any = None  # what train.fit = 'auto' did (`fit.FitChoice`); None when fit is off

    def to_dict(self) -> dict[str, Any]:
        """The `memory` object of `splitstage validate --json`."""
        return {
            "device": self.device,
            "device_budget_bytes": self.budget_bytes,
            "stage1": self.stage1.to_dict() if self.stage1 else None,
            "stage2": self.stage2.to_dict() if self.stage2 else None,
            "stage1_workers_per_device": self.workers_per_device(),
            "fit": self.fit.to_dict() if self.fit is not None else None,
            "notes": list(self.notes),
        }

    def workers_per_device(self) -> int | None:
        """How many stage-1 workers the budget holds (None without a budget)."""
        if self.budget_bytes is None or self.stage1 is None:
            return None
        return self.budget_bytes // max(1, self.stage1.peak_bytes)

    def rows(self) -> list[tuple[str, str, str]]:
        """(part, stage 1, stage 2) in GiB, the peak last: the table's rows."""
        stages = [self.stage1, self.stage2]
        found = [stage.parts if stage else {} for stage in stages]
        rows = [
            (part, *(gib(parts[part]) if part in parts else "-" for parts in found))
            for part in PART_ORDER
            if any(part in parts for parts in found)
        ]
        peaks = [gib(stage.peak_bytes) if stage else "-" for stage in stages]
        return [*rows, ("peak per rank", *peaks)]

    def lines(self) -> list[str]:
        """The plan as text: a table, what each stage was estimated for, and the budget."""
        budget = f"{gib(self.budget_bytes)} GiB" if self.budget_bytes else "none"
        head = f"memory plan on {self.device} (GiB per rank; budget: {budget})"
        width = max(len(row[0]) for row in self.rows())
        lines = [head, f"  {'part':<{width}}  {'stage 1':>8}  {'stage 2':>8}"]
        lines += [f"  {a:<{width}}  {b:>8}  {c:>8}" for a, b, c in self.rows()]
        for words, stage in (("stage 1", self.stage1), ("stage 2", self.stage2)):
            if stage is not None:
                lines.append(f"  {words}: {stage.settings}")
        if self.workers_per_device() is not None:
            lines.append(f"  preprocess workers that fit one device: {self.workers_per_device()}")
        if self.fit is not None:
            lines.append(f"  {self.fit.line()}")
        return lines + [f"  note: {note}" for note in self.notes]


def gib(count: int | None) -> str:
    """Bytes in GiB: 2 decimals from 1 GiB up, 3 significant digits below."""
    if count is None:
        return "-"
    value = count / GIB
    small = f"{value:.3g}"
    return f"{value:.2f}" if value >= 1 else small if "e" not in small else f"{value:.6f}"


def device_budget(config_bytes: int | None, device: torch.device) -> int | None:
    """`train.device_memory`, else the GPU's own memory; None on a CPU."""
    if config_bytes is not None:
        return config_bytes
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None


def estimate_memory(
    plan: JobPlan, device: torch.device | None = None, *, stage2: bool = True
) -> MemoryPlan:
    """Both stages' peak memory per rank on `device` (default: where stage 2 would train);
    stage 1 alone without `stage2` (its batch gives stage 2's inputs: it always runs)."""
    config = plan.config
    if not plan.family.fake_steps:
        raise NotImplementedError(
            f"the {plan.family.name} family cannot step on fake tensors: "
            f"{plan.family.no_fake_steps_because}"
        )
    device = device or pick_device()
    world = fsdp_world(config) if stage2 else None
    if world is not None and dist.is_initialized():
        return _estimate_in_a_fresh_process(config, device)
    with fake_world(*world) if world else contextlib.nullcontext() as mesh:
        first, second = _estimate_stages(plan, device, stage2, mesh)
    if device.type == "cuda":
        for stage in (first, second):
            if stage is not None:
                stage.parts["cuda_context"] = CUDA_ALLOWANCE_BYTES
    notes = [
        "estimated by torch's MemTracker on one stage-1 batch and one stage-2 micro-step of "
        "fake tensors (no weights read)"
    ]
    mode_name, shards = sharding(config)
    if world is not None:
        notes.append(
            f"{mode_name}: stage 2 estimated by torch's FSDPMemTracker on the trained model as "
            f"fully_shard shards it over a fake process group of {shards} ranks (rank 0's "
            "shards; gathered_blocks: the blocks all-gathered in forward and backward, and "
            "their gradients before the reduce-scatter, which with gradient accumulation each "
            "rank holds unsharded for the whole model until the update's last backward)"
        )
    elif shards > 1:
        notes.append(
            f"{mode_name}: the trained model's weights, gradients, optimizer state and EMA are "
            f"divided by the {shards} ranks sharding them"
            + (
                "; the all-gathered block FSDP holds in forward and backward is not counted"
                if "fsdp" in mode_name
                else ""
            )
        )
    if config.train.offload == "cpu":
        notes.append(
            "offload: the trained model's weights, gradients, optimizer state and EMA are in "
            "host memory; the device holds two of its blocks' weights at a time (offload_window)"
        )
    if isinstance(config.train.offload, int):
        notes.append(
            f"offload = {config.train.offload}: the frozen weights of the trained model's last "
            f"{config.train.offload} blocks are in host memory; the device holds the largest "
            "of them while it runs (offload_window: one block, copied as it runs, no prefetch)"
        )
    if config.train.base_quantization != "none":
        notes.append(
            f"base_quantization {config.train.base_quantization}: the frozen base as torchao "
            "holds it (quantized on the fake weights the same way stage 2 quantizes at load)"
        )
    if mode_name == "pp":
        notes.append(
            "pp: estimated as if one rank held the whole denoiser (each stage holds a part of "
            "it: an upper bound)"
        )
    budget = device_budget(config.train.device_memory, device)
    return MemoryPlan(str(device), first, second, budget, notes)


def _estimate_stages(
    plan: JobPlan, device: torch.device, stage2: bool, mesh: Any
) -> tuple[StageMemory, StageMemory | None]:
    """Stage 1's and (with `stage2`) stage 2's parts on fake tensors; with `mesh` (a fake
    world), the trained model sharded on it as the ranks shard it."""
    sample = synthetic_sample(plan)
    stages = ("stage1", "stage2") if stage2 else ("stage1",)
    built = {stage: stage_models(plan, stage, device) for stage in stages}
    sharded = shard_trained(plan, built["stage2"], mesh) if mesh is not None else None
    # Built on meta outside the mode, made fake in it. The step runs outside it: ops on fake
    # tensors stay fake, while what a step makes from constants (a scheduler's tables, the
    # draws) is real and small, so the ranks' `.item()` on them works.
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fakes = {stage: {n: fake(m) for n, m in models.items()} for stage, models in built.items()}
        if stage2:
            quantize_base(plan, fakes["stage2"])
        sample = {k: mode.from_tensor(v) if torch.is_tensor(v) else v for k, v in sample.items()}
    first, cached = _stage1(plan, sample, fakes["stage1"], device)
    if not stage2:
        return first, None
    return first, _stage2(plan, sample, cached, fakes["stage2"], device, sharded)


def _estimate_in_a_fresh_process(config: SplitstageConfig, device: torch.device) -> MemoryPlan:
    """The plan computed in a child process: this one has a real process group (a rank), and
    the fake one FSDP is estimated on would replace it."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_estimate_from_config, config, str(device)).result()


def _estimate_from_config(config: SplitstageConfig, device: str) -> MemoryPlan:
    """`estimate_memory` of a job's config (the child process's entry)."""
    return estimate_memory(make_plan(config), torch.device(device))


def sharding(config: SplitstageConfig) -> tuple[str, int]:
    """(parallelism, ranks that shard the trained model: FSDP and TP; 1 for DDP and PP)."""
    train = config.train
    if train.parallelism == "pp":
        return "pp", 1
    mode, dp, tp = parallel_mode(config, train.nnodes * train.nproc_per_node)
    return mode, dp * tp if mode in ("fsdp", "fsdp+tp", "tp") else 1


def _stage1(plan: JobPlan, sample: dict[str, Any], models: dict[str, Any], device: torch.device):
    """Stage 1's parts per worker (a preprocess batch) and one sample's boundary params."""
    config = plan.config
    size = config.preprocess.batch_size
    batch = collate_samples([dict(sample) for _ in range(size)])
    parts, batch = stage1_peak(plan.v2_units, models, batch, device, plan.family.settings())
    params = plan.split.boundary_params
    cached = split_batch(batch, [p for p in params if p in batch], size)[0]
    what = f"{', '.join(models) or 'no models'}; preprocess.batch_size {size}"
    return StageMemory(parts, f"{what}, {_shape_words(sample)}"), cached


def _stage2(
    plan: JobPlan,
    sample: dict[str, Any],
    cached: dict[str, Any],
    models: dict[str, Any],
    device: torch.device,
    sharded: Any = None,
) -> StageMemory:
    """Stage 2's parts per rank: one micro-step at train.batch_size; with `sharded` (the trained
    model as fully_shard wrapped it) under FSDPMemTracker, its parts already the rank's."""
    config = plan.config
    train = config.train
    unsplit = train.mode == "unsplit"
    one = dict(sample) if unsplit else cached
    inputs = collate_samples([dict(one) for _ in range(train.batch_size)])
    units = list(plan.units) if unsplit else plan.v1_units
    dtype = pick_dtype(train.mixed_precision, device)
    seed = config.job.seed
    parts = stage2_peak(
        plan.family, units, models, inputs, train, device, dtype, seed, sharded=sharded
    )
    _, shards = sharding(config)
    trained = [models[name] for name in config.trainable.models() if name in models]
    frozen = [p for m in trained for p in m.parameters() if not p.requires_grad]
    if train.offload == "cpu":  # on the host; the device holds a block and the next one's
        parts["frozen_weights"] -= storage_bytes(frozen)
        for part in SHARDED_PARTS:
            parts[part] = 0
        parts["offload_window"] = 2 * max(
            (storage_bytes(list(block.parameters())) for m in trained for block in find_blocks(m)),
            default=0,
        )
    elif isinstance(train.offload, int):  # the LoRA base's last N blocks' frozen weights on
        base = models.get(config.trainable.lora_base_model)  # the host, one on the device
        swapped = [swapped_frozen([b]) for b in swapped_blocks(base, train.offload)]
        parts["frozen_weights"] -= storage_bytes([p for block in swapped for p in block])
        parts["offload_window"] = max(map(storage_bytes, swapped), default=0)
    elif shards > 1 and sharded is None:
        parts["frozen_weights"] -= storage_bytes(frozen) - storage_bytes(frozen) // shards
        for part in SHARDED_PARTS:
            parts[part] //= shards
    checkpointing = "on" if train.gradient_checkpointing else "off"
    what = (
        f"train.batch_size {train.batch_size}, {_shape_words(sample)}, gradient checkpointing "
        f"{checkpointing}, optimizer {train.optimizer}, compute {str(dtype).removeprefix('torch.')}"
    )
    return StageMemory(parts, what)


def _shape_words(sample: dict[str, Any]) -> str:
    """'512x768 px' (and 'x 81 frames' for a clip) of the synthetic sample."""
    words = f"{sample.get('height', '?')}x{sample.get('width', '?')} px"
    frames = sample.get("num_frames")
    return f"{words} x {frames} frames" if isinstance(frames, int) and frames > 1 else words
