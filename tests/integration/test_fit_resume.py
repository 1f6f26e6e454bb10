"""`train.fit = "auto"` in a run: rank 0's choice is applied to the rank's config and recorded
in the run's settings (every checkpoint), and a resume re-uses it instead of choosing again."""

from __future__ import annotations

import pytest

from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.memory_plan import estimate_memory
from splitstage.tasks.stage2.distributed import close_distributed
from splitstage.tasks.stage2.trainer import Trainer
from tests.helpers.tiny_job import make_workspace, one_rank_setup, tiny_config

CHECKPOINTING = {"gradient_checkpointing": True}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("fit-resume"), samples=16, seed=0)


def test_a_resumed_run_keeps_the_recorded_choice(workspace, capsys):
    plain, light = (
        estimate_memory(make_plan(tiny_config(workspace, "estimate", 0, **train))).stage2
        for train in ({}, CHECKPOINTING)
    )
    budget = (plain.peak_bytes + light.peak_bytes) // 2  # checkpointing alone fits
    config = tiny_config(workspace, "fitted", 0, fit="auto", device_memory=budget)
    try:
        setup = one_rank_setup(config, workspace / "runs")
        assert setup.settings["fit"] == {"overrides": CHECKPOINTING}
        assert config.train.gradient_checkpointing  # the rank trains with the choice
        assert Trainer(setup).run()["updates"] == 3
    finally:
        close_distributed()
    assert (
        "train.fit = 'auto': chose train.gradient_checkpointing = true" in capsys.readouterr().out
    )
    # a budget under which a new choice would change nothing: the recorded one still holds
    again = tiny_config(workspace, "fitted", 0, fit="auto", device_memory="64GiB", max_steps=4)
    try:
        resumed = one_rank_setup(again, workspace / "runs")
    finally:
        close_distributed()
    assert resumed.settings["fit"] == {"overrides": CHECKPOINTING}
    assert again.train.gradient_checkpointing
    out = capsys.readouterr().out
    assert "train.fit = 'auto': re-uses the choice recorded in checkpoint step 3" in out
    assert "not a new one" in out
