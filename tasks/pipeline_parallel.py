"""Pipeline-parallel stage 2: each rank holds one stage of the denoiser and runs a 1F1B schedule.

Every rank is one stage (PP degree = world size; PP combined with data or tensor parallelism is not
supported). The stages are the splitter's module-FQN assignment (torchtitan's
`module_fqns_per_model_part`): the DiT is built on the meta device, pruned to its stage's modules
(FQNs stay global), given LoRA adapters, then loaded with only its keys from the one weights file.
Every rank reads the same batch and draws the same noise and timesteps, so the first stage feeds
the pipeline and the last compares its output with the flow-matching target; the last stage's loss
is broadcast. Checkpoints hold each stage's module and optimizer under global FQNs (disjoint across
stages); the export gathers every stage's trained tensors on rank 0 into one safetensors file.

Selected with `train.parallelism = "pp"`; `check_pp_config` refuses bad settings before launch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_bytes
from splitstage.pipelines import demo
from splitstage.pipelines.config import ConfigError, SplitstageConfig
from splitstage.pipelines.models import (
    DiT,
    add_noise,
    dit_module_fqns,
    flow_matching_target,
    prune_to_stage,
    sample_noise,
    sample_timesteps,
)
from splitstage.pipelines.runtime import StepContext, run_units
from splitstage.splitter import (
    StageAssignmentError,
    assign_stages,
    layout_from_fqns,
    validate_stages,
)
from splitstage.tasks.export import export_weights
from splitstage.tasks.stage2_models import Stage2Models, add_lora
from splitstage.tasks.train_worker import Trainer, step_generator, to_device
from splitstage.tasks.weights import materialize_and_load
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

DENOISER = "dit"
STAGES = "train.nnodes * train.nproc_per_node"


def stage_fqns(config: SplitstageConfig, num_stages: int) -> list[list[str]]:
    """The DiT's top-level module FQNs per stage, for the depth its weights file was saved with."""
    meta = demo.build_model(config, DENOISER, torch.device("meta"), load=False)
    fqns = dit_module_fqns(len(meta.blocks))
    layout = layout_from_fqns(fqns)
    try:
        parts = validate_stages(assign_stages(layout, num_stages), fqns)
    except StageAssignmentError as error:
        raise ConfigError(f"{STAGES} = {num_stages} pipeline stages: {error}") from None
    empty = _blockless(parts)
    if empty:
        fits = max(n for n in range(1, num_stages) if not _blockless(assign_stages(layout, n)))
        raise ConfigError(
            f"{STAGES} = {num_stages} pipeline stages leave stage {empty[0]} without a DiT block "
            f"({parts[empty[0]]}); use at most {fits} ranks for this {len(meta.blocks)}-block DiT"
        )
    return parts


def _blockless(parts: list[list[str]]) -> list[int]:
    """Stages holding no DiT block (nothing for LoRA to adapt, next to no work)."""
    return [i for i, part in enumerate(parts) if not any(f.startswith("blocks.") for f in part)]


