"""Wan image-to-video validation clips from a first frame per prompt (`validation.reference_images`,
tiny WanImageToVideoPipeline folders): stage 1 encodes the prompts and each frame's conditioning
(condition latents; CLIP image embeddings for Wan 2.1), stage 2's validator samples from that
file, and each clip's latents equal WanImageToVideoPipeline's for the same prompt, negative,
frame, noise and steps (classifier-free guidance on); without first frames it is refused in one
line. Run: .venv/bin/pytest -m slow tests/integration/test_wan_i2v_validation.py
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.tasks.cache.validation_prompts import (
    read_validation_references,
    write_validation_prompts,
)
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.preflight import Preflight, check_validation
from splitstage.tasks.stage2.validation import Validator
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPTS = ["squares moving right", "a red square falls"]
NEGATIVES = ["blurry", "static"]
FRAMES, SIDE, STEPS, SEED, GUIDANCE = 5, 64, 3, 7, 5.0


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny Wan 2.1 I2V folder (CLIP image encoder), the same without CLIP and with one
    transformer (Wan 2.2 I2V's parts, boundary_ratio off), and two 64 px first frames."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("wan-i2v-validation")
    write_tiny_folder("wan_i2v", root / "wan_i2v")
    write_tiny_folder("wan22_i2v", root / "wan22_i2v")
    single = shutil.copytree(root / "wan22_i2v", root / "no_clip")
    shutil.rmtree(single / "transformer_2")
    index = json.loads((single / "model_index.json").read_text())
    index = {k: v for k, v in index.items() if k not in ("transformer_2", "boundary_ratio")}
    (single / "model_index.json").write_text(json.dumps(index))
    for name, seed in (("a.png", 0), ("b.png", 1)):
        pixels = torch.rand(SIDE, SIDE, 3, generator=torch.Generator().manual_seed(seed))
        (root / "data").mkdir(exist_ok=True)
        Image.fromarray((pixels * 255).byte().numpy()).save(root / "data" / name)
    return root


def job(root: Path, folder: str, references, name: str, **pipeline):
    """A LoRA job on the tiny `folder` at 64 px, 5-frame clips, sampling PROMPTS with their
    NEGATIVES from `references` (guidance GUIDANCE, STEPS steps, seed SEED)."""
    settings = {"name": "wan_i2v", "pretrained": str(root / folder), "resolution": SIDE}
    settings |= {"precision": "fp32"} | pipeline
    validation = {"prompts": PROMPTS, "negative_prompts": NEGATIVES, "steps": STEPS}
    validation |= {"seed": SEED, "guidance_scale": GUIDANCE, "reference_images": references}
    return config_from_dict(
        {
            "job": {"name": name},
            "pipeline": settings,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
            "data": {"base_path": str(root / "data"), "video": {"num_frames": FRAMES}},
            "cache": {"url": str(root / f"cache-{name}")},
            "output": {"url": str(root / "out")},
            "validation": validation,
        }
    )


def draw(plan, pipe, names=("transformer",)) -> torch.Tensor:
    """The validator's latents as stage 2 draws them holding `names` of the pipeline's models
    (the transformer alone: prompts and first frames come from stage 1's file)."""
    models = {name: getattr(pipe, name) for name in names}
    return Validator(plan, models, CPU, "/unused", is_main=True, log=print).draw()


@pytest.mark.parametrize("folder, length", [("wan_i2v", 512), ("no_clip", 24)])
def test_a_validation_clip_equals_wan_image_to_video_pipelines(root, folder, length, monkeypatch):
    """Each prompt's clip latents (two prompts drawn together) equal WanImageToVideoPipeline's for
    its first frame from the same noise rows, from stage 1's file or encoded in stage 2 when it
    holds the encoders. ftfy is not installed here and the I2V module calls it unguarded: its
    prompt_clean is swapped for WanPipeline's (ftfy when installed), the one stage 1 uses."""
    from diffusers import WanImageToVideoPipeline
    from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v

    plan = make_plan(
        job(root, folder, ["a.png", "b.png"], f"clip-{folder}", max_prompt_length=length)
    )
    check_validation(plan, Preflight(), strict=False)  # accepted before launch
    assert write_validation_prompts(plan) is not None
    ((label, (cond, _)),) = read_validation_references(plan).items()
    assert label == f"{SIDE}x{SIDE}" and ("image_embeds" in cond) == (folder == "wan_i2v")
    pipe = WanImageToVideoPipeline.from_pretrained(root / folder)
    ours = draw(plan, pipe)
    assert ours.shape == (2, 4, 2, SIDE // 8, SIDE // 8)
    monkeypatch.setattr(pipeline_wan_i2v, "prompt_clean", pipeline_wan.prompt_clean)
    noise = torch.randn(ours.shape, generator=torch.Generator().manual_seed(SEED))
    for index, name in enumerate(("a.png", "b.png")):
        theirs = pipe(
            image=Image.open(root / "data" / name).convert("RGB"),
            prompt=PROMPTS[index],
            negative_prompt=NEGATIVES[index],
            height=SIDE,
            width=SIDE,
            num_frames=FRAMES,
            num_inference_steps=STEPS,
            guidance_scale=GUIDANCE,
            latents=noise[index : index + 1],
            max_sequence_length=length,
            output_type="latent",
        ).frames
        torch.testing.assert_close(ours[index : index + 1], theirs, atol=5e-5, rtol=0)
    names = ("transformer", "text_encoder", "vae", *plan.family.reference_models())
    held = draw(plan, pipe, names=tuple(dict.fromkeys(names)))
    torch.testing.assert_close(held, ours, atol=1e-5, rtol=1e-5)


def test_validation_prompts_without_first_frames_are_refused_in_one_line(root):
    plain = make_plan(job(root, "wan_i2v", None, "plain"))
    with pytest.raises(
        ConfigError,
        match=r"^validation.reference_images: the wan_i2v family samples each clip from a first "
        r"frame; give each of validation.prompts one image in validation.reference_images$",
    ):
        check_validation(plain, Preflight(), strict=False)
    two = make_plan(job(root, "wan_i2v", [["a.png", "b.png"], "a.png"], "two"))
    with pytest.raises(ConfigError, match=r"^validation.reference_images\[0\] names 2 images; "):
        check_validation(two, Preflight(), strict=False)
