"""Validation samples at the sizes users train at (`validation.sizes`): one grid per size, named
by it; the square default draws exactly what it drew before; non-square samples of the demo and
the diffusers families are what the diffusers pipelines draw at that size (SDXL's time ids,
FLUX's packing and shift); sizes a family cannot draw are one line before launch."""

from __future__ import annotations

import io
import re

import pytest
import torch
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.pipelines.demo.family import DemoFamily
from splitstage.pipelines.demo.vae import VAEEncoder
from splitstage.pipelines.demo.weight_files import weights_config
from splitstage.pipelines.diffusers.packing import pack
from splitstage.pipelines.runtime import StepContext
from splitstage.pipelines.sampling_common import flow_euler, guided, linear_sigmas
from splitstage.tasks.cache.validation_prompts import encode
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage2.validation import Validator, check_validation_sizes, repeat_rows
from tests.helpers.demo_job import demo_sections
from tests.helpers.diffusers_families import PIPELINE, family_plan
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPTS = ["a handwritten digit seven", "a handwritten digit one"]
SAMPLES_LINE = re.compile(r"\bsamples update (\d+): (\S+)")  # what flows/train_flow.py publishes


def demo_config(weights, out, **validation):
    return config_from_dict(
        {
            **demo_sections(weights),
            "output": {"url": str(out)},
            "validation": {"prompts": PROMPTS, "steps": 2} | validation,
        }
    )


@pytest.fixture(scope="module")
def demo_models(demo_weights):
    family = make_plan(demo_config(demo_weights, "/unused")).family
    return {name: family.build_model(name, CPU) for name in ("text_encoder", "dit")}


def validator(config, models, out, lines, grids):
    on_grid = lambda update, png, tag: grids.append((update, tag, png))  # noqa: E731
    return Validator(
        make_plan(config), models, CPU, str(out), is_main=True, log=lines.append,
        on_grid=on_grid,
    )  # fmt: skip


def old_square_draw(validator: Validator) -> torch.Tensor:
    """The demo sampler as it was before sizes (square noise from `image_size`), inline."""
    family, settings = validator.plan.family, validator.settings
    cond, uncond = validator.conditioning()
    cond, uncond = repeat_rows(cond, 1), repeat_rows(uncond, 1)
    generator = torch.Generator().manual_seed(settings.seed)
    dit = validator.models["dit"].eval()
    side = family.config.pipeline.image_size // VAEEncoder.downsample
    channels = weights_config(family.model_source("vae").weights)["latent_channels"]
    noise = torch.randn(len(PROMPTS), channels, side, side, generator=generator)

    def velocity(x, t, conditional):
        text = cond if conditional else uncond
        return dit(x, t, text["prompt_emb"], text["prompt_mask"])

    with torch.no_grad():
        return flow_euler(guided(velocity, family.default_guidance), noise, linear_sigmas(2))


def test_the_square_default_draws_what_it_drew_before(demo_weights, demo_models, tmp_path):
    lines, grids = [], []
    default = validator(demo_config(demo_weights, tmp_path), demo_models, tmp_path, lines, grids)
    assert default.sizes == [None]
    drawn = default.draw()
    assert drawn.shape == (2, 4, 8, 8) and torch.equal(drawn, old_square_draw(default))
    url = default.run(5)
    assert url == str(tmp_path / "samples" / "update-000005.png") and default.samples == {5: url}
    assert [SAMPLES_LINE.search(line).groups() for line in lines] == [("5", url)]
    assert [(u, tag) for u, tag, _ in grids] == [(5, "samples")]
    # The square named as a size draws the same images (each size starts from the seed).
    square = validator(
        demo_config(demo_weights, tmp_path, sizes=["32x16", "64x64"]), demo_models, tmp_path,
        [], [],
    )  # fmt: skip
    assert torch.equal(square.draw((64, 64)), drawn)


def test_every_size_gets_its_own_grid(demo_weights, demo_models, tmp_path):
    lines, grids = [], []
    config = demo_config(demo_weights, tmp_path, sizes=["64x32", "32x48"], images_per_prompt=2)
    sized = validator(config, demo_models, tmp_path, lines, grids)
    wide = sized.draw((32, 64))
    assert wide.shape == (4, 4, 4, 8)  # 2 prompts x 2 images, latents of 32 x 64 pixels
    family = sized.plan.family
    assert family.decode(family.load_decoder(CPU), wide).shape == (4, 3, 32, 64)

    first = sized.run(3)
    names = ["update-000003-64x32.png", "update-000003-32x48.png"]
    urls = [str(tmp_path / "samples" / name) for name in names]
    assert first == urls[0] and sized.grids == {3: urls} and sized.samples == {3: urls[0]}
    assert [SAMPLES_LINE.search(line).groups() for line in lines] == [("3", u) for u in urls]
    assert [(u, tag) for u, tag, _ in grids] == [(3, "samples/64x32"), (3, "samples/32x48")]
    band = 14  # the label strip above each grid row (pipelines.sampling_common.grid_png)
    for url, (_, _, png), (width, height) in zip(urls, grids, [(64, 32), (32, 48)], strict=True):
        with open(url, "rb") as file:
            assert file.read() == png
        grid = Image.open(io.BytesIO(png))
        assert grid.size == (2 * width, 2 * (height + band))  # 2 images a row, 2 prompts


