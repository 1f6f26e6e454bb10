"""The diffsynth family end to end with tiny models through DiffSynth-Studio's real loader.

Per pipeline (Z-Image, Wan 2.1 text-to-video, Qwen-Image): our plan equals DiffSynth's
`split_pipeline_units`; preprocess -> split training (real torchrun, gloo) -> export; a fresh
pipeline `load_lora`s the export and its output changes; the first update's loss equals
DiffSynth's own unsplit training step (its units through its runner, then FlowMatchSFTLoss) on
the same sample, seed and timestep.
"""

from __future__ import annotations

import gc
import json
import re
from pathlib import Path

import pytest
import torch
from diffsynth.configs.model_configs import MODEL_CONFIGS
from diffsynth.core.loader import hash_model_file
from diffsynth.diffusion.loss import FlowMatchSFTLoss
from safetensors.torch import load_file

from splitstage.cli import main
from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import index_data_set
from splitstage.pipelines.diffsynth.loader import pipeline_class
from splitstage.pipelines.draws import Draws
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.launch.launcher import train
from splitstage.tasks.stage1.preprocess import preprocess
from splitstage.tasks.stage2.distributed import DistInfo
from splitstage.tasks.stage2.models import build_stage2_models
from splitstage.tasks.stage2.run_records import read_metrics
from tests.helpers.diffsynth_jobs import (
    ENV,
    LORA,
    PIPELINES,
    SEED,
    SOURCE_TEXT_TARGETS,
    fresh,
    job,
    job_document,
    output,
)
from tests.helpers.tiny_diffsynth import nan_filled_empty, write_tiny_models
from tests.helpers.toml_job import toml
from tests.helpers.weight_loads import weight_loads


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A captioned data set (2 digits) and the tiny models of each pipeline."""
    root = tmp_path_factory.mktemp("diffsynth")
    write_digits_dataset(root / "data", limit=2, size=32)
    for name in PIPELINES:
        info = write_tiny_models(name, root / name)
        (root / name / "info.json").write_text(json.dumps(info))
    return root


@pytest.fixture
def registered(root):
    """The tiny models in DiffSynth's MODEL_CONFIGS (hash computed from each file), then out."""
    added = []
    for name in PIPELINES:
        for entry in json.loads((root / name / "info.json").read_text())["register_models"]:
            fields = {k: v for k, v in entry.items() if k != "path"}
            added.append({"model_hash": hash_model_file(entry["path"]), **fields})
    MODEL_CONFIGS.extend(added)
    yield
    for entry in added:
        MODEL_CONFIGS.remove(entry)


def reference_loss(config, name: str, info: dict, key: str, row: dict) -> float:
    """DiffSynth's unsplit training step on one row: its units over shared/posi/nega, then its
    loss, with the global RNG seeded as splitstage seeds its own draw for this sample (epoch 0)."""
    plan = make_plan(config)
    family = plan.family
    sample = family.load_sample(row, config.data.base_path)
    posi = {"prompt": sample.pop("prompt")}
    nega = {"negative_prompt": sample.pop("negative_prompt")}
    shared = {k: v for k, v in sample.items() if v is not None}
    pipe = fresh(name, info)
    inputs = (shared, posi, nega)
    with torch.no_grad():
        for unit in pipe.units:
            inputs = pipe.unit_runner(unit, pipe, *inputs)
    torch.manual_seed(int(Draws.per_sample(SEED, [key], epoch=0).randint(2**62, 1)))
    with torch.no_grad():
        return float(FlowMatchSFTLoss(pipe, **inputs[0], **inputs[1]))


def loaded_files(text: str) -> set[str]:
    """The files DiffSynth's loader logged `Loading models from: "<file>"` for."""
    return set(re.findall(r'Loading models from: "([^"]+)"', text))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_plan_equals_diffsynths_split(root, name):
    config = job(root, name)
    plan = make_plan(config)
    pipe = pipeline_class(config.pipeline)(device="cpu")
    v1, v2 = pipe.split_pipeline_units(["dit"])
    assert list(plan.split.v1) == [type(u).__name__ for u in v1]
    assert list(plan.split.v2) == [type(u).__name__ for u in v2]
    assert plan.split.models["stage1"] and "dit" not in plan.split.models["stage1"]


