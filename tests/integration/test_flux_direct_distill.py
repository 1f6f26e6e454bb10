"""Direct distillation (`train.task = "direct_distill"`) through the flux family.

Tiny FLUX folder; rows carry the teacher's `seed` and `num_inference_steps` (DiffSynth's metadata
columns, one row also `cfg_scale`). The plan caches the row-seeded noise with the prompt
embeddings (the noise unit is V2, never run per step) under a cache key of its own; the loss
equals FluxPipeline's own sampling (its scheduler steps, the same seed, no grad) against the
image's latents; a real split run (torchrun, 1 rank) starts from that loss, equals the unsplit
run and exports a LoRA (diffusers' layout and kohya's) that FluxPipeline.load_lora_weights loads
into the transformer, whose few-step sampling then reproduces the trained model's, and a resume of
it as 'sft' is refused; a row without its seed is one line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.diffusers.packing import pack
from splitstage.pipelines.diffusers.sampling import flux_loop
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.outputs import run_places
from splitstage.tasks.stage2.preflight import preflight
from splitstage.tasks.stage2.resume import ResumeConfigError
from tests.helpers.stage2_step import trained_model
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")
# Per row: the teacher's seed, steps and (row 1 only) cfg_scale; row 2 takes guidance_scale.
TEACHER = [
    {"seed": 101, "num_inference_steps": 2, "cfg_scale": 2.0},
    {"seed": 7, "num_inference_steps": 3},
]
GUIDANCE = 4.0  # pipeline.guidance_scale: the default a row without cfg_scale gets


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two digits with the teacher's columns, and a tiny FLUX folder."""
    root = tmp_path_factory.mktemp("flux-distill")
    write_digits_dataset(root / "data", limit=2, size=32)
    with (root / "data" / "metadata.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with (root / "data" / "distill.jsonl").open("w", encoding="utf-8") as f:
        for row, teacher in zip(rows, TEACHER, strict=True):
            f.write(json.dumps(row | teacher) + "\n")
    write_tiny_folder("flux", root / "flux")
    return root


def job(root: Path, name: str, task: str = "direct_distill", pipeline=None, **train):
    """A LoRA job on the tiny FLUX folder at 64 px: latents' mean, no caption dropout."""
    flux = {"name": "flux", "pretrained": str(root / "flux"), "resolution": 64}
    flux |= {"precision": "fp32", "max_prompt_length": 16, "vae_latents": "mean"}
    flux |= {"caption_dropout": 0.0, "guidance_scale": GUIDANCE}
    data = {"base_path": str(root / "data"), "metadata_path": str(root / "data" / "distill.jsonl")}
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": pipeline or flux,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4, "lora_alpha": 8},
            "data": data,
            "cache": {"url": str(root / "cache"), "shard_samples": 4},
            "train": {"task": task, "batch_size": 2, "max_steps": 1, "log_every": 1} | train,
            "output": {"url": str(root / "out")},
        }
    )


def stage1_batch(config) -> tuple:
    """(plan, both rows through the plan's V2 units): what stage 1 caches, computed in place."""
    plan = make_plan(config)
    family = plan.family
    rows = load_metadata(config.data.base_path, config.data.metadata_path)
    batch = collate_samples([family.load_sample(r, config.data.base_path) for r in rows])
    frozen = {name: family.build_model(name, CPU) for name in plan.split.models["stage1"]}
    run_units(plan.v2_units, StepContext(frozen, CPU, settings=family.settings()), batch)
    return plan, batch


def our_loss(config, transformer) -> tuple[torch.Tensor, dict]:
    """Both rows through the plan's V2 then V1 units and the family's loss, with `transformer`."""
    plan, batch = stage1_batch(config)
    family = plan.family
    settings = family.settings()
    draws = Draws.shared(torch.Generator().manual_seed(5))
    ctx = StepContext({"transformer": transformer}, CPU, draws, settings)
    run_units(plan.v1_units, ctx, batch)
    return family.training_loss(ctx, batch), batch


