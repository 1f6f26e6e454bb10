"""Resuming a run after its config changed: continue exactly with the new settings, or refuse.

A checkpoint records the settings of its run (`run_settings`) and its position in the epoch as
samples consumed by all replicas. Batch size, accumulation and the number of data-parallel
replicas may change: the epoch continues with the samples not yet seen (each once, see
`cache.reader.epoch_order`); optimizer settings (learning rate, weight decay, warmup) apply from
the resume point on; each change is said. What fixes the sample stream itself (seed, the sample
set, the mode) or the trained tensors (which model, LoRA rank, alpha, targets) cannot continue:
refused, naming what changed and how to start fresh. Run length (epochs, max_steps) and
logging/checkpoint cadence may change freely.

The schedule, clipping and precision (`lr_scheduler`, its arguments, `max_grad_norm`,
`mixed_precision`) apply from the resume point on, said like the optimizer's. [train.ema] too
(`ema_changes`): a new decay or start_update holds from the resume point on (the checkpoint's
average is kept, unless the new start_update lies ahead); an average added at a resume starts
from the resumed weights, at the resume update, not from the start (`average_start`); one
removed is dropped, and the export sets an earlier launch's `*_ema` files aside instead of
leaving them beside newer weights.

What a run trains on (family, pipeline, base weights, and the task it trains for: its identity)
is recorded with the settings under `IDENTITY`, computed by the launcher before launch
(`run_identity`), so every checkpoint carries it (`Trainer.save` writes the settings) and the
export's metadata names it. Each model is named by the content fingerprint the cache key uses
(`JobPlan.model_fingerprint`: weights files hashed once, memoized by path, size and mtime), so a
resume on another file with the same architecture is refused before training, naming both, as is
one on another family or another `train.task` (its loss: refused, not continued). Every
checkpoint splitstage writes records both; one that does not (another tool's, or damaged) is
refused, not resumed unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from splitstage.config.job import SplitstageConfig
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import JobPlan

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
    "optimizer_args": "train.optimizer_args",
    "weight_dtype": "train.weight_dtype (the frozen base's dtype)",
    "base_quantization": "train.base_quantization (the frozen base's quantization)",
    "lr_scheduler": "train.lr_scheduler",
    "lr_scheduler_args": "train.lr_scheduler_args",
    "max_grad_norm": "train.max_grad_norm",
    "mixed_precision": "train.mixed_precision",
}

IDENTITY = "base"  # the key of the identity in the recorded run settings
_SHOWN = 12  # hex digits of a fingerprint shown in messages and metadata


class ResumeConfigError(UserError, ValueError):
    """The config changed in a way that cannot continue the checkpointed run exactly."""


def run_settings(
    config: SplitstageConfig,
    *,
    data_parallel: int,
    samples: str,
    lora_targets: list[str],
    fit: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The settings a checkpoint records (`samples`: a digest of the training sample keys;
    `fit`: the levers train.fit = 'auto' applied, which a resume re-uses, never re-chooses)."""
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
        "optimizer": train.optimizer,
        "optimizer_args": dict(sorted(train.optimizer_args.items())),
        "weight_dtype": train.weight_dtype if lora else None,
        "base_quantization": train.base_quantization if lora else None,
        "lr_scheduler": train.lr_scheduler,
        "lr_scheduler_args": dict(sorted(train.lr_scheduler_args.items())),
        "max_grad_norm": train.max_grad_norm,
        "mixed_precision": train.mixed_precision,
        "ema": None
        if train.ema is None
        else {"decay": train.ema.decay, "start_update": train.ema.start_update},
        "fit": fit,
        "pipeline": step_settings(config),
    }


def step_settings(config: SplitstageConfig) -> dict[str, Any]:
    """The family's settings that do not change stage 1 (the training step's: caption dropout,
    timestep weighting, SNR gamma, ...), as JSON values: a resume applies and says changes."""
    group = config.pipeline
    values = group.model_dump(mode="json")
    stage1 = group.stage1_settings()
    return {name: values[name] for name in group.settings() if name not in stage1}


