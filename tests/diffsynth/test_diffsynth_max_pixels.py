"""DiffSynth's dynamic resolution (`pipeline.max_pixels`, train.py's `--max_pixels` with height
and width unset) in the diffsynth family, on tiny Qwen-Image files and images of two aspect
ratios: each image sized pixel for pixel as DiffSynth's UnifiedDataset sizes it; the first
update's loss equals train.py's step on the row it trained; bad combinations are refused in one
line before any model loads; the setting enters the cache key."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffsynth.core.data.unified_dataset import UnifiedDataset
from diffsynth.diffusion.loss import FlowMatchSFTLoss
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.index import index_data_set
from splitstage.pipelines.draws import Draws
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.preflight import check_job
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.diffsynth_jobs import ENV, PIPELINES, SEED, fresh, job_document, registered
from tests.helpers.tiny_diffsynth import write_tiny_edit_models, write_tiny_models

NAME = "QwenImagePipeline"
MAX_PIXELS = 2048
# (width, height) -> DiffSynth's size at MAX_PIXELS: 80x40 scales to 64x32 (no crop), 40x72 to
# 33x60, cut to 32x48 (a crop): two aspect ratios, two training sizes.
IMAGES = {"wide.png": (80, 40), "tall.png": (40, 72)}
# What each image pipeline's train.py sets in get_pipeline_inputs besides the data.
TRAIN_PY_CONSTANTS = {
    "QwenImagePipeline": {"edit_image_auto_resize": True, "zero_cond_t": False},
    "ZImagePipeline": {"embedded_guidance": 1.0},
}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two noise images of other aspect ratios with captions, and the tiny Qwen-Image files."""
    root = tmp_path_factory.mktemp("diffsynth_max_pixels")
    data = root / "data"
    data.mkdir()
    lines = ["image,prompt"]
    for seed, (name, (width, height)) in enumerate(IMAGES.items()):
        pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3))
        Image.fromarray(pixels.astype(np.uint8)).save(data / name)
        lines.append(f"{name},a {name[:-4]} picture of noise")
    (data / "metadata.csv").write_text("\n".join(lines) + "\n")
    tiny_models(root, NAME)
    return root


def tiny_models(root: Path, name: str) -> None:
    """The tiny files of pipeline `name` under root/name (written once)."""
    if not (root / name / "info.json").exists():
        info = write_tiny_models(name, root / name)
        (root / name / "info.json").write_text(json.dumps(info))


def dynamic_document(root: Path, max_pixels: int = MAX_PIXELS, name: str = NAME, **train) -> dict:
    """The pipeline's LoRA job with max_pixels in place of height and width."""
    document = job_document(root, name, **train)
    pipeline = {k: v for k, v in document["pipeline"].items() if k not in ("height", "width")}
    document["pipeline"] = pipeline | {"max_pixels": max_pixels}
    return document


def theirs(root: Path) -> UnifiedDataset:
    """DiffSynth's train.py data set with `--max_pixels MAX_PIXELS` (no --height / --width)."""
    data = root / "data"
    return UnifiedDataset(
        base_path=str(data),
        metadata_path=str(data / "metadata.csv"),
        data_file_keys=["image"],
        main_data_operator=UnifiedDataset.default_image_operator(
            base_path=str(data), max_pixels=MAX_PIXELS, height=None, width=None
        ),
    )


def their_row(dataset: UnifiedDataset, prompt: str) -> dict:
    """DiffSynth's loaded row with this caption (the captions differ)."""
    return next(dataset[i] for i in range(len(dataset)) if dataset[i]["prompt"] == prompt)


