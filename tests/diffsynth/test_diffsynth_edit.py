"""Qwen-Image-Edit through the diffsynth family: QwenImagePipeline with `edit_image` rows.

Tiny Qwen-Image-Edit files (the DiT, VAE, a Qwen2.5-VL text encoder knowing the vision tokens,
its processor): our plan equals DiffSynth's `split_pipeline_units`, the edit units in stage 1;
preprocess -> split training (real torchrun, 1 rank) -> export; the first update's loss equals
DiffSynth's own train.py step with `--extra_inputs edit_image` on the same row (its
UnifiedDataset reading the same metadata, its units, FlowMatchSFTLoss); a fresh pipeline
`load_lora`s the export. Rows the job cannot train are refused in one line before any model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from diffsynth.core.data.unified_dataset import UnifiedDataset
from diffsynth.diffusion.loss import FlowMatchSFTLoss
from PIL import Image
from safetensors.torch import load_file

from splitstage.cli import main
from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import index_data_set
from splitstage.pipelines.diffsynth.loader import pipeline_class
from splitstage.pipelines.draws import Draws
from splitstage.splitter import UserError
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.diffsynth_jobs import ENV, SEED, job_document, output, registered
from tests.helpers.tiny_diffsynth import write_tiny_edit_models, write_tiny_models
from tests.helpers.toml_job import toml

NAME = "QwenImagePipeline"
# Row 1: one reference (DiffSynth's single-image template), row 2: two (its multi-image one);
# references in other sizes than the target, so DiffSynth's crop-and-resize runs on them.
REFERENCES = [["refs/a.png"], ["refs/b.png", "refs/c.png"]]


def noise_image(path: Path, width: int, height: int, seed: int) -> None:
    """A seeded noise image (any resize or crop difference shows)."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3)).astype(np.uint8)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(pixels).save(path)