def check_pp_config(config: SplitstageConfig) -> list[list[str]]:
    """Refuse pipeline settings that would fail inside the ranks; return each stage's modules."""
    train = config.train
    stages = train.nnodes * train.nproc_per_node
    if config.trainable.models() != [DENOISER]:
        raise ConfigError(
            f"train.parallelism='pp' pipelines the denoiser only: train just '{DENOISER}' "
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


def denoiser_inputs(
    ctx: StepContext, inputs: dict[str, Any], dtype: torch.dtype
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """First-stage args and velocity target, drawn in the order `demo.training_loss` draws them."""
    x0 = inputs["input_latents"].to(ctx.device, torch.float32)
    noise = sample_noise(x0, ctx.generator)
    timestep = sample_timesteps(x0.shape[0], ctx.generator, ctx.device)
    args = (
        add_noise(x0, noise, timestep).to(dtype),
        timestep.to(dtype),
        inputs["prompt_emb"].to(ctx.device, dtype),
        inputs["prompt_mask"].to(ctx.device),
    )
    return args, flow_matching_target(noise.float(), x0.float())


class PipelineTrainer(Trainer):
    """The training loop of one pipeline stage: Trainer's loop, with PP model, step and export."""

    def __init__(self, spec: dict[str, Any]):
        super().__init__(spec)
        train = self.config.train
        self.stage = PipelineStage(
            self.stage2.models[DENOISER], self.dist.rank, self.dist.world_size, self.dist.device
        )
        # Grads of all microbatches (and accumulated batches) add up; the loss carries the mean.
        self.grad_scale = train.pp_microbatches * train.gradient_accumulation_steps
        self.schedule = Schedule1F1B(
            self.stage, train.pp_microbatches, loss_fn=self.stage_loss, scale_grads=False
        )

    def build_models(self, names: list[str] | None) -> Stage2Models:
        """This rank's DiT stage (meta -> prune -> LoRA -> its keys of the file), frozen others."""
        parts = check_pp_config(self.config)
        if len(parts) != self.dist.world_size:
            raise ConfigError(f"{STAGES} = {len(parts)} but the job has {self.dist.world_size}")
        device, config = self.dist.device, self.config
        models: dict[str, torch.nn.Module] = {}
        for name in names or self.plan.split.models["stage2"]:
            if name != DENOISER:  # unsplit: every rank runs the frozen V2 models itself
                models[name] = demo.build_model(config, name, device).eval().requires_grad_(False)
        model = demo.build_model(config, DENOISER, device, load=False)
        prune_to_stage(model, parts[self.dist.rank])
        lora = config.trainable.lora_base_model == DENOISER
        model = add_lora(model, config) if lora else model.requires_grad_(True)
        source = demo.model_source(config, DENOISER)
        materialize_and_load(
            model,
            source.weights,
            key_prefix=source.key_prefix,
            buffers_init=DiT.init_non_persistent_buffers,
            device=device,
            adapter_seed=config.job.seed,
            ignore_unexpected=True,
        )
        models[DENOISER] = model
        return Stage2Models(models=models, trained=[DENOISER], lora=lora, mode="pp")

    def stage_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Flow-matching MSE of one microbatch, scaled so the summed grads are the batch mean's."""
        return F.mse_loss(output.float(), target) / self.grad_scale

    def micro_step(self, batch: dict[str, Any], batch_index: int) -> torch.Tensor:
        """All ranks run V1 and draw the step alike; the schedule runs forward and backward."""
        device = self.dist.device
        ctx = StepContext(
            models=self.stage2.models,
            device=device,
            # One data stream for the whole pipeline: every stage draws the same noise/timesteps.
            generator=step_generator(self.config.job.seed, 0, batch_index, device),
            settings=demo.settings(self.config),
        )
        inputs = to_device(batch, device)
        dtype = next(self.stage2.models[DENOISER].parameters()).dtype
        losses: list[torch.Tensor] = []
        with self.accelerator.autocast():
            run_units(self.units, ctx, inputs)
            args, target = denoiser_inputs(ctx, inputs, dtype)
            self.schedule.step(
                *(args if self.stage.is_first else ()),
                target=target if self.stage.is_last else None,
                losses=losses if self.stage.is_last else None,
                return_outputs=False,
            )
        if not self.stage.is_last:
            return torch.zeros((), device=device)
        accum = self.config.train.gradient_accumulation_steps
        return torch.stack(losses).detach().sum() * accum  # mean microbatch loss, unscaled

    def mean_across_ranks(self, value: torch.Tensor) -> float:
        """The last stage's loss on every rank (only the last stage computes one)."""
        value = value.detach().float().to(self.dist.device)
        dist.broadcast(value, src=self.dist.world_size - 1)
        return float(value)

    def export(self) -> dict[str, str]:
        """Gather every stage's trained tensors on rank 0 and write them as one file."""
        model = self.stage2.models[DENOISER]
        own = {n: p.detach().cpu() for n, p in model.named_parameters() if p.requires_grad}
        blobs = [None] * self.dist.world_size if self.dist.is_main else None
        dist.gather_object(safetensors_bytes(own), blobs, dst=0)  # pickles only bytes
        merged: dict[str, torch.Tensor] = {}
        for blob in blobs or []:
            merged.update(safetensors_load(blob))
        return export_weights(self.config, self.stage2, self.spec, states={DENOISER: merged})
