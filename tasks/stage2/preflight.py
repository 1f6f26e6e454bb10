"""Everything knowable before training, checked before any weight loads: one line naming the
field and the fix.

`preflight` runs on rank 0 of a `train` run before any model is loaded or the cache is read for
training (`tasks/stage2/rank_setup.py`, which says a refusal once for all ranks), and in
`splitstage validate`: the mesh, the models and their weights files, what is trained and how,
whether the cache holds exactly the data set, whether the batches fit it, and whether a
checkpoint to resume from was made with compatible settings. Whether the outputs can be written
is checked by the launcher before it takes the run's lease (`outputs.check_outputs`). Findings
that are not errors come back as warnings, which the caller prints.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np
import torch

from splitstage.config.job import ConfigError, SplitstageConfig, check_memory_levers
from splitstage.data.index import DataIndex, index_data_set
from splitstage.pipelines.distill_rows import check_rows
from splitstage.splitter import UserError
from splitstage.tasks.cache.fingerprint import stable_hash
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.cache.validation_prompts import read_validation_prompts
from splitstage.tasks.device import pick_device
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.memory.budget import MemoryBudgetError, check_budget, checked_memory_plan
from splitstage.tasks.memory.fit import FitChoice, apply_fit, choose_fit, recorded_fit
from splitstage.tasks.memory.memory_plan import MemoryPlan, device_budget, estimate_memory
from splitstage.tasks.stage2.batch_plan import plan_epoch
from splitstage.tasks.stage2.batches import CachedBatches, PlannedBatches, RawBatches
from splitstage.tasks.stage2.export import check_export
from splitstage.tasks.stage2.models import check_lora_targets, parallel_mode
from splitstage.tasks.stage2.optimization import check_update_rule
from splitstage.tasks.stage2.outputs import RunPlaces
from splitstage.tasks.stage2.pretrained_weights import WeightsError, check_weights_file
from splitstage.tasks.stage2.resume import (
    IDENTITY,
    check_resume_identity,
    compare,
    run_identity,
    run_settings,
)
from splitstage.tasks.stage2.tracking import tracker_names
from splitstage.tasks.stage2.validation import check_validation_sizes


class StaleCacheError(UserError, RuntimeError):
    """The cache does not hold exactly the data set's samples."""


@dataclass
class Preflight:
    """What the checks found: warnings to print, the training samples, the settings to record."""

    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # what the run will do, said once (info)
    samples: KeyTable | None = None  # the keys to train on when not the cache's manifest
    sample_count: int = 0
    settings: dict = field(default_factory=dict)
    keys: KeyTable | None = None  # the keys to train on, once the cache holds them
    tail: dict | None = None  # per epoch: groups, samples dropped and repeated (the trainer's)
    memory: MemoryPlan | None = None  # each stage's estimated peak per rank, by part
    memory_note: str | None = None  # why there is no estimate, when there is none
    fit: dict | None = None  # train.fit = 'auto': the [train] overrides every rank applies


def data_parallel_degree(config: SplitstageConfig) -> int:
    """How many replicas split the data (pipeline stages and TP ranks share batches)."""
    world = config.train.nnodes * config.train.nproc_per_node
    if config.train.parallelism == "pp":
        return 1
    _, dp, _ = parallel_mode(config, world)
    return dp


def check_layout(config: SplitstageConfig) -> None:
    """The mesh fits the world; pipeline-parallel settings fit the denoiser."""
    if config.train.parallelism == "pp":
        if config.data.buckets.enabled:  # stages pass tokens on: the head assumes the square
            raise ConfigError(
                "data.buckets: aspect buckets under train.parallelism='pp' are not supported yet "
                "(pipeline stages are built for one image size); use 'fsdp', 'ddp' or 'tp', or "
                "set data.buckets.enabled = false"
            )
        from splitstage.tasks.stage2.pp_trainer import check_pp_config  # pipelining: 2-3 s

        check_pp_config(config)
    else:
        parallel_mode(config, config.train.nnodes * config.train.nproc_per_node)