def write_metadata(data: Path, references: list[list[str]]) -> Path:
    """metadata.jsonl of the digits with `edit_image` (one path, or a list of several)."""
    lines = (data / "metadata.csv").read_text().splitlines()[1:]
    path = data / "metadata.jsonl"
    with path.open("w") as f:
        for line, refs in zip(lines, references, strict=True):
            image, prompt = line.split(",", 1)
            edit = refs[0] if len(refs) == 1 else refs
            f.write(json.dumps({"image": image, "prompt": prompt, "edit_image": edit}) + "\n")
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two digits with reference images, and the tiny Qwen-Image-Edit files."""
    root = tmp_path_factory.mktemp("diffsynth_edit")
    write_digits_dataset(root / "data", limit=2, size=32)
    for seed, (name, size) in enumerate({"a": (48, 40), "b": (40, 56), "c": (32, 32)}.items()):
        noise_image(root / "data" / "refs" / f"{name}.png", *size, seed=seed)
    write_metadata(root / "data", REFERENCES)
    info = write_tiny_edit_models(root / NAME)
    (root / NAME / "info.json").write_text(json.dumps(info))
    return root


def edit_document(root: Path, **train) -> dict:
    """The diffsynth Qwen-Image LoRA job (the source text's targets) on the edit files and rows."""
    document = job_document(root, NAME, **train)
    document["data"]["metadata_path"] = str(root / "data" / "metadata.jsonl")
    return document


def info_of(root: Path) -> dict:
    return json.loads((root / NAME / "info.json").read_text())


def fresh(info: dict):
    """DiffSynth's own QwenImagePipeline from the same files, tokenizer and processor, as
    train.py's QwenImageTrainingModule loads it, in training mode."""
    from diffsynth.core import ModelConfig

    pipe = pipeline_class(type("G", (), {"pipeline_class": NAME})()).from_pretrained(
        torch_dtype=torch.bfloat16,
        device="cpu",
        model_configs=[ModelConfig(path=p) for p in info["model_paths"]],
        tokenizer_config=ModelConfig(path=info["tokenizer_path"]),
        processor_config=ModelConfig(path=info["processor_path"]),
    )
    pipe.scheduler.set_timesteps(1000, training=True)
    return pipe


def reference_loss(root: Path, pipe, index: int, key: str, zero_cond_t: bool = False) -> float:
    """DiffSynth's train.py step with `--extra_inputs edit_image --height 32 --width 32
    --data_file_keys image,edit_image` on row `index`: its UnifiedDataset loads the row, its
    forward_preprocess builds the inputs and runs every unit, then FlowMatchSFTLoss, the global
    RNG seeded as splitstage seeds its draw for this sample (epoch 0); `--zero_cond_t` as given."""
    data = root / "data"
    dataset = UnifiedDataset(
        base_path=str(data),
        metadata_path=str(data / "metadata.jsonl"),
        data_file_keys=["image", "edit_image"],
        main_data_operator=UnifiedDataset.default_image_operator(
            base_path=str(data), height=32, width=32
        ),
    )
    row = dataset[index]
    posi, nega = {"prompt": row["prompt"]}, {"negative_prompt": ""}
    shared = {
        "input_image": row["image"],
        "height": row["image"].size[1],
        "width": row["image"].size[0],
        "cfg_scale": 1,
        "rand_device": pipe.device,
        "use_gradient_checkpointing": False,
        "use_gradient_checkpointing_offload": False,
        "edit_image_auto_resize": True,
        "zero_cond_t": zero_cond_t,  # --zero_cond_t
        "edit_image": row["edit_image"],  # parse_extra_inputs
    }
    inputs = (shared, posi, nega)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
        torch.manual_seed(int(Draws.per_sample(SEED, [key], epoch=0).randint(2**62, 1)))
        return float(FlowMatchSFTLoss(pipe, **inputs[0], **inputs[1]))


def test_plan_equals_diffsynths_split_with_the_edit_units_in_stage1(root):
    """The edit image embedder (VAE) and the prompt embedder's edit branch (text encoder with
    the processor) are V2, as DiffSynth's `split_pipeline_units(["dit"])` puts them; stage 2
    reads the reference images' latents from the cache."""
    plan = make_plan(config_from_dict(edit_document(root)))
    v1, v2 = pipeline_class(plan.config.pipeline)(device="cpu").split_pipeline_units(["dit"])
    assert list(plan.split.v1) == [type(u).__name__ for u in v1] == []
    assert list(plan.split.v2) == [type(u).__name__ for u in v2]
    assert {"QwenImageUnit_EditImageEmbedder", "QwenImageUnit_PromptEmbedder"} <= set(plan.split.v2)
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert {"edit_latents", "prompt_emb", "input_latents"} <= set(plan.split.boundary_params)
    assert "edit_image" not in plan.split.boundary_params  # PIL images stay in stage 1


@pytest.mark.parametrize("as_list", [False, True])
def test_reference_images_reach_the_units_as_train_py_hands_them(root, tmp_path, as_list):
    """`edit_image` as DiffSynth's UnifiedDataset gives it to forward_preprocess, pixel for
    pixel: one path as one image, a list as a list; with pipeline.edit_image_list one reference
    goes as DiffSynth hands a JSON list of one path. The setting changes the cache key."""
    document = edit_document(root)
    document["pipeline"]["edit_image_list"] = as_list
    config = config_from_dict(document)
    plan = make_plan(config)
    theirs_metadata = tmp_path / "metadata.jsonl"
    lines = (root / "data" / "metadata.jsonl").read_text().splitlines()
    first = json.loads(lines[0])
    first["edit_image"] = [first["edit_image"]] if as_list else first["edit_image"]
    theirs_metadata.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    data = root / "data"
    dataset = UnifiedDataset(
        base_path=str(data),
        metadata_path=str(theirs_metadata),
        data_file_keys=["image", "edit_image"],
        main_data_operator=UnifiedDataset.default_image_operator(
            base_path=str(data), height=32, width=32
        ),
    )
    shapes = []
    for row in index_data_set(config).rows:
        ours = plan.family.load_sample(row, config.data.base_path)["edit_image"]
        theirs = dataset[row.line - 1]["edit_image"]
        assert type(ours) is type(theirs), (row.line, type(ours), type(theirs))
        pairs = list(zip(ours, theirs, strict=True)) if isinstance(ours, list) else [(ours, theirs)]
        assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in pairs), row.line
        shapes.append(len(pairs))
    assert sorted(shapes) == [1, 2]
    other = {**document, "pipeline": {**document["pipeline"], "edit_image_list": not as_list}}
    assert make_plan(config_from_dict(other)).cache_key != plan.cache_key


