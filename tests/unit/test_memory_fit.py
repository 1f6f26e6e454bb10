"""`train.fit = "auto"` (demo family, fake steps): the cheapest levers in the documented order
that bring stage 2 under the budget, shown by validate (text and `memory.fit`), refused in one
line when nothing fits, nothing done without a budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitstage.cli import main
from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.flows.artifacts import fitted_memory_plan, memory_markdown
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.budget import MemoryBudgetError
from splitstage.tasks.memory.fit import choose_fit
from splitstage.tasks.memory.memory_plan import estimate_memory
from splitstage.tasks.stage2.preflight import Preflight, memory_plan
from tests.helpers.memory_jobs import family_job
from tests.helpers.toml_job import toml

CHECKPOINTING = {"gradient_checkpointing": True}
# batch 1 as fit makes it from the job's batch 2: the global batch kept by accumulation (which
# the estimate counts: the next micro-batch runs beside the gradients)
BATCH_ONE = {**CHECKPOINTING, "weight_dtype": "bf16", "batch_size": 1}
BATCH_ONE |= {"gradient_accumulation_steps": 2}
INT8 = {**BATCH_ONE, "base_quantization": "int8"}


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """A digits data set (4 images) shared by the jobs."""
    folder = tmp_path_factory.mktemp("fit")
    write_digits_dataset(folder / "data", limit=4, size=32)
    return folder


@pytest.fixture(scope="module")
def between(root) -> tuple[int, int]:
    """(a budget between the plain and the checkpointed estimates, the checkpointed one)."""
    plain, light = stage2_peak(root), stage2_peak(root, **CHECKPOINTING)
    return (plain + light) // 2, light


def stage2_peak(root: Path, **train) -> int:
    """Stage 2's estimate of the demo job (batch 2) with `train` set."""
    plan = make_plan(config_from_dict(family_job(root, "demo", **train)))
    return estimate_memory(plan).stage2.peak_bytes


def fitted(root: Path, budget: int):
    """(choice, memory plan) of fit on the demo job under `budget`."""
    plan = make_plan(config_from_dict(family_job(root, "demo", fit="auto", device_memory=budget)))
    return choose_fit(plan, estimate_memory(plan))


def write_job(root: Path, name: str, **train) -> Path:
    """The demo job (fit on) as a TOML file."""
    path = root / f"{name}.toml"
    document = family_job(root, "demo", fit="auto", **train)
    path.write_text(toml(document | {"job": {"name": name}}))
    return path


def test_fit_picks_checkpointing_when_that_alone_fits(root, between, capsys):
    budget, light = between
    path = write_job(root, "ckpt")
    assert main(["validate", "--json", str(path), "--device-memory", str(budget)]) == 0
    fit = json.loads(capsys.readouterr().out)["memory"]["fit"]
    assert fit["outcome"] == "chosen" and fit["overrides"] == CHECKPOINTING
    assert fit["peak_bytes"] == light and fit["chosen"] == "train.gradient_checkpointing = true"
    assert main(["validate", str(path), "--device-memory", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "train.fit = 'auto': chose train.gradient_checkpointing = true (stage 2: " in out
    assert "gradient checkpointing on" in out  # the table is the chosen settings'


def test_fit_picks_a_quantized_base_when_only_that_fits(root):
    smallest, quantized = stage2_peak(root, **BATCH_ONE), stage2_peak(root, **INT8)
    assert quantized < smallest
    choice, memory = fitted(root, (smallest + quantized) // 2)
    assert choice.overrides == INT8
    assert memory.stage2.peak_bytes == quantized == choice.peak_bytes
    assert "train.base_quantization = 'int8'" in choice.line()


def test_fit_refuses_in_one_line_when_nothing_fits(root):
    """Rank 0's check (stage 2 alone; validate refuses stage 1 first at this budget)."""
    config = config_from_dict(family_job(root, "demo", fit="auto", device_memory=1000))
    with pytest.raises(MemoryBudgetError) as refused:
        memory_plan(make_plan(config), Preflight(), training=True)
    line = str(refused.value)
    assert isinstance(refused.value, ConfigError) and len(line.splitlines()) == 1  # exit 2
    assert line.startswith("train.device_memory: stage 2 (one rank) needs an estimated")
    # 5 sets, offload = 2, 4, 6 of the DiT's 6 blocks on an int8 base, then 'cpu'
    assert "train.fit = 'auto' tried 9 sets of levers and none fits (the lowest, " in line
    assert "train.offload = 'cpu'" in line  # offload, the last lever, is the lowest


def test_fit_does_nothing_without_a_budget_and_says_so(root, capsys):
    path = write_job(root, "nobudget")
    assert main(["validate", "--json", str(path)]) == 0
    fit = json.loads(capsys.readouterr().out)["memory"]["fit"]
    assert fit["outcome"] == "no budget" and fit["overrides"] == {}
    assert main(["validate", str(path)]) == 0
    assert "train.fit = 'auto': no device budget (a CPU without" in capsys.readouterr().out


def test_the_dashboard_shows_the_choice(root, between):
    budget = between[0]
    config = config_from_dict(family_job(root, "demo", fit="auto", device_memory=budget))
    markdown = memory_markdown(fitted_memory_plan(make_plan(config)))
    assert "- train.fit = 'auto': chose train.gradient_checkpointing = true" in markdown
    assert not config.train.gradient_checkpointing  # advice: the run's rank 0 applies it


def test_a_process_that_may_choose_a_quantized_base_keeps_torchao():
    """The console script and the ranks mark unused libraries absent: with fit = "auto" a LoRA
    job may choose (or resume with) a quantized base, so torchao stays importable."""
    from splitstage.process.unused_imports import quantizes_the_base

    lora = {"trainable": {"lora_base_model": "dit"}}
    assert quantizes_the_base({**lora, "train": {"fit": "auto"}})
    assert not quantizes_the_base({**lora, "train": {"fit": "off"}})
    assert not quantizes_the_base({"trainable": {"full": ["dit"]}, "train": {"fit": "auto"}})
    assert quantizes_the_base({"train": {"base_quantization": "nf4"}})