def check_models(plan: JobPlan) -> None:
    """Every model stage 2 builds has a usable source, its weights file fits it, and the job's
    models fit each other."""
    family = plan.family
    unsplit = plan.config.train.mode == "unsplit"
    names = list(family.model_names) if unsplit else plan.split.models["stage2"]
    family.check_models(names)
    for name in names:
        weights = family.weights_file(name)
        if weights and weights[0].endswith((".safetensors", ".safetensors.index.json")):
            meta_model = plan.meta_model(name)
            try:
                check_weights_file(meta_model, weights[0], weights[1])
            except WeightsError as error:
                raise ConfigError(f"models.{name}.weights: {error}") from None
    family.check_component_shapes()  # both stages' parts fit each other (config reads)


def check_trainable(plan: JobPlan) -> list[str]:
    """Exactly one trained model; LoRA targets that exist and a rank they can hold."""
    config = plan.config
    trained = config.trainable.models()
    if not trained:
        raise ConfigError(
            "trainable: nothing is trained; set trainable.lora_base_model (LoRA) or "
            f"trainable.full (e.g. ['{plan.family.denoiser}'])"
        )
    if len(trained) > 1:
        raise ConfigError(
            f"trainable: {', '.join(trained)} are all trained, but one trained model per run is "
            "supported so far; train one of them (trainable.full or trainable.lora_base_model)"
        )
    base = config.trainable.lora_base_model
    if base is None:
        return []
    targets = plan.family.lora_targets(base)
    named = bool(config.trainable.lora_target_modules)  # defaults adapt to the model
    rank = config.trainable.lora_rank
    return check_lora_targets(plan.meta_model(base), base, targets, rank, named=named)


def check_gradient_checkpointing(plan: JobPlan) -> None:
    """train.gradient_checkpointing: the family can recompute every trained model."""
    config = plan.config
    if not config.train.gradient_checkpointing:
        return
    for name in config.trainable.models():
        plan.family.check_gradient_checkpointing(name)


def check_offload_blocks(plan: JobPlan) -> None:
    """train.offload = N: the LoRA base has at least N repeated blocks (counted on meta)."""
    config = plan.config
    count, base = config.train.offload, config.trainable.lora_base_model
    if not isinstance(count, int) or base is None:
        return
    from splitstage.tasks.stage2.block_swap import repeated_blocks

    blocks = len(repeated_blocks(plan.meta_model(base)))
    if count > blocks:
        raise ConfigError(
            f"train.offload = {count} blocks, but '{base}' has {blocks} repeated blocks; set "
            f"train.offload to at most {blocks}"
        )


def check_cache(plan: JobPlan, data: DataIndex, result: Preflight) -> None:
    """The cache exists and holds exactly the data set's samples (or training was told to go on)."""
    config = plan.config
    if config.cache.url.startswith("memory://") and config.train.mode == "split":
        raise ConfigError(
            "cache.url: a memory:// cache lives inside one process, and stage 2 runs in torchrun "
            "processes that cannot see it; use a local folder or object storage"
        )
    if config.train.mode == "unsplit":
        result.sample_count = len(data.keys)
        result.settings["samples"] = stable_hash(sorted(data.keys))
        return
    store = plan.cache
    committed = store.key_table()  # compact: a million keys compare in well under a second
    wanted = KeyTable.from_keys(data.keys)
    if not len(committed):
        raise StaleCacheError(
            f"the cache {store.url} holds no samples: run `splitstage preprocess CONFIG` first "
            "(stage 1 must run before stage 2)"
        )
    manifest = store.read_manifest() or {}
    listed = KeyTable.from_keys(manifest.get("samples") or ())
    if config.data.skip_bad_rows:
        wanted = wanted.without(manifest.get("undecodable") or ())
    cached = committed.contains(wanted)
    trained = wanted.select(cached)
    missing = len(wanted) - int(cached.sum())
    extra = int((~wanted.contains(listed if len(listed) else committed)).sum())
    if missing or extra:
        what = (
            f"the cache {store.url} does not match the data set {config.data.base_path}: "
            f"{missing} of its {len(wanted)} samples are not cached (added or edited since "
            f"preprocess, or some --shard runs have not finished) and {extra} cached "
            "samples are no longer in it (deleted or edited)"
        )
        if not config.train.allow_stale_cache:
            raise StaleCacheError(
                f"{what}: run `splitstage preprocess CONFIG` to bring it up to date, or set "
                "train.allow_stale_cache = true to train on the cached samples of the data set"
            )
        result.warnings.append(f"{what}; training on those {len(trained)} samples")
    if listed != trained:  # no manifest (only --shard runs), or one older than the cache
        result.samples = trained
    result.sample_count = len(trained)
    result.keys = trained
    result.settings["samples"] = trained.json_hash()  # == stable_hash(sorted(trained))