def compare(
    saved: dict[str, Any] | None, now: dict[str, Any], *, step: int, checkpoint_url: str
) -> list[str]:
    """Refuse fixed-setting changes (one line); return what will be applied, one line each."""
    if not saved:
        raise ResumeConfigError(unrecorded(step, "settings", checkpoint_url))
    if "optimizer" in saved and saved["optimizer"] != now.get("optimizer"):
        raise ResumeConfigError(
            f"train.optimizer changed {saved['optimizer']!r} -> {now.get('optimizer')!r} since "
            f"checkpoint step {step}: the checkpoint holds {saved['optimizer']}'s state, which "
            f"{now.get('optimizer')} cannot take; restore train.optimizer = "
            f"{saved['optimizer']!r}, or start fresh with another --run-id (or delete "
            f"{checkpoint_url})"
        )
    changed = [k for k in FIXED if k in saved and saved[k] != now.get(k)]
    if changed:
        what = "; ".join(f"{FIXED[k]}: {saved[k]!r} -> {now.get(k)!r}" for k in changed)
        raise ResumeConfigError(
            f"the config changed since checkpoint step {step} ({what}): resuming would skip or "
            f"repeat samples or load other tensors; restore the old values, or start fresh with "
            f"another --run-id (or delete {checkpoint_url})"
        )
    applied = [
        f"{APPLIED[k]} changed {saved[k]!r} -> {now[k]!r} since checkpoint step {step}: "
        f"applied from update {step} on"
        for k in APPLIED
        if k in saved and saved[k] != now[k]
    ]
    before, after = saved.get("pipeline") or {}, now.get("pipeline") or {}
    applied += [
        f"pipeline.{name} changed {before[name]!r} -> {after.get(name)!r} since checkpoint step "
        f"{step}: applied from update {step} on"
        for name in sorted(before)
        if name in after and before[name] != after[name]
    ]
    return applied + ema_changes(saved, now, step=step)


def average_start(saved_start: int | None, start: int, step: int) -> int:
    """The update the average starts at when a run resumes from `step`: the config's
    `start_update`, or the resume step when the checkpoint holds no average (`saved_start` None)
    or one that had not started by then (it holds the resumed weights, nothing averaged)."""
    if saved_start is None or step <= saved_start:
        return max(start, step)
    return start


def ema_changes(saved: Mapping[str, Any], now: Mapping[str, Any], *, step: int) -> list[str]:
    """One line per [train.ema] change since checkpoint `step`, saying what the trainer does
    (nothing for a checkpoint that records no EMA settings: made before they were recorded)."""
    if "ema" not in saved or saved["ema"] == now.get("ema"):
        return []
    before, after = saved["ema"], now.get("ema")
    since = f"since checkpoint step {step}"
    if after is None:
        return [
            f"[train.ema] removed {since}: the checkpoint's average is dropped, the export "
            "writes no *_ema files and sets an earlier launch's aside (renamed *.stale) in "
            "the run's output folder"
        ]
    saved_start = None if before is None else before["start_update"]
    start = average_start(saved_start, after["start_update"], step)
    if before is None:
        return [
            f"[train.ema] added {since}: the average starts at update {start} (resumed), not "
            "from the start: it holds no update before it"
        ]
    lines = []
    if before["decay"] != after["decay"]:
        lines.append(
            f"train.ema.decay changed {before['decay']!r} -> {after['decay']!r} {since}: "
            f"applied from update {step} on (the average so far is kept)"
        )
    if saved_start != after["start_update"]:
        if step <= saved_start:
            what = "it had averaged nothing yet"
        elif start > step:
            what = "the average so far is dropped"
        else:
            what = f"the average so far is kept, its warm-up counted from update {start}"
        lines.append(
            f"train.ema.start_update changed {saved_start!r} -> {after['start_update']!r} "
            f"{since}: the average starts at update {start} ({what})"
        )
    return lines


def run_identity(plan: JobPlan) -> dict[str, Any]:
    """{family, pipeline, task, models: {name: {fingerprint, source}}} of every model the run
    uses."""
    family = plan.family
    if plan.config.train.mode == "unsplit":
        names = set(family.model_names)
    else:
        names = set(plan.split.models["stage1"]) | set(plan.split.models["stage2"])
    models = {
        name: {
            "fingerprint": plan.model_fingerprint(name),
            "source": describe_source(family.fingerprint_source(name)),
        }
        for name in sorted(names)
    }
    task = plan.config.train.task
    return {"family": family.name, "pipeline": plan.pipeline.name, "task": task, "models": models}


