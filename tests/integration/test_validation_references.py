"""Validation samples conditioned on `validation.reference_images` (flux_kontext, tiny folder):
stage 1 encodes the references beside the prompts and the sample equals FluxKontextPipeline's for
the same prompt, reference image, seed and steps; a changed image is another key and another
sample; what cannot sample is refused in one line before any model loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.images import DataError, center_crop_resize
from splitstage.pipelines.diffusers.packing import pack
from splitstage.tasks.cache.validation_prompts import (
    prompts_key,
    read_validation_references,
    write_validation_prompts,
)
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage1.preprocess import start_preprocess
from splitstage.tasks.stage2.preflight import Preflight, check_validation
from splitstage.tasks.stage2.validation import Validator
from tests.helpers.demo_job import demo_sections
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
CPU = torch.device("cpu")
PROMPT = "a red square"


def _reference(path: Path, colour: tuple[int, int, int]) -> None:
    """A 64 px reference (the sample size): a coloured square on grey."""
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.new("RGB", (64, 64), (128, 128, 128))
    ImageDraw.Draw(image).rectangle((12, 16, 44, 52), fill=colour)
    image.save(path)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A tiny FluxKontextPipeline folder and a data folder with two reference images."""
    root = tmp_path_factory.mktemp("validation-references")
    write_tiny_folder("flux_kontext", root / "flux_kontext")
    _reference(root / "data" / "ref" / "a.png", (220, 20, 20))
    _reference(root / "data" / "ref" / "b.png", (20, 20, 220))
    return root


@pytest.fixture(scope="module")
def pipe(root):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(root / "flux_kontext")


def job(root: Path, references, name: str = "refs", data: str = "data", **validation):
    """A flux_kontext LoRA job at 64 px sampling PROMPT with `references`."""
    pipeline = {"name": "flux_kontext", "pretrained": str(root / "flux_kontext")}
    pipeline |= {"resolution": 64, "precision": "fp32", "max_prompt_length": 16}
    settings = {"prompts": [PROMPT], "steps": 2, "seed": 7, "guidance_scale": 3.5}
    return config_from_dict(
        {
            "job": {"name": name},
            "pipeline": pipeline,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4},
            "data": {"base_path": str(root / data)},
            "cache": {"url": str(root / f"cache-{name}")},
            "output": {"url": str(root / "out")},
            "validation": settings | {"reference_images": references} | validation,
        }
    )


def draw(plan, pipe, size=None, *, names=("transformer",)) -> torch.Tensor:
    """The validator's sample as stage 2 draws it with `names` of the pipeline's models (the
    transformer alone: the prompts and references come from stage 1's file)."""
    models = {name: getattr(pipe, name) for name in names}
    validator = Validator(plan, models, CPU, "/unused", is_main=True, log=print)
    return validator.draw(size)


def kontext(pipe, reference: Image.Image, height: int, width: int) -> torch.Tensor:
    """FluxKontextPipeline's latents for PROMPT and `reference` (seed 7, 2 steps, guidance 3.5)."""
    return pipe(
        prompt=PROMPT,
        image=reference,
        height=height,
        width=width,
        max_area=height * width,
        _auto_resize=False,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
    ).images


def test_a_reference_sample_equals_flux_kontext_pipeline(root, pipe):
    """At every validation size (the reference cropped to it, as training crops it to the
    target's bucket), from stage 1's file or encoded in stage 2 when it holds the VAE."""
    plan = make_plan(job(root, ["ref/a.png"], sizes=["64x64", "96x64"]))
    assert write_validation_prompts(plan) is not None
    assert set(read_validation_references(plan)) == {"64x64", "96x64"}
    reference = Image.open(root / "data" / "ref" / "a.png").convert("RGB")
    for height, width in ((64, 64), (64, 96)):
        ours = draw(plan, pipe, (height, width))
        cropped = center_crop_resize(reference, height, width)
        theirs = kontext(pipe, cropped, height, width)
        torch.testing.assert_close(pack(ours), theirs, atol=1e-4, rtol=1e-4)
    held = draw(plan, pipe, (64, 96), names=("transformer", "vae", "text_encoder",
                                             "text_encoder_2"))  # fmt: skip
    torch.testing.assert_close(held, ours, atol=1e-5, rtol=1e-5)


def test_a_changed_reference_is_another_key_and_another_sample(root, pipe, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(root / "data", data)
    plan = make_plan(job(root, ["ref/a.png"], name="changed", data=str(data)))
    before_key = prompts_key(plan)
    write_validation_prompts(plan)
    before = draw(plan, pipe)
    shutil.copyfile(data / "ref" / "b.png", data / "ref" / "a.png")  # same name, other content
    assert prompts_key(plan) != before_key
    assert read_validation_references(plan) is None  # not encoded for the new image yet
    write_validation_prompts(plan)
    after = draw(plan, pipe)
    assert not torch.allclose(before, after, atol=1e-4)
    other = make_plan(job(root, ["ref/b.png"], name="changed", data=str(data)))
    assert prompts_key(other) == prompts_key(plan)  # by content, not by name
    torch.testing.assert_close(draw(other, pipe), after)


def test_what_cannot_sample_is_refused_in_one_line_before_launch(root, demo_weights):
    with pytest.raises(ConfigError, match=r"reference_images has 2 entries for 1 prompts"):
        job(root, ["ref/a.png", "ref/b.png"])
    with pytest.raises(ConfigError, match=r"reference_images\[0\] names no file"):
        job(root, [[]])
    demo = config_from_dict(
        demo_sections(demo_weights)
        | {"validation": {"prompts": [PROMPT], "reference_images": ["ref/a.png"]}}
    )
    with pytest.raises(
        ConfigError,
        match=r"^validation.reference_images: the demo family takes no reference images; "
        r".*'flux_kontext'",
    ):
        check_validation(make_plan(demo), Preflight(), strict=False)
    two = make_plan(job(root, [["ref/a.png", "ref/b.png"]]))
    with pytest.raises(ConfigError, match=r"^validation.reference_images\[0\] names 2 images; "):
        check_validation(two, Preflight(), strict=False)
    missing = make_plan(job(root, ["ref/a.png"], name="missing", data="nowhere"))
    shown = root / "nowhere" / "ref" / "a.png"
    with pytest.raises(DataError, match=rf"^validation.reference_images\[0\]: image file {shown} "):
        check_validation(missing, Preflight(), strict=False)
    with pytest.raises(DataError, match=r"does not exist"):
        write_validation_prompts(missing)  # stage 1 refuses before it builds an encoder
    with pytest.raises(DataError, match=r"^validation.reference_images\[0\]: image file "):
        start_preprocess(missing)  # preprocess refuses before indexing or computing a sample
    (root / "bad").mkdir(exist_ok=True)
    (root / "bad" / "x.png").write_bytes(b"not a png")
    bad = make_plan(job(root, ["x.png"], name="bad", data="bad"))
    with pytest.raises(DataError, match=r"x.png is corrupt or not an image"):
        check_validation(bad, Preflight(), strict=False)
    assert not (root / "cache-missing").exists() and not (root / "cache-bad").exists()
