"""The diffusers families' tiny folders by kind, their diffusers pipelines, and a plan for each;
and the scaffolding their integration tests share: LoRA jobs on a tiny folder, the folder's
diffusers pipeline, a drawn training step, training through torchrun, and the checks that an
exported LoRA loads into the pipeline, that a resumed run ends bitwise where an uninterrupted one
does, and that `splitstage validate` refuses a folder."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from tests.helpers.tiny_diffusers import write_tiny_folder

FAMILY = {
    "sd": "sd",
    "sd2": "sd",
    "sdxl": "sdxl",
    "sd3": "sd3",
    "sd3-dynamic-shift": "sd3",  # the scheduler shifts by token count (use_dynamic_shifting)
    "flux": "flux",
}
PIPELINE = {
    "sd": "StableDiffusionPipeline",
    "sdxl": "StableDiffusionXLPipeline",
    "sd3": "StableDiffusion3Pipeline",
    "flux": "FluxPipeline",
}
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")
ONE_CPU = DistInfo(0, 0, 1, CPU, "gloo")


def family_plan(folder, kind: str):
    """The plan of a job on the `kind` folder (64 px, fp32, LoRA on its denoiser)."""
    family = FAMILY[kind]
    pipeline = {"name": family, "pretrained": str(folder), "resolution": 64, "precision": "fp32"}
    if family in ("sd3", "flux"):
        pipeline["max_prompt_length"] = 16
    denoiser = "unet" if family in ("sd", "sdxl") else "transformer"
    return make_plan(
        config_from_dict({"pipeline": pipeline, "trainable": {"lora_base_model": denoiser}})
    )


def digits_and_folder(tmp_path_factory, family: str) -> Path:
    """A root holding a captioned data set (4 digits, 32 px) in data/ and the tiny `family`
    folder in family/ (torch on one thread)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp(family)
    write_digits_dataset(root / "data", limit=4, size=32)
    write_tiny_folder(family, root / family)
    return root


def lora_job(
    root: Path,
    family: str,
    name: str,
    *,
    pipeline=None,
    data=None,
    cache=None,
    lora: str = "transformer",
    validation=None,
    **train,
):
    """A LoRA job (rank 4, alpha 8, on `lora`) on the tiny folder root/family, fp32, 64 px unless
    `pipeline` sets resolution or max_pixels: seed 3, the data in root/data, the cache in
    root/cache (4 samples a shard), 2 steps of 2 samples at learning rate 1e-2, the output in
    root/out. `pipeline`, `data`, `cache` and the `train` keywords update those sections;
    `validation`, where given, is the [validation] section."""
    settings = {"name": family, "pretrained": str(root / family), "precision": "fp32"}
    settings |= pipeline or {}
    if "max_pixels" not in settings:
        settings.setdefault("resolution", 64)
    config = {
        "job": {"name": name, "seed": 3},
        "pipeline": settings,
        "trainable": {"lora_base_model": lora, "lora_rank": 4, "lora_alpha": 8},
        "data": {"base_path": str(root / "data")} | (data or {}),
        "cache": {"url": str(root / "cache"), "shard_samples": 4} | (cache or {}),
        "train": {"batch_size": 2, "max_steps": 2, "log_every": 1, "learning_rate": 1e-2} | train,
        "output": {"url": str(root / "out")},
    }
    if validation is not None:
        config["validation"] = validation
    return config_from_dict(config)


def assert_the_encoders_are_cached(plan, cached: set[str]) -> None:
    """Stage 1 (the text encoder and the VAE) encodes the prompts and the images, caching
    `cached` and the latents' moments; the latents and the caption dropout are drawn afresh
    every step; stage 2 loads the transformer alone."""
    assert list(plan.split.v2) == ["PromptEncoder", "VAEEncoder"]
    assert list(plan.split.v1) == ["LatentSampler", "CaptionDropout"]  # fresh every step
    boundary = set(plan.split.boundary_params)
    assert cached <= boundary
    assert {"latent_mean", "latent_logvar"} <= boundary
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert plan.split.models["stage2"] == ("transformer",)


