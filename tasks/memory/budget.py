"""The device budget: a stage estimated above `train.device_memory` is refused in one line that
names the estimate, the budget, the largest part and the settings that would fit (each with
its own estimate, computed as the plan is)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.tasks.device import pick_device
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.memory.memory_plan import MemoryPlan, device_budget, estimate_memory, gib

STAGE_WORDS = {"stage1": "stage 1 (one preprocess worker)", "stage2": "stage 2 (one rank)"}
Change = Callable[[SplitstageConfig], None]


class MemoryBudgetError(ConfigError):
    """A stage's estimated peak is above the device budget."""


def check_budget(
    plan: JobPlan, memory: MemoryPlan, stages: tuple[str, ...] = ("stage1", "stage2")
) -> None:
    """Refuse (one line) the first of `stages` whose estimate is above the budget."""
    budget = memory.budget_bytes
    if budget is None:
        return
    for stage in stages:
        estimate = getattr(memory, stage)
        if estimate is None or estimate.peak_bytes <= budget:
            continue
        part, size = estimate.largest_part()
        device = torch.device(memory.device)
        fits = [
            f"{words} ({gib(peak)} GiB)"
            for words, peak in fitting_settings(plan, stage, budget, device)
        ]
        tried = (
            "a smaller preprocess.batch_size"
            if stage == "stage1"
            else "gradient checkpointing, a bf16 base, a smaller batch with more accumulation"
        )
        more = "" if stage == "stage1" else " or use more FSDP ranks"
        fix = (
            f"settings that fit: {'; '.join(fits)}; or raise train.device_memory"
            if fits
            else f"none of the settings tried fits ({tried}); raise train.device_memory{more}"
        )
        raise MemoryBudgetError(
            f"train.device_memory: {STAGE_WORDS[stage]} needs an estimated "
            f"{gib(estimate.peak_bytes)} GiB, over the budget of {gib(budget)} GiB (largest "
            f"part: {part.replace('_', ' ')} {gib(size)} GiB); {fix}"
        )


def fitting_settings(
    plan: JobPlan, stage: str, budget: int, device: torch.device
) -> list[tuple[str, int]]:
    """(setting in words, its estimate) of each candidate that fits, cheapest change first."""
    found: list[tuple[str, int]] = []
    batch_fits = False
    for words, change in candidates(plan.config, stage):
        smaller_batch = "batch_size =" in words
        if smaller_batch and batch_fits:  # the largest batch that fits is the one to offer
            continue
        config = plan.config.model_copy(deep=True)
        change(config)
        try:
            memory = estimate_memory(make_plan(config), device, stage2=stage == "stage2")
            estimate = getattr(memory, stage)
        except ConfigError:  # a setting this job cannot take (the family refuses it)
            continue
        if estimate is not None and estimate.peak_bytes <= budget:
            found.append((words, estimate.peak_bytes))
            batch_fits = batch_fits or smaller_batch
    return found


def candidates(config: SplitstageConfig, stage: str) -> Iterator[tuple[str, Change]]:
    """The settings to try, each a change of a copy of the config, in the documented order."""
    if stage == "stage1":
        yield from _smaller_batches(config.preprocess.batch_size, "preprocess.batch_size", None)
        return
    train = config.train
    lora = config.trainable.lora_base_model is not None
    if not train.gradient_checkpointing:
        yield "train.gradient_checkpointing = true", _set(gradient_checkpointing=True)
    if lora and train.weight_dtype not in ("bf16", "fp16"):
        yield "train.weight_dtype = 'bf16'", _set(weight_dtype="bf16")
        if not train.gradient_checkpointing:
            yield (
                "train.gradient_checkpointing = true and train.weight_dtype = 'bf16'",
                _set(gradient_checkpointing=True, weight_dtype="bf16"),
            )
    accumulation = train.gradient_accumulation_steps
    yield from _smaller_batches(train.batch_size, "train.batch_size", accumulation)


def _set(**fields) -> Change:
    """A change setting [train] fields."""

    def change(config: SplitstageConfig) -> None:
        for name, value in fields.items():
            setattr(config.train, name, value)

    return change


def _smaller_batches(
    size: int, field_name: str, accumulation: int | None
) -> Iterator[tuple[str, Change]]:
    """Halved batch sizes down to 1; for training with accumulation keeping the global batch."""
    group, name = field_name.split(".")
    smaller = size // 2
    while smaller >= 1:
        words = f"{field_name} = {smaller}"
        steps = None
        if accumulation is not None:
            if size % smaller:
                smaller //= 2
                continue
            steps = accumulation * size // smaller
            words += f" with train.gradient_accumulation_steps = {steps}"

        def change(config: SplitstageConfig, smaller=smaller, steps=steps) -> None:
            setattr(getattr(config, group), name, smaller)
            if steps is not None:
                config.train.gradient_accumulation_steps = steps

        yield words, change
        smaller //= 2


def checked_memory_plan(
    plan: JobPlan, stages: tuple[str, ...] = ("stage1", "stage2")
) -> MemoryPlan:
    """Both stages' estimates where stage 2 would train, refused when one of `stages` is over
    the budget (`validate`: both; a `train` rank's checks: stage 2)."""
    memory = estimate_memory(plan)
    check_budget(plan, memory, stages)
    return memory


def check_stage1_memory(plan: JobPlan) -> None:
    """`preprocess`: refuse a worker estimated over the budget of its device (none on a CPU
    without train.device_memory: then nothing is estimated)."""
    device = pick_device(plan.config.preprocess.device)
    if device_budget(plan.config.train.device_memory, device) is None:
        return
    check_budget(plan, estimate_memory(plan, device, stage2=False), ("stage1",))
