"""The memory plan against what runs (demo family): the estimate (fake tensors, models on meta, no
weights) within 15% of the same stage-1 batch and stage-2 micro-step measured on the real models
and tensors by torch's tracker, as the settings move its parts; and the budget's refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitstage.cli import main
from splitstage.config.job import ConfigError, TrainConfig, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.flows.artifacts import memory_markdown
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.budget import MemoryBudgetError, check_budget
from splitstage.tasks.memory.measured_step import measure_memory
from splitstage.tasks.memory.memory_plan import GIB, estimate_memory, gib
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers.memory_jobs import close, family_job
from tests.helpers.toml_job import toml
from tests.helpers.weight_loads import weight_loads


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A digits data set (4 images) shared by the jobs."""
    folder = tmp_path_factory.mktemp("memory")
    write_digits_dataset(folder / "data", limit=4, size=32)
    return folder


@pytest.fixture(scope="module")
def base(root):
    """The demo job's estimate with the default settings."""
    return estimate_memory(make_plan(config_from_dict(family_job(root, "demo"))))


@pytest.mark.parametrize(
    "train",
    [
        {},
        {"gradient_checkpointing": True, "ema": {"decay": 0.99}},
        {"optimizer": "adafactor", "weight_dtype": "bf16", "mixed_precision": "bf16"},
        {"optimizer": "prodigy", "batch_size": 4},
        {"base_quantization": "int8", "weight_dtype": "bf16"},
        {"base_quantization": "nf4", "weight_dtype": "bf16", "gradient_checkpointing": True},
        {"gradient_accumulation_steps": 2},
    ],
    ids=[
        *("default", "checkpointing-ema", "adafactor-bf16", "prodigy-batch4", "int8", "nf4"),
        "accumulation",
    ],
)
def test_settings_move_the_parts_and_the_estimate_stays_close(root, base, train):
    plan = make_plan(config_from_dict(family_job(root, "demo", **train)))
    estimated, measured = estimate_memory(plan), measure_memory(plan)
    for stage in ("stage1", "stage2"):
        guess, real = getattr(estimated, stage), getattr(measured, stage)
        assert close(guess.peak_bytes, real.peak_bytes), (stage, guess.parts, real.parts)
    before, after = base.stage2.parts, estimated.stage2.parts
    assert after["trained_params"] > 0 and after["optimizer_state"] > 0
    if train.get("gradient_checkpointing") and not train.get("base_quantization"):
        assert after["activations"] < before["activations"]
        assert after["ema"] == before["trained_params"]  # an fp32 copy of the LoRA params
    if train.get("weight_dtype") == "bf16":
        assert after["frozen_weights"] < before["frozen_weights"]
    if train.get("optimizer") == "adafactor":
        assert after["optimizer_state"] < before["optimizer_state"]  # factored moments
    if train.get("batch_size") == 4:
        assert after["activations"] > before["activations"]
    if train.get("gradient_accumulation_steps"):  # the next micro-batch beside the gradients
        assert estimated.stage2.peak_bytes > base.stage2.peak_bytes
    if train.get("base_quantization"):  # the frozen base as torchao holds it, measured alike
        bound = {"int8": 0.6, "nf4": 0.35}[train["base_quantization"]]  # of the bf16 base
        bf16 = estimate_memory(
            make_plan(config_from_dict(family_job(root, "demo", weight_dtype="bf16")))
        )
        assert after["frozen_weights"] <= bound * bf16.stage2.parts["frozen_weights"]
        assert close(after["frozen_weights"], measured.stage2.parts["frozen_weights"])


def test_accumulation_counts_a_full_fine_tune_s_gradients_beside_the_next_micro_batch(root):
    """A full fine-tune with accumulation holds the whole gradient while the next micro-batch
    runs forward: the peak (estimated, and measured on the same two micro-batches) holds both
    at once; one micro-batch alone peaks at its update instead, with few activations left."""

    def full(**train):
        document = family_job(root, "demo", **train)
        document["trainable"] = {"full": ["dit"]}
        return make_plan(config_from_dict(document))

    one, two = estimate_memory(full()), estimate_memory(full(gradient_accumulation_steps=2))
    measured = measure_memory(full(gradient_accumulation_steps=2))
    assert close(two.stage2.peak_bytes, measured.stage2.peak_bytes)
    held = two.stage2.parts
    assert held["gradients"] == held["trained_params"]  # fp32 gradients of the fp32 weights
    assert held["activations"] > 10 * one.stage2.parts["activations"], (held, one.stage2.parts)
    assert two.stage2.peak_bytes > one.stage2.peak_bytes


