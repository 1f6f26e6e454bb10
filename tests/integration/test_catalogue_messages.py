"""Issue 26, messages that sent the user the wrong way: each names the real cause and its fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitstage.config.job import load_config
from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, cli, config_text

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

assets = catalogue.assets  # the shared module-scoped fixture

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "written, read",
    [
        ('"tensorboard"', ["tensorboard"]),  # accelerate's spelling
        ('"tensorboard, wandb"', ["tensorboard", "wandb"]),
        ('["wandb"]', ["wandb"]),
        ('"auto"', "auto"),
        ('"none"', "none"),
    ],
)
def test_report_to_takes_accelerates_spelling(written, read, assets, tmp_path):
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=f"[tracking]\nreport_to = {written}\n"))
    assert load_config(str(path)).tracking.report_to == read


@pytest.mark.parametrize(
    "written, needles",
    [
        ('["comet"]', ["tracking.report_to", "unknown tracker 'comet'", "tensorboard, wandb"]),
        ('"all"', ["tracking.report_to", "'all' is accelerate's", "'auto'"]),
        ("3", ["tracking.report_to", "not a tracker name"]),
    ],
)
def test_report_to_refusals_are_one_line(written, needles, assets, tmp_path, capsys):
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, extra=f"[tracking]\nreport_to = {written}\n"))
    code, err = cli(["validate", str(path)], capsys)
    check_one_line(code, err, *needles)
    assert "literal[" not in err


def s3_job(assets: Path, tmp: Path, data: str, cache: str) -> Path:
    """The tiny job with `[data]` and `[cache]` bodies replaced."""
    text = config_text(assets)
    text = text.replace(f'[data]\nbase_path = "{assets}/data"\n', f"[data]\n{data}\n")
    text = text.replace(f'[cache]\nurl = "{assets}/cache"\n', f"[cache]\n{cache}\n")
    path = tmp / "job.toml"
    path.write_text(text)
    return path


@pytest.fixture
def s3_data(assets, s3_bucket):
    """The digits uploaded under s3://bucket/prefix/data; yields the endpoint URL."""
    import s3fs

    _, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    local = assets / "data"
    files = [path for path in local.rglob("*") if path.is_file()]
    fs.pipe(
        {f"bucket/prefix/data/{p.relative_to(local).as_posix()}": p.read_bytes() for p in files}
    )
    return options["client_kwargs"]["endpoint_url"]


def no_credentials(monkeypatch, tmp_path) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))


def test_data_on_s3_without_credentials_names_the_fix(
    assets, tmp_path, s3_data, monkeypatch, capsys
):
    no_credentials(monkeypatch, tmp_path)
    data = (
        f'base_path = "s3://bucket/prefix/data"\nstorage_options = {{endpoint_url = "{s3_data}"}}'
    )
    path = s3_job(assets, tmp_path, data, f'url = "{tmp_path}/cache"')
    code, err = cli(["preprocess", str(path)], capsys)
    check_one_line(code, err, "no credentials found", "AWS_ACCESS_KEY_ID", "data.storage_options")
    assert "data.credentials_block" in err and "Unable to locate" not in err


def test_a_cache_on_s3_without_credentials_is_one_line_without_memo_warnings(
    assets, tmp_path, s3_data, monkeypatch, capsys
):
    no_credentials(monkeypatch, tmp_path)
    cache = f'url = "s3://bucket/prefix/cache"\nstorage_options = {{endpoint_url = "{s3_data}"}}'
    path = s3_job(assets, tmp_path, f'base_path = "{assets}/data"', cache)
    code, err = cli(["preprocess", str(path)], capsys)
    check_one_line(code, err, "no credentials found", "cache.storage_options")
    assert "memo" not in err.replace("data-memo/", "")  # no 'hash memo ... not read' warnings