def describe_source(source: str | Mapping[str, Any]) -> str:
    """A short human name of a model's source: its file, its first file, or its payload."""
    if isinstance(source, str):
        return source
    files = list(source.get("files") or [])
    if files:
        more = f" (+{len(files) - 1} more files)" if len(files) > 1 else ""
        return f"{files[0]}{more}"
    return json.dumps(dict(source), sort_keys=True, separators=(",", ":"))


def _model(entry: Mapping[str, Any]) -> str:
    """'path (sha256 0123456789ab)'."""
    return f"{entry.get('source')} (sha256 {str(entry.get('fingerprint'))[:_SHOWN]})"


def unrecorded(step: int, what: str, checkpoint_url: str) -> str:
    """The line refusing a checkpoint that does not record `what`."""
    return (
        f"checkpoint step {step} under {checkpoint_url} records no {what}: "
        "splitstage records them in every checkpoint, so this one was written by another tool or "
        f"is damaged; start fresh with another --run-id (or delete {checkpoint_url})"
    )


def check_resume_identity(
    saved_settings: Mapping[str, Any] | None,
    current: Mapping[str, Any],
    *,
    step: int,
    checkpoint_url: str,
) -> list[str]:
    """Refuse (one line) a checkpoint made on another family, pipeline or base weights, or for
    another `train.task`, or one that records none (not written by splitstage, or damaged)."""
    saved = (saved_settings or {}).get(IDENTITY)
    if not saved:
        raise ResumeConfigError(unrecorded(step, "family or base weights", checkpoint_url))
    fresh = f"or start fresh with another --run-id (or delete {checkpoint_url})"
    if (saved.get("family"), saved.get("pipeline")) != (current["family"], current["pipeline"]):
        raise ResumeConfigError(
            f"checkpoint step {step} was trained on the {saved.get('family')!r} family (pipeline "
            f"{saved.get('pipeline')!r}), and this config names {current['family']!r} (pipeline "
            f"{current['pipeline']!r}): its weights cannot continue on another pipeline; set "
            f"pipeline.name back to {saved.get('family')!r} (with the weights it was trained "
            f"on), {fresh}"
        )
    task = saved.get("task")  # None: a checkpoint made before the task was recorded
    if task is not None and task != current.get("task"):
        raise ResumeConfigError(
            f"train.task changed {task!r} -> {current.get('task')!r} since checkpoint step "
            f"{step}: its weights, optimizer state and schedule were trained for the {task} "
            f"loss, and continuing them under another loss is not this run; set train.task = "
            f"{task!r} back, {fresh}"
        )
    before, now = saved.get("models") or {}, current["models"]
    changed = sorted(
        name
        for name in before.keys() & now.keys()
        if before[name].get("fingerprint") != now[name]["fingerprint"]
    )
    if changed:
        what = "; ".join(
            f"{name}: trained on {_model(before[name])}, now {_model(now[name])}"
            for name in changed
        )
        raise ResumeConfigError(
            f"checkpoint step {step} was trained on other base weights than this config names "
            f"({what}): resuming would continue it on other weights; point the config back at "
            f"the weights it was trained on, {fresh}"
        )
    if task is None:
        return [
            f"checkpoint step {step} records no train.task (an older splitstage made it): "
            f"resumed as train.task = {current.get('task')!r}, unchecked; if it was trained "
            f"for another task, {fresh}"
        ]
    return []


def export_metadata(identity: Mapping[str, Any] | None) -> dict[str, str]:
    """Safetensors metadata naming the base an export was trained on ({} when not recorded)."""
    if not identity:
        return {}
    models = identity.get("models") or {}
    return {
        "splitstage_family": str(identity.get("family")),
        "splitstage_pipeline": str(identity.get("pipeline")),
        "splitstage_base": json.dumps(
            {name: dict(entry) for name, entry in sorted(models.items())}, sort_keys=True
        ),
    }
