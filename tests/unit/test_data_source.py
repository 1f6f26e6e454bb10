"""Data sets by URL: parquet metadata (with the csv/jsonl checks), one listing instead of a stat
per row, images read through fsspec (memory:// here; S3 in tests/integration/test_data_s3.py)."""

from __future__ import annotations

import io
import os
import posixpath
from pathlib import Path

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from splitstage.config.job import ConfigError, config_from_dict
from splitstage.data import source as data_source
from splitstage.data.dataset import (
    DataError,
    load_metadata,
    load_sample,
    read_image_bytes,
    sample_keys,
)
from splitstage.data.source import DataSource


def _png(color=(255, 0, 0), size=(8, 8)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, "PNG")
    return out.getvalue()


def _parquet(path: Path, table: pa.Table) -> None:
    pq.write_table(table, path)


@pytest.fixture
def base(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(_png((255, 0, 0)))
    (tmp_path / "img" / "b.png").write_bytes(_png((0, 0, 255), (16, 8)))
    return tmp_path


def test_parquet_metadata_reads_like_csv(base):
    table = pa.table(
        {"image": ["img/a.png", "img/b.png"], "prompt": ["red", "blue"], "score": [1.5, 2.0]}
    )
    _parquet(base / "metadata.parquet", table)
    rows = load_metadata(base)  # found by name, like metadata.csv
    assert [(r.line, r.image, r.prompt, r.extras) for r in rows] == [
        (1, "img/a.png", "red", {"score": 1.5}),
        (2, "img/b.png", "blue", {"score": 2.0}),
    ]
    (base / "metadata.csv").write_text("image,prompt,score\nimg/a.png,red,1.5\nimg/b.png,blue,2\n")
    from_csv = load_metadata(base, base / "metadata.csv")
    assert sample_keys(rows, base) != sample_keys(from_csv, base)  # extras typed: 1.5 vs "1.5"
    assert load_sample(rows[1], base, size=8)["score"] == 2.0


@pytest.mark.parametrize(
    "table, match",
    [
        (
            pa.table({"file": ["img/a.png"], "text": ["x"]}),
            r"missing column\(s\) 'image', 'prompt'",
        ),
        (pa.table({"image": ["img/a.png"], "prompt": [3]}), r"column 'prompt' is int64, not str"),
        (pa.table({"image": [1], "prompt": ["x"]}), r"column 'image' is int64, not strings"),
        (pa.table({"image": ["img/a.png"], "prompt": ["  "]}), r"row 1: empty 'prompt'"),
        (pa.table({"image": ["img/a.png"], "prompt": [None]}), r"row 1: empty 'prompt'"),
        (pa.table({"image": [None], "prompt": ["x"]}), r"row 1: empty 'image' field"),
        (
            pa.table({"image": ["img/a.png", "img/gone.png"], "prompt": ["x", "y"]}),
            r"metadata.parquet row 2: image file .*gone.png not found",
        ),
    ],
)
def test_bad_parquet_names_file_row_and_fix(base, table, match):
    _parquet(base / "metadata.parquet", table)
    with pytest.raises(DataError, match=match):
        load_metadata(base)


def test_parquet_bad_rows_are_skipped_and_bad_files_are_not(base):
    table = pa.table({"image": ["img/a.png", "img/x.png", "img/b.png"], "prompt": ["a", "b", ""]})
    _parquet(base / "metadata.parquet", table)
    rows, skipped = load_metadata(base, skip_bad_rows=True)
    assert [r.image for r in rows] == ["img/a.png"]
    assert [s.line for s in skipped] == [2, 3]
    (base / "metadata.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"metadata.parquet: not a readable parquet file"):
        load_metadata(base, skip_bad_rows=True)


def test_existence_comes_from_one_listing_not_a_stat_per_row(base, monkeypatch):
    for i in range(50):
        (base / "img" / f"{i}.png").write_bytes(_png((i, 0, 0)))
    lines = ["image,prompt", *(f"img/{i}.png,p{i}" for i in range(50)), "./img//a.png,dots"]
    (base / "metadata.csv").write_text("\n".join(lines) + "\n")
    calls = []
    real = Path.is_file
    monkeypatch.setattr(Path, "is_file", lambda p: calls.append(p) or real(p))
    scans = []
    real_scandir = os.scandir
    monkeypatch.setattr(data_source.os, "scandir", lambda p: scans.append(p) or real_scandir(p))
    rows = load_metadata(base)
    assert len(rows) == 51 and not calls
    assert scans == [os.path.join(str(base), "img")]  # the one folder the rows name


def test_data_set_on_an_fsspec_url(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe({"/ds/img/a.png": _png(), "/ds/img/b.png": _png((0, 255, 0))})
    fs.pipe("/ds/metadata.jsonl", b'{"image": "img/a.png", "prompt": "a"}\n')
    fs.pipe("/ds/meta/other.jsonl", b'{"image": "img/b.png", "prompt": "b"}\n')
    source = DataSource("memory://ds")
    rows = load_metadata(source)
    assert read_image_bytes(rows[0], source) == _png()  # the source handed down
    assert load_sample(rows[0], source, size=4)["image"].shape == (3, 4, 4)
    assert read_image_bytes(rows[0], "memory://ds") == _png()  # a URL alone: no options needed
    other = load_metadata(source, "memory://ds/meta/other.jsonl")
    assert other[0].image == "img/b.png"
    fs.pipe("/ds/metadata.jsonl", b'{"image": "img/zz.png", "prompt": "a"}\n')
    with pytest.raises(DataError, match=r"row 1: image file memory://ds/img/zz.png not found"):
        load_metadata(source)
    with pytest.raises(DataError, match=r"no metadata.csv or metadata.jsonl"):
        load_metadata(DataSource("memory://empty"))


def test_data_config_takes_urls_and_refuses_secrets_and_bad_blocks():
    config = config_from_dict(
        {
            "data": {
                "base_path": "s3://my-bucket//data/",
                "metadata_path": "s3://my-bucket/meta/m.parquet",
                "storage_options": {"endpoint_url": "http://127.0.0.1:9000/"},
                "credentials_block": "aws-credentials/my-creds",
            }
        }
    )
    assert config.data.base_path == "s3://my-bucket/data"
    assert config.data.storage_options == {"endpoint_url": "http://127.0.0.1:9000"}
    bad = {
        "data.storage_options: holds credentials (secret)": {"storage_options": {"secret": "x"}},
        "data.storage_options: endpoint_url": {"storage_options": {"endpoint_url": "ftp://h"}},
        "data.credentials_block: 'my-creds' is not a Prefect block name": {
            "credentials_block": "my-creds"
        },
        "data.base_path: 'memory://x'": {"base_path": "memory://x"},
    }
    for message, data in bad.items():
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            config_from_dict({"data": data})
    with pytest.raises(ConfigError, match=r"cache.storage_options: holds credentials"):
        config_from_dict({"cache": {"storage_options": {"key": "k"}}})


def test_source_reprs_and_pickles_carry_no_secrets():
    import pickle

    source = DataSource("s3://bucket/data", {"client_kwargs": {"region_name": "x"}}, "s3-bucket/b")
    copy = pickle.loads(pickle.dumps(source))
    assert (copy.url, copy.credentials_block) == ("s3://bucket/data", "s3-bucket/b")
    assert copy._fs is None  # opened again (and credentials read again) where it is used
    assert "bucket/data" in repr(copy)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(["a", "é", ".", "..", "", "b c"]), min_size=1, max_size=5))
def test_listed_folders_are_the_dirnames_of_the_listing_keys(parts):
    """The fast folder split agrees with posixpath.dirname on every key relative_key makes."""
    for lead in ("", "/", "//"):
        key = data_source.relative_key(lead + "/".join(parts))
        assert data_source._folders_of([key]) == {posixpath.dirname(key)}, key


def test_local_listing_has_regular_files_with_their_os_stat(tmp_path):
    """Regular files only (symlinks followed, broken ones and folders left out), with the sizes
    and mtimes os.stat gives."""
    for rel, body in {"a/x.png": b"12", "a/é y.png": b"345", "top.png": b"6"}.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(body)
    (tmp_path / "a" / "link.png").symlink_to(tmp_path / "top.png")
    (tmp_path / "a" / "broken.png").symlink_to(tmp_path / "nowhere.png")
    (tmp_path / "a" / "sub").mkdir()
    got = DataSource(str(tmp_path)).listing(["a/x.png", "top.png"]).files
    want = {}
    for rel in ("a/x.png", "a/é y.png", "a/link.png", "top.png"):
        stat = os.stat(tmp_path / rel)
        want[rel] = (stat.st_size, stat.st_mtime_ns)
    assert got == want
