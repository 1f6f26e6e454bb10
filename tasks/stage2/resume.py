"""Resuming a run after its config changed: continue exactly with the new settings, or refuse.

A checkpoint records the settings of its run (`run_settings`) and its position in the epoch as
samples consumed by all replicas. Batch size, accumulation and the number of data-parallel
replicas may change: the epoch continues with the samples not yet seen (each once, see
`cache.reader.epoch_order`); optimizer settings (learning rate, weight decay, warmup) apply from
the resume point on; each change is said. What fixes the sample stream itself (seed, the sample
set, the mode) or the trained tensors (which model, LoRA rank, alpha, targets) cannot continue:
refused, naming what changed and how to start fresh. Run length (epochs, max_steps) and
logging/checkpoint cadence may change freely.
"""

from __future__ import annotations

from typing import Any

from splitstage.config.job import SplitstageConfig
from splitstage.splitter import UserError

# Settings that fix the sample stream or the trained tensors: a change is refused.
FIXED = {
    "seed": "job.seed",
    "samples": "the cached samples (the data set or the cache changed)",
    "mode": "train.mode",
    "trained": "trainable.full / trainable.lora_base_model",
    "lora_rank": "trainable.lora_rank",
    "lora_alpha": "trainable.lora_alpha",
    "lora_targets": "trainable.lora_target_modules",
}
# Applied from the resume point on: the epoch's remaining samples, the new optimizer settings.
APPLIED = {
    "batch_size": "train.batch_size",
    "gradient_accumulation_steps": "train.gradient_accumulation_steps",
    "data_parallel": "the data-parallel degree (world size / train.tp_degree)",
    "learning_rate": "train.learning_rate",
    "weight_decay": "train.weight_decay",
    "warmup_steps": "train.warmup_steps",
}


class ResumeConfigError(UserError, ValueError):
    """The config changed in a way that cannot continue the checkpointed run exactly."""


def run_settings(
    config: SplitstageConfig, *, data_parallel: int, samples: str, lora_targets: list[str]
) -> dict[str, Any]:
    """The settings a checkpoint records (`samples`: a digest of the training sample keys)."""
    train, trainable = config.train, config.trainable
    lora = trainable.lora_base_model is not None
    return {
        "seed": config.job.seed,
        "batch_size": train.batch_size,
        "gradient_accumulation_steps": train.gradient_accumulation_steps,
        "data_parallel": data_parallel,
        "samples": samples,
        "mode": train.mode,
        "trained": trainable.models(),
        "lora_rank": trainable.lora_rank if lora else None,
        "lora_alpha": (trainable.lora_alpha or trainable.lora_rank) if lora else None,
        "lora_targets": sorted(lora_targets) if lora else None,
        "learning_rate": train.learning_rate,
        "weight_decay": train.weight_decay,
        "warmup_steps": train.warmup_steps,
    }


def compare(
    saved: dict[str, Any] | None, now: dict[str, Any], *, step: int, checkpoint_url: str
) -> list[str]:
    """Refuse fixed-setting changes (one line); return what will be applied, one line each."""
    if not saved:  # a checkpoint written before settings were recorded
        return [f"checkpoint step {step} records no settings; resuming without comparing them"]
    changed = [k for k in FIXED if k in saved and saved[k] != now.get(k)]
    if changed:
        what = "; ".join(f"{FIXED[k]}: {saved[k]!r} -> {now.get(k)!r}" for k in changed)
        raise ResumeConfigError(
            f"the config changed since checkpoint step {step} ({what}): resuming would skip or "
            f"repeat samples or load other tensors; restore the old values, or start fresh with "
            f"another --run-id (or delete {checkpoint_url})"
        )
    return [
        f"{APPLIED[k]} changed {saved[k]!r} -> {now[k]!r} since checkpoint step {step}: "
        f"applied from update {step} on"
        for k in APPLIED
        if k in saved and saved[k] != now[k]
    ]
