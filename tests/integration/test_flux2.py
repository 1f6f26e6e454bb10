"""FLUX.2 through diffusers (`[pipeline] name = "flux2"`) on a tiny Hub-style folder with the
real classes (Flux2Transformer2DModel, AutoencoderKLFlux2, Mistral3ForConditionalGeneration, a
byte-level tokenizer with a chat template): the split plan, our training loss against diffusers'
train_dreambooth_lora_flux2 computation for the same noise and timesteps, the sampler against
Flux2Pipeline, and plan -> preprocess -> torchrun training -> an export
Flux2Pipeline.load_lora_weights reproduces.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.cache.validation_prompts import encode
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")
ONE_CPU = DistInfo(0, 0, 1, CPU, "gloo")
PROMPTS = ["a photo of the digit 3", "a cat"]
LENGTH = 48  # max_prompt_length: the embeddings are padded to it, as the pipeline passes them


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (4 digits) and the tiny FLUX.2 folder."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("flux2")
    write_digits_dataset(root / "data", limit=4, size=32)
    write_tiny_folder("flux2", root / "flux2")
    return root


def job(root: Path, name: str, *, pipeline=None, **train):
    """A LoRA job (rank 4, alpha 8) on the tiny folder at 64 px, fp32."""
    settings = {"name": "flux2", "pretrained": str(root / "flux2"), "resolution": 64}
    settings |= {"precision": "fp32", "max_prompt_length": LENGTH} | (pipeline or {})
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": settings,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4, "lora_alpha": 8},
            "data": {"base_path": str(root / "data")},
            "cache": {"url": str(root / "cache"), "shard_samples": 4},
            "train": {"batch_size": 2, "max_steps": 2, "log_every": 1, "learning_rate": 1e-2}
            | train,
            "output": {"url": str(root / "out")},
        }
    )


def pipeline(root: Path):
    """Flux2Pipeline from the same folder (offline)."""
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(root / "flux2")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def drawn_step(plan, denoiser, seed: int = 5):
    """Two images captioned PROMPTS (of unlike lengths) through stage 1 and the per-step units,
    then one drawn training step."""
    family = plan.family
    base = plan.config.data.base_path
    batch = collate_samples([family.load_sample(r, base) for r in load_metadata(base)[:2]])
    batch["prompt"] = list(PROMPTS)
    frozen = {name: family.build_model(name, CPU) for name in plan.split.models["stage1"]}
    settings = family.settings()
    run_units(plan.v2_units, StepContext(frozen, CPU, settings=settings), batch)
    ctx = StepContext(
        {family.denoiser: denoiser},
        CPU,
        Draws.shared(torch.Generator().manual_seed(seed)),
        settings,
    )
    run_units(plan.v1_units, ctx, batch)
    return batch, ctx, family.training_step(ctx, batch)


def test_the_plan_caches_prompt_and_vae_encoding_and_trains_the_transformer(root):
    plan = make_plan(job(root, "plan"))
    assert list(plan.split.v2) == ["PromptEncoder", "VAEEncoder"]
    assert list(plan.split.v1) == ["LatentSampler", "CaptionDropout"]  # fresh every step
    cached = set(plan.split.boundary_params)
    assert {"prompt_embeds", "empty_prompt_embeds"} <= cached
    assert {"latent_mean", "latent_logvar"} <= cached
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert plan.split.models["stage2"] == ("transformer",)
    longer = make_plan(job(root, "plan", pipeline={"max_prompt_length": LENGTH + 1}))
    assert longer.cache_key != plan.cache_key
    per_step = {"caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert make_plan(job(root, "plan", pipeline=per_step)).cache_key == plan.cache_key


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps: diffusers' train_dreambooth_lora_flux2 lines on the pipeline's
    own prompt encoding and VAE (patchified, batch-norm normalised) give our loss."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    transformer = pipe.transformer
    batch, ctx, step = drawn_step(plan, transformer)
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


def ours(plan, seed: int) -> torch.Tensor:
    """Our sampler + decoder on the folder's frozen models, images in [0, 1]."""
    family = plan.family
    models = {name: family.build_model(name, CPU) for name in family.prompt_models()}
    cond, uncond = encode(plan, models, CPU, PROMPTS, ["", ""])
    models[family.denoiser] = family.build_model(family.denoiser, CPU)
    ctx = StepContext(models, CPU, settings=family.settings())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        latents = family.sample(
            ctx, cond, uncond, generator, steps=3, guidance=family.default_guidance
        )
        return (family.decode(family.load_decoder(CPU), latents) + 1) / 2