def reference_loss(config) -> float:
    """FluxPipeline's own sampling from each row's seed (no grad) against pack(VAE mean)."""
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(config.pipeline.pretrained)
    family = make_plan(config).family
    rows = load_metadata(config.data.base_path, config.data.metadata_path)
    scale = float(pipe.vae.config.scaling_factor)
    shift = float(pipe.vae.config.shift_factor or 0.0)
    errors = []
    with torch.no_grad():
        for row, teacher in zip(rows, TEACHER, strict=True):
            image = family.load_sample(row, config.data.base_path)["image"]
            z = pipe.vae.encode(image[None]).latent_dist.mean
            target = pack((z - shift) * scale)
            final = pipe(
                prompt=row.prompt,
                height=64,
                width=64,
                num_inference_steps=teacher["num_inference_steps"],
                guidance_scale=teacher.get("cfg_scale", GUIDANCE),
                generator=torch.Generator("cpu").manual_seed(teacher["seed"]),
                max_sequence_length=16,
                output_type="latent",
            ).images
            errors.append(F.mse_loss(final.float(), target.float()))
    return float(torch.stack(errors).mean())


def few_step_latents(plan, batch, transformer) -> torch.Tensor:
    """Each row's few-step loop from its cached noise (its teacher's steps and guidance), no
    grad: the packed final latents direct distillation trains, with `transformer`."""
    family = plan.family
    ctx = StepContext({"transformer": transformer}, CPU, settings=family.settings())
    finals = []
    with torch.no_grad():
        for index, teacher in enumerate(TEACHER):
            cond = {name: batch[name][index : index + 1] for name in family.denoiser_params}
            noise = batch["distill_noise"][index : index + 1]
            steps, guidance = teacher["num_inference_steps"], teacher.get("cfg_scale", GUIDANCE)
            finals.append(
                flux_loop(family, transformer, ctx, noise, cond, steps=steps, guidance=guidance)
            )
    return torch.cat(finals)


def trained_from_checkpoint(config, report):
    """The transformer as the run left it: stage 2's build (LoRA), then its last DCP checkpoint."""
    plan, model = trained_model(config)
    step = latest_checkpoint(report.checkpoint_url, clean=False)
    load_checkpoint(report.checkpoint_url, step, model, None, restore_rng=False)
    return plan, model


def test_plan_caches_the_seeded_noise_with_the_embeddings(root):
    config = job(root, "plan")
    plan = make_plan(config)
    assert "SeededNoise" in plan.split.v2  # a function of the row: stage 1, never per step
    assert list(plan.split.v1) == ["LatentSampler", "CaptionDropout"]
    boundary = set(plan.split.boundary_params)
    assert {"distill_noise", "prompt_embeds", "pooled_prompt_embeds", "latent_mean"} <= boundary
    assert {"num_inference_steps", "cfg_scale"} <= boundary
    assert "seed" not in boundary  # stage 2 needs the noise, not the seed
    sft = make_plan(job(root, "sft", task="sft"))
    assert "distill_noise" not in sft.split.boundary_params
    assert sft.cache_key != plan.cache_key

    rows = load_metadata(config.data.base_path, config.data.metadata_path)
    batch = collate_samples([plan.family.load_sample(r, config.data.base_path) for r in rows])
    frozen = {name: plan.family.build_model(name, CPU) for name in plan.split.models["stage1"]}
    run_units(plan.v2_units, StepContext(frozen, CPU, settings=plan.family.settings()), batch)
    shape = (1, *batch["latent_mean"].shape[1:])
    for noise, teacher in zip(batch["distill_noise"], TEACHER, strict=True):
        drawn = torch.randn(shape, generator=torch.Generator().manual_seed(teacher["seed"]))
        assert torch.equal(noise, drawn[0])  # FluxPipeline.prepare_latents' draw, unpacked
    assert batch["cfg_scale"] == [2.0, None]


