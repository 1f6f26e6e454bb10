"""Qwen-Image-Edit on tiny QwenImageEdit(Plus)Pipeline folders: stage 1 gives the transformer what
the pipeline gives it (prompt embeddings seen with the references, reference latents, img_shapes),
split training equals unsplit with references of two sizes batched apart, the exported LoRA loads
into the pipeline and changes its prediction, and rows that do not fit are refused in one line."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageOps

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import DataError, load_metadata
from splitstage.data.digits import write_digits_dataset
from splitstage.pipelines.draws import Draws
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.checkpoint import latest_checkpoint, load_checkpoint
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.preflight import preflight
from tests.helpers.tiny_diffusers import write_tiny_folder

pytestmark = pytest.mark.slow
ENV = {"SPLITSTAGE_DEVICE": "cpu", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
ONE_CPU = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
REFERENCE_AREA = 96 * 64  # square references -> 64x64, 3:2 ones -> 96x64 (multiples of 32)
CONDITION_AREA = 56 * 56  # Plus's VL sees square ones at 64x64, 3:2 ones at 64x32


def _with_references(data: Path, count: int) -> None:
    """Give each digit row `count` references: the digit mirrored, square for the first half
    of the rows and 3:2 for the rest (so their reference latents differ in shape)."""
    (data / "ref").mkdir()
    with (data / "metadata.csv").open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    for index, row in enumerate(rows):
        size = (64, 64) if index < len(rows) // 2 else (96, 64)
        names = []
        for k in range(count):
            name = f"ref/{Path(row['image']).stem}-{k}.png"
            image = Image.open(data / row["image"]).convert("RGB").resize(size)
            (ImageOps.mirror(image) if k == 0 else ImageOps.flip(image)).save(data / name)
            names.append(name)
        row["edit_image"] = names[0] if count == 1 else json.dumps(names)
    with (data / "metadata.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, ["image", "prompt", "edit_image"])
        writer.writeheader()
        writer.writerows(rows)


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Eight captioned digits with one reference each, the same with two, and tiny
    QwenImageEditPipeline / QwenImageEditPlusPipeline folders."""
    root = tmp_path_factory.mktemp("qwen-edit")
    for name, count in (("data", 1), ("data2", 2)):
        write_digits_dataset(root / name, limit=8, size=32)
        _with_references(root / name, count)
    write_tiny_folder("qwenimage_edit", root / "edit")
    write_tiny_folder("qwenimage_edit_plus", root / "plus")
    return root


def job(
    root: Path,
    name: str,
    folder: str = "edit",
    data: str = "data",
    dropout: float = 0.25,
    length: int = 96,
    extra: dict | None = None,
    **train,
):
    """A LoRA job (rank 4, alpha 8) on a tiny edit folder at 64 px, references at tiny areas."""
    pipeline = {"name": "qwenimage_edit", "pretrained": str(root / folder), "resolution": 64}
    pipeline |= {"caption_dropout": dropout, "precision": "fp32", "max_prompt_length": length}
    pipeline |= {"reference_max_pixels": REFERENCE_AREA, "condition_max_pixels": CONDITION_AREA}
    return config_from_dict(
        {
            "job": {"name": name, "seed": 3},
            "pipeline": pipeline,
            "trainable": {"lora_base_model": "transformer", "lora_rank": 4, "lora_alpha": 8},
            "data": {"base_path": str(root / data)},
            "cache": {"url": str(root / f"cache-{name}"), "shard_samples": 4},
            "train": {"batch_size": 2, "max_steps": 2, "log_every": 1, "learning_rate": 1e-3}
            | train,
            "output": {"url": str(root / "out")},
        }
        | (extra or {})
    )


def fixed_step(plan, config, denoiser, rows=(0, 1)):
    """Rows through stage 1 and the per-step units, and one drawn training step."""
    family = plan.family
    base = config.data.base_path
    metadata = load_metadata(base)
    batch = collate_samples([family.load_sample(metadata[r], base) for r in rows])
    frozen = {n: family.build_model(n, ONE_CPU.device) for n in plan.split.models["stage1"]}
    settings = family.settings()
    run_units(plan.v2_units, StepContext(frozen, ONE_CPU.device, settings=settings), batch)
    draws = Draws.shared(torch.Generator().manual_seed(5))
    ctx = StepContext({family.denoiser: denoiser}, ONE_CPU.device, draws, settings)
    run_units(plan.v1_units, ctx, batch)
    return batch, family.training_step(ctx, batch)


