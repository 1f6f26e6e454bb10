"""Qwen-Image through diffusers (`[pipeline] name = "qwenimage"`) on a tiny Hub-style folder with
the real classes (QwenImageTransformer2DModel, AutoencoderKLQwenImage, Qwen2.5-VL, Qwen2Tokenizer):
the split plan, our training loss against the diffusers computation for the same noise and
timesteps, the sampler against QwenImagePipeline, and plan -> preprocess -> torchrun training ->
an export QwenImagePipeline.load_lora_weights reproduces.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.diffusers.qwenimage_latents import pack
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.lora_targets import QWEN_IMAGE_LORA_TARGETS
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.cache.validation_prompts import encode
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.parallelize import find_blocks
from tests.helpers.stage2_step import seed_adapters, trained_model
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")
ONE_CPU = DistInfo(0, 0, 1, CPU, "gloo")
PROMPTS = ["a photo of the digit 3", "a cat"]
LENGTH = 24  # max_prompt_length: longer than both prompts, so the mask pads


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (4 digits) and the tiny Qwen-Image folder."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("qwenimage")
    write_digits_dataset(root / "data", limit=4, size=32)
    write_tiny_folder("qwenimage", root / "qwenimage")
    return root


def job(root: Path, name: str, *, pipeline=None, buckets=None, **train):
    """A LoRA job (rank 4, alpha 8) on the tiny folder at 64 px (unless max_pixels), fp32."""
    settings = {"name": "qwenimage", "pretrained": str(root / "qwenimage")}
    settings |= {"precision": "fp32", "max_prompt_length": LENGTH} | (pipeline or {})
    if "max_pixels" not in settings:
        settings.setdefault("resolution", 64)
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": settings,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4, "lora_alpha": 8},
            "data": {"base_path": str(root / "data"), "buckets": buckets or {}},
            "cache": {"url": str(root / "cache"), "shard_samples": 4},
            "train": {"batch_size": 2, "max_steps": 2, "log_every": 1, "learning_rate": 1e-2}
            | train,
            "output": {"url": str(root / "out")},
        }
    )


def pipeline(root: Path):
    """QwenImagePipeline from the same folder (offline)."""
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(root / "qwenimage")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def drawn_step(plan, denoiser, seed: int = 5):
    """Two images captioned PROMPTS (of unlike lengths, so the mask pads one) through stage 1
    and the per-step units, then one drawn training step."""
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
    assert {"prompt_embeds", "prompt_embeds_mask", "empty_prompt_embeds_mask"} <= cached
    assert {"latent_mean", "latent_logvar"} <= cached
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert plan.split.models["stage2"] == ("transformer",)
    # the source text's targets in every block, less the last block's text stream (no gradient)
    targets = plan.family.lora_targets("transformer")
    for target in QWEN_IMAGE_LORA_TARGETS:
        blocks = {name.split(".")[1] for name in targets if name.endswith(f".{target}")}
        dead = target in ("to_add_out", "txt_mlp.net.2")
        assert blocks == ({"0"} if dead else {"0", "1"}), target
    # a stage-1 setting changes the cache key; per-step ones do not
    longer = make_plan(job(root, "plan", pipeline={"max_prompt_length": LENGTH + 1}))
    assert longer.cache_key != plan.cache_key
    per_step = {"dynamic_shift": False, "caption_dropout": 0.5, "weighting_scheme": "logit_normal"}
    assert make_plan(job(root, "plan", pipeline=per_step)).cache_key == plan.cache_key


def test_max_pixels_sizes_the_square_and_the_buckets(root):
    """The source text's max_pixels is an area: the square's side without buckets, the buckets'
    area with them (data.buckets.area still overrides); resolution with it is refused."""
    square = make_plan(job(root, "px", pipeline={"max_pixels": 100 * 100})).family
    assert square.image_resolution() == (96, 16)  # isqrt 100, down to a multiple of 16
    buckets = {"enabled": True, "step": 16}
    bucketed = make_plan(job(root, "px", pipeline={"max_pixels": 64 * 96}, buckets=buckets))
    assert bucketed.family.buckets.area == 64 * 96
    assert (64, 96) in bucketed.family.buckets.sizes and (96, 64) in bucketed.family.buckets.sizes
    area = make_plan(
        job(root, "px", pipeline={"max_pixels": 64 * 96}, buckets=buckets | {"area": 4096})
    )
    assert area.family.buckets.area == 4096
    with pytest.raises(ConfigError, match="max_pixels and resolution"):
        job(root, "px", pipeline={"max_pixels": 4096, "resolution": 64})


def test_the_training_loss_is_the_diffusers_computation(root):
    """Same noise and timesteps: diffusers' train_dreambooth_lora_qwen_image lines on the
    pipeline's own prompt encoding and VAE give our loss; the timesteps lie on the table the
    pipeline's scheduler gives for this image size (its dynamic shift)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift
    from diffusers.training_utils import compute_loss_weighting_for_sd3

    plan = make_plan(job(root, "loss", pipeline={"vae_latents": "mean"}))
    family = plan.family
    pipe = pipeline(root)
    transformer = pipe.transformer
    batch, ctx, step = drawn_step(plan, transformer)
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)

    with torch.no_grad():
        embeds, mask = pipe.encode_prompt(PROMPTS, max_sequence_length=LENGTH)
        z = pipe.vae.encode(batch["image"].unsqueeze(2)).latent_dist.mode()
    config = pipe.vae.config
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
    model_input = (z - mean) * inv_std
    bsz, height, width = model_input.shape[0], model_input.shape[3], model_input.shape[4]
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(
        root / "qwenimage", subfolder="scheduler"
    )
    sc = scheduler.config
    mu = calculate_shift(
        (height // 2) * (width // 2),
        sc.base_image_seq_len,
        sc.max_image_seq_len,
        sc.base_shift,
        sc.max_shift,
    )
    scheduler.set_timesteps(sc.num_train_timesteps, mu=mu)
    timesteps = batch["timestep"]
    index = [(scheduler.timesteps == t).nonzero().item() for t in timesteps]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1, 1)
    noise = batch["noise"].unsqueeze(2)
    noisy = ((1.0 - sigmas) * model_input + sigmas * noise).permute(0, 2, 1, 3, 4)
    packed = QwenImagePipeline._pack_latents(noisy, bsz, model_input.shape[1], height, width)
    with torch.no_grad():
        pred = transformer(
            hidden_states=packed,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            timestep=timesteps / 1000,
            img_shapes=[(1, height // 2, width // 2)] * bsz,
            return_dict=False,
        )[0]
    pred = QwenImagePipeline._unpack_latents(pred, 64, 64, pipe.vae_scale_factor)
    weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)
    target = noise - model_input
    loss = torch.mean((weighting * (pred - target) ** 2).reshape(bsz, -1), 1).mean()
    assert mask is not None  # the shorter prompt is padded: the mask matters
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


def test_the_sampler_matches_the_qwenimage_pipeline(root):
    plan = make_plan(job(root, "sample"))
    mine = ours(plan, seed=4)
    assert torch.equal(mine, ours(plan, seed=4))
    assert not torch.equal(mine, ours(plan, seed=5))
    generator = torch.Generator().manual_seed(4)
    noise = torch.randn(2, 4, 8, 8, generator=generator)
    theirs = pipeline(root)(
        prompt=PROMPTS,
        negative_prompt=["", ""],
        true_cfg_scale=plan.family.default_guidance,
        latents=pack(noise),
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


def test_checkpointing_gives_the_same_loss_and_gradients_and_recomputes_each_block(root):
    """The family's hook (the transformer's own switch) on the real stage-2 build."""
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(2, LENGTH, dtype=torch.long)
    mask[1, 7:] = 0
    inputs = {
        "input_latents": torch.randn(2, 4, 8, 8, generator=g),
        "prompt_embeds": torch.randn(2, LENGTH, 32, generator=g),
        "prompt_embeds_mask": mask,
    }
    results = []
    for on in (False, True):
        plan, model = trained_model(job(root, "gc", gradient_checkpointing=on))
        seed_adapters(model)
        calls: list[nn.Module] = []
        for block in find_blocks(model):
            block.register_forward_pre_hook(lambda module, args, calls=calls: calls.append(module))
        family = plan.family
        draws = Draws.shared(torch.Generator().manual_seed(1))
        ctx = StepContext({"transformer": model}, CPU, draws, family.settings())
        loss = family.training_loss(ctx, dict(inputs))
        forward = len(calls)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), grads, forward, len(calls)))
    (loss_off, grads_off, forward_off, total_off), (loss_on, grads_on, forward_on, total_on) = (
        results
    )
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-6, atol=0)
    assert grads_on.keys() == grads_off.keys() and grads_off
    for name, grad in grads_off.items():
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7)
    assert forward_off == forward_on == total_off == 2  # two blocks, once each
    assert total_on == 2 * forward_on  # recomputed in backward