def test_edit_training_matches_diffsynths_train_py_and_exports_a_lora_it_loads(root):
    """preprocess -> torchrun (1 rank): the first update's loss is DiffSynth's own step on the
    row it trained (references loaded, sized and encoded as train.py does); the exported LoRA
    loads into a fresh DiffSynth pipeline and changes its output; a changed reference image is
    a new sample."""
    info = info_of(root)
    config = config_from_dict(edit_document(root))
    report = preprocess(config, progress=False)
    assert report.computed == 2
    result = train(config, run_root=root / "runs", env=ENV)
    metrics = read_metrics(Path(result.run_dir))
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)
    with registered([info]):
        pipe = fresh(info)
    data = index_data_set(config)
    assert sorted(len(r.references) for r in data.rows) == [1, 2]
    # The first update trained on the first key of the epoch order: find which row it was
    # (UnifiedDataset's index i is the metadata's line i + 1).
    expected = [reference_loss(root, pipe, r.line - 1, k) for k, r in zip(data.keys, data.rows)]
    first = metrics[0]["loss"]
    assert min(abs(first - e) for e in expected) <= 1e-6 * max(1.0, abs(first)), (first, expected)
    lora = Path(result.outputs["dit"])
    assert load_file(lora) and not any(k.startswith("pipe.") for k in load_file(lora))
    before = output(pipe, NAME)
    pipe.load_lora(pipe.dit, str(lora))
    assert not torch.equal(before, output(pipe, NAME))
    # The sample key covers the references' content: a replaced one re-encodes its row alone.
    noise_image(root / "data" / "refs" / "c.png", 32, 32, seed=99)
    try:
        again = preprocess(config_from_dict(edit_document(root)), progress=False)
    finally:
        noise_image(root / "data" / "refs" / "c.png", 32, 32, seed=2)
    assert (again.samples, again.computed, again.reused) == (2, 1, 1), again


def test_zero_cond_t_reaches_the_loss_as_train_py_gives_it(root):
    """`zero_cond_t = true` (Qwen-Image-Edit-2511; train.py's --zero_cond_t) trains from the
    same cache: the first update's loss is train.py's step with it on, not the one without."""
    document = edit_document(root, max_steps=1)
    document["pipeline"]["zero_cond_t"] = True
    document["output"]["url"] = str(root / "out-zero-cond-t")  # a run of its own, not a resume
    config = config_from_dict(document)
    assert make_plan(config).cache_key == make_plan(config_from_dict(edit_document(root))).cache_key
    preprocess(config, progress=False)
    result = train(config, run_root=root / "runs-zero-cond-t", env=ENV)
    first = read_metrics(Path(result.run_dir))[0]["loss"]
    with registered([info_of(root)]):
        pipe = fresh(info_of(root))
    data = index_data_set(config)
    rows = [(r.line - 1, k) for k, r in zip(data.keys, data.rows)]
    on = [reference_loss(root, pipe, i, k, zero_cond_t=True) for i, k in rows]
    off = [reference_loss(root, pipe, i, k) for i, k in rows]
    assert min(abs(first - e) for e in on) <= 1e-6 * max(1.0, abs(first)), (first, on)
    assert min(abs(first - e) for e in off) > 1e-4 * max(1.0, abs(first)), (first, off)


def refused(tmp_path: Path, document: dict, capsys) -> str:
    """`splitstage validate` of the job: exit 2 and the one line it printed (no traceback)."""
    path = tmp_path / "job.toml"
    path.write_text(toml(document))
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