class DataSetBatches(PlannedBatches):
    """The data set's samples in one group: the plan known before stage 1 assigned buckets."""

    def __init__(self, config: SplitstageConfig, keys: list[str], data_parallel: int):
        super().__init__(config, 0, data_parallel)
        self.keys = sorted(keys)
        self.groups = np.zeros(len(self.keys), np.int64)

    def group_labels(self) -> dict[str, int]:
        """One group: every sample."""
        return {"all samples": len(self.keys)}


def batch_source(
    plan: JobPlan, data: DataIndex, result: Preflight, dp: int
) -> tuple[PlannedBatches, bool]:
    """The batch source stage 2 builds (rank 0's view: every rank plans the same batches) and
    whether it knows the real groups: the cache's groups (aspect buckets) when the cache is
    ready, the raw data set's in unsplit mode (which, as its trainer, decodes each image once
    when buckets are on), else every sample in one group."""
    config = plan.config
    if config.train.mode == "unsplit":
        return RawBatches(plan.family, 0, dp), True
    if result.keys is None:  # validate before (or between) stage-1 runs
        return DataSetBatches(config, list(data.keys), dp), False
    return CachedBatches(config, plan.cache, 0, dp, keys=result.keys), True


def check_batches(
    config: SplitstageConfig, source: PlannedBatches, data_parallel: int
) -> dict[str, int]:
    """At least one update per epoch on every rank, counted on the plan stage 2 uses (batches
    within one bucket, its tail); returns the tail's cost per epoch."""
    train = config.train
    batches = source.steps_per_epoch()
    if batches < train.gradient_accumulation_steps:
        raise ConfigError(_too_few_batches(config, source, data_parallel, batches))
    return source.tail_cost()


def grouping_line(source: PlannedBatches) -> str:
    """The batches' grouping when buckets are off (samples of one shape per batch, e.g. prompt
    embeddings of one length), in words that do not read as a mistake."""
    groups, cost = source.group_labels(), source.tail_cost()
    line = f"batches hold samples of one shape: {len(groups)} shapes"
    if cost["dropped"] or cost["repeated"]:
        line += (
            f"; per epoch {cost['dropped']} samples left out and {cost['repeated']} repeated to "
            "fill batches (data.buckets.tail)"
        )
    return line


def _too_few_batches(
    config: SplitstageConfig, source: PlannedBatches, dp: int, batches: int
) -> str:
    """The one line for an epoch with no update: the groups, their sizes, and what fits."""
    train, buckets = config.train, config.data.buckets
    accum = train.gradient_accumulation_steps

    def count(batch_size: int, tail: str) -> int:  # the plan stage 2 would make with these
        settings = {"epoch": 0, "seed": config.job.seed, "replicas": dp, "tail": tail}
        return len(
            plan_epoch(source.groups, source.keys, batch_size=batch_size, **settings).batches
        )

    fits = _largest(lambda b: count(b, source.tail) >= accum, train.batch_size - 1)
    fixes = [f"set train.batch_size <= {fits}"] if fits else []
    if batches:
        fixes.append(f"lower train.gradient_accumulation_steps to <= {batches}")
    if source.tail == "drop" and (repeat := count(train.batch_size, "repeat")) >= accum:
        fixes.append(f"set data.buckets.tail = 'repeat' ({repeat} batches)")
    if dp > 1:
        fixes.append("use fewer data-parallel ranks")
    groups = source.group_labels()
    if len(groups) > 1:
        fixes.append("use fewer, larger buckets (larger data.buckets.step, smaller max_aspect)")
    fixes.append("add data")
    shown = ", ".join(f"{label}: {n}" for label, n in list(groups.items())[:8])
    shown += f", ... ({len(groups)} in all)" if len(groups) > 8 else ""
    where = (
        f"the {sum(groups.values())} samples in {len(groups)} buckets ({shown}; batches hold "
        f"one bucket each, tail {buckets.tail!r})"
        if len(groups) > 1
        else f"{sum(groups.values())} samples"
    )
    return (
        f"{where} over {dp} data-parallel replica(s) give {batches} batches per rank per epoch "
        f"with train.batch_size={train.batch_size}, fewer than "
        f"train.gradient_accumulation_steps={accum}: no update would run; "
        f"{_either(fixes)}"
    )


