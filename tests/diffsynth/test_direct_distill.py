"""Direct distillation (`train.task = "direct_distill"`) through DiffSynth's DirectDistillLoss.

Tiny Qwen-Image; rows carry the teacher's `seed` and `num_inference_steps` (DiffSynth's metadata
columns). The plan caches the starting noise with the image latents (no unit is per-step);
preprocess -> split training (real torchrun) -> export; the first update's loss equals DiffSynth's
own direct-distill step on the same row (its units, then DirectDistillLoss); the LoRA loads with
`pipe.load_lora`. A family without the task refuses it in one line before anything runs.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from diffsynth.configs.model_configs import MODEL_CONFIGS
from diffsynth.core.loader import hash_model_file
from diffsynth.diffusion.loss import DirectDistillLoss

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import index_data_set
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.pipelines.runtime import StepContext, collate_samples, run_units
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.demo_job import demo_sections
from tests.helpers.diffsynth_jobs import ENV, fresh, job_document, output
from tests.helpers.tiny_diffsynth import write_tiny_models

NAME = "QwenImagePipeline"
STEPS = 2  # the student's few-step loop


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Two digits with DiffSynth's direct-distill columns, and the tiny Qwen-Image models."""
    root = tmp_path_factory.mktemp("distill")
    write_digits_dataset(root / "data", limit=2, size=32)
    with (root / "data" / "metadata.csv").open(encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    with (root / "data" / "distill.jsonl").open("w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            teacher = {"seed": 100 + i, "num_inference_steps": STEPS, "rand_device": "cpu"}
            f.write(json.dumps(row | teacher | {"cfg_scale": 1}) + "\n")
    info = write_tiny_models(NAME, root / NAME)
    (root / NAME / "info.json").write_text(json.dumps(info))
    return root


@pytest.fixture
def registered(root):
    """The tiny models in DiffSynth's MODEL_CONFIGS, then out."""
    added = []
    for entry in json.loads((root / NAME / "info.json").read_text())["register_models"]:
        fields = {k: v for k, v in entry.items() if k != "path"}
        added.append({"model_hash": hash_model_file(entry["path"]), **fields})
    MODEL_CONFIGS.extend(added)
    yield
    for entry in added:
        MODEL_CONFIGS.remove(entry)


def distill_job(root: Path):
    """The source text's Qwen-Image LoRA job, as direct distillation on the seeded rows."""
    document = job_document(root, NAME, task="direct_distill", max_steps=1)
    document["data"]["metadata_path"] = str(root / "data" / "distill.jsonl")
    document["cache"]["url"] = str(root / "cache")
    document["output"]["url"] = str(root / "out")
    return config_from_dict(document)


def reference_loss(config, info: dict, row) -> float:
    """DiffSynth's own direct-distill step on one row: its units, then DirectDistillLoss."""
    sample = make_plan(config).family.load_sample(row, config.data.base_path)
    posi = {"prompt": sample.pop("prompt")}
    nega = {"negative_prompt": sample.pop("negative_prompt")}
    inputs = ({k: v for k, v in sample.items() if v is not None}, posi, nega)
    pipe = fresh(NAME, info)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
        return float(DirectDistillLoss(pipe, **inputs[0], **inputs[1]))


def test_plan_caches_the_seeded_noise_and_runs_no_unit_per_step(root):
    config = distill_job(root)
    plan = make_plan(config)
    assert plan.split.v1 == ()  # no unit per-step: the noise follows from the row's seed
    assert {"latents", "input_latents", "prompt_emb", "num_inference_steps"} <= set(
        plan.split.boundary_params
    )
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    sft = make_plan(config_from_dict(job_document(root, NAME)))
    assert "latents" not in sft.split.boundary_params  # sft draws its noise every step
    assert sft.cache_key != plan.cache_key


def test_direct_distill_matches_diffsynth_and_exports_a_lora_it_loads(root, registered):
    config = distill_job(root)
    info = json.loads((root / NAME / "info.json").read_text())
    report = preprocess(config, progress=False)
    assert report.computed == 2
    result = train(config, run_root=root / "runs", env=ENV)
    metrics = read_metrics(Path(result.run_dir))
    first = metrics[0]["loss"]
    data = index_data_set(config)
    expected = [reference_loss(config, info, row) for row in data.rows]
    assert expected[0] != expected[1]  # the rows' seeds give different students' images
    assert min(abs(first - e) for e in expected) <= 1e-6 * max(1.0, abs(first)), (first, expected)
    pipe = fresh(NAME, info)
    before = output(pipe, NAME)
    pipe.load_lora(pipe.dit, str(result.outputs["dit"]))
    assert not torch.equal(before, output(pipe, NAME))


def test_a_row_without_the_teachers_seed_is_one_line(root, tmp_path):
    config = distill_job(root)
    row = index_data_set(config).rows[0]
    row.extras.pop("seed")
    with pytest.raises(ConfigError, match="needs the column\\(s\\) seed"):
        make_plan(config).family.load_sample(row, config.data.base_path)


def test_row_values_replace_train_pys_and_rand_device_follows_the_pipeline(root, registered):
    """As DiffSynth's train.py: `rand_device` is the pipeline's device unless the row gives
    it, and a row's extra inputs (cfg_scale) replace train.py's fixed values, never the other
    way round; stage 1's cached starting noise equals DiffSynth's own units' on that row."""
    config = distill_job(root)
    info = json.loads((root / NAME / "info.json").read_text())
    plan = make_plan(config)
    family = plan.family
    row = index_data_set(config).rows[0]
    row.extras.pop("rand_device")
    row.extras["cfg_scale"] = 3.0
    sample = family.load_sample(row, config.data.base_path)
    assert sample["rand_device"] is None and sample["cfg_scale"] == 3.0
    batch = collate_samples([sample])
    cpu = torch.device("cpu")
    frozen = {name: family.build_model(name, cpu) for name in plan.split.models["stage1"]}
    with torch.no_grad():
        run_units(plan.v2_units, StepContext(frozen, cpu, settings=family.settings()), batch)
    shared = family.units_of.session.triples[0].shared
    assert shared["cfg_scale"] == 3.0  # the row's, not train.py's 1
    assert str(shared["rand_device"]) == str(family.pipe.device) == "cpu"

    pipe = fresh(NAME, info)  # DiffSynth's train.py: rand_device = pipe.device, row over it
    posi = {"prompt": sample["prompt"]}
    nega = {"negative_prompt": sample["negative_prompt"]}
    given = {k: v for k, v in sample.items() if v is not None and k not in ("prompt",)}
    inputs = ({**given, "rand_device": pipe.device}, posi, nega)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
    assert torch.equal(batch["latents"][0], inputs[0]["latents"][0])


def test_a_family_without_direct_distill_refuses_it(tmp_path):
    weights = build_demo_weights(tmp_path / "weights")
    document = {
        "job": {"name": "demo"},
        "pipeline": {"name": "demo", "image_size": 32},
        **demo_sections(weights),
        "data": {"base_path": str(tmp_path)},
        "cache": {"url": str(tmp_path / "cache")},
        "train": {"task": "direct_distill"},
        "output": {"url": str(tmp_path / "out")},
    }
    with pytest.raises(ConfigError, match="train.task='direct_distill': the demo family trains"):
        make_plan(config_from_dict(document))
