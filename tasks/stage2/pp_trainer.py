"""Pipeline-parallel stage 2: each rank holds one stage of the denoiser and runs a 1F1B schedule.

Every rank is one stage (PP degree = world size; PP combined with data or tensor parallelism is not
supported). The stages are the splitter's module-FQN assignment (torchtitan's
`module_fqns_per_model_part`): the DiT is built on the meta device, pruned to its stage's modules
(FQNs stay global), given LoRA adapters, then loaded with only its keys from the one weights file.
Every rank reads the same batch and draws the same noise and timesteps, so the first stage feeds
the pipeline and the last compares its output with the flow-matching target; the last stage's loss
is broadcast. Checkpoints hold each stage's module and optimizer under global FQNs (disjoint across
stages); the export gathers every stage's trained tensors on rank 0 into one safetensors file.
With [train.ema] each stage averages its own parameters: the checkpoint keeps every stage's
average under global FQNs (merged on rank 0), each stage restores its own, and the export writes
`<name>_ema` beside the weights.

Selected with `train.parallelism = "pp"`; `check_pp_config` refuses bad settings before launch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

from splitstage.config.job import ConfigError, SplitstageConfig
from splitstage.pipelines.family import Family, TrainingStep, family_for
from splitstage.pipelines.runtime import run_units
from splitstage.splitter import (
    StageAssignmentError,
    assign_stages,
    layout_from_fqns,
    validate_stages,
)
from splitstage.tasks.stage2.checkpoint import Stateful
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.export import export_weights
from splitstage.tasks.stage2.models import Stage2Models, adapt_trained
from splitstage.tasks.stage2.optimization import TrainedAverage
from splitstage.tasks.stage2.pretrained_weights import materialize_and_load
from splitstage.tasks.stage2.trainer import Trainer, require_finite, to_device

if TYPE_CHECKING:  # made by the worker before the trainer is built (rank_setup.py)
    from splitstage.tasks.stage2.run_spec import RankSetup

STAGES = "train.nnodes * train.nproc_per_node"


def stage_fqns(config: SplitstageConfig, num_stages: int) -> list[list[str]]:
    """The denoiser's top-level module FQNs per stage, for the depth its weights were saved with."""
    family = family_for(config)
    meta = family.build_model(family.denoiser, torch.device("meta"), meta=True)
    fqns = family.pp_module_fqns(meta)
    family.pp_prune(meta, fqns)  # refuses here, before launch, a family that cannot prune
    layout = layout_from_fqns(fqns)
    try:
        parts = validate_stages(assign_stages(layout, num_stages), fqns)
    except StageAssignmentError as error:
        raise ConfigError(f"{STAGES} = {num_stages} pipeline stages: {error}") from None
    idle = [i for i, part in enumerate(parts) if not family.pp_stage_has_work(part)]
    if idle:
        fits = max(
            (n for n in range(1, num_stages) if _all_work(family, assign_stages(layout, n))),
            default=1,
        )
        raise ConfigError(
            f"{STAGES} = {num_stages} pipeline stages leave stage {idle[0]} without a repeated "
            f"block of the {family.denoiser} ({parts[idle[0]]}); use at most {fits} ranks"
        )
    return parts


def _all_work(family: Family, parts: list[list[str]]) -> bool:
    return all(family.pp_stage_has_work(part) for part in parts)