def test_a_cache_bucket_that_does_not_exist_is_one_line(
    assets, tmp_path, s3_data, monkeypatch, capsys
):
    cache = f'url = "s3://no-bucket/cache"\nstorage_options = {{endpoint_url = "{s3_data}"}}'
    path = s3_job(assets, tmp_path, f'base_path = "{assets}/data"', cache)
    code, err = cli(["preprocess", str(path)], capsys)
    check_one_line(code, err, "bucket 'no-bucket' does not exist", "cache.url")


def test_unreachable_endpoints_name_the_field_and_the_endpoint(tmp_path, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    from splitstage.storage.files import translate_error

    for name in ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)
    down = EndpointConnectionError(endpoint_url="https://bucket.s3.amazonaws.com/data/x")
    default = str(
        translate_error(down, "s3://bucket/data/x", "read", {}, field="data.storage_options")
    )
    assert (
        "AWS's S3 endpoint" in default
        and "no endpoint_url is set in data.storage_options" in default
    )
    assert 'data.storage_options = {endpoint_url = "http(s)://host:port"}' in default
    options = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:1"}}
    given = str(translate_error(down, "s3://b/c", "list", options, field="cache.storage_options"))
    assert "endpoint http://127.0.0.1:1" in given and "cache.storage_options" in given


@pytest.mark.parametrize("scheme, package", [("gs", "gcsfs"), ("az", "adlfs"), ("abfs", "adlfs")])
def test_data_on_other_stores_names_their_filesystem_package(
    scheme, package, assets, tmp_path, capsys
):
    import importlib.util

    if importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed here")
    path = s3_job(assets, tmp_path, f'base_path = "{scheme}://b/data"', f'url = "{tmp_path}/c"')
    code, err = cli(["validate", str(path)], capsys)
    check_one_line(code, err, f"'{scheme}://'", f"pip install {package}")
    assert "s3fs" not in err


def test_a_credentials_block_without_a_prefect_api_says_so_at_once(assets, tmp_path):
    """No temporary server is started (it took 39 s and then said the block does not exist)."""
    import os
    import subprocess
    import sys
    import time

    data = (
        'base_path = "s3://bucket/data"\n'
        'storage_options = {endpoint_url = "http://127.0.0.1:1"}\n'
        'credentials_block = "aws-credentials/my-creds"'
    )
    path = s3_job(assets, tmp_path, data, f'url = "{tmp_path}/cache"')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PYTHONPATH=str(ROOT))
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "splitstage.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    check_one_line(
        done.returncode,
        done.stderr,
        "data.credentials_block",
        "no Prefect API is set",
        "prefect config set PREFECT_API_URL=",
    )
    assert not (tmp_path / "prefect-home" / "prefect.db").exists()  # no temporary server ran
    assert time.monotonic() - started < 30


def _one_block_sd3():
    """A real SD3 transformer whose only joint block is context_pre_only (no to_add_out)."""
    from diffusers import SD3Transformer2DModel

    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=16,
        out_channels=16,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=32,
        pos_embed_max_size=16,
    )


def test_default_lora_targets_adapt_to_the_model_and_named_ones_are_refused():
    from splitstage.config.base_group import ConfigError
    from splitstage.pipelines.diffusers.mmdit import MMDIT_LORA_TARGETS
    from splitstage.tasks.stage2.models import check_lora_targets

    model = _one_block_sd3()
    assert not any(name.endswith("attn.to_add_out") for name, _ in model.named_modules())
    kept = check_lora_targets(model, "transformer", list(MMDIT_LORA_TARGETS), 4, named=False)
    assert kept == [t for t in MMDIT_LORA_TARGETS if t != "attn.to_add_out"]
    with pytest.raises(ConfigError, match=r"attn.to_add_out name no module of 'transformer'"):
        check_lora_targets(model, "transformer", list(MMDIT_LORA_TARGETS), 4, named=True)
    with pytest.raises(ConfigError, match=r"the family's default LoRA targets .*set trainable"):
        check_lora_targets(model, "transformer", ["to_nothing"], 4, named=False)
