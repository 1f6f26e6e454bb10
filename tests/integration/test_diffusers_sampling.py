"""Validation samplers of the diffusers families draw what their diffusers pipelines draw."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from splitstage.pipelines.diffusers.packing import pack
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.cache.validation_prompts import encode
from tests.helpers.diffusers_families import FAMILY, PIPELINE, family_plan
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of the digit 3", "a cat"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    shifting = "sd3-dynamic-shift"
    folders = {kind: write_tiny_folder(kind, root / kind) for kind in FAMILY if kind != shifting}
    shifted = shutil.copytree(folders["sd3"], root / shifting)
    scheduler = shifted / "scheduler" / "scheduler_config.json"
    scheduler.write_text(
        json.dumps(json.loads(scheduler.read_text()) | {"use_dynamic_shifting": True})
    )
    folders[shifting] = shifted
    return folders


def ours(plan, seed: int) -> torch.Tensor:
    """Our sampler + decoder, on the folder's frozen models, in [0, 1]."""
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


@pytest.mark.parametrize("kind", list(FAMILY))
def test_the_sampler_matches_the_diffusers_pipeline(folders, kind):
    import diffusers

    plan = family_plan(folders[kind], kind)
    family = plan.family
    mine = ours(plan, seed=4)
    assert torch.equal(mine, ours(plan, seed=4))  # deterministic per seed
    assert not torch.equal(mine, ours(plan, seed=5))
    pipe = getattr(diffusers, PIPELINE[FAMILY[kind]]).from_pretrained(folders[kind])
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(4)
    channels = family.vae_config["latent_channels"]
    noise = torch.randn(2, channels, 8, 8, generator=generator)  # then the step noise, as ours
    options = {"num_inference_steps": 3, "guidance_scale": family.default_guidance}
    options |= {"height": 64, "width": 64, "output_type": "pt", "prompt": PROMPTS}
    if FAMILY[kind] == "flux":
        options |= {"latents": pack(noise), "max_sequence_length": 16}
    elif FAMILY[kind] == "sd3":
        options |= {"latents": noise, "negative_prompt": ["", ""], "max_sequence_length": 16}
    else:
        options |= {"latents": noise, "generator": generator}
    theirs = pipe(**options).images
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)