def check_pp_config(config: SplitstageConfig) -> list[list[str]]:
    """Refuse pipeline settings that would fail inside the ranks; return each stage's modules."""
    train = config.train
    stages = train.nnodes * train.nproc_per_node
    denoiser = family_for(config).denoiser
    if config.trainable.models() != [denoiser]:
        raise ConfigError(
            f"train.parallelism='pp' pipelines the denoiser only: train just '{denoiser}' "
            f"(trainable.full or trainable.lora_base_model), not {config.trainable.models()}"
        )
    if train.tp_degree != 1:
        raise ConfigError(
            f"train.tp_degree={train.tp_degree}: with train.parallelism='pp' every rank is one "
            "stage (PP degree = world size, no PP+TP or PP+DP); set train.tp_degree = 1"
        )
    if train.pp_microbatches < stages:
        raise ConfigError(
            f"train.pp_microbatches={train.pp_microbatches} is fewer than the {stages} pipeline "
            f"stages ({STAGES}); set train.pp_microbatches >= {stages}"
        )
    if train.batch_size % train.pp_microbatches:
        fits = [n for n in range(stages, train.batch_size + 1) if train.batch_size % n == 0]
        raise ConfigError(
            f"train.batch_size={train.batch_size} does not split into "
            f"train.pp_microbatches={train.pp_microbatches} equal microbatches; make the batch "
            f"size a multiple of it, or use pp_microbatches in {fits or 'none: raise batch_size'}"
        )
    if train.mixed_precision == "fp16":
        raise ConfigError(
            "train.mixed_precision='fp16' needs a gradient scaler, which the pipeline schedule "
            "does not apply; use 'bf16', 'auto' or 'no' with train.parallelism='pp'"
        )
    if train.weights_loading != "slices":
        raise ConfigError(
            "train.weights_loading='broadcast' cannot feed pipeline stages (each stage reads "
            "only its own modules from the file); use 'slices' with train.parallelism='pp'"
        )
    return stage_fqns(config, stages)


class StageAverage:
    """A pipeline stage's [train.ema] as a checkpoint part: every stage's averages merged on
    rank 0 with their tensors keyed by global FQN (disjoint across stages), so each stage of a
    resume finds its own, whatever the stage layout."""

    def __init__(self, average: TrainedAverage, names: list[str], dist_info: DistInfo):
        self.average, self.names, self.dist = average, names, dist_info

    def state_dict(self) -> dict[str, Any] | None:
        """The merged state on rank 0 (collective; None elsewhere: only rank 0 writes it)."""
        state = self.average.state_by_name(self.names)
        shadow = state.pop("shadow_params")
        blobs = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(safetensors_bytes(shadow), blobs, dst=0)  # pickles only bytes
        if not self.dist.is_main:
            return None
        merged: dict[str, torch.Tensor] = {}
        for blob in blobs or []:
            merged.update(safetensors_load(blob))
        return {**state, "shadow_params": merged}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This stage's averages from the merged state."""
        self.average.load_state_by_name(state, self.names)


