"""Stage 2, one rank: run V1 + the denoiser on cached boundary params, backprop, checkpoint, export.

The loop of every data/tensor-parallel mode; `pp_trainer.PipelineTrainer` reuses it with the
pipeline schedule. Started by torchrun through `splitstage.tasks.stage2.worker`.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.optim.lr_scheduler import LRScheduler

from splitstage.config.job import ConfigError, SplitstageConfig, TrainConfig
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, run_units
from splitstage.splitter import UserError
from splitstage.tasks.device import (
    peak_memory_gib,
    peak_resident_mb,
    pick_dtype,
    resident_mb,
    steady_heap,
)
from splitstage.tasks.job_plan import JobPlan
from splitstage.tasks.stage2.batches import CachedBatches, RawBatches, UpdateBatches
from splitstage.tasks.stage2.checkpoint import Checkpointer, Stateful
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.export import export_weights, set_aside_averages
from splitstage.tasks.stage2.faults import crash, injected_fault
from splitstage.tasks.stage2.models import Stage2Models, build_stage2_models
from splitstage.tasks.stage2.optimization import (
    TrainedAverage,
    apply_config_to_groups,
    build_optimizer,
    build_scheduler,
    clip_gradients,
)
from splitstage.tasks.stage2.parallelize import set_gradient_sync
from splitstage.tasks.stage2.run_records import append_metrics, write_result
from splitstage.tasks.stage2.run_spec import RunSpec
from splitstage.tasks.stage2.tracking import Tracking, tracker_names
from splitstage.tasks.stage2.validation import Validator

if TYPE_CHECKING:  # made by the worker before the trainer is built (rank_setup.py)
    from splitstage.tasks.stage2.run_spec import RankSetup


class TrainingDivergedError(UserError, FloatingPointError):
    """The loss became NaN or infinite: training stops, nothing non-finite is saved."""


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


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Move tensors of a batch to the training device."""
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


