"""The CLI contract: `plan` JSON/table output, `stages`, exit code 2 without a traceback."""

import json
import subprocess
import sys

import pytest

from splitstage.cli import main
from tests.helpers.splitter_cases import demo_like, qwen_image_like


@pytest.fixture
def qwen_file(tmp_path):
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(qwen_image_like().to_dict()))
    return path


def test_plan_json_has_the_contract_keys(qwen_file, capsys):
    assert (
        main(["plan", str(qwen_file), "--trainable", "dit,text_encoder", "--format", "json"]) == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["v1"] == ["PromptEmbedder"]
    assert out["v2"] == [
        "ShapeChecker",
        "NoiseInitializer",
        "InputImageEmbedder",
        "EditImageEmbedder",
    ]
    assert set(out["reasons"]) == {"PromptEmbedder"}
    assert "input_latents" in out["boundary_params"]
    assert out["models"] == {"stage1": ["vae"], "stage2": ["text_encoder", "dit"]}
    assert out["offload"] == {"stage1": ["dit", "text_encoder"], "stage2": ["vae"]}


def test_plan_accepts_an_empty_trainable_value(qwen_file, capsys):
    assert main(["plan", str(qwen_file), "--trainable", "", "--format", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["v1"] == [] and len(out["v2"]) == 5


def test_plan_table_lists_units_boundary_and_offload(tmp_path, capsys):
    path = tmp_path / "demo.json"
    path.write_text(json.dumps(demo_like().to_dict()))
    assert main(["plan", str(path), "--trainable", "dit"]) == 0
    out = capsys.readouterr().out
    assert "CaptionDropout  V1 (stage 2, every step)" in out
    assert "stage 1 loads: text_encoder, vae; never loads: dit" in out
    assert "input_latents" in out


def test_null_fields_are_accepted_by_the_file_format(tmp_path, capsys):
    path = tmp_path / "p.json"
    path.write_text(
        json.dumps(
            {
                "name": "p",
                "units": [
                    {
                        "name": "enc",
                        "input_params": None,
                        "input_params_posi": None,
                        "input_params_nega": None,
                        "output_params": ["x"],
                        "onload_model_names": ["m"],
                    }
                ],
                "model_fn_params": None,
            }
        )
    )
    assert main(["plan", str(path), "--trainable", "m", "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["v1"] == ["enc"]


@pytest.mark.parametrize(
    ("content", "args", "message"),
    [
        ("{not json", [], "not valid JSON at line 1"),
        ('{"name": "p", "units": [{"name": "a"}, {"name": "a"}]}', [], "unit name 'a' is used"),
        ('{"name": "p", "units": [{"name": "a", "outputs": []}]}', [], "field 'outputs'"),
        (
            '{"name": "p", "units": [{"name": "a", "onload_model_names": ["vae"]}]}',
            ["--trainable", "vea"],
            "Did you mean 'vae'?",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path, content, args, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    result = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "plan", str(path), *args],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1


def test_missing_pipeline_file_is_named(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read it" in capsys.readouterr().err


def test_stages_command_prints_json(capsys):
    args = ["stages", "--num-layers", "4", "--input-modules", "embed", "--output-modules", "head"]
    assert main([*args, "--num-stages", "2"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["module_fqns_per_model_part"] == [
        ["embed", "blocks.0", "blocks.1"],
        ["blocks.2", "blocks.3", "head"],
    ]


def test_stages_validate_reports_bad_lists(tmp_path, capsys):
    path = tmp_path / "stages.json"
    path.write_text(json.dumps([["embed", "blocks.0"], ["blocks.0", "head"]]))
    args = ["stages", "--modules", "embed,blocks.0,head", "--validate", str(path)]
    assert main(args) == 2
    assert "module 'blocks.0' is already in stage 0" in capsys.readouterr().err


@pytest.mark.parametrize("path", ["/dev/zero", "FOLDER", "BIG"])
def test_a_config_that_is_not_a_job_file_is_one_line_not_a_hang(tmp_path, path):
    if path == "FOLDER":
        path = str(tmp_path)
    elif path == "BIG":
        big = tmp_path / "big.toml"
        big.write_bytes(b"# " + b"x" * (17 * 2**20))
        path = str(big)
    result = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "validate", path],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"config {path}: " in result.stderr and result.stderr.count("\n") == 1


def test_a_task_the_family_cannot_train_is_one_line_before_anything_runs(tmp_path, capsys):
    from splitstage.data.digits import write_digits_dataset
    from splitstage.pipelines.demo.weight_files import build_demo_weights
    from tests.helpers.catalogue import check_one_line, config_text, run_cli

    write_digits_dataset(tmp_path / "data", limit=2)
    build_demo_weights(tmp_path / "weights")
    path = tmp_path / "job.toml"
    path.write_text(config_text(tmp_path) + '[train]\ntask = "direct_distill"\n')
    code, err = run_cli(["validate", str(path)], capsys)
    check_one_line(code, err, "train.task", "direct_distill")
