"""FLUX.2 through diffusers (`[pipeline] name = "flux2"`) on a tiny Hub-style folder with the
real classes (Flux2Transformer2DModel, AutoencoderKLFlux2, Mistral3ForConditionalGeneration, a
byte-level tokenizer with a chat template): the split plan, our training loss against diffusers'
train_dreambooth_lora_flux2 computation for the same noise and timesteps, the sampler against
Flux2Pipeline, plan -> preprocess -> torchrun training -> exports (diffusers and kohya layouts)
Flux2Pipeline.load_lora_weights reproduces, and two ranks (TP, FSDP2) give the one-rank run.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from splitstage.config.job import ConfigError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.export import check_export
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
LENGTH = 48  # max_prompt_length: the embeddings are padded to it, as the pipeline passes them


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (4 digits) and the tiny FLUX.2 folder."""
    return digits_and_folder(tmp_path_factory, "flux2")


def job(root: Path, name: str, *, pipeline=None, **train):
    """A LoRA job on the tiny folder (see lora_job), prompts padded to LENGTH tokens."""
    pipeline = {"max_prompt_length": LENGTH} | (pipeline or {})
    return lora_job(root, "flux2", name, pipeline=pipeline, **train)


def pipeline(root: Path):
    """Flux2Pipeline from the same folder (offline)."""
    return tiny_pipeline(root, "Flux2Pipeline", "flux2")


def test_the_plan_caches_prompt_and_vae_encoding_and_trains_the_transformer(root):
    plan = make_plan(job(root, "plan"))
    assert_the_encoders_are_cached(plan, {"prompt_embeds", "empty_prompt_embeds"})
    per_step = {"caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert_only_stage_1_settings_key_the_cache(job, root, plan, per_step)


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps: diffusers' train_dreambooth_lora_flux2 lines on the pipeline's
    own prompt encoding and VAE (patchified, batch-norm normalised) give our loss."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    transformer = pipe.transformer
    batch, ctx, step = drawn_step(plan, transformer, PROMPTS)
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)

    vae = pipe.vae
    latents_bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    latents_bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)
    assert not torch.allclose(latents_bn_std, torch.ones_like(latents_bn_std))
    with torch.no_grad():
        prompt_embeds, text_ids = pipe.encode_prompt(list(PROMPTS), max_sequence_length=LENGTH)
        model_input = vae.encode(batch["image"]).latent_dist.mode()
    model_input = Flux2Pipeline._patchify_latents(model_input)
    model_input = (model_input - latents_bn_mean) / latents_bn_std
    model_input_ids = Flux2Pipeline._prepare_latent_ids(model_input)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        root / "flux2", subfolder="scheduler"
    )
    timesteps = batch["timestep"]
    index = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1)
    noise = batch["noise"]
    noisy = (1.0 - sigmas) * model_input + sigmas * noise
    packed = Flux2Pipeline._pack_latents(noisy)
    guidance = torch.full([1], plan.config.pipeline.guidance_scale).expand(noise.shape[0])
    with torch.no_grad():
        pred = transformer(
            hidden_states=packed,
            timestep=timesteps / 1000,
            guidance=guidance,
            encoder_hidden_states=prompt_embeds,
            txt_ids=text_ids,
            img_ids=model_input_ids,
            return_dict=False,
        )[0]
    pred = Flux2Pipeline._unpack_latents_with_ids(pred[:, : packed.size(1) :], model_input_ids)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (pred - target) ** 2).reshape(target.shape[0], -1), 1).mean()
    assert ours.item() == pytest.approx(loss.item(), rel=1e-5)


def test_the_sampler_matches_the_flux2_pipeline(root):
    plan = make_plan(job(root, "sample"))
    noise = torch.randn(2, 16, 4, 4, generator=torch.Generator().manual_seed(4))  # it packs them
    guidance = {"guidance_scale": plan.family.default_guidance}
    assert_the_sampler_matches(plan, partial(pipeline, root), PROMPTS, noise, **guidance)