def assert_only_stage_1_settings_key_the_cache(job, root: Path, plan, per_step: dict) -> None:
    """A longer max_prompt_length (a stage-1 setting) changes the cache key of `job`'s "plan"
    job; the `per_step` pipeline settings do not."""
    length = plan.config.pipeline.max_prompt_length
    longer = make_plan(job(root, "plan", pipeline={"max_prompt_length": length + 1}))
    assert longer.cache_key != plan.cache_key
    assert make_plan(job(root, "plan", pipeline=per_step)).cache_key == plan.cache_key


def tiny_pipeline(root: Path, class_name: str, folder: str):
    """diffusers' `class_name` pipeline from root/folder (offline), without progress bars."""
    import diffusers

    pipe = getattr(diffusers, class_name).from_pretrained(root / folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def drawn_step(plan, denoiser, prompts=None, seed: int = 5):
    """The data set's first two rows (captioned `prompts` where given) through stage 1 and the
    per-step units, then one drawn training step: (batch, ctx, step)."""
    family = plan.family
    base = plan.config.data.base_path
    batch = collate_samples([family.load_sample(r, base) for r in load_metadata(base)[:2]])
    if prompts is not None:
        batch["prompt"] = list(prompts)
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


def repeatable_sample(plan, prompts) -> torch.Tensor:
    """sampled() for seed 4, checked to give the same images again and others for seed 5."""
    mine = sampled(plan, prompts, seed=4)
    assert torch.equal(mine, sampled(plan, prompts, seed=4))
    assert not torch.equal(mine, sampled(plan, prompts, seed=5))
    return mine


def assert_the_sampler_matches(plan, load, prompts, latents, **options) -> None:
    """repeatable_sample() gives the images the pipeline from `load()` gives for the same
    prompts and initial `latents` in 3 steps at 64 px (prompts of the plan's
    max_prompt_length); `options` are the family's own arguments (guidance, negative prompts)."""
    mine = repeatable_sample(plan, prompts)  # our sampler + decoder, images in [0, 1]
    theirs = load()(
        prompt=list(prompts),
        latents=latents,
        num_inference_steps=3,
        height=64,
        width=64,
        max_sequence_length=plan.config.pipeline.max_prompt_length,
        output_type="pt",
        **options,
    ).images
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)


def sampled(plan, prompts, seed: int, clips: bool = False) -> torch.Tensor:
    """Our sampler (3 steps, the family's guidance, empty negative prompts) and decoder on the
    folder's frozen models: images, or with `clips` clips [B, F, 3, H, W], in [0, 1]."""
    from splitstage.tasks.cache.validation_prompts import encode

    family = plan.family
    models = {name: family.build_model(name, CPU) for name in family.prompt_models()}
    cond, uncond = encode(plan, models, CPU, prompts, [""] * len(prompts))
    models[family.denoiser] = family.build_model(family.denoiser, CPU)
    ctx = StepContext(models, CPU, settings=family.settings())
    generator = torch.Generator().manual_seed(seed)
    decode = family.decode_clips if clips else family.decode
    with torch.no_grad():
        latents = family.sample(
            ctx, cond, uncond, generator, steps=3, guidance=family.default_guidance
        )
        return (decode(family.load_decoder(CPU), latents) + 1) / 2


def predict(plan, denoiser, step) -> torch.Tensor:
    """The family's prediction for `step` with `denoiser` as its denoiser (no gradients)."""
    ctx = StepContext({plan.family.denoiser: denoiser}, CPU)
    with torch.no_grad():
        return plan.family.denoise(ctx, step)


