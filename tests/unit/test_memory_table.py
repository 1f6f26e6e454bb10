"""docs/memory-table.md is what splitstage computes: SD 1.5's rows rebuilt from its public
configs by the page's generator (bench/memory_table.py; the larger models take about an hour
here: `--check` rebuilds them), every row present, the configs' digest current, and the
generator's budget rule picking what `choose_fit` picks."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from splitstage.config.job import config_from_dict
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.budget import MemoryBudgetError
from splitstage.tasks.memory.fit import choose_fit
from splitstage.tasks.memory.memory_plan import estimate_memory
from tests.helpers.memory_jobs import family_job
from tests.helpers.public_configs import configs_digest

GENERATOR = Path(__file__).resolve().parents[2] / "bench" / "memory_table.py"
REGENERATE = "stale: run .venv/bin/python bench/memory_table.py --write"


@pytest.fixture(scope="module")
def table():
    """The generator, imported from its file."""
    spec = importlib.util.spec_from_file_location("memory_table", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_sd15_rows_are_rebuilt_as_the_page_has_them(table, tmp_path):
    model = next(model for model in table.MODELS if model.key == "sd15")
    rows = table.model_rows(model, tmp_path)
    assert len(rows) == 2
    differences = table.stale([model], rows, table.PAGE.read_text())
    assert not differences, "\n".join([*differences, REGENERATE])


def test_the_page_has_every_model_and_training_and_the_configs_digest(table):
    text = table.PAGE.read_text()
    rows = table.page_rows(text, table.MODELS)
    cells = [tuple(part.strip() for part in row.split("|")[1:4:2]) for row in rows]
    wanted = [(m.title, words) for m in table.MODELS for words in table.TRAININGS.values()]
    assert cells == wanted, REGENERATE
    assert f"digest `{configs_digest()}`" in text, REGENERATE
    assert text == table.page(rows), REGENERATE  # the text around the rows is current too


def test_the_table_chooses_what_fit_chooses(table, tmp_path):
    """On the demo job (batch 2) under half its estimate, where levers are needed: the
    generator's candidates, shared by the budgets, give the choice `choose_fit` makes."""
    from splitstage.data.digits import write_digits_dataset

    write_digits_dataset(tmp_path / "data", limit=4, size=32)
    plan = make_plan(config_from_dict(family_job(tmp_path, "demo", fit="auto")))
    budget = estimate_memory(plan).stage2.peak_bytes // 2
    expected = table.fit_cell(plan, budget).choice(budget)
    job = family_job(tmp_path, "demo", fit="auto", device_memory=budget)
    budgeted = make_plan(config_from_dict(job))
    try:
        chosen, _ = choose_fit(budgeted, estimate_memory(budgeted))
    except MemoryBudgetError:
        assert expected is None
        return
    assert expected is not None and chosen.overrides
    assert (chosen.overrides, chosen.peak_bytes) == (expected.overrides, expected.peak_bytes)