def test_rows_the_job_cannot_train_are_refused_in_one_line(root, tmp_path, capsys):
    """Z-Image has no edit units: rows with edit_image are refused, naming the row and the
    pipeline class that takes them. A Qwen-Image edit job without the processor folder, or with
    a row lacking its reference, is refused before any model loads."""
    zimage = write_tiny_models("ZImagePipeline", tmp_path / "ZImagePipeline")
    (tmp_path / "ZImagePipeline" / "info.json").write_text(json.dumps(zimage))
    document = job_document(tmp_path, "ZImagePipeline")
    document["data"] = edit_document(root)["data"]
    err = refused(tmp_path, document, capsys)
    assert "metadata.jsonl row 1 has 'edit_image'" in err and "'QwenImagePipeline'" in err, err

    without = edit_document(root)
    del without["pipeline"]["processor_path"]
    err = refused(tmp_path, without, capsys)
    assert err.count("pipeline.processor_path") == 2 and "row 1 has 'edit_image'" in err, err

    mixed = tmp_path / "mixed.jsonl"
    lines = (root / "data" / "metadata.jsonl").read_text().splitlines()
    plain = {k: v for k, v in json.loads(lines[1]).items() if k != "edit_image"}
    mixed.write_text(lines[0] + "\n" + json.dumps(plain) + "\n")
    document = edit_document(root)
    document["data"]["metadata_path"] = str(mixed)
    err = refused(tmp_path, document, capsys)
    assert "mixed.jsonl row 2 has no 'edit_image'" in err, err


def test_edit_settings_are_refused_for_a_pipeline_without_edit_units(root, tmp_path):
    """A processor folder, edit_image_list or zero_cond_t for Z-Image is a config mistake,
    named by field."""
    zimage = write_tiny_models("ZImagePipeline", tmp_path / "ZImagePipeline")
    (tmp_path / "ZImagePipeline" / "info.json").write_text(json.dumps(zimage))
    document = job_document(tmp_path, "ZImagePipeline")
    document["pipeline"]["processor_path"] = info_of(root)["processor_path"]
    with pytest.raises(UserError) as error:
        config_from_dict(document)
    assert "processor_path: ZImagePipeline encodes no reference images" in str(error.value)
    del document["pipeline"]["processor_path"]
    document["pipeline"]["edit_image_list"] = True
    with pytest.raises(UserError) as error:
        config_from_dict(document)
    assert "edit_image_list: ZImagePipeline encodes no reference images" in str(error.value)
    del document["pipeline"]["edit_image_list"]
    document["pipeline"]["zero_cond_t"] = True
    with pytest.raises(UserError) as error:
        config_from_dict(document)
    assert "zero_cond_t: ZImagePipeline has no zero_cond_t" in str(error.value)


def test_a_resumed_edit_run_ends_bitwise_where_an_uninterrupted_one_does(root):
    """The source text's LoRA targets include the last block's text stream, which no output
    reads (no gradient, no optimizer state in a checkpoint): 1 update, then a resume to 2, gives
    the losses and LoRA of 2 updates in one go, bit for bit."""

    def run(name: str, max_steps: int, lines: list[str] | None = None):
        document = edit_document(root, max_steps=max_steps)
        document["output"]["url"] = str(root / f"out-{name}")
        config = config_from_dict(document)
        preprocess(config, progress=False)
        on_line = lines.append if lines is not None else (lambda line: None)
        return train(config, run_id=name, run_root=root / "runs", env=ENV, on_line=on_line)

    straight = run("straight", 2)
    first = run("resumed", 1)
    lines: list[str] = []
    resumed = run("resumed", 2, lines)
    assert any("resumed from checkpoint step 1" in line for line in lines), lines[-5:]
    assert first.losses + resumed.losses[-1:] == straight.losses
    ours, theirs = load_file(resumed.outputs["dit"]), load_file(straight.outputs["dit"])
    assert set(ours) == set(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