@pytest.mark.parametrize(("parallelism", "batch_size"), [("tp", 2), ("fsdp", 1), ("ddp", 1)])
def test_two_ranks_give_the_one_rank_losses(root, split_run, parallelism, batch_size):
    """TP (diffusers' plan, heads sharded) on the same batch; FSDP2 and DDP with one sample
    per rank."""
    config, report = split_run
    two = job(
        root,
        f"split-{parallelism}",
        pipeline={"caption_dropout": 0.5},
        parallelism=parallelism,
        nproc_per_node=2,
        tp_degree=2 if parallelism == "tp" else 1,
        batch_size=batch_size,
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
    for lora in (
        Path(report.outputs["transformer"]).parent,
        Path(report.outputs["transformer_kohya"]),
    ):
        pipe = pipeline(root)
        with torch.no_grad():
            base = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
        assert not torch.allclose(base, expected, atol=1e-5)  # the LoRA learned something
        pipe.load_lora_weights(str(lora))
        with torch.no_grad():
            loaded = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
        torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def test_a_tokenizer_that_keeps_part_of_the_system_prompt_is_refused_by_validate(root, tmp_path):
    """A tokenizer that encodes the template's prefix into other than the 34 tokens the pipeline
    drops would leave system-prompt tokens in the embeddings, silently: `splitstage validate`
    refuses it in one line (exit 2); a VAE config without latents_mean is refused too."""
    import json
    import os
    import shutil
    import subprocess
    import sys

    from transformers import Qwen2Tokenizer

    from tests.helpers.tiny_diffusers import QWEN_SPECIALS, _byte_symbols

    folder = shutil.copytree(root / "qwenimage", tmp_path / "qwenimage")
    shutil.rmtree(folder / "tokenizer")
    vocab = {s: i for i, s in enumerate([*_byte_symbols(), *QWEN_SPECIALS])}
    bytewise = Qwen2Tokenizer(vocab=vocab, merges=[], extra_special_tokens=list(QWEN_SPECIALS[1:]))
    bytewise.save_pretrained(folder / "tokenizer")
    config = tmp_path / "job.toml"
    config.write_text(
        f'[pipeline]\nname = "qwenimage"\npretrained = "{folder}"\nresolution = 64\n'
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
    assert "pipeline.pretrained" in lines[0] and "drops 34" in lines[0]

    vae = json.loads((folder / "vae" / "config.json").read_text())
    del vae["latents_mean"]
    (folder / "vae" / "config.json").write_text(json.dumps(vae))
    shutil.rmtree(folder / "tokenizer")
    shutil.copytree(root / "qwenimage" / "tokenizer", folder / "tokenizer")
    with pytest.raises(ConfigError, match="vae/config.json has no latents_mean"):
        make_plan(job(root, "bad-vae", pipeline={"pretrained": str(folder)}))
