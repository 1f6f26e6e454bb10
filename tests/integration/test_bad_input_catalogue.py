"""The bad-input catalogue: every case prints ONE line naming the thing and the fix, exits 2.

Each case runs the real CLI entry point (`splitstage.cli.main`) in-process; a few run it as a
subprocess to prove no traceback reaches the terminal. The README's troubleshooting section lists
the same cases.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, config_text, run_cli

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

assets = catalogue.assets  # the shared module-scoped fixture

ROOT = Path(__file__).resolve().parents[2]


CONFIG_CASES = {
    "unknown field": ("[train]\nepochz = 2\n", ["train.epochz", "unknown field"]),
    "wrong type": ("[train]\nepochs = 'many'\n", ["train.epochs", "valid integer"]),
    "bad URL scheme": ('[output]\nurl = "x"\n[cache2]\n', ["cache2", "unknown field"]),
    "number out of range": ("[train]\nlearning_rate = -1\n", ["train.learning_rate"]),
    "bad image size": ("[pipeline]\nimage_size = 50\n", ["pipeline.image_size", "16"]),
    "unknown parallelism": ('[train]\nparallelism = "zero"\n', ["train.parallelism"]),
    "unknown mixed precision": ('[train]\nmixed_precision = "fp8"\n', ["train.mixed_precision"]),
    "unknown train mode": ('[train]\nmode = "both"\n', ["train.mode"]),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_config_field_errors(case, assets, tmp_path, capsys):
    extra, needles = CONFIG_CASES[case]
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=extra))
    check_one_line(*run_cli(["validate", str(path)], capsys), *needles)


REPLACED_CASES = {
    "unsupported cache URL": ('url = "{a}/cache"', 'url = "ftp://host/cache"', ["ftp://"]),
    "s3 URL without bucket": ('url = "{a}/cache"', 'url = "s3://"', ["needs a bucket"]),
    "cache URL is a file": (
        'url = "{a}/cache"',
        'url = "{a}/data/metadata.csv/cache"',
        ["cache.url", "metadata.csv is a file", "point cache.url at a folder"],
    ),
    "credentials in the config": (
        'url = "{a}/cache"',
        'url = "s3://b/c"\nstorage_options = {secret = "x"}',
        ["cache.storage_options", "environment"],
    ),
    "missing weights file": (
        "weights/dit.safetensors",
        "weights/none.safetensors",
        ["models.dit.weights", "none.safetensors", "does not exist"],
    ),
    "model with two sources": (
        'builder = "tiny"',
        'builder = "tiny"\nweights = "x.safetensors"',
        ["models.text_encoder", "exactly one"],
    ),
    "unknown text encoder builder": (
        'builder = "tiny"',
        'builder = "bert-9000"',
        ["models.text_encoder.builder", "minilm"],
    ),
    "trainable model without an entry": (
        'lora_base_model = "dit"',
        'lora_base_model = "unet"',
        ["unet", "[models.unet]"],
    ),
}


@pytest.mark.parametrize("case", sorted(REPLACED_CASES))
def test_config_value_errors(case, assets, tmp_path, capsys):
    old, new, needles = REPLACED_CASES[case]
    text = config_text(assets).replace(
        old.replace("{a}", str(assets)), new.replace("{a}", str(assets))
    )
    path = tmp_path / "job.toml"
    path.write_text(text)
    check_one_line(*run_cli(["validate", str(path)], capsys), *needles)


def test_config_not_toml_and_missing_file(tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text("[train\n")
    check_one_line(*run_cli(["validate", str(path)], capsys), "not valid TOML")
    check_one_line(*run_cli(["validate", str(tmp_path / "nope.toml")], capsys), "cannot read")


GRAPH_CASES = {
    "duplicate unit names": (
        {"name": "p", "units": [{"name": "a"}, {"name": "a"}]},
        [],
        ["unit name 'a'"],
    ),
    "unknown trainable model": (
        {"name": "p", "units": [{"name": "a", "onload_model_names": ["vae"]}]},
        ["--trainable", "vea"],
        ["Did you mean 'vae'?"],
    ),
    "wrong field type": (
        {"name": "p", "units": [{"name": "a", "output_params": 3}]},
        [],
        ["field 'output_params'"],
    ),
    "unknown unit field": (
        {"name": "p", "units": [{"name": "a", "onload": []}]},
        [],
        ["field 'onload'", "unknown field"],
    ),
}


@pytest.mark.parametrize("case", sorted(GRAPH_CASES))
def test_unit_graph_errors(case, tmp_path, capsys):
    document, args, needles = GRAPH_CASES[case]
    path = tmp_path / "pipeline.json"
    path.write_text(json.dumps(document))
    check_one_line(*run_cli(["plan", str(path), *args], capsys), *needles)


def broken_data(assets: Path, tmp: Path, how: str) -> Path:
    """A copy of the data set with one defect."""
    data = tmp / "data"
    subprocess.run(["cp", "-r", str(assets / "data"), str(data)], check=True)
    meta = data / "metadata.csv"
    lines = meta.read_text().splitlines()
    first_image = lines[1].split(",", 1)[0]
    if how == "missing image":
        (data / first_image).unlink()
    elif how == "unreadable image":
        (data / first_image).write_bytes(b"not a png")
    elif how == "empty prompt":
        lines[2] = lines[2].split(",", 1)[0] + ","
        meta.write_text("\n".join(lines) + "\n")
    elif how == "missing column":
        meta.write_text("\n".join(["image,caption", *lines[1:]]) + "\n")
    elif how == "bad metadata file":
        meta.rename(data / "metadata.xlsx")
    return data


DATA_CASES = {
    "missing image": ["metadata.csv row 2", "not found"],
    "unreadable image": ["metadata.csv row 2", "corrupt or not an image"],
    "empty prompt": ["metadata.csv row 3", "empty 'prompt'"],
    "missing column": ["missing column(s) 'prompt'", "caption"],
    "bad metadata file": ["no metadata.csv or metadata.jsonl"],
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_data_errors_name_the_row_and_file(case, assets, tmp_path, capsys):
    data = broken_data(assets, tmp_path, case)
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, data=data).replace(f"{assets}/cache", f"{tmp_path}/c"))
    check_one_line(*run_cli(["preprocess", str(path)], capsys), *DATA_CASES[case])


def s3_config(assets: Path, tmp: Path, url: str, endpoint: str) -> Path:
    path = tmp / "job.toml"
    text = config_text(assets).replace(
        f'url = "{assets}/cache"',
        f'url = "{url}"\nstorage_options = {{endpoint_url = "{endpoint}"}}',
    )
    path.write_text(text)
    return path


def test_missing_bucket(assets, tmp_path, s3_bucket, monkeypatch, capsys):
    _, options = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    endpoint = options["client_kwargs"]["endpoint_url"]
    missing = s3_config(assets, tmp_path, "s3://no-such-bucket/cache", endpoint)
    check_one_line(*run_cli(["preprocess", str(missing)], capsys), "no-such-bucket")


@pytest.mark.parametrize(
    ("user", "secret", "needle"),
    [("writer", "Wr0ngSecretValue1234", "check the key"), ("nobody", None, "lack permission")],
)
def test_wrong_credentials_and_no_permission(
    user, secret, needle, assets, tmp_path, s3_auth, s3_endpoint, monkeypatch, capsys
):
    url, opts = s3_auth
    options = opts(user, secret)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    code, err = run_cli(["preprocess", str(s3_config(assets, tmp_path, url, s3_endpoint))], capsys)
    check_one_line(code, err, needle)
    assert options["secret"] not in err


def test_mesh_larger_than_the_world_fails_before_launch(assets, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        config_text(
            assets, extra='[train]\nparallelism = "tp"\ntp_degree = 4\nnproc_per_node = 2\n'
        )
    )
    check_one_line(*run_cli(["train", str(path)], capsys), "train.tp_degree=4")


def test_bad_stage_lists(tmp_path, capsys):
    path = tmp_path / "stages.json"
    path.write_text(json.dumps([["embed"], ["head", "blocks.0"]]))
    args = ["stages", "--modules", "embed,blocks.0,head", "--validate", str(path)]
    check_one_line(*run_cli(args, capsys), "list modules in model order")


@pytest.mark.parametrize(
    "args",
    [["validate", "/nonexistent/job.toml"], ["plan", "/nonexistent/pipeline.json"]],
)
def test_no_traceback_reaches_the_terminal(args):
    result = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr and result.stderr.count("\n") == 1


def test_bad_pipeline_microbatches_fail_before_launch(assets, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(
        config_text(
            assets,
            extra='[train]\nparallelism = "pp"\nnproc_per_node = 2\npp_microbatches = 1\n',
        )
    )
    check_one_line(*run_cli(["train", str(path)], capsys), "train.pp_microbatches")


def test_weights_file_with_wrong_keys_or_shapes_fails_before_launch(assets, tmp_path, capsys):
    import json as _json

    from safetensors.torch import load_file, save_file

    from splitstage.pipelines.demo.dit import DiT

    state = load_file(str(assets / "weights/dit.safetensors"))
    renamed = tmp_path / "renamed.safetensors"
    save_file(
        {f"model.{k}": v for k, v in state.items()},
        str(renamed),
        metadata={"config": _json.dumps(DiT().config)},
    )
    small = DiT(hidden=96, heads=3)
    reshaped = tmp_path / "reshaped.safetensors"
    save_file(
        {k: v.contiguous() for k, v in small.state_dict().items()},
        str(reshaped),
        metadata={"config": _json.dumps(DiT().config)},
    )
    for weights, needles in (
        (renamed, ["models.dit.weights", "key_prefix"]),
        (reshaped, ["models.dit.weights", "shape"]),
    ):
        path = tmp_path / "job.toml"
        text = config_text(assets).replace(f"{assets}/weights/dit.safetensors", str(weights))
        path.write_text(text)
        check_one_line(*run_cli(["train", str(path)], capsys), *needles)
