"""Wan image-to-video (`[pipeline] name = "wan_i2v"`) on tiny WanImageToVideoPipeline folders with
the real classes (Wan 2.1 I2V with a CLIPVisionModel; Wan 2.2 I2V A14B's two experts) and real
PyAV clips: stage 1's CLIP image embeddings and condition latents (mask included) equal the
pipeline's for the same first frame (or the row's edit_image), the loss is the diffusers
computation, plan -> preprocess -> torchrun training split equals unsplit, the exported LoRA
loads into WanImageToVideoPipeline (transformer_2 for a Wan 2.2 expert) and changes its
prediction, and bad rows and folders are refused in one line.
Run: .venv/bin/pytest -m slow tests/integration/test_wan_i2v.py
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("av")

from splitstage.config.job import ConfigError, config_from_dict  # noqa: E402
from splitstage.data.dataset import DataError, load_metadata  # noqa: E402
from splitstage.pipelines.draws import Draws  # noqa: E402
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units  # noqa: E402
from splitstage.pipelines.sampling_common import to_pil  # noqa: E402
from splitstage.tasks.job_plan import make_plan  # noqa: E402
from splitstage.tasks.launch.launcher import train  # noqa: E402
from splitstage.tasks.stage1.preprocess import preprocess  # noqa: E402
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint  # noqa: E402
from splitstage.tasks.stage2.distributed import DistInfo  # noqa: E402
from splitstage.tasks.stage2.models import build_stage2_models  # noqa: E402
from tests.helpers.stage2_step import seed_adapters, trained_model  # noqa: E402
from tests.helpers.tiny_diffusers import write_tiny_folder  # noqa: E402
from tests.helpers.video_files import write_video  # noqa: E402

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
CPU = torch.device("cpu")
ONE_CPU = DistInfo(0, 0, 1, CPU, "gloo")
FRAMES = 5  # 4k+1: two latent frames
SIDE = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Three real short videos (PyAV, h264), the second with an edit_image (a PNG) as its
    conditioning frame, captioned in metadata.jsonl; tiny Wan 2.1 and 2.2 I2V folders."""
    from PIL import Image

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("wan_i2v")
    rows = []
    for index in range(3):
        name = f"clips/clip{index}.mp4"
        write_video(root / "data" / name, 10 + 2 * index, rate=8 + index)
        rows.append({"video": name, "prompt": f"clip {index} of moving squares"})
    pixels = torch.rand(48, 80, 3, generator=torch.Generator().manual_seed(0))
    Image.fromarray((pixels * 255).byte().numpy()).save(root / "data" / "first.png")
    rows[1]["edit_image"] = "first.png"
    lines = "".join(json.dumps(row) + "\n" for row in rows)
    (root / "data" / "metadata.jsonl").write_text(lines)
    write_tiny_folder("wan_i2v", root / "wan_i2v")
    write_tiny_folder("wan22_i2v", root / "wan22_i2v")
    return root


def job(root: Path, name: str, *, pipeline=None, data="data", lora=None, video=None, **train):
    """A LoRA job (rank 4, alpha 8) on the tiny Wan 2.1 I2V folder: 64 px, 5-frame clips."""
    settings = {"name": "wan_i2v", "pretrained": str(root / "wan_i2v"), "resolution": SIDE}
    settings |= {"precision": "fp32", "caption_dropout": 0.5} | (pipeline or {})
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": settings,
            "trainable": {
                "lora_base_model": lora or "transformer",
                "lora_rank": 4,
                "lora_alpha": 8,
            },
            "data": {
                "base_path": str(root / data),
                "video": {"num_frames": FRAMES, "frame_stride": 2} | (video or {}),
            },
            "cache": {"url": str(root / f"cache-{name}"), "shard_samples": 4},
            "train": {"batch_size": 3, "max_steps": 2, "log_every": 1, "learning_rate": 1e-2}
            | train,
            "output": {"url": str(root / "out")},
        }
    )


def pipeline(root: Path, folder: str = "wan_i2v"):
    """WanImageToVideoPipeline from the folder (offline; transformers falls back to the PIL
    image processor without torchvision)."""
    from diffusers import WanImageToVideoPipeline

    return WanImageToVideoPipeline.from_pretrained(root / folder)