def _either(options: list[str]) -> str:
    """'a, b or c'."""
    return options[0] if len(options) == 1 else f"{', '.join(options[:-1])} or {options[-1]}"


def _largest(fits, upper: int) -> int:
    """The largest n in 1..upper with fits(n) (fits holds for small n if at all), else 0."""
    low, high = 0, upper
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def saved_checkpoint(places: RunPlaces) -> tuple[int, str, dict | None] | None:
    """(step, checkpoint URL, its recorded settings) of the run's latest checkpoint, or None:
    what the resume checks compare against (listed and read once per launch)."""
    from splitstage.tasks.stage2.checkpoint import latest_checkpoint, read_extra_state  # DCP

    url, options = places.checkpoint_url, places.checkpoint_storage_options
    step = latest_checkpoint(url, storage_options=options, clean=False)
    if step is None:
        return None
    return step, url, read_extra_state(url, step, storage_options=options).get("settings")


def precision_warnings(config: SplitstageConfig) -> list[str]:
    """Precision asked for that this machine will not give (accelerate ignores fp16 on CPUs)."""
    on_gpu = torch.cuda.is_available() and os.environ.get("SPLITSTAGE_DEVICE", "") != "cpu"
    if config.train.mixed_precision == "fp16" and not on_gpu:
        return [
            "train.mixed_precision='fp16' on a CPU: there is no fp16 autocast on CPUs, so this "
            "run trains in fp32; use 'bf16' for reduced precision on a CPU, or 'auto'"
        ]
    return []


def check_job(plan: JobPlan, *, optimizer_package: bool = True) -> list[str]:
    """The checks of the job itself (no data, cache or outputs read): what `validate`, `preprocess`
    and `train` all refuse before any model loads, so no stage 1 is spent on a job train would
    refuse. Returns the LoRA targets. `optimizer_package=False` checks the optimizer's settings
    without importing its package (preprocess: bitsandbytes prints on import)."""
    config = plan.config
    check_layout(config)
    check_update_rule(config.train, optimizer_package=optimizer_package)
    check_models(plan)
    targets = check_trainable(plan)
    check_export(plan)
    check_gradient_checkpointing(plan)
    check_offload_blocks(plan)
    return targets


def preflight(plan: JobPlan, places: RunPlaces | None = None) -> Preflight:
    """Every check a rank makes before training (rank 0, before any weight loads); `places`
    (the run's) adds the resume checks. Without `places` (`splitstage validate`) a cache that is
    not ready is a warning. The outputs' checks run in the launcher (`outputs.check_outputs`)."""
    config = plan.config
    result = Preflight()
    targets = check_job(plan)
    saved = saved_checkpoint(places) if places is not None else None  # listed and read once
    result.memory = memory_plan(plan, result, training=places is not None, saved=saved)
    dp = data_parallel_degree(config)
    fit = None if result.fit is None else {"overrides": result.fit}
    result.settings = run_settings(
        config, data_parallel=dp, samples="", lora_targets=targets, fit=fit
    )
    if places is not None:  # recorded in each checkpoint: a resume on another base is refused
        result.settings[IDENTITY] = identity = run_identity(plan)
        if saved is not None:
            step, url, settings = saved
            result.warnings += check_resume_identity(
                settings, identity, step=step, checkpoint_url=url
            )
    data = index_data_set(config)
    check_rows(config, data.rows)  # the task's row values, before any model loads
    try:
        check_cache(plan, data, result)
    except StaleCacheError as error:
        if places is not None:
            raise
        result.warnings.append(f"train would refuse now: {error}")
        result.sample_count = len(data.keys)
    source, known = batch_source(plan, data, result, dp)
    result.tail = check_batches(config, source, dp)
    tail = result.tail
    if known and (tail["groups"] > 1 or tail["dropped"] or tail["repeated"]):
        if config.data.buckets.enabled:
            result.warnings.append(source.tail_line())  # what the trainer logs, before it starts
        else:
            result.notes.append(grouping_line(source))
    check_validation(plan, result, strict=places is not None)
    tracker_names(config)  # an explicitly named tracker that is not installed
    result.warnings += precision_warnings(config)
    if saved is not None:  # a resume continues exactly, or says what changed
        step, url, settings = saved
        result.warnings += compare(settings, result.settings, step=step, checkpoint_url=url)
    return result


