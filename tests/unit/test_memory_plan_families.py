"""The memory plan for every family's tiny model: the estimate (fake tensors, models on meta, no
weights read) within 15% of the same stage-1 batch and stage-2 micro-step measured on the real
models and tensors by torch's tracker."""

from __future__ import annotations

import pytest

from splitstage.config.job import config_from_dict
from splitstage.data.digits import write_digits_dataset
from splitstage.tasks.job_plan import make_plan
from splitstage.tasks.memory.measured_step import measure_memory
from splitstage.tasks.memory.memory_plan import estimate_memory
from tests.helpers.memory_jobs import close, family_job


@pytest.mark.parametrize(
    "family",
    [
        "sd",
        "sdxl",
        "sd3",
        "flux",
        "qwenimage",
        "wan",
        "zimage",
        "flux2",
        "wan_i2v",
        "flux_kontext",
    ],
)
def test_the_estimate_is_within_15_percent_of_the_measured_peak(tmp_path, family):
    write_digits_dataset(tmp_path / "data", limit=4, size=32)
    plan = make_plan(config_from_dict(family_job(tmp_path, family)))
    estimated, measured = estimate_memory(plan), measure_memory(plan)
    for stage in ("stage1", "stage2"):
        guess, real = getattr(estimated, stage), getattr(measured, stage)
        assert close(guess.peak_bytes, real.peak_bytes), (stage, guess.parts, real.parts)
        assert guess.parts["frozen_weights"] > 0 and guess.parts["activations"] > 0
    parts = estimated.stage2.parts
    assert parts["trained_params"] > 0 and parts["optimizer_state"] > 0
    assert parts["frozen_weights"] == measured.stage2.parts["frozen_weights"]


def test_a_family_that_cannot_step_on_fake_tensors_says_why_and_is_measured(tmp_path):
    """Qwen-Image-Edit's stage 1 finds the images' tokens by value (Qwen2.5-VL's nonzero): the
    plan says so instead of a traceback; the same job measured on real tensors holds its
    references (three for Plus, as large as the target) and the longest prompt it takes."""
    write_digits_dataset(tmp_path / "data", limit=4, size=32)
    plan = make_plan(config_from_dict(family_job(tmp_path, "qwenimage_edit_plus")))
    with pytest.raises(NotImplementedError, match=r"qwenimage_edit family cannot step on fake"):
        estimate_memory(plan)
    measured = measure_memory(plan)
    assert measured.stage1.peak_bytes > 0 and measured.stage2.parts["activations"] > 0
    assert plan.family.most_references() == 3
