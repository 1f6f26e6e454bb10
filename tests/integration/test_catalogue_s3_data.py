"""The bad-input catalogue for data sets on object storage (real S3 endpoint: moto server on
loopback): buckets that do not exist and image paths that cannot name an object under the base.
Each case runs the real CLI entry point and must print ONE line naming the row or field, exit 2;
with `skip_bad_rows` a bad path is skipped and named instead."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, config_text, run_cli

assets = catalogue.assets  # the shared module-scoped fixture

pytestmark = pytest.mark.slow


@pytest.fixture
def s3_data(assets, s3_bucket, monkeypatch):
    """The tiny digits data set uploaded under s3://bucket/prefix/data; yields (fs, endpoint)."""
    import s3fs

    _, options = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    fs = s3fs.S3FileSystem(**options)
    local = assets / "data"
    fs.pipe(
        {
            f"bucket/prefix/data/{path.relative_to(local).as_posix()}": path.read_bytes()
            for path in local.rglob("*")
            if path.is_file()
        }
    )
    return fs, options["client_kwargs"]["endpoint_url"]


def job(assets: Path, tmp: Path, endpoint: str, base: str, data_extra: str = "") -> Path:
    """A tiny job reading its data from `base` on the endpoint, caching under tmp."""
    options = f'storage_options = {{endpoint_url = "{endpoint}"}}\n'
    text = config_text(assets).replace(f'base_path = "{assets}/data"\n', "")
    text = text.replace("[data]\n", f'[data]\nbase_path = "{base}"\n{options}{data_extra}')
    text = text.replace(f"{assets}/cache", f"{tmp}/cache")
    path = tmp / "job.toml"
    path.write_text(text)
    return path


def with_row(fs, image: str) -> None:
    """Append a row naming `image` to the uploaded metadata.csv."""
    name = "bucket/prefix/data/metadata.csv"
    fs.pipe({name: fs.cat_file(name) + f"{image},a digit\n".encode()})


def test_buckets_that_do_not_exist_are_named(assets, tmp_path, s3_data, capsys):
    fs, endpoint = s3_data
    base = job(assets, tmp_path, endpoint, "s3://no-such-bucket/data")
    check_one_line(
        *run_cli(["validate", str(base)], capsys),
        "data.base_path s3://no-such-bucket/data",
        "bucket 'no-such-bucket' does not exist",
    )
    meta = job(
        assets,
        tmp_path,
        endpoint,
        "s3://bucket/prefix/data",
        'metadata_path = "s3://gone-bucket/metadata.csv"\n',
    )
    check_one_line(
        *run_cli(["validate", str(meta)], capsys),
        "metadata file s3://gone-bucket/metadata.csv",
        "bucket 'gone-bucket' does not exist",
        "data.metadata_path",
    )


PATH_CASES = {
    "absolute": ("/home/me/data/images/00000.png", ["is absolute", "relative to data.base_path"]),
    "climbs out": ("../other/00000.png", ["climbs out of data.base_path", "'..'"]),
    "a URL": ("s3://bucket/prefix/data/images/00000.png", ["is a URL", "relative to"]),
    "a folder marker": ("images/", ["names a folder, not a file"]),
}


@pytest.mark.parametrize("case", sorted(PATH_CASES))
def test_image_paths_that_cannot_name_an_object_are_refused_or_skipped(
    case, assets, tmp_path, s3_data, capsys
):
    fs, endpoint = s3_data
    image, needles = PATH_CASES[case]
    fs.pipe({"bucket/prefix/other/00000.png": b"x"})  # what '../other/...' would mean on disk
    with_row(fs, image)
    rows = len(fs.cat_file("bucket/prefix/data/metadata.csv").decode().splitlines())
    strict = job(assets, tmp_path, endpoint, "s3://bucket/prefix/data")
    check_one_line(*run_cli(["validate", str(strict)], capsys), f"row {rows}", *needles)

    lenient = job(assets, tmp_path, endpoint, "s3://bucket/prefix/data", "skip_bad_rows = true\n")
    code, err = run_cli(["preprocess", str(lenient)], capsys)
    assert code == 0, err
    assert f"skipped (data.skip_bad_rows) metadata.csv row {rows}: " in err
    assert needles[0] in err


def test_a_url_in_a_local_data_set_is_refused(assets, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(assets / "data", data)
    with open(data / "metadata.csv", "a") as fh:
        fh.write("https://example.com/cat.png,a cat\n")
    path = tmp_path / "job.toml"
    path.write_text(config_text(assets, data=data).replace(f"{assets}/cache", f"{tmp_path}/c"))
    check_one_line(*run_cli(["validate", str(path)], capsys), "is a URL", "metadata.csv row 8")
