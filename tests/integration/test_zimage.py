"""Z-Image through diffusers (`[pipeline] name = "zimage"`) on a tiny Hub-style folder with the
real classes (ZImageTransformer2DModel, AutoencoderKL, Qwen3Model, Qwen2Tokenizer with a chat
template): the split plan, our training loss against diffusers' train_dreambooth_lora_z_image
computation for the same noise and timesteps, the sampler against ZImagePipeline, and plan ->
preprocess -> torchrun training -> an export ZImagePipeline.load_lora_weights reproduces.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from splitstage.config.job import ConfigError
from splitstage.tasks.job_plan import make_plan
from tests.helpers.diffusers_families import (
    assert_only_stage_1_settings_key_the_cache,
    assert_split_equals_unsplit_and_exports,
    assert_the_encoders_are_cached,
    assert_the_sampler_matches,
    assert_two_ranks_give_the_one_rank_losses,
    digits_and_folder,
    drawn_step,
    drop_chat_template,
    lora_job,
    split_run_of,
    tiny_pipeline,
    validate_refusal,
)

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of the digit 3", "a cat"]
LENGTH = 48  # max_prompt_length: longer than both templated prompts, so each is unpadded


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (4 digits) and the tiny Z-Image folder."""
    return digits_and_folder(tmp_path_factory, "zimage")


def job(root: Path, name: str, *, pipeline=None, **train):
    """A LoRA job on the tiny folder (see lora_job), prompts LENGTH tokens at most."""
    pipeline = {"max_prompt_length": LENGTH} | (pipeline or {})
    return lora_job(root, "zimage", name, pipeline=pipeline, **train)


def pipeline(root: Path):
    """ZImagePipeline from the same folder (offline)."""
    return tiny_pipeline(root, "ZImagePipeline", "zimage")


def test_the_plan_caches_prompt_and_vae_encoding_and_trains_the_transformer(root):
    plan = make_plan(job(root, "plan"))
    assert_the_encoders_are_cached(
        plan, {"prompt_embeds", "prompt_embeds_mask", "empty_prompt_embeds_mask"}
    )
    per_step = {"caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert_only_stage_1_settings_key_the_cache(job, root, plan, per_step)


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps: diffusers' train_dreambooth_lora_z_image lines on the
    pipeline's own prompt encoding and VAE give our loss."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    transformer = pipe.transformer
    batch, ctx, step = drawn_step(plan, transformer, PROMPTS)
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)

    with torch.no_grad():
        prompt_embeds, _ = pipe.encode_prompt(
            list(PROMPTS), do_classifier_free_guidance=False, max_sequence_length=LENGTH
        )
        model_input = pipe.vae.encode(batch["image"]).latent_dist.mode()
    assert len({len(e) for e in prompt_embeds}) == 2  # unlike lengths: the unpadding matters
    config = pipe.vae.config
    model_input = (model_input - config.shift_factor) * config.scaling_factor
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        root / "zimage", subfolder="scheduler"
    )
    timesteps = batch["timestep"]
    index = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1)
    noise = batch["noise"]
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    with torch.no_grad():
        pred = transformer(
            list(noisy.unsqueeze(2).unbind(dim=0)),
            (1000 - timesteps) / 1000,
            prompt_embeds,
            return_dict=False,
        )[0]
    pred = -torch.stack(pred, dim=0).squeeze(2)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (pred - target) ** 2).reshape(target.shape[0], -1), 1).mean()
    assert ours.item() == pytest.approx(loss.item(), rel=1e-5)


def test_the_sampler_matches_the_zimage_pipeline(root):
    plan = make_plan(job(root, "sample"))
    noise = torch.randn(2, 16, 8, 8, generator=torch.Generator().manual_seed(4))
    cfg = {"negative_prompt": ["", ""], "guidance_scale": plan.family.default_guidance}
    assert_the_sampler_matches(plan, partial(pipeline, root), PROMPTS, noise, **cfg)


@pytest.fixture(scope="module")
def split_run(root):
    """(config, report) of plan -> preprocess -> split training on one torchrun rank."""
    return split_run_of(job, root)


@pytest.mark.parametrize(("parallelism", "batch_size"), [("tp", 2), ("fsdp", 1)])
def test_two_ranks_give_the_one_rank_losses(root, split_run, parallelism, batch_size):
    """TP (heads and MLP sharded) on the same batch; FSDP2 with one sample per rank."""
    assert_two_ranks_give_the_one_rank_losses(job, root, split_run, parallelism, batch_size)


def test_split_training_through_torchrun_exports_a_lora_the_pipeline_loads(root, split_run):
    outputs = ("transformer", "transformer_kohya")
    load = partial(pipeline, root)
    assert_split_equals_unsplit_and_exports(job, root, split_run, PROMPTS, load, outputs)


def test_a_tokenizer_without_a_chat_template_is_refused_by_validate(root, tmp_path):
    """ZImagePipeline applies the tokenizer's chat template to every prompt: a tokenizer without
    one is refused by `splitstage validate` in one line (exit 2); a prompt length the
    transformer's positions cannot number is refused naming the field."""
    import shutil

    folder = shutil.copytree(root / "zimage", tmp_path / "zimage")
    drop_chat_template(folder)
    line = validate_refusal(tmp_path, "zimage", folder, root / "data")
    assert "pipeline.pretrained" in line and "chat_template" in line

    with pytest.raises(ConfigError, match=r"pipeline.max_prompt_length: 1023 .* at most 992"):
        make_plan(job(root, "long", pipeline={"max_prompt_length": 1023}))