def test_offload_moves_the_trained_model_to_the_host_and_keeps_two_blocks(root, base):
    """On a GPU the offloaded model lives in host memory; the device holds the block that runs
    and the next (FSDP2's prefetch). On this CPU the host is the device, so the estimate's
    parts are checked against the built model's own blocks, not against a measurement."""
    from splitstage.tasks.stage2.parallelize import find_blocks

    plan = make_plan(config_from_dict(family_job(root, "demo", offload="cpu")))
    parts = estimate_memory(plan).stage2.parts
    assert parts["trained_params"] == parts["gradients"] == parts["optimizer_state"] == 0
    dit = plan.family.build_model("dit", __import__("torch").device("cpu"), meta=True)
    largest = max(sum(p.numel() * 4 for p in block.parameters()) for block in find_blocks(dit))
    assert parts["offload_window"] >= 2 * largest  # fp32 base + its LoRA adapters
    assert parts["frozen_weights"] < base.stage2.parts["frozen_weights"]


def test_the_dashboard_shows_the_same_table(base):
    """The plan artifact's markdown: validate's rows as a table, then the settings."""
    markdown = memory_markdown(base)
    assert markdown.startswith("### memory plan on cpu")
    for part, stage1, stage2 in base.rows():
        assert f"| {part} | {stage1} | {stage2} |" in markdown
    assert "- stage 2: train.batch_size 2" in markdown


def write_job(root: Path, name: str, **train) -> Path:
    """The demo job as a TOML file."""
    path = root / f"{name}.toml"
    document = family_job(root, "demo", **train)
    path.write_text(toml(document | {"job": {"name": name}}))
    return path


def test_validate_prints_the_table_and_json_gives_the_memory_plan(root, capsys):
    path = write_job(root, "json")
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "memory plan on cpu (GiB per rank; budget: none)" in out
    assert "peak per rank" in out and "optimizer_state" in out
    assert main(["validate", "--json", str(path), "--device-memory", "24GiB"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["device_budget_bytes"] == 24 * GIB
    stage2 = memory["stage2"]
    assert memory["stage1"]["peak_bytes"] > 0 and stage2["peak_bytes"] == sum(
        stage2["parts"].values()
    )
    for part in ("frozen_weights", "trained_params", "gradients", "optimizer_state", "ema"):
        assert part in stage2["parts"]
    assert stage2["parts"]["activations"] > 0
    workers = memory["stage1_workers_per_device"]
    assert workers == 24 * GIB // memory["stage1"]["peak_bytes"]


def test_a_job_over_the_budget_is_refused_in_one_line_with_settings_that_fit(root, capsys):
    """Stage 2 over the budget, under it with checkpointing: validate exits 2 naming both."""
    plan = make_plan(config_from_dict(family_job(root, "demo", batch_size=4)))
    plain = estimate_memory(plan).stage2.parts
    light = make_plan(config_from_dict(family_job(root, "demo", batch_size=4, **CHECKPOINTING)))
    fits = estimate_memory(light).stage2.peak_bytes
    budget = (fits + sum(plain.values())) // 2
    path = write_job(root, "over", batch_size=4)
    code = main(["validate", str(path), "--device-memory", str(budget)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "train.device_memory: stage 2 (one rank) needs an estimated" in err
    assert f"over the budget of {gib(budget)} GiB" in err
    assert "(largest part: " in err
    assert "train.gradient_checkpointing = true (" in err
    assert "train.batch_size = 2 with train.gradient_accumulation_steps = 2" in err


CHECKPOINTING = {"gradient_checkpointing": True}


def test_a_budget_nothing_fits_says_so(root):
    plan = make_plan(config_from_dict(family_job(root, "demo", device_memory=1000)))
    with pytest.raises(MemoryBudgetError, match="none of the settings tried fits"):
        check_budget(plan, estimate_memory(plan))


def test_preprocess_refuses_a_worker_over_the_budget_before_any_model_loads(root):
    document = family_job(root, "demo")
    two = estimate_memory(make_plan(config_from_dict(document)), stage2=False).stage1
    document["preprocess"]["batch_size"] = 1
    one = estimate_memory(make_plan(config_from_dict(document)), stage2=False).stage1
    document["preprocess"]["batch_size"] = 2
    document["train"]["device_memory"] = (one.peak_bytes + two.peak_bytes) // 2
    config = config_from_dict(document)
    with weight_loads() as seen, pytest.raises(MemoryBudgetError) as refused:
        preprocess(config, workers=1, progress=False)
    assert seen == []
    line = str(refused.value)
    assert line.startswith("train.device_memory: stage 1 (one preprocess worker) needs")
    assert "preprocess.batch_size = 1 (" in line


@pytest.mark.parametrize("size", ["24GiB", "80GB", "512 MiB", 10**9])
def test_device_memory_takes_sizes(size):
    assert TrainConfig(device_memory=size).device_memory in (24 * GIB, 80 * 10**9, 2**29, 10**9)


def test_a_bad_size_names_the_field(capsys):
    with pytest.raises(ConfigError, match="train.device_memory: expected a size"):
        config_from_dict({"train": {"device_memory": "lots"}})
    with pytest.raises(SystemExit) as stopped:
        main(["validate", "job.toml", "--device-memory", "lots"])
    assert stopped.value.code == 2
    assert "argument --device-memory: expected a size" in capsys.readouterr().err