def test_qwen_image_job_is_the_source_texts_three_commands(root):
    """The source text's Qwen-Image LoRA as one job: `--lora_base_model "dit"`, its 12 targets,
    `--lora_rank 32`, `--remove_prefix_in_ckpt "pipe.dit."`. The split is DiffSynth's
    `split_pipeline_units(["dit"])` (every unit in stage 1); stage 1 loads what `sft:data_process`
    keeps (`--offload_models` the transformer), stage 2 what `sft:train` keeps (text encoder and
    VAE offloaded). Training, parity and export: the QwenImagePipeline cases above."""
    name = "QwenImagePipeline"
    config = job(root, name)
    plan = make_plan(config)
    assert config.trainable.lora_base_model == "dit" and config.trainable.lora_rank == 32
    assert plan.family.lora_targets("dit") == SOURCE_TEXT_TARGETS
    assert config.output.remove_prefix_in_ckpt == "pipe.dit."
    v1, v2 = pipeline_class(config.pipeline)(device="cpu").split_pipeline_units(["dit"])
    assert v1 == [] and list(plan.split.v1) == []
    assert list(plan.split.v2) == [type(u).__name__ for u in v2]
    sources = plan.family.sources
    assert sorted(plan.split.models["stage1"]) == ["text_encoder", "vae"]
    assert [m for m in plan.split.models["stage2"] if m in sources] == ["dit"]
    assert {"prompt_emb", "prompt_emb_mask", "input_latents"} <= set(plan.split.boundary_params)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_tiny_model_files_are_fully_initialized_and_reproducible(root, tmp_path, name):
    """Every tensor of the tiny files is defined: written with torch.empty returning NaN, they
    are finite (no uninitialized parameter, e.g. ZImageDiT's pad tokens, reaches a file) and
    equal the fixture's files (same seed, another process state)."""
    with nan_filled_empty():
        info = write_tiny_models(name, tmp_path)
    fixture = json.loads((root / name / "info.json").read_text())
    for path, again in zip(fixture["model_paths"], info["model_paths"], strict=True):
        written, rewritten = load_file(path), load_file(again)
        assert written.keys() == rewritten.keys()
        for key, tensor in rewritten.items():
            assert tensor.isfinite().all() and tensor.abs().max() <= 10, (path, key)
            assert torch.equal(written[key], tensor), (path, key)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_stage2_model_equals_diffsynths_loaded_model(root, registered, name):
    """The stage-2 denoiser (meta build, LoRA, to_empty, file load, init_buffers) holds exactly
    what DiffSynth's own from_pretrained holds: every parameter and every buffer, persistent or
    not; the LoRA starts as a no-op (B = 0, A finite), so model_fn's output is identical too."""
    config = job(root, name)
    info = json.loads((root / name / "info.json").read_text())
    dist_info = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
    model = build_stage2_models(make_plan(config), dist_info, names=["dit"]).models["dit"]
    pipe = fresh(name, info)
    reference = pipe.dit
    ours = {
        k.replace(".base_layer.", "."): v
        for k, v in [*model.named_parameters(), *model.named_buffers()]
        if "lora_" not in k
    }
    theirs = dict([*reference.named_parameters(), *reference.named_buffers()])
    assert ours.keys() == theirs.keys()
    for key, tensor in theirs.items():
        assert ours[key].dtype == tensor.dtype and torch.equal(ours[key], tensor), key
    lora = {k: v for k, v in model.named_parameters() if "lora_" in k}
    assert lora and all(v.isfinite().all() for v in lora.values())
    assert all(not v.any() for k, v in lora.items() if "lora_B" in k)
    assert torch.equal(output(pipe, name, model), output(pipe, name))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_split_training_matches_diffsynth_and_exports_a_lora_it_loads(
    root, registered, name, capsys
):
    """Stage 1 loads its models' files alone, stage 2 none through DiffSynth (its DiT from the
    file, once), the launcher no weights; the loss is DiffSynth's, the LoRA loads in it."""
    config = job(root, name)
    info = json.loads((root / name / "info.json").read_text())
    sources = make_plan(config).family.sources
    capsys.readouterr()
    report = preprocess(config, progress=False)
    assert report.computed == 2
    stage1 = {sources[m].path for m in make_plan(config).split.models["stage1"] if m in sources}
    assert loaded_files(capsys.readouterr().out) == stage1  # DiffSynth's own log line
    assert sources["dit"].path not in stage1
    cache = root / "cache" / report.cache_key
    assert not list(cache.rglob("*.pt*"))  # our format: safetensors shards + JSON, no pickle
    lines: list[str] = []
    with weight_loads() as launcher_reads:
        result = train(config, run_root=root / "runs", env=ENV, on_line=lines.append)
    assert launcher_reads == []  # the launcher read headers only; the rank loaded the DiT
    assert loaded_files("\n".join(lines)) == set()  # stage 2 never ran DiffSynth's loader
    assert not any(line.startswith("warning: buckets") for line in lines)  # buckets are off
    metrics = read_metrics(Path(result.run_dir))
    assert len(metrics) == 2 and all(m["loss"] > 0 for m in metrics)
    # The first update trained on the first key of the epoch order: find which row it was.
    data = index_data_set(config)
    expected = [reference_loss(config, name, info, k, r) for k, r in zip(data.keys, data.rows)]
    first = metrics[0]["loss"]
    assert min(abs(first - e) for e in expected) <= 1e-6 * max(1.0, abs(first)), (first, expected)
    lora = Path(result.outputs["dit"])
    keys = load_file(lora).keys()
    assert keys and not any(k.startswith("pipe.") for k in keys)  # remove_prefix_in_ckpt
    targets = LORA.get(name, {}).get("lora_target_modules", [])
    assert all(any(f".{t}.lora_A." in k for k in keys) for t in targets)  # each one trained
    before = output(fresh(name, info), name)
    pipe = fresh(name, info)
    pipe.load_lora(pipe.dit, str(lora))
    after = output(pipe, name)
    assert not torch.equal(before, after)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_stage2_builds_the_trained_dit_once_and_loads_nothing_else(root, name, capsys):
    """Stage 2's models are the plan's (the DiT, and in-iteration slots no file fills, such as
    Z-Image's controlnet): the DiT built on meta and loaded from its file once; the pipeline its
    loss runs holds no model of its own (no text encoder, VAE or second DiT)."""
    config = job(root, name)
    plan = make_plan(config)
    capsys.readouterr()
    dist_info = DistInfo(0, 0, 1, torch.device("cpu"), "gloo")
    models = build_stage2_models(plan, dist_info).models
    assert sorted(models) == sorted(plan.split.models["stage2"]) and "dit" in models
    assert "text_encoder" not in models and not any("vae" in name for name in models)
    absent = [n for n, m in models.items() if getattr(m, "diffsynth_absent", False)]
    assert sorted(absent) == sorted(set(models) - {"dit"})  # no file fills them
    stand_ins = dict(plan.family.pipe.named_children())  # meta-device models: no weights
    assert sorted(stand_ins) == sorted(plan.family.sources)
    assert all(t.is_meta for m in stand_ins.values() for t in [*m.parameters(), *m.buffers()])
    assert loaded_files(capsys.readouterr().out) == set()
    gc.collect()
    dit_class = type(models["dit"])
    dits = [o for o in gc.get_objects() if type(o) is dit_class]
    assert sum(not next(d.parameters()).is_meta for d in dits) == 1