@dataclass
class LoopState:
    """Where the loop stands: updates done and the loss of every update so far (the epoch and
    the position within it are the batch source's: `UpdateBatches`)."""

    update: int = 0
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        """Plain numbers for the checkpoint."""
        return {"update": self.update, "losses": list(self.losses)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a checkpoint's loop state."""
        self.update = int(state["update"])
        self.losses = [float(loss) for loss in state["losses"]]


class LearningRate:
    """The learning-rate schedule as a checkpoint part: built once the run's length is known
    (`start`), at the update a checkpoint left it (a resume may change the run's length)."""

    def __init__(self, optimizer: torch.optim.Optimizer, train: TrainConfig):
        self.optimizer, self.train = optimizer, train
        self.done = 0  # updates the schedule has taken
        self.scheduler: LRScheduler | None = None

    def state_dict(self) -> dict[str, Any]:
        """The schedule's own state (its position: `last_epoch`)."""
        assert self.scheduler is not None, "start() the schedule first"
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Where a checkpoint left the schedule; the config's optimizer settings hold from
        here on (the rate comes back through `start`)."""
        self.done = int(state["last_epoch"])
        apply_config_to_groups(self.optimizer, self.train)

    def start(self, total_updates: int) -> None:
        """Build the schedule for a run ending at `total_updates`, positioned after `done`."""
        self.scheduler = build_scheduler(self.optimizer, self.train, total_updates, self.done)

    def step(self) -> None:
        """After an update."""
        assert self.scheduler is not None, "start() the schedule first"
        self.scheduler.step()

    def rate(self) -> float:
        """The current learning rate (of the first parameter group)."""
        assert self.scheduler is not None, "start() the schedule first"
        return self.scheduler.get_last_lr()[0]


class Trainer:
    """The training loop of one rank; `run()` trains to the end and returns the figures."""

    total_updates: int  # the update this run ends at: fixed once, when it starts (`restore`)

    def __init__(self, setup: RankSetup):
        steady_heap()  # a CPU step's transient buffers go back to the system
        self.baseline_rss_mb = resident_mb()  # after imports, before any model is built
        self.spec: RunSpec = setup.spec
        self.places = setup.spec.places
        self.config: SplitstageConfig = setup.spec.config
        self.dist: DistInfo = setup.dist
        self.plan: JobPlan = setup.plan
        self.settings = setup.settings  # recorded in every checkpoint (resume checks)
        train = self.config.train
        dtype = pick_dtype(train.mixed_precision, self.dist.device)
        precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "no")
        self.accelerator = Accelerator(
            cpu=self.dist.device.type == "cpu",
            mixed_precision=precision,
            gradient_accumulation_steps=train.gradient_accumulation_steps,
            log_with=tracker_names(self.config) or None,
            project_dir=str(Path(self.places.run_dir) / "tracking"),
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
                self.plan.cache,  # the store the checks opened, on rank 0
                self.stage2.dp_rank,
                self.stage2.dp_size,
                keys=setup.samples,
            )
        )
        params = self.stage2.parameters()
        if not params:
            raise ConfigError(
                "no parameter requires gradients: set trainable.full or trainable.lora_base_model"
            )
        self.optimizer = build_optimizer(params, train)
        self.prepared_optimizer = self.accelerator.prepare(self.optimizer)
        self.learning_rate = LearningRate(self.optimizer, train)  # started once the run's
        self.average = (  # length is known (`restore`)
            TrainedAverage(params, train.ema.decay, train.ema.start_update) if train.ema else None
        )
        ema_samples = train.ema is not None and train.ema.use_for_validation
        self.validator = Validator(
            self.plan,
            self.stage2.models,
            self.dist.device,
            self.places.output_url,
            is_main=self.dist.is_main,
            log=self.log,
            autocast=self.accelerator.autocast,
            on_grid=self.tracking.grid,
            on_clips=self.tracking.clips if self.tracking.active else None,  # no GIFs for none
            weights=self.average.swapped_in if self.average is not None and ema_samples else None,
        )
        steps_per_epoch = self.source.steps_per_epoch()
        if steps_per_epoch < train.gradient_accumulation_steps:  # preflight refuses this first
            raise ConfigError(
                f"{steps_per_epoch} batches per rank per epoch (train.batch_size="
                f"{train.batch_size}, {self.stage2.dp_size} data-parallel replicas) is fewer than "
                f"train.gradient_accumulation_steps={train.gradient_accumulation_steps}"
            )
        self.batches = UpdateBatches(self.source, train.gradient_accumulation_steps)
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
        # Samples all data-parallel replicas consume per update (for the samples/s figure).
        self.samples_per_update = (
            train.gradient_accumulation_steps * train.batch_size * self.stage2.dp_size
        )
        self.state = LoopState()
        self.checkpointer = Checkpointer(
            self.places.checkpoint_url,
            self.stage2.models[self.stage2.trained[0]],
            [self.optimizer],
            self.checkpoint_parts(),
            every=train.checkpoint_every,
            keep_last=train.keep_checkpoints,
            lora_only=self.stage2.lora,
            storage_options=self.places.checkpoint_storage_options,
            recorded={"settings": self.settings},  # what a resume's checks compare
        )
        self.run_dir = Path(self.places.run_dir)
        self.step_seconds: list[float] = []
        self.fault = injected_fault()

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """What a checkpoint holds besides the model and the optimizer, by name."""
        parts: dict[str, Stateful] = {
            "loop": self.state,
            "batches": self.batches,
            "scheduler": self.learning_rate,
        }
        if self.average is not None:
            parts["ema"] = self.average
        return parts

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
        self.learning_rate.step()
        if self.average is not None:
            self.average.step()
        return grad_norm

    def gradient_group(self) -> dist.ProcessGroup | None:
        """Ranks holding other parameters whose gradients join the global norm (none: DDP
        replicas hold the same gradients; FSDP/TP shards are DTensors torch reduces)."""
        return None

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        """The loss averaged over ranks, for logging."""
        if dist.is_initialized() and self.dist.world_size > 1:
            value = value.clone().to(self.dist.device)
            dist.all_reduce(value)
            value /= self.dist.world_size
        return float(value)

    def train_step(self) -> tuple[int, float, float]:
        """One update: its micro-batches forward and backward, the gradients reduced across
        replicas once (with the last micro-batch), then the weights; (epoch, mean loss,
        pre-clip gradient norm)."""
        update = self.batches.next_update()
        models = self.trained_models()
        total = torch.zeros((), device=self.dist.device)
        for keys, batch in update.micro_batches:
            # accelerate owns the cadence (sync_gradients: the update's last micro-batch) and
            # the loss division; the wrappers' gradient sync follows it
            with self.accelerator.accumulate(*models):
                set_gradient_sync(models, self.accelerator.sync_gradients)
                total += self.micro_step(batch, keys, update.epoch).float()
        if not self.accelerator.sync_gradients:
            raise RuntimeError(
                "accelerate's gradient accumulation is out of step with the update's micro-"
                f"batches ({self.batches.accumulation} per update)"
            )
        grad_norm = self.update_weights()
        mean = self.mean_across_ranks(total / self.batches.accumulation)  # micro-batches, ranks
        if not math.isfinite(mean):
            raise TrainingDivergedError(self.diverged(self.state.update + 1, mean))
        return update.epoch, mean, grad_norm

    # -- the loop ---------------------------------------------------------------------------------
    def log(self, line: str) -> None:
        """Rank 0 prints a line the launcher streams (and Prefect shows)."""
        if self.dist.is_main:
            print(line, flush=True)

    def restore(self) -> None:
        """Resume from the latest complete checkpoint, if any (model, optimizer, schedule, EMA,
        loop state, data position); then the run's length is known: start the schedule."""
        step = self.checkpointer.load()
        if step is not None:
            self.log(f"resumed from checkpoint step {step}")
            if self.average is not None:  # the config's EMA settings, from here on
                self.average.resume_at(step)
        train = self.config.train
        self.total_updates = self.batches.planned_updates(
            self.state.update, train.epochs, train.max_steps
        )
        self.learning_rate.start(self.total_updates)
        if self.dist.is_main:  # the run's records are appended, one start line per launch
            append_metrics(self.run_dir, {"start": self.state.update, "of": self.total_updates})

    def record(self, epoch: int, loss: float, grad_norm: float, seconds: float) -> None:
        """The update's figures: metrics.jsonl and the trackers (rank 0), the log line every
        `train.log_every` updates and at the last."""
        update = self.state.update
        self.state.losses.append(loss)
        self.step_seconds.append(seconds)
        if self.dist.is_main:
            lr = self.learning_rate.rate()
            memory = peak_memory_gib(self.dist.device)
            figures = {"update": update, "loss": loss, "grad_norm": grad_norm, "lr": lr}
            append_metrics(self.run_dir, {**figures, "s": seconds, **memory})
            rate = self.samples_per_update / seconds if seconds > 0 else 0.0
            scalars = {"loss": loss, "grad_norm": grad_norm, "lr": lr, "samples_per_s": rate}
            self.tracking.scalars(update, scalars | memory)
        if update % self.config.train.log_every == 0 or update == self.total_updates:
            self.log(
                f"update {update}/{self.total_updates} epoch {epoch} loss {loss:.5f} "
                f"{seconds:.3f}s/update"
            )

    def run(self) -> dict[str, Any]:
        """Train from the latest checkpoint to the end, then export the weights (rank 0)."""
        self.restore()
        state = self.state
        started = time.perf_counter()
        for model in self.trained_models():
            model.train()
        while state.update < self.total_updates:
            t0 = time.perf_counter()
            epoch, loss, grad_norm = self.train_step()
            state.update += 1
            if self.fault and self.fault[:2] == (self.dist.rank, state.update):
                crash(whole_node=self.fault[2])
            self.record(epoch, loss, grad_norm, time.perf_counter() - t0)
            last = state.update == self.total_updates
            self.checkpointer.save(state.update, last=last)
            self.validator.validate(state.update, last=last)
        self.batches.close()
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
            "peak_rss_mb": peak_resident_mb(),
            "baseline_rss_mb": self.baseline_rss_mb,
            "outputs": outputs,
            "samples": {str(k): v for k, v in self.validator.samples.items()},
            "grids": {str(k): v for k, v in self.validator.grids.items()},  # one per size
        }
        if self.dist.is_main:
            write_result(self.run_dir, result)
        return result

    def diverged(self, update: int, loss: float) -> str:
        """The one line saying the run diverged, where, and what to do."""
        lr = self.learning_rate.rate()
        last = self.checkpointer.latest()
        kept = f"the last checkpoint is step {last}" if last else "no checkpoint was written"
        return (
            f"update {update}: the loss is {loss} (learning rate {lr:g}); stopped before it "
            f"could be checkpointed or exported ({kept}); lower train.learning_rate, or check "
            "the data and train.mixed_precision"
        )

    def export(self) -> dict[str, str]:
        """Write the trained weights (collective); rank 0 gets their URLs."""
        require_finite(self.stage2.parameters(), self.dist.device)
        written = export_weights(
            self.family, self.stage2, self.places, self.settings, steps=self.total_updates
        )
        if self.average is not None:  # the average beside the weights, in the same formats
            written |= self.average.swapped_in(
                lambda: export_weights(
                    self.family,
                    self.stage2,
                    self.places,
                    self.settings,
                    steps=self.total_updates,
                    suffix="_ema",
                )
            )
        else:
            self.set_aside_stale_average(written)
        return written

    def set_aside_stale_average(self, written: dict[str, str]) -> None:
        """Without [train.ema]: an earlier launch's `*_ema` files beside these weights would look
        current; rename them `*.stale` (rank 0; only in the run's output folder) and say so."""
        for old, new in set_aside_averages(self.places, written):
            self.log(
                f"[train.ema] is off: {old} is an earlier launch's average, older than the "
                f"weights beside it; renamed {new}"
            )

    def trained_models(self) -> list[torch.nn.Module]:
        """The modules being trained."""
        return [self.stage2.models[name] for name in self.stage2.trained]