def trained_from_checkpoint(config, report):
    """The transformer as the run left it: meta build, LoRA, load, its last DCP checkpoint."""
    plan = make_plan(config)
    stage2 = build_stage2_models(plan, ONE_CPU)
    step = latest_checkpoint(report.checkpoint_url, clean=False)
    model = stage2.models["transformer"]
    load_checkpoint(report.checkpoint_url, step, model, None, restore_rng=False)
    return plan, model


def run(config, root: Path, env: dict[str, str] | None = None):
    """Train through the real launcher (torchrun, gloo)."""
    return train(config, run_root=root / "runs", env=ENV | (env or {}), on_line=lambda line: None)


DROPOUT = {"caption_dropout": 0.5}  # the pipeline settings of the split runs below


def split_run_of(job, root: Path):
    """(config, report) of `job`'s "split" job (caption dropout 0.5): preprocess (4 samples)
    -> split training on one torchrun rank."""
    config = job(root, "split", pipeline=DROPOUT)
    assert preprocess(config, workers=1, progress=False).computed == 4
    return config, run(config, root)


def assert_two_ranks_give_the_one_rank_losses(job, root, split_run, parallelism, batch_size):
    """`parallelism` on two ranks (TP of degree 2), `batch_size` samples a rank, gives the
    losses of the one-rank split run; returns the two-rank run's report."""
    _, report = split_run
    tp_degree = 2 if parallelism == "tp" else 1
    ranks = dict(parallelism=parallelism, nproc_per_node=2, tp_degree=tp_degree)
    two = job(root, f"split-{parallelism}", pipeline=DROPOUT, batch_size=batch_size, **ranks)
    done = run(two, root)
    assert done.losses == pytest.approx(report.losses, rel=1e-5)
    return done


def assert_split_equals_unsplit_and_exports(job, root, split_run, prompts, load, outputs):
    """The split run made 2 updates of finite loss on the transformer alone, unsplit training
    gives its losses, and its exported `outputs` reproduce it (assert_exports_reproduce)."""
    config, report = split_run
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]
    unsplit = job(root, "unsplit", pipeline=DROPOUT, mode="unsplit")
    assert run(unsplit, root).losses == pytest.approx(report.losses, rel=1e-5)
    assert_exports_reproduce(config, report, prompts, outputs, load)


def assert_loras_load(plan, step, expected, loras, load, **options) -> None:
    """Each of `loras`, loaded into a fresh pipeline from `load()`, makes its denoiser predict
    `expected` for `step`, which the pipeline's own denoiser does not."""
    name = plan.family.denoiser
    for lora in loras:
        pipe = load()
        base = predict(plan, getattr(pipe, name), step)
        assert not torch.allclose(base, expected, atol=1e-5)  # the LoRA learned something
        pipe.load_lora_weights(str(lora), **options)
        loaded = predict(plan, getattr(pipe, name), step)
        torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def assert_exports_reproduce(config, report, prompts, outputs, load) -> None:
    """The run's last checkpoint (`config` on one rank) predicts for a drawn step what each of
    the run's exported `outputs` makes a fresh pipeline from `load()` predict: "transformer"
    by its folder (diffusers' layout), the others (kohya, ComfyUI names) by their file."""
    loras = [
        Path(report.outputs[name]).parent if name == "transformer" else report.outputs[name]
        for name in outputs
    ]
    plan, trained = trained_from_checkpoint(config, report)
    _, ctx, step = drawn_step(plan, trained, prompts)
    with torch.no_grad():
        expected = plan.family.denoise(ctx, step)
    assert_loras_load(plan, step, expected, loras, load)


def drop_chat_template(folder: Path) -> None:
    """Take the chat template out of folder/tokenizer (its config and its side files)."""
    import json

    settings = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    settings.pop("chat_template", None)
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(settings))
    for extra in ("chat_template.jinja", "chat_template.json"):
        (folder / "tokenizer" / extra).unlink(missing_ok=True)


