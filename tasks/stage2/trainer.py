"""Stage 2, one rank: run V1 + the denoiser on cached boundary params, backprop, checkpoint, export.

The loop of every data/tensor-parallel mode; `pp_trainer.PipelineTrainer` reuses it with the
pipeline schedule. Started by torchrun through `splitstage.tasks.stage2.worker`.
"""

from __future__ import annotations

import json
import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, run_units
from splitstage.splitter import UserError
from splitstage.tasks.cache.batch_plan import Position
from splitstage.tasks.cache.key_table import KeyTable
from splitstage.tasks.device import peak_memory_gib, pick_dtype, resident_mb, steady_heap
from splitstage.tasks.job_plan import JobPlan, make_plan, open_cache
from splitstage.tasks.stage2.batches import CachedBatches, RawBatches
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo, init_distributed
from splitstage.tasks.stage2.export import export_weights
from splitstage.tasks.stage2.faults import crash, injected_fault
from splitstage.tasks.stage2.models import Stage2Models, build_stage2_models
from splitstage.tasks.stage2.optimization import (
    TrainedAverage,
    apply_config_to_groups,
    build_optimizer,
    build_scheduler,
    clip_gradients,
)
from splitstage.tasks.stage2.run_records import append_metrics, write_result
from splitstage.tasks.stage2.tracking import Tracking, tracker_names
from splitstage.tasks.stage2.validation import Validator


class TrainingDivergedError(UserError, FloatingPointError):
    """The loss became NaN or infinite: training stops, nothing non-finite is saved."""


def read_samples(path: str | None) -> KeyTable | list[str] | None:
    """The sample keys a launcher chose to train on (None: the cache's manifest): a compact
    safetensors key table, or a JSON list from an older launcher."""
    if path is None:
        return None
    return json.loads(Path(path).read_text()) if path.endswith(".json") else KeyTable.load(path)


def require_finite(params: list[torch.nn.Parameter], device: torch.device) -> None:
    """Refuse to export weights with a NaN or infinite value (collective across ranks)."""
    bad = torch.zeros((), device=device)
    for param in params:
        local = param.to_local() if hasattr(param, "to_local") else param
        if not torch.isfinite(local).all():
            bad += 1
    if dist.is_initialized():
        dist.all_reduce(bad)
    if bad.item():
        raise TrainingDivergedError(
            "the trained weights hold NaN or infinite values: nothing was exported; lower "
            "train.learning_rate or check the data"
        )


def check_same_split(plan: JobPlan, launcher_split: dict[str, Any] | None) -> None:
    """A rank trains the split the launcher checked and showed, or stops: a family whose units
    or models differ between the launcher's machine and a rank's (another package version on a
    node, an environment-dependent unit) would otherwise train a split nobody saw."""
    if launcher_split is None:
        return
    mine = plan.split.to_dict()
    differing = sorted(
        k for k in ("v1", "v2", "boundary_params", "models") if mine[k] != launcher_split.get(k)
    )
    if differing:
        raise UserError(
            f"this rank split pipeline {mine['pipeline']!r} differently from the launcher "
            f"({', '.join(differing)} differ: {mine[differing[0]]} here, "
            f"{launcher_split.get(differing[0])} at launch); install the same splitstage and "
            "family packages on every node"
        )


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move tensors of a batch to the training device."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


@dataclass
class LoopState:
    """Where the loop stands: updates done, the epoch, the epoch's samples consumed by all
    replicas (a count, or per group of sample shapes) and the loss of every update so far."""

    update: int = 0
    epoch: int = 0
    offset: Position = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers for the checkpoint's extra state."""
        return {
            "update": self.update,
            "epoch": self.epoch,
            "offset": self.offset,
            "losses": list(self.losses),
        }

    def load_state_dict(self, extra: dict[str, Any], updates_per_epoch: int, samples: int):
        """Restore from a checkpoint's extra state; checkpoints written before offsets were
        recorded derive the position from the update count (`samples` per update)."""
        self.update = int(extra["update"])
        self.losses = list(extra.get("losses", []))
        if "offset" in extra:
            offset = extra["offset"]
            self.epoch = int(extra["epoch"])
            self.offset = offset if isinstance(offset, dict) else int(offset)
        else:
            self.epoch, in_epoch = divmod(self.update, updates_per_epoch)
            self.offset = in_epoch * samples