def test_loss_equals_flux_pipelines_own_sampling_and_has_gradients(root):
    config = job(root, "loss")
    transformer = make_plan(config).family.build_model("transformer", CPU)
    transformer.requires_grad_(True)
    loss, _ = our_loss(config, transformer)
    expected = reference_loss(config)
    assert abs(loss.item() - expected) <= 1e-5 * max(1.0, expected), (loss.item(), expected)
    loss.backward()  # the few-step loop ran with gradients through the transformer
    grads = [p.grad for p in transformer.parameters() if p.grad is not None]
    assert grads and any(float(g.abs().sum()) > 0 for g in grads)


def test_split_training_runs_equals_unsplit_and_exports(root):
    config = job(root, "split", learning_rate=1e-3)  # one update moves the LoRA visibly
    assert preprocess(config, workers=1, progress=False).computed == 2
    report = train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    expected = reference_loss(config)
    assert report.updates == 1
    assert abs(report.losses[0] - expected) <= 1e-5 * max(1.0, expected)  # LoRA starts at base
    assert report.models_loaded == ["transformer"]
    assert Path(report.outputs["transformer"]).is_file()
    # Resuming it under another train.task: refused by rank 0's checks, before any weight loads.
    sft = job(root, "split", task="sft", learning_rate=1e-3)
    with pytest.raises(ResumeConfigError, match="train.task changed 'direct_distill' -> 'sft'"):
        preflight(make_plan(sft), run_places(sft, "split", root / "runs"))
    unsplit = job(root, "unsplit", mode="unsplit", learning_rate=1e-3)
    unsplit = train(unsplit, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert unsplit.losses == pytest.approx(report.losses, rel=1e-5)

    # The export loads with FluxPipeline.load_lora_weights and samples as the trained model does.
    from diffusers import FluxPipeline

    _, batch = stage1_batch(config)
    plan, trained = trained_from_checkpoint(config, report)
    expected = few_step_latents(plan, batch, trained)
    for lora in (
        Path(report.outputs["transformer"]).parent,  # diffusers' layout
        Path(report.outputs["transformer_kohya"]),  # kohya's names
    ):
        pipe = FluxPipeline.from_pretrained(config.pipeline.pretrained)
        base = few_step_latents(plan, batch, pipe.transformer)
        assert not torch.allclose(base, expected, atol=1e-5)  # the LoRA learned something
        pipe.load_lora_weights(str(lora))
        loaded = few_step_latents(plan, batch, pipe.transformer)
        torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def test_a_row_without_the_teachers_seed_is_one_line(root):
    config = job(root, "missing")
    row = load_metadata(config.data.base_path, config.data.metadata_path)[0]
    row.extras.pop("seed")
    with pytest.raises(ConfigError, match=r"row 1: .*needs the column\(s\) seed") as error:
        make_plan(config).family.load_sample(row, config.data.base_path)
    assert "\n" not in str(error.value)


def test_sd3_refuses_direct_distill_in_one_line(root):
    sd3 = {"name": "sd3", "pretrained": str(root / "flux")}
    with pytest.raises(
        ConfigError, match="train.task='direct_distill': the sd3 family trains 'sft'"
    ):
        make_plan(job(root, "sd3", pipeline=sd3))


def test_bad_teacher_values_are_refused_before_stage_1_loads_a_model(root):
    """The whole row table is read before any worker starts: a truncating seed, a boolean step
    count and a missing column are one line naming the rows; no shard is written."""
    bad = root / "data" / "bad.jsonl"
    rows = [json.loads(line) for line in (root / "data" / "distill.jsonl").read_text().splitlines()]
    rows[0] |= {"seed": 7.9, "num_inference_steps": True}
    rows[1].pop("num_inference_steps")
    bad.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = job(root, "bad")
    config.data.metadata_path = str(bad)
    config.cache.url = str(root / "bad-cache")
    with pytest.raises(ConfigError) as error:
        preprocess(config, workers=2, progress=False)
    said = str(error.value)
    assert "row 1: seed = 7.9 is not a whole number" in said
    assert "row 2: train.task = 'direct_distill' needs the column(s) num_inference_steps" in said
    assert "\n" not in said
    assert not list((root / "bad-cache").rglob("*.safetensors"))
