"""Gradient accumulation has one owner: after k micro-batches the gradient is the mean of their
gradients (accelerate divides the loss once; dividing it again made it 1/k of that). And the draws
are per sample: the same 8 samples as 1 x 8, 8 x 1 or 2 ranks x 4 make the same update."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.config.job import SplitstageConfig, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.runtime import run_units
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.run_records import read_metrics
from splitstage.tasks.stage2.trainer import Trainer, to_device
from tests.helpers.tiny_diffusers import write_tiny_folder
from tests.helpers.tiny_job import make_workspace, one_rank_setup, tiny_config


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("accumulation"), samples=16, seed=0)


def one_rank_trainer(workspace: Path, accum: int) -> Trainer:
    """A rank of a real run spec, in this process (a one-rank group, as without torchrun)."""
    config = tiny_config(workspace, f"accum{accum}", 0, gradient_accumulation_steps=accum)
    return Trainer(one_rank_setup(config, workspace / "runs"))


def plain_gradient(trainer: Trainer, batch, keys: list[str]) -> list[torch.Tensor]:
    """One micro-batch's loss gradient by plain autograd (no accelerate), with the same draws."""
    ctx = trainer.step_context(keys, epoch=0)
    params = trainer.stage2.parameters()
    for param in params:
        param.grad = None
    inputs = to_device(batch, trainer.dist.device)
    run_units(trainer.units, ctx, inputs)
    trainer.family.training_loss(ctx, inputs).backward()
    return [param.grad.detach().clone() for param in params]


def test_accumulated_gradient_is_the_mean_of_the_micro_batches(workspace):
    try:
        trainer = one_rank_trainer(workspace, accum=2)
        batches = list(itertools.islice(trainer.source.iterate(0, 0), 2))
        model = trainer.trained_models()[0]
        for keys, batch in batches:
            with trainer.accelerator.accumulate(model):
                trainer.micro_step(batch, keys, epoch=0)
        accumulated = [param.grad.detach().clone() for param in trainer.stage2.parameters()]
        first, second = (plain_gradient(trainer, batch, keys) for keys, batch in batches)
    finally:
        close_distributed()
    assert any(g.abs().sum() > 0 for g in accumulated)
    for got, a, b in zip(accumulated, first, second, strict=True):
        # float32 sums of the same terms in another order: a few ulps of the gradient's scale
        torch.testing.assert_close(got, (a + b) / 2, rtol=1e-5, atol=1e-7)


CUTS = {  # the same 8 samples per update, cut three ways
    "1x8": {"batch_size": 8, "gradient_accumulation_steps": 1},
    "8x1": {"batch_size": 1, "gradient_accumulation_steps": 8},
    "2ranks-x4": {"batch_size": 4, "gradient_accumulation_steps": 1, "nproc_per_node": 2},
}


def sd_config(root: Path, name: str, **train_fields) -> SplitstageConfig:
    """The tiny SD folder (DDPM: noise offset, integer timesteps, a latent drawn from the VAE's
    posterior, caption dropout: every per-sample draw of a diffusers family)."""
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": {
                "name": "sd",
                "pretrained": str(root / "sd"),
                "resolution": 64,
                "noise_offset": 0.1,
                "caption_dropout": 0.5,
                "vae_latents": "sample",
            },
            "trainable": {"lora_base_model": "unet", "lora_rank": 4},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache")},
            "train": {"max_steps": 1, "learning_rate": 1e-3} | train_fields,
            "output": {"url": str(root / "out")},
            "tracking": {"report_to": "none"},
        }
    )


@pytest.fixture(scope="module")
def sd_workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("accumulation-sd")
    write_digits_dataset(root / "data", limit=8, size=32)
    write_tiny_folder("sd", root / "sd")
    preprocess(sd_config(root, "prep", batch_size=8), workers=1, progress=False)
    return root


@pytest.mark.slow
@pytest.mark.parametrize("family", ["demo", "sd"])
def test_one_update_is_the_same_however_the_batch_is_cut(request, family):
    """The old draws (per rank and batch index) and the old double division both fail this."""
    results = {}
    for name, cut in CUTS.items():
        # AdamW's eps well above |g|: its first update is ~ lr * g / eps, linear in the gradient
        # (with the default 1e-8, lr * g / |g| amplifies float noise of gradients near zero)
        fields = {**cut, "optimizer_args": {"eps": 1e-2}}
        if family == "demo":
            root = request.getfixturevalue("workspace")
            config = tiny_config(root, f"cut-{name}", 0, max_steps=1, **fields)
        else:
            root = request.getfixturevalue("sd_workspace")
            config = sd_config(root, f"cut-{name}", **fields)
        env = {"SPLITSTAGE_DEVICE": "cpu", "HF_HUB_OFFLINE": "1"}
        report = train(config, run_root=root / "runs", env=env, on_line=lambda line: None)
        (record,) = read_metrics(Path(report.run_dir))
        results[name] = record, load_file(report.outputs["dit" if family == "demo" else "unet"])
    (loss, norm, weights), *others = (
        (record["loss"], record["grad_norm"], w) for record, w in results.values()
    )
    assert norm > 0 and weights
    for other_loss, other_norm, other_weights in others:
        # fp32 means of the same 8 per-sample terms summed in another order: a few ulps
        assert other_loss == pytest.approx(loss, rel=1e-5)
        assert other_norm == pytest.approx(norm, rel=1e-4)
        for key, tensor in weights.items():  # one update of ~0.1 * g: float noise of g only
            torch.testing.assert_close(other_weights[key], tensor, rtol=1e-4, atol=1e-8)
