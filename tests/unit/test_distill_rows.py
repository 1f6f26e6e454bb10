"""Direct distillation's row table: each teacher setting read exactly or refused in one line."""

from __future__ import annotations

import pytest
import torch

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data.dataset import Row
from splitstage.pipelines.distill_rows import check_distill_rows, check_rows, distill_values


def row(line: int = 1, **extras) -> Row:
    """A metadata row with these extra columns (CSV gives strings, JSON typed values)."""
    return Row(line=line, image="a.png", prompt="a digit", extras=extras, source="meta.jsonl")


GOOD = {"seed": 7, "num_inference_steps": 4}


def test_values_are_read_exactly_from_json_and_csv_text():
    assert distill_values(row(**GOOD)) == {
        "seed": 7,
        "num_inference_steps": 4,
        "rand_device": None,  # the stage-1 device, as DiffSynth's train.py (pipe.device)
        "cfg_scale": None,  # the pipeline's default
    }
    text = row(seed="7", num_inference_steps=" 4 ", rand_device="cpu", cfg_scale="3.5")
    assert distill_values(text) == {
        "seed": 7,
        "num_inference_steps": 4,
        "rand_device": "cpu",
        "cfg_scale": 3.5,
    }
    assert distill_values(row(seed=7.0, num_inference_steps="4.0"))["seed"] == 7  # exact
    assert distill_values(row(seed=2**64 - 1, num_inference_steps=1))["seed"] == 2**64 - 1


@pytest.mark.parametrize(
    ("extras", "said"),
    [
        ({"seed": 7.9, "num_inference_steps": 4}, r"row 1: seed = 7\.9 is not a whole number"),
        ({"seed": "7.9", "num_inference_steps": 4}, r"seed = '7\.9' is not a whole number"),
        ({"seed": 7, "num_inference_steps": True}, r"num_inference_steps = True is not a whole"),
        ({"seed": 7, "num_inference_steps": "true"}, r"num_inference_steps = 'true' is not a"),
        ({"seed": 7, "num_inference_steps": 0}, r"num_inference_steps = 0 is outside 1 \.\.\."),
        ({"seed": 2**64, "num_inference_steps": 4}, r"seed = 18446744073709551616 is outside"),
        ({"seed": 7, "num_inference_steps": 4, "cfg_scale": "high"}, r"cfg_scale = 'high' is"),
        ({"seed": 7, "num_inference_steps": 4, "cfg_scale": True}, r"cfg_scale = True is not"),
        ({"seed": 7, "num_inference_steps": 4, "rand_device": "gpu"}, r"rand_device = 'gpu' is"),
        ({"num_inference_steps": 4}, r"row 1: .*needs the column\(s\) seed"),
        ({"seed": 7}, r"needs the column\(s\) num_inference_steps"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_row_and_column(extras, said):
    with pytest.raises(ConfigError, match=said) as error:
        distill_values(row(**extras))
    assert "\n" not in str(error.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA refuses 'cuda'")
def test_cuda_noise_on_a_machine_without_cuda_is_refused():
    with pytest.raises(ConfigError, match="rand_device = 'cuda' but CUDA is not available"):
        distill_values(row(**GOOD, rand_device="cuda"))


def test_the_table_check_names_the_first_rows_and_counts_the_rest():
    rows = [row(i, seed=i + 0.5, num_inference_steps=2) for i in range(1, 9)]
    with pytest.raises(ConfigError) as error:
        check_distill_rows([row(0, **GOOD), *rows])
    said = str(error.value)
    assert "row 1: seed = 1.5" in said and "row 5: seed = 5.5" in said
    assert "row 6" not in said and said.endswith("(and 3 more rows)")
    assert "\n" not in said
    check_distill_rows([row(1, **GOOD), row(2, seed="3", num_inference_steps="2")])


def test_only_a_direct_distill_job_reads_the_teachers_columns():
    bad = [row(1, seed="x")]
    check_rows(config_from_dict({}), bad)  # sft reads no teacher settings
    distill = config_from_dict({"train": {"task": "direct_distill"}})
    with pytest.raises(ConfigError, match="needs the column"):
        check_rows(distill, bad)
