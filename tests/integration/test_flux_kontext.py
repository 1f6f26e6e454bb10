"""FLUX.1 Kontext on a tiny FluxKontextPipeline folder: rows with reference images trained split
equal unsplit training, the exported LoRA loads into FluxKontextPipeline and changes its
prediction, the denoiser's inputs are laid out as the pipeline lays them out, and families
refuse rows that do not fit them before stage 1 caches anything."""

from __future__ import annotations

import io
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from splitstage.data.dataset import DataError, load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.runtime import StepContext
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers.diffusers_families import (
    CPU,
    drawn_step,
    lora_job,
    predict,
    run,
    tiny_pipeline,
    trained_from_checkpoint,
)
from tests.helpers.family_roots import add_reference_images
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Eight captioned digits with reference images, and a tiny FluxKontextPipeline folder."""
    root = tmp_path_factory.mktemp("kontext")
    write_digits_dataset(root / "data", limit=8, size=32)
    add_reference_images(root / "data")
    write_tiny_folder("flux_kontext", root / "flux_kontext")
    return root


def job(
    root: Path,
    name: str,
    family: str = "flux_kontext",
    data: str = "data",
    skip: bool = False,
    **train,
):
    """A LoRA job on the family's tiny folder (see lora_job): caption dropout 0.25, prompts 16
    tokens at most, root/data's rows (`skip` bad ones), a cache of its own, batches of 4 at
    learning rate 1e-3."""
    return lora_job(
        root,
        family,
        name,
        pipeline={"caption_dropout": 0.25, "max_prompt_length": 16},
        data={"base_path": str(root / data), "skip_bad_rows": skip},
        cache={"url": str(root / f"cache-{name}")},
        **{"batch_size": 4, "learning_rate": 1e-3} | train,
    )


def pipeline(root: Path):
    """FluxKontextPipeline from the tiny folder (offline)."""
    return tiny_pipeline(root, "FluxKontextPipeline", "flux_kontext")


def test_split_training_equals_unsplit_and_its_lora_loads_into_flux_kontext(root):
    config = job(root, "kontext-split")
    plan = make_plan(config)
    assert list(plan.split.v2) == ["PromptEncoder", "VAEEncoder", "ReferenceEncoder"]
    assert "reference_latents" in plan.split.boundary_params
    assert preprocess(config, workers=1, progress=False).computed == 8
    report = run(config, root)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]  # stage 2 never opens the VAE or the images

    unsplit_config = job(root, "kontext-unsplit", mode="unsplit")
    unsplit = run(unsplit_config, root)
    assert unsplit.losses == pytest.approx(report.losses, rel=1e-5)

    _, trained = trained_from_checkpoint(config, report)
    _, _, step = drawn_step(plan, trained)
    expected = predict(plan, trained, step)
    pipe = pipeline(root)
    base = predict(plan, pipe.transformer, step)
    assert not torch.allclose(base, expected, atol=1e-6)  # the LoRA changes the prediction
    pipe.load_lora_weights(Path(report.outputs["transformer"]).parent)
    assert torch.allclose(predict(plan, pipe.transformer, step), expected, atol=2e-5)


def test_the_denoiser_inputs_are_laid_out_as_flux_kontext_pipeline_lays_them_out(root):
    """Reference latents, their tokens after the noisy ones and their ids (first coordinate 1)
    equal what FluxKontextPipeline gives its transformer for the same reference image."""
    config = job(root, "kontext-layout")
    plan = make_plan(config)
    pipe = pipeline(root)
    batch, _, step = drawn_step(plan, pipe.transformer)
    seen = {}

    def keep(module, args, kwargs):
        seen.setdefault("kwargs", kwargs)

    pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    row = load_metadata(config.data.base_path)[0]
    reference = Image.open(Path(config.data.base_path) / row.references[0])
    pipe(
        prompt=row.prompt,
        image=reference,
        height=64,
        width=64,
        num_inference_steps=1,
        max_sequence_length=16,
        _auto_resize=False,
        max_area=64 * 64,
        output_type="latent",
    )
    theirs = seen["kwargs"]
    ours = step.denoiser_kwargs
    tokens = ours["hidden_states"].shape[1] // 2
    assert theirs["hidden_states"].shape[1] == ours["hidden_states"].shape[1]
    torch.testing.assert_close(
        theirs["hidden_states"][0, tokens:], ours["hidden_states"][0, tokens:], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(theirs["img_ids"], ours["img_ids"])
    assert step.target.shape[1] == tokens and predict(plan, pipe.transformer, step).shape == (
        step.target.shape
    )
    assert batch["reference_latents"].shape == batch["latent_mean"].shape


def _png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (32, 32), (200, 10, 10)).save(out, format="PNG")
    return out.getvalue()


def test_families_refuse_rows_that_do_not_fit_before_stage_1(root):
    write_tiny_folder("flux", root / "flux")
    flux = job(root, "flux-with-references", family="flux")
    with pytest.raises(
        DataError, match=r"the flux family takes no reference images; .*'flux_kontext'"
    ):
        preprocess(flux, workers=1, progress=False)
    assert not (root / "cache-flux-with-references").exists() or not any(
        (root / "cache-flux-with-references").rglob("*.safetensors")
    )
    plain = root / "plain"
    plain.mkdir()
    (plain / "a.png").write_bytes(_png())
    (plain / "metadata.csv").write_text("image,prompt\na.png,a red square\n")
    kontext = job(root, "kontext-without", data="plain")
    with pytest.raises(
        DataError, match=r"^metadata.csv row 2 has no 'edit_image': the flux_kontext"
    ):
        preprocess(kontext, workers=1, progress=False)


def test_an_undecodable_reference_is_a_bad_row_in_stage_1(root):
    import shutil

    bad = root / "bad-data"
    shutil.copytree(root / "data", bad)
    row = load_metadata(bad)[0]
    (bad / row.references[0]).write_bytes(b"not a png")
    with pytest.raises(DataError, match=rf"^metadata.csv row 2: .*{row.references[0]}"):
        preprocess(job(root, "kontext-bad", data="bad-data"), workers=1, progress=False)
    config = job(root, "kontext-bad-skip", data="bad-data", skip=True)
    report = preprocess(config, workers=1, progress=False)
    assert (report.computed, report.skipped) == (7, 1)
    ((line, message),) = report.skipped_rows
    assert line == 2 and message.startswith("metadata.csv row 2: ")
    assert str(bad / row.references[0]) in message  # the record's placeholder, named again
    again = preprocess(config, workers=1, progress=False)  # known: not decoded again
    assert (again.computed, again.skipped_rows) == (0, report.skipped_rows)


def test_sampling_with_reference_latents_equals_flux_kontext_pipeline(root):
    """Given a reference's latents, the family's sampler gives FluxKontextPipeline's latents for
    the same prompt, reference image, generator and steps."""
    from splitstage.data.images import image_to_tensor
    from splitstage.pipelines.diffusers.flux_kontext import encode_references
    from splitstage.pipelines.diffusers.packing import pack

    config = job(root, "kontext-sample")
    family = make_plan(config).family
    pipe = pipeline(root)
    row = load_metadata(config.data.base_path)[0]
    reference = Image.open(Path(config.data.base_path) / row.references[0]).convert("RGB")
    models = {name: getattr(pipe, name) for name in family.model_names}
    ctx = StepContext(models, CPU, settings=family.settings())
    with torch.no_grad():
        cond = family.prompt_conditioning(ctx, [row.prompt])
        cond |= encode_references(ctx, image_to_tensor(reference).unsqueeze(0))
        ours = family.sample(
            ctx, cond, {}, torch.Generator().manual_seed(7), steps=2, guidance=3.5, size=(64, 64)
        )
    theirs = pipe(
        prompt=row.prompt,
        image=reference,
        height=64,
        width=64,
        max_area=64 * 64,
        _auto_resize=False,
        num_inference_steps=2,
        guidance_scale=3.5,
        max_sequence_length=16,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack(ours), theirs, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # without a reference: FLUX's sampler, other latents
        plain = family.sample(
            ctx, {k: v for k, v in cond.items() if k != "reference_latents"}, {},
            torch.Generator().manual_seed(7), steps=2, guidance=3.5, size=(64, 64),
        )  # fmt: skip
    assert not torch.allclose(plain, ours, atol=1e-4)