def validate_refusal(tmp_path: Path, family: str, folder: Path, data: Path) -> str:
    """`splitstage validate` of a minimal job on `folder`: it exits 2 with one error line, which
    is returned."""
    import os
    import subprocess
    import sys

    config = tmp_path / "job.toml"
    config.write_text(
        f'[pipeline]\nname = "{family}"\npretrained = "{folder}"\nresolution = 64\n'
        f'[trainable]\nlora_base_model = "transformer"\n'
        f'[data]\nbase_path = "{data}"\n[cache]\nurl = "{tmp_path / "cache"}"\n'
        f'[output]\nurl = "{tmp_path / "out"}"\n'
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "splitstage.cli", "validate", str(config)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
    lines = [line for line in done.stderr.split("\n") if line and "\r" not in line]
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("splitstage: error: "), done.stderr
    return lines[0]


def assert_resume_is_bitwise(job, root: Path, halt: int = 1, total: int = 2) -> None:
    """Nothing of the family's step lives outside the checkpoint: `job(max_steps)` (split, one
    rank) halted after `halt` updates and resumed to `total` gives the losses and the exported
    LoRA of `total` updates in one go, bit for bit (each way under its own run id)."""
    from safetensors.torch import load_file

    def launch(config, run_id: str, on_line=lambda line: None):
        return train(config, run_id=run_id, run_root=root / "runs", env=ENV, on_line=on_line)

    config = job(total)
    preprocess(config, workers=1, progress=False)
    straight = launch(config, f"{config.job.name}-straight")
    assert straight.updates == total, straight  # the data holds `total` updates
    lines: list[str] = []
    first = launch(job(halt), f"{config.job.name}-resumed")
    resumed = launch(config, f"{config.job.name}-resumed", lines.append)
    assert any(f"resumed from checkpoint step {halt}" in line for line in lines), lines[-5:]
    assert first.losses + resumed.losses[halt - total :] == straight.losses
    ours = load_file(resumed.outputs["transformer"])
    theirs = load_file(straight.outputs["transformer"])
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)


def edit_pipeline_areas(monkeypatch, reference_area: int, condition_area: int) -> None:
    """QwenImageEdit(Plus)Pipeline's reference areas (1024x1024 for the VAE, 384x384 for Plus's
    VL: constants there) set to a job's reference_max_pixels / condition_max_pixels, so the tiny
    models see the sizes the job gives them."""
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit as edit
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as plus

    areas = {1024 * 1024: reference_area, 384 * 384: condition_area}
    for module in (edit, plus):
        original = module.calculate_dimensions
        monkeypatch.setattr(
            module,
            "calculate_dimensions",
            lambda area, ratio, original=original: original(areas.get(area, area), ratio),
        )


def cached_prompt_lengths(plan) -> tuple[Any, list[str], dict[str, int]]:
    """(the cache's dataset, its keys, each key's prompt token count) of a job stage 1 cached,
    checking every sample's prompt and empty prompt were kept at their own length (no padding)."""
    from splitstage.tasks.cache.reader import CacheDataset
    from splitstage.tasks.job_plan import open_cache

    store = open_cache(plan)
    dataset = CacheDataset(store)
    keys = dataset.keys.to_list()
    lengths = {}
    for key, one in store.read_samples(keys).items():
        for name in ("prompt_embeds", "empty_prompt_embeds"):
            mask = one[f"{name}_mask"]
            assert len(one[name]) == len(mask) and mask.all(), name  # no padding kept
        lengths[key] = len(one["prompt_embeds"])
    return dataset, keys, lengths


def padded_to(plan, batch: dict[str, Any], length: int) -> dict[str, Any]:
    """`batch` with the family's sequence params and masks zero-padded to `length` tokens (as
    stage 1 cached prompts before they were kept at their own length)."""
    params = plan.family.sequence_params
    padded = dict(batch)
    for name in (*params, *params.values()):
        value = batch[name]
        tail = value.new_zeros(value.shape[0], length - value.shape[1], *value.shape[2:])
        padded[name] = torch.cat([value, tail], dim=1)
    return padded
