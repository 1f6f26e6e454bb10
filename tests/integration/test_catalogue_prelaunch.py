"""Catalogue, class 1 and 4: what `validate` accepted but failed inside the ranks, and options that
were silently ignored. Every case runs the real CLI; errors are ONE line, exit 2, before launch.

The cases stand for classes: a trained-model count, LoRA targets and ranks that no layer can hold,
batches the data set cannot fill, outputs nothing can write, a cache no training process can read,
training before stage 1, a node rank outside the job, precision this machine will not give.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from splitstage.cli import main
from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, cli, job

assets = catalogue.assets  # the shared module-scoped fixture

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cached(assets):  # noqa: F811 - the catalogue's module fixture, imported above
    """The catalogue's assets with their cache filled once (stage 1 of the tiny job)."""
    (assets / "prep").mkdir(exist_ok=True)
    path = Path(job(assets, assets / "prep"))
    assert main(["preprocess", str(path)]) == 0
    return assets


CASES = {  # name -> (groups for job(), command, needles)
    "two trained models": (
        {"trainable": 'lora_base_model = "dit"\nfull = ["vae"]'},
        "validate",
        ["trainable: vae, dit", "one trained model"],
    ),
    "nothing trained": ({"trainable": "lora_rank = 4"}, "validate", ["nothing is trained"]),
    "LoRA targets matching no module": (
        {"trainable": 'lora_base_model = "dit"\nlora_target_modules = ["to_qq"]'},
        "validate",
        ["trainable.lora_target_modules", "to_qq", "to_q"],
    ),
    "empty LoRA target list": (
        {"trainable": 'lora_base_model = "dit"\nlora_target_modules = []'},
        "validate",
        ["trainable.lora_target_modules"],
    ),
    "LoRA rank above the layer width": (
        {"trainable": 'lora_base_model = "dit"\nlora_rank = 1000'},
        "validate",
        ["trainable.lora_rank=1000", "lora_rank <= 192"],
    ),
    "LoRA alpha of zero": (
        {"trainable": 'lora_base_model = "dit"\nlora_alpha = 0'},
        "validate",
        ["trainable.lora_alpha", "greater than 0"],
    ),
    "full and LoRA on one model": (
        {"trainable": 'lora_base_model = "dit"\nfull = ["dit"]'},
        "validate",
        ["both in full and the lora_base_model"],
    ),
    "batch larger than the data set": (
        {"train": "batch_size = 64"},
        "train",
        ["6 samples", "train.batch_size=64", "set train.batch_size <= 6"],
    ),
    "accumulation larger than the data set": (
        {"train": "batch_size = 2\ngradient_accumulation_steps = 8"},
        "train",
        ["train.gradient_accumulation_steps=8", "no update would run"],
    ),
    "seed beyond 63 bits": ({"job": "seed = 18446744073709551616"}, "validate", ["job.seed"]),
    "infinite learning rate": ({"train": "learning_rate = inf"}, "validate", ["finite"]),
    "output URL scheme nothing writes": (
        {"output": 'url = "ftp://host/out"'},
        "validate",
        ["output.url", "ftp://"],
    ),
    "memory:// cache read by torchrun processes": (
        {"cache": 'url = "memory://cache"'},
        "train",
        ["cache.url", "memory://"],
    ),
    "job name escaping output.url": (
        {"job": 'name = "../../x"'},
        "validate",
        ["job.name", "cannot name one folder"],
    ),
    "read-only output folder": (
        {"output": 'url = "/sys/kernel/splitstage-out"'},
        "train",
        ["output.url", "/sys/kernel/splitstage-out"],
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_refused_before_launch(case, cached, tmp_path, capsys):
    groups, command, needles = CASES[case]
    started = time.monotonic()
    code, err = cli([command, job(cached, tmp_path, **groups)], capsys)
    check_one_line(code, err, *needles)
    assert time.monotonic() - started < 30  # refused before any torchrun process started
    assert not list(tmp_path.glob("out/**/*.safetensors"))


JOB_CASES = sorted(name for name, (_, command, _) in CASES.items() if command == "validate")


@pytest.mark.parametrize("case", JOB_CASES)
def test_preprocess_refuses_what_validate_and_train_refuse(case, assets, tmp_path, capsys):  # noqa: F811
    """One set of the job's checks for all three commands: stage 1 is never spent on a job
    train would refuse (refused before the data set is indexed or a model loads)."""
    groups, _, needles = CASES[case]
    fresh = {"cache": f'url = "{tmp_path}/cache"\nshard_samples = 4'}
    path = job(assets, tmp_path, **{**fresh, **groups})
    for command in ("validate", "preprocess", "train"):
        check_one_line(*cli([command, path], capsys), *needles)
    assert not list(tmp_path.glob("cache/**/*.safetensors"))


def test_training_before_preprocess_says_run_preprocess(assets, tmp_path, capsys):  # noqa: F811
    path = job(assets, tmp_path, cache=f'url = "{tmp_path}/empty-cache"')
    check_one_line(*cli(["train", path], capsys), "holds no samples", "splitstage preprocess")
    code, err = cli(["validate", path], capsys)  # validate plans and warns, it does not refuse
    assert code == 0 and "warning: train would refuse now" in err


def test_a_rank_over_the_device_budget_is_refused_before_any_model_loads(cached, tmp_path, capsys):
    """Rank 0's checks estimate stage 2 (fake tensors) and refuse it over --device-memory."""
    path = job(cached, tmp_path)
    code, err = cli(["train", path, "--device-memory", "1MiB"], capsys)
    check_one_line(code, err, "train.device_memory: stage 2 (one rank) needs", "largest part")
    assert "over the budget of 0.000977 GiB" in err
    assert not list(tmp_path.glob("out/**/*.safetensors"))


def test_node_rank_outside_the_job(cached, tmp_path, capsys):
    path = job(cached, tmp_path)
    check_one_line(*cli(["train", path, "--node-rank", "3"], capsys), "--node-rank 3", "0..0")


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["preprocess", "JOB", "--workers", "0"], "--workers: must be >= 1"),
        (["train", "JOB", "--nproc-per-node", "-2"], "--nproc-per-node: must be >= 1"),
        (["train", "JOB", "--run-id", "../escape"], "run id '../escape'"),
        (["data", "digits", "OUT", "--size", "0"], "--size: must be >= 8"),
        (["data", "digits", "OUT", "--limit", "-5"], "--limit: must be >= 1"),
        (["stages", "--num-layers", "4", "--num-stages", "0"], "--num-stages: must be >= 1"),
    ],
)
def test_bad_numbers_on_the_command_line(args, needle, cached, tmp_path, capsys):
    path = job(cached, tmp_path)
    args = [path if a == "JOB" else str(tmp_path / "d") if a == "OUT" else a for a in args]
    check_one_line(*cli(args, capsys), needle)


def test_fp16_on_a_cpu_is_said_not_silent(cached, tmp_path, capsys):
    code, err = cli(
        ["validate", job(cached, tmp_path, train='batch_size = 2\nmixed_precision = "fp16"')],
        capsys,
    )
    assert code == 0 and "mixed_precision='fp16' on a CPU" in err and "fp32" in err