def predict(plan, denoiser, step) -> torch.Tensor:
    ctx = StepContext({plan.family.denoiser: denoiser}, ONE_CPU.device)
    with torch.no_grad():
        return plan.family.denoise(ctx, step)


def tiny_areas(monkeypatch) -> None:
    """The pipelines' reference areas set to this test's settings (see edit_pipeline_areas)."""
    from tests.helpers.diffusers_families import edit_pipeline_areas

    edit_pipeline_areas(monkeypatch, REFERENCE_AREA, CONDITION_AREA)


def pipeline_inputs(pipe, prompt: str, images: list) -> dict:
    """What the pipeline gives its transformer at its first step (64 px target)."""
    seen = {}

    def keep(module, args, kwargs):
        seen.setdefault("kwargs", kwargs)

    pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    image = images if len(images) > 1 else images[0]
    pipe(prompt=prompt, image=image, height=64, width=64, num_inference_steps=1,
         output_type="latent", true_cfg_scale=1.0)  # fmt: skip
    return seen["kwargs"]


@pytest.mark.parametrize("folder, data, row", [("plus", "data2", 5), ("edit", "data", 5)])
def test_stage_1_gives_the_transformer_what_the_edit_pipeline_gives_it(
    root, folder, data, row, monkeypatch
):
    """Prompt embeddings (seen with the references) and their mask, the reference tokens after
    the noisy ones and img_shapes equal the pipeline's for the same prompt and images (Plus
    with two 3:2 references, each sized on its own)."""
    import diffusers

    config = job(root, f"layout-{folder}", folder=folder, data=data, dropout=0.0)
    plan = make_plan(config)
    family = plan.family
    cls = getattr(diffusers, family.folder.index["_class_name"])
    pipe = cls.from_pretrained(root / folder, processor=family.processor)
    tiny_areas(monkeypatch)
    _, step = fixed_step(plan, config, pipe.transformer, rows=(row,))
    metadata = load_metadata(config.data.base_path)[row]
    base = Path(config.data.base_path)
    images = [Image.open(base / ref).convert("RGB") for ref in metadata.references]
    theirs = pipeline_inputs(pipe, metadata.prompt, images)
    ours = step.denoiser_kwargs
    mask = ours["encoder_hidden_states_mask"][0].bool()
    text = theirs["encoder_hidden_states"][0]
    assert theirs["encoder_hidden_states_mask"] is None and int(mask.sum()) == text.shape[0]
    torch.testing.assert_close(ours["encoder_hidden_states"][0][mask], text, atol=1e-5, rtol=0)
    assert ours["img_shapes"] == theirs["img_shapes"]
    assert len(ours["img_shapes"][0]) == 1 + len(images)
    tokens = step.target.shape[1]
    assert ours["hidden_states"].shape == theirs["hidden_states"].shape
    torch.testing.assert_close(
        ours["hidden_states"][0, tokens:], theirs["hidden_states"][0, tokens:], atol=1e-5, rtol=0
    )
    assert predict(plan, pipe.transformer, step).shape == step.target.shape


def test_sampling_with_reference_latents_equals_the_plus_pipeline(root, monkeypatch):
    """Given a row's stage-1 conditioning (prompt seen with two references, their latents), the
    family's sampler gives QwenImageEditPlusPipeline's latents for the same prompt, images,
    generator and steps."""
    from diffusers import QwenImageEditPlusPipeline

    from splitstage.pipelines.diffusers.qwenimage_latents import pack

    config = job(root, "plus-sample", folder="plus", data="data2", dropout=0.0)
    plan = make_plan(config)
    family = plan.family
    pipe = QwenImageEditPlusPipeline.from_pretrained(root / "plus", processor=family.processor)
    tiny_areas(monkeypatch)
    base = config.data.base_path
    row = load_metadata(base)[5]
    batch = collate_samples([family.load_sample(row, base)])
    models = {name: getattr(pipe, name) for name in family.model_names}
    ctx = StepContext(models, ONE_CPU.device, settings=family.settings())
    with torch.no_grad():
        run_units(plan.v2_units, ctx, batch)
        names = ("prompt_embeds", "prompt_embeds_mask", *family.reference_slots)
        cond = {name: torch.stack(list(batch[name])) for name in names}
        ours = family.sample(
            ctx, cond, {}, torch.Generator().manual_seed(7), steps=2, guidance=1.0, size=(64, 64)
        )
    images = [Image.open(Path(base) / ref).convert("RGB") for ref in row.references]
    theirs = pipe(
        prompt=row.prompt,
        image=images,
        height=64,
        width=64,
        num_inference_steps=2,
        true_cfg_scale=1.0,
        generator=torch.Generator().manual_seed(7),
        output_type="latent",
    ).images
    torch.testing.assert_close(pack(ours), theirs, atol=1e-4, rtol=1e-4)
    one = cond | {"reference_latents_2": cond["reference_latents_2"][..., :0, :0]}
    with torch.no_grad():  # the second reference left out: other latents
        fewer = family.sample(
            ctx, one, {}, torch.Generator().manual_seed(7), steps=2, guidance=1.0, size=(64, 64)
        )
    assert not torch.allclose(pack(fewer), theirs, atol=1e-4)