def reference_loss(name: str, pipe, image: Image.Image, prompt: str, key: str) -> float:
    """train.py's step on one row: its inputs (height and width from the image, the pipeline's
    constants of get_pipeline_inputs), its units, FlowMatchSFTLoss with the global RNG seeded as
    splitstage seeds this sample (epoch 0)."""
    shared = {
        "input_image": image,
        "height": image.size[1],
        "width": image.size[0],
        "cfg_scale": 1,
        "rand_device": pipe.device,
        "use_gradient_checkpointing": False,
        "use_gradient_checkpointing_offload": False,
        **TRAIN_PY_CONSTANTS[name],
    }
    inputs = (shared, {"prompt": prompt}, {"negative_prompt": ""})
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
        torch.manual_seed(int(Draws.per_sample(SEED, [key], epoch=0).randint(2**62, 1)))
        return float(FlowMatchSFTLoss(pipe, **inputs[0], **inputs[1]))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_each_image_is_sized_as_train_py_sizes_it_with_max_pixels(root, name):
    """Pixel for pixel DiffSynth's data operator with --max_pixels (its image operator; Wan's
    video operator, which gives an image row as a clip of one frame); height and width of the
    sample are its image's, two sizes for two aspect ratios; the plan's size checks pass."""
    tiny_models(root, name)
    config = config_from_dict(dynamic_document(root, name=name))
    plan = make_plan(config)
    check_job(plan)
    video = name == "WanVideoPipeline"
    default = (
        UnifiedDataset.default_video_operator if video else UnifiedDataset.default_image_operator
    )
    operator = default(base_path=str(root / "data"), max_pixels=MAX_PIXELS, height=None, width=None)
    sizes = set()
    for row in index_data_set(config).rows:
        sample = plan.family.load_sample(row, config.data.base_path)
        ours = sample["input_video"] if video else [sample["input_image"]]
        theirs = operator(row.image) if video else [operator(row.image)]
        assert len(ours) == len(theirs) == 1
        assert ours[0].size == theirs[0].size
        assert np.array_equal(np.asarray(ours[0]), np.asarray(theirs[0])), row.line
        assert (sample["width"], sample["height"]) == theirs[0].size
        sizes.add(theirs[0].size)
    assert sizes == {(64, 32), (32, 48)}


@pytest.mark.parametrize("name", list(TRAIN_PY_CONSTANTS))
def test_max_pixels_training_matches_train_py_on_the_row_it_trained(root, name):
    """preprocess -> torchrun (1 rank): the first update's loss is train.py's step with
    --max_pixels on the row it trained (its size from that image)."""
    tiny_models(root, name)
    config = config_from_dict(dynamic_document(root, name=name, max_steps=1))
    report = preprocess(config, progress=False)
    assert report.computed == 2
    result = train(config, run_root=root / "runs", env=ENV)
    metrics = read_metrics(Path(result.run_dir))
    assert len(metrics) == 1 and metrics[0]["loss"] > 0
    info = json.loads((root / name / "info.json").read_text())
    with registered([info]):
        pipe = fresh(name, info)
    dataset, data = theirs(root), index_data_set(config)
    expected = []
    for key, row in zip(data.keys, data.rows, strict=True):
        item = their_row(dataset, row.prompt)
        expected.append(reference_loss(name, pipe, item["image"], item["prompt"], key))
    first = metrics[0]["loss"]
    assert min(abs(first - e) for e in expected) <= 1e-6 * max(1.0, abs(first)), (first, expected)
    assert abs(expected[0] - expected[1]) > 1e-6  # the rows are told apart


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"height": 32}, "pipeline: height: pipeline.max_pixels sizes each image by its own"),
        ({"width": 32}, "pipeline: width: pipeline.max_pixels sizes each image by its own"),
        ({"max_pixels": 100}, "pipeline.max_pixels: Input should be greater than or equal to 256"),
    ],
)
def test_a_size_beside_max_pixels_is_refused_in_one_line(root, change, expected):
    """train.py ignores height or width when either is unset: a fixed side beside max_pixels
    is refused naming it; max_pixels under one 16 x 16 patch too."""
    document = dynamic_document(root)
    document["pipeline"] |= change
    with pytest.raises(ValueError) as error:
        config_from_dict(document)
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def test_no_size_at_all_is_refused_naming_the_fields(root):
    """Height and width unset without max_pixels: no size to train at, one line naming them."""
    document = job_document(root, NAME)
    document["pipeline"] = {**document["pipeline"], "height": None}
    with pytest.raises(ValueError) as error:
        config_from_dict(document)
    assert "pipeline.height and pipeline.width" in str(error.value)
    assert "pipeline.max_pixels" in str(error.value)