def test_stage1_sees_the_slots_it_does_not_load_as_diffsynth_does(tmp_path, capsys):
    """Z-Image's prompt unit picks its encoding by the DiT's structure (Omni-Base's
    siglip_embedder). Stage 1 never loads the DiT but holds its meta stand-in, so it takes
    DiffSynth's branch, not a silently different encoding; that branch's nested prompt segments
    are refused in one line (the cache does not store them yet)."""
    name = "ZImagePipeline"
    write_digits_dataset(tmp_path / "data", limit=1, size=32)
    info = write_tiny_models(name, tmp_path / name, kwargs_of={"dit": {"siglip_feat_dim": 16}})
    (tmp_path / name / "info.json").write_text(json.dumps(info))
    path = tmp_path / "job.toml"
    path.write_text(toml(job_document(tmp_path, name)))
    assert main(["preprocess", str(path)]) == 2
    captured = capsys.readouterr()
    line = "unit 'ZImageUnit_PromptEmbedder' wrote 'prompt_embeds' as tensors nested in lists"
    assert line in captured.err and "Traceback" not in captured.err
    loaded = loaded_files(captured.out)
    assert loaded and not any(Path(p).name == "dit.safetensors" for p in loaded)
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


@pytest.mark.parametrize("name", list(PIPELINES))
def test_validate_reads_headers_and_loads_no_model(root, tmp_path, name, capsys):
    """`splitstage validate` of a diffsynth job: the plan and every check, from the files'
    headers and meta-device builds; DiffSynth's loader never runs, no tensor is read."""
    path = tmp_path / "job.toml"
    path.write_text(toml(job_document(root, name)))
    with weight_loads() as seen:
        code = main(["validate", str(path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "cache key:" in out and loaded_files(out + err) == set()
    assert seen == []


def test_batch_size_above_one_is_refused_before_launch(root):
    config = job(root, "ZImagePipeline", batch_size=4)
    with pytest.raises(Exception) as error:
        make_plan(config)
    assert "train.gradient_accumulation_steps = 4" in str(error.value)


@pytest.mark.parametrize("name", list(PIPELINES))
def test_a_missing_slot_or_a_size_the_models_cannot_take_is_refused_by_validate(root, name):
    """Parts that do not fit are found before anything runs (validate's checks, which preprocess
    and train run too): a model_paths list without the VAE's file names the slot; a height
    that the pipeline's division factor does not divide names the factor and a size that fits."""
    from splitstage.pipelines.diffsynth.config import REQUIRED_SLOTS
    from splitstage.splitter import UserError
    from splitstage.tasks.stage2.preflight import check_job

    document = job_document(root, name)
    vae = next(s for s in REQUIRED_SLOTS[name] if s.startswith("vae"))
    info = json.loads((root / name / "info.json").read_text())
    vae_file = next(p for p in info["model_paths"] if Path(p).stem == vae)
    without = [p for p in document["pipeline"]["model_paths"] if p != vae_file]
    broken = {**document, "pipeline": {**document["pipeline"], "model_paths": without}}
    with pytest.raises(UserError) as error:
        check_job(make_plan(config_from_dict(broken)))
    message = str(error.value)
    assert f"'{vae}'" in message and "pipeline.model_paths" in message, message
    odd = {**document, "pipeline": {**document["pipeline"], "height": 30}}
    with pytest.raises(UserError) as error:
        check_job(make_plan(config_from_dict(odd)))
    message = str(error.value)
    assert "pipeline.height = 30" in message and "multiple of 16" in message, message
    assert "use 32" in message, message
    check_job(make_plan(config_from_dict(document)))  # the whole folder, 32 x 32: fits


def test_another_models_tokenizer_is_refused_by_validate(root):
    """Qwen-Image given Wan's T5 tokenizer would encode every prompt into ids its text encoder
    reads as other words: refused before anything runs, naming tokenizer_path; each pipeline's
    own tokenizer passes."""
    from splitstage.splitter import UserError
    from splitstage.tasks.stage2.preflight import check_job

    wan = json.loads((root / "WanVideoPipeline" / "info.json").read_text())["tokenizer_path"]
    document = job_document(root, "QwenImagePipeline")
    foreign = {**document, "pipeline": {**document["pipeline"], "tokenizer_path": wan}}
    with pytest.raises(UserError) as error:
        check_job(make_plan(config_from_dict(foreign)))
    message = str(error.value)
    assert message.startswith("pipeline.tokenizer_path: ") and "tokenizer" in message, message
    assert "\n" not in message
    for name in PIPELINES:
        check_job(make_plan(config_from_dict(job_document(root, name))))