@pytest.fixture(scope="module")
def split_run(root):
    """(config, report) of plan -> preprocess -> split training on one torchrun rank."""
    return split_run_of(job, root)


@pytest.mark.parametrize(("parallelism", "batch_size"), [("tp", 2), ("fsdp", 1)])
def test_two_ranks_give_the_one_rank_losses(root, split_run, parallelism, batch_size):
    """TP (double blocks' heads sharded, fused projections sharded with their outputs gathered)
    on the same batch, and its exported LoRA, gathered from the shards, is the one-rank run's;
    FSDP2 with one sample per rank: the per-sample draws make the update the same."""
    two = assert_two_ranks_give_the_one_rank_losses(job, root, split_run, parallelism, batch_size)
    if parallelism == "tp":
        ours, theirs = (load_file(r.outputs["transformer"]) for r in (two, split_run[1]))
        assert set(ours) == set(theirs)
        assert any("to_qkv_mlp_proj.lora_B" in key for key in ours)  # a fused shard, gathered
        for key, tensor in ours.items():
            torch.testing.assert_close(tensor, theirs[key], rtol=1e-4, atol=1e-5)


def test_split_training_through_torchrun_exports_a_lora_the_pipeline_loads(root, split_run):
    """Both files, diffusers' and the kohya / ComfyUI one in BFL's names (q, k, v fused), make
    Flux2Pipeline.load_lora_weights reproduce the trained transformer."""
    outputs = ("transformer", "transformer_kohya")
    load = partial(pipeline, root)
    assert_split_equals_unsplit_and_exports(job, root, split_run, PROMPTS, load, outputs)
    kohya = load_file(split_run[1].outputs["transformer_kohya"])
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_up.weight" in kohya
    assert "lora_unet_single_blocks_0_linear1.lora_down.weight" in kohya


def test_a_tokenizer_without_a_chat_template_is_refused_by_validate(root, tmp_path):
    """Flux2Pipeline applies the tokenizer's chat template to every prompt: a tokenizer without
    one is refused by `splitstage validate` in one line (exit 2); so is a text encoder without
    the hidden states the pipeline reads, a VAE file without its batch-norm statistics and a
    LoRA of a module the kohya file cannot name."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(root / "flux2", tmp_path / "flux2")
    drop_chat_template(folder)
    line = validate_refusal(tmp_path, "flux2", folder, root / "data")
    assert "pipeline.pretrained" in line and "chat_template" in line

    shutil.rmtree(folder / "tokenizer")
    shutil.copytree(root / "flux2" / "tokenizer", folder / "tokenizer")
    text = json.loads((folder / "text_encoder" / "config.json").read_text())
    text["text_config"]["num_hidden_layers"] = 20
    (folder / "text_encoder" / "config.json").write_text(json.dumps(text))
    with pytest.raises(ConfigError, match="has 20 layers, but Flux2Pipeline reads hidden states"):
        make_plan(job(root, "shallow", pipeline={"pretrained": str(folder)}))

    shutil.rmtree(folder / "text_encoder")
    shutil.copytree(root / "flux2" / "text_encoder", folder / "text_encoder")
    weights = folder / "vae" / "diffusion_pytorch_model.safetensors"
    state = {k: v for k, v in load_file(weights).items() if not k.startswith("bn.")}
    save_file(state, weights)
    with pytest.raises(ConfigError, match="has no bn.running_mean"):
        make_plan(job(root, "no-bn", pipeline={"pretrained": str(folder)}))

    config = job(root, "norm-out")  # a LoRA target the kohya FLUX.2 layout cannot name
    targets = {"lora_target_modules": ["attn.to_q", "norm_out.linear"]}
    config = config.model_copy(update={"trainable": config.trainable.model_copy(update=targets)})
    with pytest.raises(ConfigError, match=r"kohya / ComfyUI LoRA file has no name for norm_out"):
        check_export(make_plan(config))