def test_max_pixels_enters_the_cache_key_and_fixed_sizes_keep_theirs(root):
    """Another max_pixels is another cache; a fixed-size job's settings do not name it."""
    one = make_plan(config_from_dict(dynamic_document(root)))
    other = make_plan(config_from_dict(dynamic_document(root, max_pixels=4096)))
    assert one.cache_key != other.cache_key
    assert one.family.stage1_settings()["max_pixels"] == MAX_PIXELS
    fixed = make_plan(config_from_dict(job_document(root, NAME)))
    assert "max_pixels" not in fixed.family.stage1_settings()
    assert fixed.cache_key not in (one.cache_key, other.cache_key)


def test_reference_images_are_sized_each_at_its_own_aspect_ratio(root, tmp_path):
    """Qwen-Image-Edit rows with max_pixels: each `edit_image` sized by itself, as train.py's
    data operator sizes every data file key, pixel for pixel DiffSynth's UnifiedDataset."""
    data = root / "data"
    pixels = np.random.default_rng(7).integers(0, 256, (40, 40, 3)).astype(np.uint8)
    Image.fromarray(pixels).save(data / "square.png")
    rows = [("wide.png", "square.png"), ("tall.png", ["wide.png", "square.png"])]
    metadata = tmp_path / "metadata.jsonl"
    lines = [json.dumps({"image": i, "prompt": f"edit {i}", "edit_image": e}) for i, e in rows]
    metadata.write_text("\n".join(lines) + "\n")
    info = write_tiny_edit_models(tmp_path / NAME)
    document = dynamic_document(root)
    document["pipeline"] |= info
    document["data"]["metadata_path"] = str(metadata)
    config = config_from_dict(document)
    family = make_plan(config).family
    dataset = UnifiedDataset(
        base_path=str(data),
        metadata_path=str(metadata),
        data_file_keys=["image", "edit_image"],
        main_data_operator=UnifiedDataset.default_image_operator(
            base_path=str(data), max_pixels=MAX_PIXELS, height=None, width=None
        ),
    )
    sizes = set()
    for row in index_data_set(config).rows:
        ours = family.load_sample(row, config.data.base_path)["edit_image"]
        theirs = their_row(dataset, row.prompt)["edit_image"]
        assert type(ours) is type(theirs)
        pairs = list(zip(ours, theirs, strict=True)) if isinstance(ours, list) else [(ours, theirs)]
        for a, b in pairs:
            assert a.size == b.size and np.array_equal(np.asarray(a), np.asarray(b)), row.line
            sizes.add(b.size)
    assert sizes == {(64, 32), (32, 32)}


def test_files_needing_other_multiples_than_16_are_refused_with_max_pixels(root):
    """train.py's dynamic sizes are multiples of 16: a pipeline whose files need 32 (Wan 2.2
    TI2V-5B's VAE) would get sizes its ShapeChecker rounds away from the image; refused before
    any model loads, naming max_pixels and what to set instead."""
    family = make_plan(config_from_dict(dynamic_document(root))).family
    family.meta_pipe.height_division_factor = 32  # as those files set it
    with pytest.raises(ConfigError) as error:
        family.check_component_shapes()
    message = str(error.value)
    assert message.startswith("pipeline.max_pixels: ") and "multiples of 32" in message, message
    assert "set pipeline.height and pipeline.width" in message and "\n" not in message
