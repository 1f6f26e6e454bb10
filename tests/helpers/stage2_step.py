"""One stage-2 training step in this process, on the real stage-2 build (meta -> LoRA ->
checkpointing / dtypes -> load): the demo DiT from small weight files, or a tiny FLUX folder."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from splitstage.config.job import SplitstageConfig, config_from_dict
from splitstage.pipelines.demo.dit import DiT
from splitstage.pipelines.demo.vae import VAEEncoder
from splitstage.pipelines.demo.weight_files import save_weights
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.job_plan import JobPlan, make_plan
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from tests.helpers.tiny_diffusers import write_tiny_folder

ONE_CPU = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
BATCH = 2


def demo_files(root: Path) -> Path:
    """A small seeded DiT (3 blocks) and VAE encoder as weight files under `root`."""
    torch.manual_seed(0)
    save_weights(DiT(hidden=64, depth=3, heads=4, text_dim=32), root / "dit.safetensors")
    save_weights(VAEEncoder(), root / "vae.safetensors")
    return root


def demo_config(root: Path, trainable: dict | None = None, **train) -> SplitstageConfig:
    """LoRA (rank 4) on the demo DiT of `demo_files(root)`, or `trainable`; `train` sets
    [train] fields."""
    return config_from_dict(
        {
            "job": {"name": "step", "seed": 1},
            "models": {
                "vae": {"weights": str(root / "vae.safetensors")},
                "dit": {"weights": str(root / "dit.safetensors")},
                "text_encoder": {"builder": "tiny"},
            },
            "trainable": trainable or {"lora_base_model": "dit", "lora_rank": 4},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache")},
            "train": train,
            "output": {"url": str(root / "out")},
        }
    )


def flux_config(root: Path, **train) -> SplitstageConfig:
    """LoRA (rank 4, alpha 8) on a tiny FLUX transformer written under `root / 'flux'`."""
    if not (root / "flux" / "model_index.json").is_file():
        write_tiny_folder("flux", root / "flux")
    pipeline = {"name": "flux", "pretrained": str(root / "flux"), "resolution": 64}
    pipeline |= {"precision": "fp32", "max_prompt_length": 16}
    return config_from_dict(
        {
            "job": {"name": "step", "seed": 1},
            "pipeline": pipeline,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4, "lora_alpha": 8},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache")},
            "train": train,
            "output": {"url": str(root / "out")},
        }
    )


def trained_model(config: SplitstageConfig, lines: list[str] | None = None):
    """(plan, the trained model) as stage 2 builds it on one CPU rank; log lines to `lines`."""
    plan = make_plan(config)
    name = config.trainable.models()[0]
    log = (lambda line: lines.append(line)) if lines is not None else (lambda line: None)
    stage2 = build_stage2_models(plan, ONE_CPU, names=[name], log=log)
    return plan, stage2.models[name]


def step_inputs(plan: JobPlan, seed: int = 0) -> dict[str, torch.Tensor]:
    """What stage 1 would have cached for a batch: latents and prompt embeddings (random)."""
    g = torch.Generator().manual_seed(seed)
    if plan.family.name == "demo":
        mask = torch.ones(BATCH, 8, dtype=torch.bool)
        mask[:, 5:] = False
        return {
            "input_latents": torch.randn(BATCH, 4, 8, 8, generator=g),
            "prompt_emb": torch.randn(BATCH, 8, 32, generator=g),
            "prompt_mask": mask,
        }
    return {  # the tiny FLUX: 16 latent channels, T5 / pooled CLIP width 32
        "input_latents": torch.randn(BATCH, 16, 8, 8, generator=g),
        "prompt_embeds": torch.randn(BATCH, 16, 32, generator=g),
        "pooled_prompt_embeds": torch.randn(BATCH, 32, generator=g),
    }


def seed_adapters(model: torch.nn.Module, seed: int = 0) -> None:
    """Non-zero LoRA B matrices (peft starts them at 0, which would leave A without gradient)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                values = torch.randn(param.shape, generator=g) * 0.1
                if isinstance(param, DTensor):  # sharded (FSDP2, offload): this rank's part
                    values = distribute_tensor(values, param.device_mesh, param.placements)
                param.copy_(values)


def step_loss(plan: JobPlan, model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    """The family's training loss of one drawn step on `step_inputs` (backward not called)."""
    family = plan.family
    generator = torch.Generator().manual_seed(seed + 1)
    draws = Draws.shared(generator)
    ctx = StepContext({family.denoiser: model}, ONE_CPU.device, draws, family.settings())
    return family.training_loss(ctx, step_inputs(plan, seed))