def test_split_training_equals_unsplit_and_its_lora_loads_into_the_edit_pipeline(root):
    from diffusers import QwenImageEditPipeline

    config = job(root, "edit-split")
    plan = make_plan(config)
    assert list(plan.split.v2) == ["PromptEncoder", "VAEEncoder", "ReferenceEncoder"]
    assert "reference_latents" in plan.split.boundary_params
    assert preprocess(config, workers=1, progress=False).computed == 8
    report = train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]  # stage 2 never opens the VAE or the images

    unsplit_config = job(root, "edit-unsplit", mode="unsplit")
    unsplit = train(unsplit_config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert unsplit.losses == pytest.approx(report.losses, rel=1e-5)

    stage2 = build_stage2_models(make_plan(config), ONE_CPU)
    trained = stage2.models["transformer"]
    step_no = latest_checkpoint(report.checkpoint_url, clean=False)
    load_checkpoint(report.checkpoint_url, step_no, trained, None, restore_rng=False)
    _, step = fixed_step(plan, config, trained)
    expected = predict(plan, trained, step)
    pipe = QwenImageEditPipeline.from_pretrained(root / "edit", processor=plan.family.processor)
    base = predict(plan, pipe.transformer, step)
    assert not torch.allclose(base, expected, atol=1e-6)  # the LoRA changes the prediction
    pipe.load_lora_weights(Path(report.outputs["transformer"]).parent)
    assert torch.allclose(predict(plan, pipe.transformer, step), expected, atol=2e-5)


def test_plus_trains_on_two_references_per_row_from_the_cache(root):
    """QwenImageEditPlusPipeline rows with two references: both cached (the third slot empty)
    and trained on in stage 2 without the VAE, the text encoder or the images."""
    config = job(root, "plus-split", folder="plus", data="data2")
    plan = make_plan(config)
    slots = ("reference_latents", "reference_latents_2", "reference_latents_3")
    assert set(slots) <= set(plan.split.boundary_params)
    assert preprocess(config, workers=1, progress=False).computed == 8
    report = train(config, run_root=root / "runs", env=ENV, on_line=lambda line: None)
    assert report.updates == 2 and all(math.isfinite(loss) for loss in report.losses)
    assert report.models_loaded == ["transformer"]


def test_prompts_are_cached_at_their_own_length_and_padded_per_batch(root):
    """Stage 1 caches each row's prompt (its references' vision tokens with it) and the empty
    prompt at their own token count, not max_prompt_length; rows batch by their references'
    shape alone, padded to the batch's longest prompt; the transformer predicts for such a
    batch what it predicts for the same batch padded to max_prompt_length."""
    from tests.helpers.diffusers_families import cached_prompt_lengths, padded_to

    config = job(root, "edit-own-length", dropout=0.0)
    assert preprocess(config, workers=1, progress=False).computed == 8
    plan = make_plan(config)
    dataset, keys, lengths = cached_prompt_lengths(plan)
    assert max(lengths.values()) < 96 and len(set(lengths.values())) > 2
    groups = dict(zip(keys, dataset.groups.tolist(), strict=True))
    assert sorted(groups.values()).count(0) == 4 and len(set(groups.values())) == 2

    first = [key for key in keys if groups[key] == 0]
    pair = [min(first, key=lengths.get), max(first, key=lengths.get)]
    assert lengths[pair[0]] < lengths[pair[1]]
    batch = next(dataset.iterate_keys([pair], prefetch=0))
    assert batch["prompt_embeds_mask"].sum(dim=1).tolist() == [lengths[k] for k in pair]
    assert batch["prompt_embeds"].shape[1] == lengths[pair[1]]
    padded = padded_to(plan, batch, 96)  # as stage 1 cached them before
    family = plan.family
    model = family.build_model("transformer", ONE_CPU.device)
    predictions = []
    for inputs in (batch, padded):
        draws = Draws.shared(torch.Generator().manual_seed(1))
        ctx = StepContext({"transformer": model}, ONE_CPU.device, draws, family.settings())
        with torch.no_grad():
            step = family.training_step(ctx, run_units(plan.v1_units, ctx, dict(inputs)))
            predictions.append(family.denoise(ctx, step))
    assert step.denoiser_kwargs["encoder_hidden_states"].shape[1] == 96
    torch.testing.assert_close(predictions[0], predictions[1], atol=1e-5, rtol=0)


def test_the_processor_files_name_the_cache(root):
    """The VL processor decides the prompt embeddings: another image-processor config (pixel
    bounds) is another cache."""
    import json
    import shutil

    other = root / "edit-other-processor"
    shutil.copytree(root / "edit", other)
    path = other / "processor" / "preprocessor_config.json"
    config = json.loads(path.read_text())
    config["size"]["longest_edge"] *= 2  # the most pixels an image is resized to
    path.write_text(json.dumps(config))
    first = make_plan(job(root, "key")).cache_key
    again = make_plan(job(root, "key")).cache_key
    moved = make_plan(job(root, "key", folder="edit-other-processor")).cache_key
    assert first == again != moved


def test_references_of_two_sizes_are_batched_apart(root):
    """Rows whose references differ in size (square, 3:2) are cached in two shape groups."""
    from splitstage.tasks.stage2.batches import RawBatches

    config = job(root, "edit-groups")
    family = make_plan(config).family
    raw = RawBatches(family, 0, 1)
    assert sorted(raw.group_labels().values()) == [4, 4]


def test_rows_that_do_not_fit_are_refused_in_one_line(root):
    import shutil

    plain = root / "plain"
    write_digits_dataset(plain, limit=2, size=32)
    with pytest.raises(
        DataError, match=r"^metadata.csv row 2 has no 'edit_image'.*qwenimage_edit family"
    ):
        preprocess(job(root, "edit-without", data="plain"), workers=1, progress=False)
    # two references for the single-image pipeline: refused, naming the row and the fix
    shutil.rmtree(root / "cache-edit-two", ignore_errors=True)
    with pytest.raises(DataError, match=r"row 2 has 2 reference images: QwenImageEditPipeline"):
        preprocess(job(root, "edit-two", data="data2"), workers=1, progress=False)
    # a prompt and its references' vision tokens past max_prompt_length: refused, not cut
    with pytest.raises(
        ConfigError, match=r"^pipeline.max_prompt_length: metadata.csv row 2 encodes into \d+ "
    ):
        preprocess(job(root, "edit-long", length=8), workers=1, progress=False)
    # validation prompts without reference images: refused before launch, naming the field
    sampled = job(root, "edit-sampled", extra={"validation": {"prompts": ["a digit"]}})
    with pytest.raises(
        ConfigError, match=r"^validation.reference_images: the qwenimage_edit family samples only"
    ):
        preflight(make_plan(sampled))


def test_a_16_bit_reference_keeps_its_pixels():
    """A 16-bit grey reference reaches the pipeline's resizing as 8-bit RGB of its values (PIL's
    own convert would clip it to black)."""
    import io

    import numpy as np

    from splitstage.data.images import open_image
    from splitstage.pipelines.diffusers.qwenimage_edit import as_rgb8

    out = io.BytesIO()
    Image.fromarray(np.full((8, 8), 40000, np.uint16)).save(out, format="PNG")
    image = as_rgb8(open_image(out.getvalue(), "row 2", "ref.png"))
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (156, 156, 156)  # 40000/65535


def test_a_resumed_edit_run_ends_bitwise_where_an_uninterrupted_one_does(root):
    """Nothing of a reference family's step lives outside the checkpoint: 2 updates, then a
    resume to 4, give the losses and the LoRA of 4 updates in one go, bit for bit."""
    from tests.helpers.diffusers_families import assert_resume_is_bitwise

    def plus(max_steps: int):
        return job(root, "plus-resume", folder="plus", data="data2", max_steps=max_steps)

    assert_resume_is_bitwise(plus, root, halt=2, total=4)