def stage1(plan, count: int = 3) -> dict:
    """The first `count` rows through the V2 units (stage 1) on the folder's frozen models."""
    family = plan.family
    base = plan.config.data.base_path
    batch = collate_samples([family.load_sample(r, base) for r in load_metadata(base)[:count]])
    frozen = {name: family.build_model(name, CPU) for name in plan.split.models["stage1"]}
    run_units(plan.v2_units, StepContext(frozen, CPU, settings=family.settings()), batch)
    return batch


def drawn_step(plan, batch: dict, denoiser, seed: int = 5):
    """The per-step units and one drawn training step on a stage-1 batch."""
    family = plan.family
    draws = Draws.shared(torch.Generator().manual_seed(seed))
    ctx = StepContext({family.denoiser: denoiser}, CPU, draws, family.settings())
    batch = dict(batch)
    run_units(plan.v1_units, ctx, batch)
    return batch, ctx, family.training_step(ctx, batch)


def pipeline_conditioning(pipe, image, frames: int):
    """What WanImageToVideoPipeline computes for one PIL first frame: (CLIP image embeds or
    None, cat([mask, condition latents])), via its own encode_image and prepare_latents."""
    embeds = None
    if pipe.image_encoder is not None:
        embeds = pipe.encode_image(image, CPU)
    pixels = pipe.video_processor.preprocess(image, height=SIDE, width=SIDE)
    zeros = torch.zeros(1, pipe.vae.config.z_dim, (frames - 1) // 4 + 1, SIDE // 8, SIDE // 8)
    with torch.no_grad():
        _, condition = pipe.prepare_latents(
            pixels, 1, pipe.vae.config.z_dim, SIDE, SIDE, frames, torch.float32, CPU, None, zeros
        )
    return embeds, condition


def diffusers_loss(pipe, transformer, batch, embeds, condition) -> torch.Tensor:
    """The loss with diffusers' parts alone: the VAE's latents normalised as the pipeline undoes
    them, sigma from FlowMatchEulerDiscreteScheduler(shift), the transformer fed the pipeline's
    cat([latents, condition]) and image embeddings, target noise - latents."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    config = pipe.vae.config
    with torch.no_grad():
        z = pipe.vae.encode(batch["video"].permute(0, 2, 1, 3, 4)).latent_dist.mode()
    mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
    x0 = (z - mean) / torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=pipe.scheduler.config.flow_shift)
    index = [(scheduler.timesteps == t).nonzero().item() for t in batch["timestep"]]
    sigmas = scheduler.sigmas[index].view(-1, 1, 1, 1, 1)
    noisy = (1.0 - sigmas) * x0 + sigmas * batch["noise"]
    with torch.no_grad():
        pred = transformer(
            hidden_states=torch.cat([noisy, condition], dim=1),
            timestep=batch["timestep"],
            encoder_hidden_states=batch["prompt_embeds"],
            encoder_hidden_states_image=embeds,
            return_dict=False,
        )[0]
    return torch.mean((pred - (batch["noise"] - x0)) ** 2)


def test_stage_1_caches_the_pipelines_image_conditioning_and_the_loss_is_diffusers(root):
    """The plan caches CLIP embeddings and condition latents (V2); for each clip, stage 1's
    equal encode_image / prepare_latents on the same 8-bit first frame (row 2: its edit_image),
    and the training loss equals the diffusers computation for the same draws."""
    plan = make_plan(job(root, "plan", pipeline={"vae_latents": "mean"}))
    v2 = ["PromptEncoder", "VAEEncoder", "ImageEncoder", "ConditionEncoder"]
    assert list(plan.split.v2) == v2
    assert list(plan.split.v1) == ["LatentSampler", "CaptionDropout"]
    assert {"image_embeds", "condition_latents"} <= set(plan.split.boundary_params)
    assert sorted(plan.split.models["stage1"]) == ["image_encoder", "text_encoder", "vae"]
    assert plan.split.models["stage2"] == ("transformer",)

    batch = stage1(plan)
    first = batch["video"][:, 0]
    assert not torch.equal(batch["reference_image"][1], first[1])  # row 2: its edit_image
    torch.testing.assert_close(batch["reference_image"][[0, 2]], first[[0, 2]], rtol=0, atol=0)
    pipe = pipeline(root)
    conditioning = [
        pipeline_conditioning(pipe, image, FRAMES) for image in to_pil(batch["reference_image"])
    ]
    embeds = torch.cat([one for one, _ in conditioning])
    condition = torch.cat([one for _, one in conditioning])
    assert condition.shape == (3, 4 + 4, 2, SIDE // 8, SIDE // 8)  # mask over 4x time + z
    assert condition[:, :4, 0].eq(1).all() and condition[:, :4, 1:].eq(0).all()
    torch.testing.assert_close(batch["image_embeds"], embeds, rtol=0, atol=1e-6)
    torch.testing.assert_close(batch["condition_latents"], condition, rtol=0, atol=1e-5)

    step_batch, ctx, step = drawn_step(plan, batch, pipe.transformer)
    with torch.no_grad():
        ours = plan.family.loss(plan.family.denoise(ctx, step), step)
    theirs = diffusers_loss(pipe, pipe.transformer, step_batch, embeds, condition)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)


def test_split_training_through_torchrun_equals_unsplit_and_the_lora_loads_into_the_pipeline(
    root,
):
    """Split (2 ranks of tensor parallelism, from the cache) against unsplit (1 rank, every
    unit every step) over 3 updates; stage 2 loads only the transformer; the LoRA from the
    run's checkpoint, exported in diffusers' layout, loads into WanImageToVideoPipeline and
    changes its prediction."""
    tp = {"parallelism": "tp", "nproc_per_node": 2, "tp_degree": 2}
    config = job(root, "split", batch_size=1, max_steps=3, **tp)
    assert preprocess(config, workers=1, progress=False).computed == 3
    report = train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert report.updates == 3 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]  # no VAE, CLIP or image in stage 2
    unsplit = job(root, "unsplit", mode="unsplit", batch_size=1, max_steps=3)
    done = train(unsplit, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert done.losses == pytest.approx(report.losses, rel=1e-5)

    plan = make_plan(job(root, "split", batch_size=1, max_steps=3))  # read on one rank
    trained = build_stage2_models(plan, ONE_CPU).models["transformer"]
    step_no = latest_checkpoint(report.checkpoint_url, clean=False)
    load_checkpoint(report.checkpoint_url, step_no, trained, None, restore_rng=False)
    _, ctx, step = drawn_step(plan, stage1(plan, 2), trained)
    with torch.no_grad():
        expected = plan.family.denoise(ctx, step)
    pipe = pipeline(root)
    with torch.no_grad():
        base = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
    assert not torch.allclose(base, expected, atol=1e-5)
    pipe.load_lora_weights(str(Path(report.outputs["transformer"]).parent))
    with torch.no_grad():
        loaded = plan.family.denoise(StepContext({"transformer": pipe.transformer}, CPU), step)
    torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def test_a_wan_22_i2v_expert_trains_without_an_image_encoder_and_its_lora_loads(root, tmp_path):
    """Wan 2.2 I2V A14B: the low-noise expert's plan has no ImageEncoder, its loss is the
    diffusers computation on transformer_2 (no image embeddings), and its LoRA loads with
    load_into_transformer_2=True and changes the prediction."""
    from splitstage.tasks.stage2.export import request_for
    from splitstage.tasks.stage2.models import LORA_ADAPTER

    settings = {"pretrained": str(root / "wan22_i2v"), "expert": "low_noise"}
    settings |= {"vae_latents": "mean", "max_prompt_length": 24}  # no CLIP: any prompt length
    plan = make_plan(job(root, "w22", pipeline=settings, lora="transformer_2"))
    family = plan.family
    assert list(plan.split.v2) == ["PromptEncoder", "VAEEncoder", "ConditionEncoder"]
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert plan.split.models["stage2"] == ("transformer_2",)
    batch = stage1(plan, 2)
    pipe = pipeline(root, "wan22_i2v")
    _, condition = zip(
        *(pipeline_conditioning(pipe, one, FRAMES) for one in to_pil(batch["reference_image"]))
    )
    condition = torch.cat(condition)
    torch.testing.assert_close(batch["condition_latents"], condition, rtol=0, atol=1e-5)
    step_batch, ctx, step = drawn_step(plan, batch, pipe.transformer_2)
    assert (step_batch["timestep"] < 875).all()
    with torch.no_grad():
        ours = family.loss(family.denoise(ctx, step), step)
    theirs = diffusers_loss(pipe, pipe.transformer_2, step_batch, None, condition)
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-5)

    _, trained = trained_model(plan.config)
    seed_adapters(trained)
    state = {
        key.replace(f".{LORA_ADAPTER}.", "."): tensor
        for key, tensor in trained.state_dict().items()
        if "lora_" in key
    }
    name, data = family.export_files("transformer_2", state, request_for(True, family, 1))[
        "transformer_2"
    ]
    (tmp_path / name).write_bytes(data)
    with torch.no_grad():
        expected = family.denoise(StepContext({"transformer_2": trained}, CPU), step)
        base = family.denoise(StepContext({"transformer_2": pipe.transformer_2}, CPU), step)
    assert not torch.allclose(base, expected, atol=1e-5)
    pipe.load_lora_weights(str(tmp_path / name), load_into_transformer_2=True)
    with torch.no_grad():
        loaded = family.denoise(StepContext({"transformer_2": pipe.transformer_2}, CPU), step)
    torch.testing.assert_close(loaded, expected, atol=2e-5, rtol=0)


def test_bad_rows_and_folders_are_refused_in_one_line(root, tmp_path):
    """A clip too short for num_frames, an edit_image that is a video, two edit_images: one
    DataError line naming the row (and file), before anything is cached; a 2.1 I2V job with
    prompts not padded to 512 tokens, a TI2V folder, validation prompts without first frames
    and a folder without its image processor: one ConfigError line naming the field."""
    bad = tmp_path / "bad"
    shutil.copytree(root / "data", bad)
    (bad / "metadata.jsonl").write_text(
        json.dumps({"video": "clips/clip0.mp4", "prompt": "a", "edit_image": "clips/clip1.mp4"})
        + "\n"
    )
    with pytest.raises(DataError) as error:
        preprocess(job(root, "bad-ref", data=str(bad)), workers=1, progress=False)
    message = str(error.value)
    assert message.startswith("metadata.jsonl row 1 (edit_image): 'clips/clip1.mp4' is a video")
    assert "reference images are images" in message and "\n" not in message
    with pytest.raises(DataError) as error:
        preprocess(job(root, "short", video={"num_frames": 9}), workers=1, progress=False)
    message = str(error.value)
    assert "clip0.mp4" in message and "of the 9 frames" in message and "\n" not in message
    assert not any((root / "cache-short").rglob("*.safetensors"))

    with pytest.raises(ConfigError, match=r"^pipeline\.max_prompt_length = 24: .* 512") as error:
        make_plan(job(root, "length", pipeline={"max_prompt_length": 24}))
    assert "\n" not in str(error.value)
    folder = shutil.copytree(root / "wan22_i2v", tmp_path / "ti2v")
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index | {"expand_timesteps": True}))
    ti2v = {"pretrained": str(folder), "expert": "low_noise"}
    with pytest.raises(ConfigError, match="expand_timesteps .*Wan 2.2 TI2V"):
        make_plan(job(root, "ti2v", pipeline=ti2v, lora="transformer_2"))
    with pytest.raises(ConfigError, match="^validation.reference_images: the wan_i2v family"):
        make_plan(job(root, "plan")).family.check_sampling()
    no_processor = shutil.copytree(root / "wan_i2v", tmp_path / "no-processor")
    shutil.rmtree(no_processor / "image_processor")
    with pytest.raises(ConfigError, match=r"^pipeline\.pretrained: .*image_processor/\)$"):
        make_plan(job(root, "np", pipeline={"pretrained": str(no_processor)}))
    two = {"video": "clips/clip0.mp4", "prompt": "a", "edit_image": ["first.png", "first.png"]}
    (bad / "metadata.jsonl").write_text(json.dumps(two) + "\n")
    with pytest.raises(DataError, match=r"^metadata.jsonl row 1 has 2 reference images: .* 1"):
        preprocess(job(root, "two-refs", data=str(bad)), workers=1, progress=False)