class SizelessDemo(DemoFamily):
    """The demo family as one that takes no images of a chosen size (as the diffsynth one)."""

    def image_resolution(self):
        return None


@pytest.mark.parametrize(
    ("sizes", "needles"),
    [
        (["64x40"], ["'64x40'", "multiples of 16 for the demo family", "use '64x48'"]),
        (["64x64", "100x64"], ["'100x64'", "use '96x64'"]),
        (["4x64"], ["'4x64'", "use '16x64'"]),
    ],
)
def test_sizes_the_family_cannot_draw_are_one_line(demo_weights, sizes, needles):
    config = demo_config(demo_weights, "/unused", sizes=sizes)
    with pytest.raises(ConfigError) as error:
        check_validation_sizes(make_plan(config).family)
    line = str(error.value)
    assert line.startswith("validation.sizes: ") and "\n" not in line
    for needle in needles:
        assert needle in line, line


def test_fitting_sizes_pass_and_a_sizeless_family_is_refused(demo_weights):
    config = demo_config(demo_weights, "/unused", sizes=["64x32", "48x96"])
    check_validation_sizes(make_plan(config).family)  # multiples of 16: no error
    off = demo_config(demo_weights, "/unused", prompts=[], sizes=["64x40"])
    check_validation_sizes(make_plan(off).family)  # nothing samples: nothing to check
    with pytest.raises(ConfigError, match=r"^validation.sizes: the demo family does not sample "):
        check_validation_sizes(SizelessDemo(config))


# -- diffusers families: a non-square sample is the diffusers pipeline's at that size --------------
@pytest.mark.parametrize("kind", list(PIPELINE))
def test_a_non_square_sample_is_what_the_diffusers_pipeline_draws(tmp_path, kind):
    import diffusers

    folder = write_tiny_folder(kind, tmp_path / kind)
    plan = family_plan(folder, kind)
    family = plan.family
    models = {name: family.build_model(name, CPU) for name in family.prompt_models()}
    cond, uncond = encode(plan, models, CPU, PROMPTS, ["", ""])
    models[family.denoiser] = family.build_model(family.denoiser, CPU)
    ctx = StepContext(models, CPU, settings=family.settings())
    guidance = family.default_guidance

    def ours(size):
        generator = torch.Generator().manual_seed(4)
        with torch.no_grad():
            return family.sample(
                ctx, cond, uncond, generator, steps=3, guidance=guidance, size=size
            )

    assert torch.equal(ours(None), ours((64, 64)))  # the default is the square, as before
    height, width = 64, 96
    latents = ours((height, width))
    assert latents.shape == (2, family.vae_config["latent_channels"], 8, 12)
    with torch.no_grad():
        mine = (family.decode(family.load_decoder(CPU), latents) + 1) / 2
    assert mine.shape == (2, 3, height, width)

    pipe = getattr(diffusers, PIPELINE[kind]).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(4)
    noise = torch.randn(2, family.vae_config["latent_channels"], 8, 12, generator=generator)
    options = {"num_inference_steps": 3, "guidance_scale": guidance, "prompt": PROMPTS}
    options |= {"height": height, "width": width, "output_type": "pt"}
    if kind == "flux":  # packed 2x2 patches, position ids and shift from the 4 x 6 token grid
        options |= {"latents": pack(noise), "max_sequence_length": 16}
    elif kind == "sd3":
        options |= {"latents": noise, "negative_prompt": ["", ""], "max_sequence_length": 16}
    else:  # SDXL's time ids: original and target size (64, 96), crop (0, 0)
        options |= {"latents": noise, "generator": generator}
    theirs = pipe(**options).images
    torch.testing.assert_close(mine, theirs, atol=5e-5, rtol=0)


def test_the_preflight_refuses_a_size_the_family_cannot_draw(demo_weights):
    """`validate` / `train` run this check before anything launches."""
    from splitstage.tasks.stage2.preflight import Preflight, check_validation

    config = demo_config(demo_weights, "/unused", sizes=["64x40"])
    with pytest.raises(ConfigError, match=r"^validation.sizes: '64x40': .*use '64x48'"):
        check_validation(make_plan(config), Preflight(), strict=False)
    fits = demo_config(demo_weights, "/unused", sizes=["64x48"])
    check_validation(make_plan(fits), Preflight(), strict=False)