class Trainer:
    """The training loop of one rank; `run()` trains to the end and returns the figures."""

    def __init__(self, spec: dict[str, Any], plan: JobPlan | None = None):
        steady_heap()  # a CPU step's transient buffers go back to the system
        self.baseline_rss_mb = resident_mb()  # after imports, before any model is built
        self.spec = spec
        self.config = SplitstageConfig.model_validate(spec["config"])
        self.dist: DistInfo = init_distributed()
        # the set-up's own plan when this process ran it (a one-process job), else planned here
        self.plan: JobPlan = plan if plan is not None else make_plan(self.config)
        check_same_split(self.plan, spec.get("split"))
        train = self.config.train
        dtype = pick_dtype(train.mixed_precision, self.dist.device)
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
        self.accelerator = Accelerator(
            cpu=self.dist.device.type == "cpu",
            mixed_precision=precision,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            log_with=tracker_names(self.config) or None,
            project_dir=str(Path(spec["run_dir"]) / "tracking"),
        )
        self.tracking = Tracking(self.accelerator, self.config, self.log)
        self.unsplit = train.mode == "unsplit"
        self.family = self.plan.family
        names = list(self.family.model_names) if self.unsplit else None
        self.stage2: Stage2Models = self.build_models(names)
        # Unsplit runs every unit in pipeline order each step; split runs only V1.
        self.units = list(self.plan.units) if self.unsplit else self.plan.v1_units
        self.source = (
            RawBatches(self.family, self.stage2.dp_rank, self.stage2.dp_size)
            if self.unsplit
            else CachedBatches(
                self.config,
                open_cache(self.plan, spec.get("cache_key")),
                self.stage2.dp_rank,
                self.stage2.dp_size,
                keys=read_samples(spec.get("samples_file")),
            )
        )
        self.validator = Validator(
            self.plan,
            self.stage2.models,
            self.dist.device,
            spec["output_url"],
            is_main=self.dist.is_main,
            log=self.log,
            autocast=self.accelerator.autocast,
            on_grid=self.tracking.grid,
            on_clips=self.tracking.clips if self.tracking.active else None,  # no GIFs for none
        )
        params = self.stage2.parameters()
        if not params:
            raise ConfigError(
                "no parameter requires gradients: set trainable.full or trainable.lora_base_model"
            )
        self.optimizer = build_optimizer(params, train)
        self.prepared_optimizer = self.accelerator.prepare(self.optimizer)
        steps_per_epoch = self.source.steps_per_epoch()
        if steps_per_epoch < train.gradient_accumulation_steps:  # preflight refuses this first
            raise ConfigError(
                f"{steps_per_epoch} batches per rank per epoch (train.batch_size="
                f"{train.batch_size}, {self.stage2.dp_size} data-parallel replicas) is fewer than "
                f"train.gradient_accumulation_steps={train.gradient_accumulation_steps}"
            )
        self.updates_per_epoch = steps_per_epoch // train.gradient_accumulation_steps
        self.tail_cost = self.source.tail_cost()
        cost = self.tail_cost
        tail = cost["dropped"] or cost["repeated"]
        if self.config.data.buckets.enabled and (cost["groups"] > 1 or tail):
            self.log(self.source.tail_line())
        elif tail:  # no buckets: the launcher said how samples are grouped
            self.log(
                f"each epoch's last partial batch: {cost['dropped']} samples dropped, "
                f"{cost['repeated']} repeated (data.buckets.tail = '{self.source.tail}')"
            )
        # Samples all data-parallel replicas consume per update: the epoch position advances by it.
        self.samples_per_update = (
            train.gradient_accumulation_steps * train.batch_size * self.stage2.dp_size
        )
        self.total_updates = self.planned_updates(0, 0, 0)
        self.scheduler = build_scheduler(self.optimizer, train, self.total_updates)
        self.average = (
            TrainedAverage(params, train.ema.decay, train.ema.start_update) if train.ema else None
        )
        self.checkpoint_url = spec["checkpoint_url"]
        self.run_dir = Path(spec["run_dir"])
        self.state = LoopState()
        self.step_seconds: list[float] = []
        self.fault = injected_fault()

    def build_models(self, names: list[str] | None) -> Stage2Models:
        """This rank's stage-2 models (`names`, default the plan's); PipelineTrainer splits them."""
        return build_stage2_models(self.plan, self.dist, names=names)

    # -- one update ----------------------------------------------------------------------------
    def step_context(self, keys: list[str], epoch: int) -> StepContext:
        """The models, device and settings of a step, and its draws: per sample, from (seed,
        sample key, epoch), so the tensor-parallel ranks of a replica draw alike and no draw
        depends on how the batch is cut over ranks and micro-batches."""
        return StepContext(
            models=self.stage2.models,
            device=self.dist.device,
            draws=Draws.per_sample(self.config.job.seed, keys, epoch, self.dist.device),
            settings=self.family.settings(),
        )

    def micro_step(self, batch: dict[str, Any], keys: list[str], epoch: int) -> torch.Tensor:
        """V1 units then the loss on one batch; backward through the trained weights."""
        ctx = self.step_context(keys, epoch)
        inputs = to_device(batch, self.dist.device)
        with self.accelerator.autocast():
            run_units(self.units, ctx, inputs)
            loss = self.family.training_loss(ctx, inputs)
        # accelerate divides by gradient_accumulation_steps (it was built with it): the one owner
        # of that division, so the accumulated gradient is the mean over the micro-batches.
        self.accelerator.backward(loss)
        return loss.detach()

    def update_weights(self) -> float:
        """One update from the accumulated gradients: clip (`train.max_grad_norm`), step the
        optimizer and the schedule, fold into the EMA; returns the pre-clip gradient norm."""
        self.accelerator.unscale_gradients(self.prepared_optimizer)  # fp16: real gradients
        params = self.stage2.parameters()
        grad_norm = clip_gradients(params, self.config.train.max_grad_norm, self.gradient_group())
        self.prepared_optimizer.step()
        self.prepared_optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        if self.average is not None:
            self.average.step()
        return grad_norm

    def gradient_group(self) -> dist.ProcessGroup | None:
        """Ranks holding other parameters whose gradients join the global norm (none: DDP
        replicas hold the same gradients; FSDP/TP shards are DTensors torch reduces)."""
        return None

    def validate(self, update: int) -> None:
        """Validation samples now, from the EMA weights when [train.ema] asks for it."""
        ema = self.config.train.ema
        if self.average is not None and ema is not None and ema.use_for_validation:
            self.average.swapped_in(lambda: self.validator.run(update))
        else:
            self.validator.run(update)

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        """The loss averaged over ranks, for logging."""
        if dist.is_initialized() and self.dist.world_size > 1:
            value = value.clone().to(self.dist.device)
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

    # -- checkpoints -----------------------------------------------------------------------------
    def planned_updates(self, update: int, epoch: int, offset: Position) -> int:
        """The update this run ends at, from a position (train.max_steps caps train.epochs)."""
        accum = self.config.train.gradient_accumulation_steps
        left = (
            self.source.steps_per_epoch(offset) // accum if epoch < self.config.train.epochs else 0
        )
        later = max(0, self.config.train.epochs - epoch - 1) * self.updates_per_epoch
        total = update + left + later
        return min(total, self.config.train.max_steps) if self.config.train.max_steps else total

    def save(self) -> None:
        """Checkpoint model, optimizer, schedule, EMA and the loop state (collective)."""
        model = self.stage2.models[self.stage2.trained[0]]
        save_checkpoint(
            self.checkpoint_url,
            self.state.update,
            model,
            [self.optimizer],
            {
                "scheduler": self.scheduler.state_dict(),
                "ema": self.ema_state(),
                **self.state.state_dict(),
                "settings": self.spec.get("settings"),
            },
            keep_last=self.config.train.keep_checkpoints,
            lora_only=self.stage2.lora,
            storage_options=self.spec.get("checkpoint_storage_options"),
        )

    def resume(self) -> None:
        """Load the latest complete checkpoint, if any, into the model, optimizer, schedule,
        EMA and loop state."""
        options = self.spec.get("checkpoint_storage_options")
        step = latest_checkpoint(self.checkpoint_url, storage_options=options)
        if step is None:
            return
        model = self.stage2.models[self.stage2.trained[0]]
        extra = load_checkpoint(
            self.checkpoint_url, step, model, [self.optimizer], storage_options=options
        )
        done = int(extra["scheduler"]["last_epoch"])  # updates the schedule has taken
        apply_config_to_groups(self.optimizer, self.config.train)
        self.scheduler = build_scheduler(
            self.optimizer, self.config.train, self.total_updates, done
        )
        if self.average is not None and extra.get("ema") is not None:
            self.load_ema(extra["ema"], step)
        self.state.load_state_dict(extra, self.updates_per_epoch, self.samples_per_update)
        self.log(f"resumed from checkpoint step {step}")

    def ema_state(self) -> dict[str, Any] | None:
        """The EMA's state for the checkpoint (collective where ranks hold other parameters)."""
        return self.average.state_dict() if self.average else None

    def load_ema(self, state: dict[str, Any], step: int) -> None:
        """Restore the EMA from checkpoint `step`'s state (what `ema_state` saved)."""
        assert self.average is not None
        self.average.load_state_dict(state)

    # -- the loop ---------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        """Rank 0 prints a line the launcher streams (and Prefect shows)."""
        if self.dist.is_main:
            print(line, flush=True)

    def record(self, loss: float, grad_norm: float, seconds: float) -> None:
        """Append the update's figures to metrics.jsonl and the trackers (rank 0)."""
        update = self.state.update
        self.state.losses.append(loss)
        self.step_seconds.append(seconds)
        if self.dist.is_main:
            lr = self.scheduler.get_last_lr()[0]
            memory = peak_memory_gib(self.dist.device)
            figures = {"update": update, "loss": loss, "grad_norm": grad_norm, "lr": lr}
            append_metrics(self.run_dir, {**figures, "s": seconds, **memory})
            rate = self.samples_per_update / seconds if seconds > 0 else 0.0
            scalars = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "samples_per_s": rate}
            self.tracking.scalars(update, scalars | memory)

    def run(self) -> dict[str, Any]:
        """Train from the latest checkpoint to the end, then export the weights (rank 0)."""
        train = self.config.train
        accum = train.gradient_accumulation_steps
        state = self.state
        self.resume()
        self.total_updates = self.planned_updates(state.update, state.epoch, state.offset)
        if self.dist.is_main:  # the run's records are appended, one start line per launch
            append_metrics(self.run_dir, {"start": state.update, "of": self.total_updates})
        started = time.perf_counter()
        for model in self.trained_models():
            model.train()
        while state.update < self.total_updates:
            left = self.source.steps_per_epoch(state.offset) // accum  # updates left in epoch
            if left == 0:
                state.epoch, state.offset = state.epoch + 1, 0
                continue
            epoch, start = state.epoch, state.offset
            for micro, (keys, batch) in enumerate(self.source.iterate(epoch, start)):
                if micro % accum == 0:
                    t0 = time.perf_counter()
                    update_loss = torch.zeros((), device=self.dist.device)
                model = self.trained_models()[0]
                with self.accelerator.accumulate(model):  # no_sync until the last micro-batch
                    update_loss += self.micro_step(batch, keys, epoch).float()
                if not self.accelerator.sync_gradients:  # accelerate owns the cadence
                    continue
                grad_norm = self.update_weights()
                state.update += 1
                state.offset = self.source.position_after(epoch, start, micro + 1)
                epoch_done = (micro + 1) // accum >= left
                if epoch_done:
                    state.epoch, state.offset = epoch + 1, 0
                if self.fault and self.fault[:2] == (self.dist.rank, state.update):
                    crash(whole_node=self.fault[2])
                seconds = time.perf_counter() - t0
                mean = self.mean_across_ranks(update_loss / accum)  # over micro-batches, ranks
                if not math.isfinite(mean):
                    raise TrainingDivergedError(self.diverged(state.update, mean))
                self.record(mean, grad_norm, seconds)
                self.after_update(epoch, mean, seconds)
                if state.update >= self.total_updates or epoch_done:
                    break
        elapsed = time.perf_counter() - started
        outputs = self.export()
        self.tracking.end()
        result = {
            "updates": state.update,
            "losses": state.losses,
            "seconds": elapsed,
            "step_seconds": self.step_seconds,
            "stall_seconds": self.source.stall_seconds,
            "tail": self.tail_cost,
            "world_size": self.dist.world_size,
            "mode": self.config.train.mode,
            "parallelism": self.stage2.mode,
            "models_loaded": sorted(self.stage2.models),
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "baseline_rss_mb": self.baseline_rss_mb,
            "outputs": outputs,
            "samples": {str(k): v for k, v in self.validator.samples.items()},
            "grids": {str(k): v for k, v in self.validator.grids.items()},  # one per size
        }
        if self.dist.is_main:
            write_result(self.run_dir, result)
        return result

    def after_update(self, epoch: int, loss: float, seconds: float) -> None:
        """The cadences after an update: log, checkpoint, validation samples."""
        train, update = self.config.train, self.state.update
        last = update == self.total_updates
        if update % train.log_every == 0 or last:
            self.log(
                f"update {update}/{self.total_updates} epoch {epoch} loss {loss:.5f} "
                f"{seconds:.3f}s/update"
            )
        if update % train.checkpoint_every == 0 or last:
            self.save()
        if self.validator.due(update, self.total_updates):
            self.validate(update)

    def diverged(self, update: int, loss: float) -> str:
        """The one line saying the run diverged, where, and what to do."""
        lr = self.scheduler.get_last_lr()[0]
        last = latest_checkpoint(
            self.checkpoint_url,
            storage_options=self.spec.get("checkpoint_storage_options"),
            clean=False,
        )
        kept = f"the last checkpoint is step {last}" if last else "no checkpoint was written"
        return (
            f"update {update}: the loss is {loss} (learning rate {lr:g}); stopped before it "
            f"could be checkpointed or exported ({kept}); lower train.learning_rate, or check "
            "the data and train.mixed_precision"
        )

    def export(self) -> dict[str, str]:
        """Write the trained weights (collective); rank 0 gets their URLs."""
        require_finite(self.stage2.parameters(), self.dist.device)
        written = export_weights(self.family, self.stage2, self.spec, steps=self.total_updates)
        if self.average is not None:  # the average beside the weights, in the same formats
            written |= self.average.swapped_in(
                lambda: export_weights(
                    self.family,
                    self.stage2,
                    self.spec,
                    steps=self.total_updates,
                    suffix="_ema",
                )
            )
        return written

    def trained_models(self) -> list[torch.nn.Module]:
        """The modules being trained."""
        return [self.stage2.models[name] for name in self.stage2.trained]