def test_the_sampler_matches_the_flux2_pipeline(root):
    plan = make_plan(job(root, "sample"))
    mine = ours(plan, seed=4)
    assert torch.equal(mine, ours(plan, seed=4))
    assert not torch.equal(mine, ours(plan, seed=5))
    generator = torch.Generator().manual_seed(4)
    noise = torch.randn(2, 16, 4, 4, generator=generator)
    theirs = pipeline(root)(
        prompt=list(PROMPTS),
        guidance_scale=plan.family.default_guidance,
        latents=noise,  # the pipeline packs them
        num_inference_steps=3,
        height=64,
        width=64,
        max_sequence_length=LENGTH,
        output_type="pt",
    ).images
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)


def trained_from_checkpoint(config, report):
    """The transformer as the run left it: meta build, LoRA, load, its last DCP checkpoint."""
    plan = make_plan(config)
    stage2 = build_stage2_models(plan, ONE_CPU)
    step = latest_checkpoint(report.checkpoint_url, clean=False)
    model = stage2.models["transformer"]
    load_checkpoint(report.checkpoint_url, step, model, None, restore_rng=False)
    return plan, model


def run(config, root: Path):
    """Train through the real launcher (torchrun, gloo)."""
    return train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)


@pytest.fixture(scope="module")
def split_run(root):
    """(config, report) of plan -> preprocess -> split training on one torchrun rank."""
    config = job(root, "split", pipeline={"caption_dropout": 0.5})
    assert preprocess(config, workers=1, progress=False).computed == 4
    return config, run(config, root)


def test_two_fsdp_ranks_give_the_one_rank_losses(root, split_run):
    """FSDP2 with one sample per rank: the per-sample draws make the update the same."""
    config, report = split_run
    two = job(
        root,
        "split-fsdp",
        pipeline={"caption_dropout": 0.5},
        parallelism="fsdp",
        nproc_per_node=2,
        batch_size=1,
    )
    assert run(two, root).losses == pytest.approx(report.losses, rel=1e-5)


def test_split_training_through_torchrun_exports_a_lora_the_pipeline_loads(root, split_run):
    config, report = split_run
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]
    unsplit = job(root, "unsplit", pipeline={"caption_dropout": 0.5}, mode="unsplit")
    assert run(unsplit, root).losses == pytest.approx(report.losses, rel=1e-5)

    plan, trained = trained_from_checkpoint(config, report)
    _, ctx, step = drawn_step(plan, trained)
    with torch.no_grad():
        expected = plan.family.denoise(ctx, step)
    assert set(report.outputs) == {"transformer"}  # no kohya file: see Flux2Family
    for lora in (Path(report.outputs["transformer"]).parent,):
        pipe = pipeline(root)
        with torch.no_grad():
            base = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
        assert not torch.allclose(base, expected, atol=1e-5)  # the LoRA learned something
        pipe.load_lora_weights(str(lora))
        with torch.no_grad():
            loaded = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
        torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def test_a_tokenizer_without_a_chat_template_is_refused_by_validate(root, tmp_path):
    """Flux2Pipeline applies the tokenizer's chat template to every prompt: a tokenizer without
    one is refused by `splitstage validate` in one line (exit 2); so is a text encoder without
    the hidden states the pipeline reads, a VAE file without its batch-norm statistics, and
    tensor parallelism (no plan yet)."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(root / "flux2", tmp_path / "flux2")
    settings = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(settings))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / "tokenizer" / extra).unlink(missing_ok=True)
    config = tmp_path / "job.toml"
    config.write_text(
        f'[pipeline]\nname = "flux2"\npretrained = "{folder}"\nresolution = 64\n'
        f'[trainable]\nlora_base_model = "transformer"\n'
        f'[data]\nbase_path = "{root / "data"}"\n[cache]\nurl = "{tmp_path / "cache"}"\n'
        f'[output]\nurl = "{tmp_path / "out"}"\n'
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "splitstage.cli", "validate", str(config)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in done.stderr.split("\n") if line and "\r" not in line]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("splitstage: error: "), done.stderr
    assert "pipeline.pretrained" in lines[0] and "chat_template" in lines[0]

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
    with pytest.raises(ConfigError, match="train.parallelism = 'tp': the flux2 family has no"):
        make_plan(job(root, "tp", parallelism="tp", nproc_per_node=2, tp_degree=2))