def memory_plan(
    plan: JobPlan, result: Preflight, *, training: bool, saved: tuple | None = None
) -> MemoryPlan | None:
    """Each stage's estimated peak per rank (fake models, no weights), refused over the budget
    (`train.device_memory`; `training`: stage 2 alone, and nothing estimated without a budget,
    as on a CPU); an estimate that fails on a family's code is a warning. `train.fit = 'auto'`
    applies the levers that fit (`memory.fit`), or those `saved` (the run's checkpoint) records."""
    config = plan.config
    auto = config.train.fit == "auto"
    choice = reuse_fit(config, saved) if auto else None
    if auto:  # nothing changed unless a choice says otherwise
        result.fit = dict(choice.overrides) if choice is not None else {}
    if training and device_budget(config.train.device_memory, pick_device()) is None:
        if auto:
            result.notes.append((choice or FitChoice({}, "no budget")).line())
        return None
    stages = ("stage2",) if training else ("stage1", "stage2")
    try:
        if not auto or choice is not None:
            memory = checked_memory_plan(plan, stages)
        else:
            memory = estimate_memory(plan)
            check_budget(plan, memory, stages[:-1])  # stage 1: fit changes stage 2 alone
            choice, memory = choose_fit(plan, memory)
            apply_fit(config, choice.overrides)
            result.fit = dict(choice.overrides)
        memory.fit = choice
        if training and choice is not None:
            result.notes.append(choice.line())
        return memory
    except (MemoryBudgetError, UserError):
        raise
    except Exception as error:  # noqa: BLE001 - the plan is advice; the run itself decides
        line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        why = line if isinstance(error, NotImplementedError) else f"{type(error).__name__}: "
        why += "" if isinstance(error, NotImplementedError) else line[:200]
        result.memory_note = f"memory plan: no estimate ({why}); no device-memory check"
        if auto and choice is None:
            result.memory_note += "; train.fit = 'auto' changed nothing"
        result.notes.append(result.memory_note)
        return None


def reuse_fit(config: SplitstageConfig, saved: tuple | None) -> FitChoice | None:
    """A resume keeps the levers its run's fit chose (never chosen again): set on `config`;
    None when the checkpoint records none (a fresh run, or one trained with fit off)."""
    recorded = recorded_fit(saved[2]) if saved is not None else None
    if recorded is None:
        return None
    apply_fit(config, recorded)
    choice = FitChoice(recorded, "recorded", step=saved[0])
    try:
        check_memory_levers(config.train, config.trainable)
    except ValueError as error:
        raise ConfigError(
            f"train.fit: the levers checkpoint step {saved[0]} records ({choice.words()}) "
            f"cannot run with this config: {error}; set train.fit = 'off' and choose them "
            "yourself, or start fresh with another --run-id"
        ) from None
    return choice


def check_validation(plan: JobPlan, result, *, strict: bool) -> None:
    """[validation] can sample: a family sampler and decoder, and prompts encoded in stage 1
    when stage 2 holds no prompt encoder (else `train` would sample nothing)."""
    config = plan.config
    if not config.validation.enabled:
        return
    if config.train.parallelism == "pp":
        raise ConfigError(
            "validation.prompts: sampling under train.parallelism='pp' is not supported yet; "
            "remove [validation] prompts or use 'ddp' / 'fsdp'"
        )
    family = plan.family
    family.check_sampling()
    check_validation_sizes(family)
    stage2 = set(
        family.model_names if config.train.mode == "unsplit" else plan.split.models["stage2"]
    )
    if set(family.prompt_models()) <= stage2 or read_validation_prompts(plan) is not None:
        return
    message = (
        "validation.prompts are not encoded for this cache yet; run `splitstage preprocess "
        "CONFIG` (it encodes only the prompts when the samples are cached)"
    )
    if strict:
        raise ConfigError(message)
    result.warnings.append(message)