class PipelineTrainer(Trainer):
    """The training loop of one pipeline stage: Trainer's loop, with PP model, step and export."""

    def __init__(self, setup: RankSetup):
        super().__init__(setup)
        train = self.config.train
        self.stage = PipelineStage(
            self.stage2.models[self.family.denoiser],
            self.dist.rank,
            self.dist.world_size,
            self.dist.device,
        )
        # Grads of all microbatches (and accumulated batches) add up; the loss carries the mean.
        self.grad_scale = train.pp_microbatches * train.gradient_accumulation_steps
        self.schedule = Schedule1F1B(
            self.stage, train.pp_microbatches, loss_fn=self.stage_loss, scale_grads=False
        )

    def build_models(self, names: list[str] | None) -> Stage2Models:
        """This rank's denoiser stage (meta, prune, LoRA, its keys of the file); frozen others."""
        parts = check_pp_config(self.config)
        if len(parts) != self.dist.world_size:
            raise ConfigError(f"{STAGES} = {len(parts)} but the job has {self.dist.world_size}")
        device, config, family = self.dist.device, self.config, self.plan.family
        denoiser = family.denoiser
        models: dict[str, torch.nn.Module] = {}
        for name in names or self.plan.split.models["stage2"]:
            if name != denoiser:  # unsplit: every rank runs the frozen V2 models itself
                models[name] = family.build_model(name, device).eval().requires_grad_(False)
        model = family.build_model(denoiser, device, meta=True)
        family.pp_prune(model, parts[self.dist.rank])
        lora = config.trainable.lora_base_model == denoiser
        model = adapt_trained(model, denoiser, family, device)  # LoRA, dtype, checkpointing
        weights = family.weights_file(denoiser)
        if weights is None:
            raise ConfigError(
                f"train.parallelism='pp' loads each stage's slice of one weights file, but the "
                f"{family.name} family gives none for '{denoiser}'; use another parallelism"
            )
        materialize_and_load(
            model,
            weights[0],
            key_prefix=weights[1],
            buffers_init=family.init_buffers,
            device=device,
            adapter_seed=config.job.seed,
            ignore_unexpected=True,
        )
        models[denoiser] = model
        return Stage2Models(models=models, trained=[denoiser], lora=lora, mode="pp")

    def stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The family's loss of one microbatch, scaled so the summed grads are the batch mean's."""
        return self.family.loss(output, TrainingStep((), target)) / self.grad_scale

    def micro_step(self, batch: dict[str, Any], keys: list[str], epoch: int) -> torch.Tensor:
        """All ranks run V1 and draw the step alike (one data stream for the whole pipeline:
        the same keys, so the same per-sample draws); the schedule runs forward and backward."""
        device = self.dist.device
        ctx = self.step_context(keys, epoch)
        inputs = to_device(batch, device)
        losses: list[torch.Tensor] = []
        with self.accelerator.autocast():
            run_units(self.units, ctx, inputs)
            step = self.family.training_step(ctx, inputs)
            self.schedule.step(
                *(step.denoiser_args if self.stage.is_first else ()),
                target=step.target if self.stage.is_last else None,
                losses=losses if self.stage.is_last else None,
                return_outputs=False,
            )
        if not self.stage.is_last:
            return torch.zeros((), device=device)
        accum = self.config.train.gradient_accumulation_steps
        return torch.stack(losses).detach().sum() * accum  # mean microbatch loss, unscaled

    def gradient_group(self) -> dist.ProcessGroup | None:
        """Every stage holds other parameters: the global gradient norm sums over all of them."""
        return dist.group.WORLD

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        """The last stage's loss on every rank (only the last stage computes one)."""
        value = value.detach().float().to(self.dist.device)
        dist.broadcast(value, src=self.dist.world_size - 1)
        return float(value)

    def trained_names(self) -> list[str]:
        """Global FQNs of this stage's trained parameters, in `stage2.parameters()` order."""
        model = self.stage2.models[self.family.denoiser]
        return [name for name, param in model.named_parameters() if param.requires_grad]

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """Trainer's parts, with each stage's EMA kept by parameter name."""
        parts = super().checkpoint_parts()
        if self.average is not None:
            parts["ema"] = StageAverage(self.average, self.trained_names(), self.dist)
        return parts

    def gathered(self) -> dict[str, torch.Tensor]:
        """Every stage's trained tensors, merged on rank 0 (collective; empty elsewhere)."""
        model = self.stage2.models[self.family.denoiser]
        own = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        blobs = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(safetensors_bytes(own), blobs, dst=0)  # pickles only bytes
        merged: dict[str, torch.Tensor] = {}
        for blob in blobs or []:
            merged.update(safetensors_load(blob))
        return merged

    def export(self) -> dict[str, str]:
        """Gather every stage's trained tensors on rank 0 and write them as one file; with
        [train.ema], the average beside them as `<name>_ema`, like the other modes."""
        require_finite(self.stage2.parameters(), self.dist.device)
        denoiser = self.family.denoiser

        def write(states: dict[str, torch.Tensor], suffix: str = "") -> dict[str, str]:
            return export_weights(
                self.family,
                self.stage2,
                self.places,
                self.settings,
                states={denoiser: states},
                steps=self.total_updates,
                suffix=suffix,
            )

        written = write(self.gathered())
        if self.average is not None:
            written |= write(self.average.swapped_in(self.gathered), "_ema")
        else:
            self.set_aside_stale_average(written)
        return written
