"""`train.fit = "auto"`: the cheapest levers that bring stage 2 under the device budget.

The levers are tried in the documented order (docs/job-config.md), each added to the ones
before it: gradient checkpointing; a bf16 frozen base (LoRA); the micro-batch halved down to 1
with more accumulation (the global batch kept); FSDP over the job's own ranks (when it has
several and runs `ddp`); a quantized base, int8 then NF4 (LoRA, where `check_memory_levers`
allows; in place of FSDP); NF4 with FSDP over those ranks (QLoRA + FSDP2: each rank holds its
share of the NF4 base); the quantized base's last N blocks in host
memory (`offload = N`: the job's own kind or int8, N = 2, 4, 8, ... then every block: the
smallest power of two that fits); CPU offload (in place of quantization). A lever the job
cannot use is skipped. Each candidate costs one estimate (one fake step); the
first that fits is kept. Rank 0 chooses (`tasks/stage2/preflight.py`), every rank applies the
same overrides (`rank_setup.py`), the run records them and a resume re-uses them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from splitstage.config.job import ConfigError, SplitstageConfig, check_memory_levers
from splitstage.tasks.device import pick_dtype
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.memory.budget import STAGE_WORDS, MemoryBudgetError
from splitstage.tasks.memory.memory_plan import MemoryPlan, estimate_memory, gib
from splitstage.tasks.stage2.block_swap import repeated_blocks
from splitstage.tasks.stage2.models import parallel_mode

Overrides = dict[str, Any]  # [train] field -> value


@dataclass
class FitChoice:
    """What `train.fit = "auto"` did: the [train] overrides, in words, and why."""

    overrides: Overrides
    outcome: str  # 'chosen', 'fits' (nothing needed), 'recorded' (a resume), 'no budget'
    peak_bytes: int | None = None  # stage 2's estimate with the overrides
    step: int | None = None  # the checkpoint step a recorded choice came from

    def words(self) -> str:
        """The overrides as config lines: "train.batch_size = 2, ..." (or 'nothing')."""
        return ", ".join(lever_words(k, v) for k, v in self.overrides.items()) or "nothing"

    def line(self) -> str:
        """What fit did, in one line (validate, the dashboard, the run's log)."""
        what = {
            "chosen": f"chose {self.words()}",
            "fits": "the job fits the budget as configured: nothing changed",
            "recorded": f"re-uses the choice recorded in checkpoint step {self.step} of this "
            f"run ({self.words()}), not a new one",
            "no budget": "no device budget (a CPU without train.device_memory): nothing changed",
        }[self.outcome]
        peak = f" (stage 2: {gib(self.peak_bytes)} GiB)" if self.peak_bytes is not None else ""
        return f"train.fit = 'auto': {what}{peak}"

    def to_dict(self) -> dict[str, Any]:
        """`memory.fit` of `validate --json`."""
        return {
            "mode": "auto",
            "outcome": self.outcome,
            "overrides": dict(self.overrides),
            "chosen": self.words(),
            "peak_bytes": self.peak_bytes,
            "recorded_step": self.step,
        }


def lever_words(name: str, value: Any) -> str:
    """'train.gradient_checkpointing = true'."""
    shown = str(value).lower() if isinstance(value, bool) else repr(value)
    return f"train.{name} = {shown}"


def apply_fit(config: SplitstageConfig, overrides: Overrides) -> None:
    """Set the chosen [train] fields on `config` (in place: the plan and the trainer hold it)."""
    for name, value in overrides.items():
        setattr(config.train, name, value)


def fit_candidates(
    config: SplitstageConfig, device: torch.device, blocks: int | None = None
) -> Iterator[Overrides]:
    """The override sets to try, cheapest first, each adding a lever to the ones before it;
    `blocks`: the LoRA base's repeated blocks (counted on meta when not given)."""
    train = config.train
    lora = config.trainable.lora_base_model is not None
    kept: Overrides = {}
    if not train.gradient_checkpointing:
        kept = {"gradient_checkpointing": True}
        yield dict(kept)
    sixteen = train.weight_dtype in ("bf16", "fp16") or (
        train.weight_dtype == "auto" and pick_dtype(train.mixed_precision, device).itemsize == 2
    )
    if lora and not sixteen and train.base_quantization == "none":
        kept["weight_dtype"] = "bf16"
        yield dict(kept)
    size, accumulation = train.batch_size, train.gradient_accumulation_steps
    for smaller in (size >> shift for shift in range(1, size.bit_length())):
        if size % smaller == 0:
            kept |= {
                "batch_size": smaller,
                "gradient_accumulation_steps": accumulation * size // smaller,
            }
            yield dict(kept)
    if train.nnodes * train.nproc_per_node > 1 and train.parallelism == "ddp":
        kept["parallelism"] = "fsdp"
        yield dict(kept)
    unsharded = {k: v for k, v in kept.items() if k != "parallelism"}
    stronger = {"none": ("int8", "nf4"), "int8": ("nf4",), "fp8": ("nf4",)}
    for kind in stronger.get(train.base_quantization, ()) if lora else ():
        yield unsharded | {"base_quantization": kind}
    if lora and kept.get("parallelism") == "fsdp":  # NF4 sharded over the job's FSDP ranks
        yield kept | {"base_quantization": "nf4"}
    if lora and train.offload == "none":  # a quantized base's blocks in host memory
        kind = "int8" if train.base_quantization == "none" else train.base_quantization
        swapped = unsharded | {"base_quantization": kind, "gradient_checkpointing": True}
        for count in swap_counts(blocks if blocks is not None else base_blocks(config)):
            yield swapped | {"offload": count}
    if train.offload == "none":
        plain = {"base_quantization": "none"} if train.base_quantization != "none" else {}
        yield kept | {"offload": "cpu", **plain}


def swap_counts(blocks: int) -> list[int]:
    """The `offload = N` tried, fewest first: 2, 4, 8, ... below `blocks`, then all of them (a
    fake step each: the smallest power of two that fits, in log2(blocks) estimates). One block
    is not tried: the device holds a swapped block while it runs, so one saves nothing."""
    powers = [1 << shift for shift in range(1, max(blocks - 1, 0).bit_length())]
    return [*powers, blocks] if blocks > 1 else []


def base_blocks(config: SplitstageConfig) -> int:
    """How many repeated blocks the LoRA base has (built on meta)."""
    plan = make_plan(config)
    return len(repeated_blocks(plan.meta_model(config.trainable.lora_base_model)))


def usable(config: SplitstageConfig, plan: JobPlan) -> bool:
    """The levers of `config` can run for this job (else the candidate is skipped)."""
    try:
        check_memory_levers(config.train, config.trainable)
        train = config.train
        if train.parallelism != "pp":  # the mesh fits the world (pp's own checks ran already)
            parallel_mode(config, train.nnodes * train.nproc_per_node)
        if config.train.gradient_checkpointing:
            for name in config.trainable.models():
                plan.family.check_gradient_checkpointing(name)
    except (ValueError, ConfigError):
        return False
    return True


def choose_fit(plan: JobPlan, memory: MemoryPlan) -> tuple[FitChoice, MemoryPlan]:
    """The first candidate whose stage 2 fits the budget, and its memory plan; refused in one
    line when none does (nothing is estimated past the first that fits)."""
    budget, current = memory.budget_bytes, memory.stage2
    if budget is None or current is None:
        return FitChoice({}, "no budget"), memory
    if current.peak_bytes <= budget:
        return FitChoice({}, "fits", current.peak_bytes), memory
    device = torch.device(memory.device)
    tried: list[tuple[Overrides, int]] = []
    base = plan.config.trainable.lora_base_model
    blocks = len(repeated_blocks(plan.meta_model(base))) if base is not None else 0
    for overrides in fit_candidates(plan.config, device, blocks):
        config = plan.config.model_copy(deep=True)
        apply_fit(config, overrides)
        if not usable(config, plan):
            continue
        try:
            fitted = estimate_memory(make_plan(config), device)
        except (ConfigError, NotImplementedError):  # a setting the family cannot take
            continue
        assert fitted.stage2 is not None
        if fitted.stage2.peak_bytes <= budget:
            return FitChoice(overrides, "chosen", fitted.stage2.peak_bytes), fitted
        tried.append((overrides, fitted.stage2.peak_bytes))
    raise MemoryBudgetError(refusal(memory, tried))


def refusal(memory: MemoryPlan, tried: list[tuple[Overrides, int]]) -> str:
    """The one line when no set of levers fits: the estimate, the budget, what was tried."""
    assert memory.stage2 is not None and memory.budget_bytes is not None
    part, size = memory.stage2.largest_part()
    lowest = min(tried, key=lambda item: item[1], default=None)
    best = (
        f"the lowest, {FitChoice(lowest[0], 'chosen').words()}, needs {gib(lowest[1])} GiB"
        if lowest
        else "this job can use none of its levers"
    )
    return (
        f"train.device_memory: {STAGE_WORDS['stage2']} needs an estimated "
        f"{gib(memory.stage2.peak_bytes)} GiB, over the budget of {gib(memory.budget_bytes)} "
        f"GiB (largest part: {part.replace('_', ' ')} {gib(size)} GiB); train.fit = 'auto' "
        f"tried {len(tried)} sets of levers and none fits ({best}); raise "
        "train.device_memory, or train on more ranks or a smaller model"
    )


def recorded_fit(saved: dict[str, Any] | None) -> Overrides | None:
    """The overrides a checkpoint's run settings record (None: that run did not fit)."""
    fit = (saved or {}).get("fit")
    return dict(fit["overrides"]) if isinstance(fit, dict) and "overrides" in fit else None
