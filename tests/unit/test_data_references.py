"""Rows with reference images ('edit_image', alias 'control_image') in every metadata format:
parsed apart from the extras, keyed by content, listed, found missing and decoded like the
row's image, kept by the index memo, and checked against a family's rule."""

from __future__ import annotations

import io
import os
import time

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import (
    DataError,
    load_metadata,
    row_key,
    sample_key,
)
from splitstage.data.index import index_data_set
from splitstage.data.references import ReferenceImages, check_reference_rows, load_references
from splitstage.data.source import DataSource
from splitstage.tasks.stage1 import undecodable


def _png(color=(255, 0, 0), size=(8, 6)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, color).save(out, format="PNG")
    return out.getvalue()


@pytest.fixture
def base(tmp_path):
    """A target image and two reference images."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "t.png").write_bytes(_png())
    (tmp_path / "ref").mkdir()
    (tmp_path / "ref" / "a.png").write_bytes(_png((0, 255, 0)))
    (tmp_path / "ref" / "b.png").write_bytes(_png((0, 0, 255), (6, 8)))
    return tmp_path


CSV = (
    "image,prompt,edit_image,score\nimg/t.png,one,ref/a.png,1\n"
    'img/t.png,two,"[""ref/a.png"", ""ref/b.png""]",2\n'
)
JSONL = (
    '{"image": "img/t.png", "prompt": "one", "edit_image": "ref/a.png", "score": 1}\n'
    '{"image": "img/t.png", "prompt": "two", "control_image": ["ref/a.png", "ref/b.png"], '
    '"score": 2}\n'
)


def _write_parquet(base, listed: bool):
    refs = [["ref/a.png"], ["ref/a.png", "ref/b.png"]] if listed else ["ref/a.png", "ref/a.png"]
    table = pa.table(
        {"image": ["img/t.png"] * 2, "prompt": ["one", "two"], "edit_image": refs, "score": [1, 2]}
    )
    pq.write_table(table, base / "metadata.parquet")


@pytest.mark.parametrize("kind", ["csv", "jsonl", "parquet-list", "parquet-str"])
def test_every_metadata_format_reads_reference_images_apart_from_the_extras(base, kind):
    if kind == "csv":
        (base / "metadata.csv").write_text(CSV)
    elif kind == "jsonl":
        (base / "metadata.jsonl").write_text(JSONL)
    else:
        _write_parquet(base, listed=kind == "parquet-list")
    rows = load_metadata(base)
    second = ("ref/a.png",) if kind == "parquet-str" else ("ref/a.png", "ref/b.png")
    assert [r.references for r in rows] == [("ref/a.png",), second]
    assert [int(r.extras["score"]) for r in rows] == [1, 2]  # CSV cells are text
    assert all(set(r.extras) == {"score"} for r in rows)


def test_reference_bytes_are_in_the_key_and_their_paths_are_not(base):
    (base / "metadata.csv").write_text("image,prompt,edit_image\nimg/t.png,one,ref/a.png\n")
    (row,) = load_metadata(base)
    key = row_key(row, base)
    target = (base / "img" / "t.png").read_bytes()
    assert key == sample_key(target, "one", references=[(base / "ref" / "a.png").read_bytes()])
    assert key != sample_key(target, "one")  # a row without references keys as before
    (base / "ref" / "a.png").rename(base / "ref" / "moved.png")
    (base / "metadata.csv").write_text("image,prompt,edit_image\nimg/t.png,one,ref/moved.png\n")
    (moved,) = load_metadata(base)
    assert row_key(moved, base) == key  # renaming a reference keeps the key
    (base / "ref" / "moved.png").write_bytes(_png((1, 2, 3)))
    assert row_key(moved, base) != key  # its bytes do not


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "image,prompt,edit_image\nimg/t.png,one,ref/zz.png\n",
            r"^metadata.csv row 2 \(edit_image\): image file .*ref/zz.png not found",
        ),
        (
            "image,prompt,edit_image,control_image\nimg/t.png,one,ref/a.png,ref/b.png\n",
            r"^metadata.csv row 2: both 'edit_image' and 'control_image' are set",
        ),
        (
            'image,prompt,edit_image\nimg/t.png,one,"[""ref/a.png"", 3]"\n',
            r"^metadata.csv row 2: 'edit_image' must be a path or a list of paths",
        ),
        (
            "image,prompt,edit_image\nimg/t.png,one,clip.mp4\n",
            r"^metadata.csv row 2 \(edit_image\): 'clip.mp4' is a video",
        ),
    ],
)
def test_bad_reference_paths_are_one_line_naming_row_and_file(base, text, match):
    (base / "metadata.csv").write_text(text)
    with pytest.raises(DataError, match=match) as caught:
        load_metadata(base)
    assert "\n" not in str(caught.value)


def test_a_missing_or_undecodable_reference_is_a_bad_row_skip_bad_rows_skips(base):
    (base / "ref" / "bad.png").write_bytes(b"not a png")
    text = "image,prompt,edit_image\nimg/t.png,one,ref/a.png\nimg/t.png,two,ref/zz.png\n"
    (base / "metadata.csv").write_text(text + "img/t.png,three,ref/bad.png\n")
    rows, skipped = load_metadata(base, skip_bad_rows=True, check_images=True)
    assert [r.prompt for r in rows] == ["one"]
    assert [s.line for s in skipped] == [3, 4]
    assert "ref/bad.png" in skipped[1].reason and "row 4" in skipped[1].reason


def test_parquet_reference_column_must_hold_strings(base):
    table = pa.table({"image": ["img/t.png"], "prompt": ["one"], "edit_image": [[1, 2]]})
    pq.write_table(table, base / "metadata.parquet")
    with pytest.raises(DataError, match=r"column 'edit_image' is list<.*int64>, not strings"):
        load_metadata(base)


def _age(*paths) -> None:
    """Files a minute old: the index memo trusts no file written just before its listing."""
    stamp = time.time() - 60
    for path in paths:
        os.utime(path, (stamp, stamp))


def _config(base, tmp_path):
    return config_from_dict(
        {"data": {"base_path": str(base)}, "cache": {"url": str(tmp_path / "cache")}}
    )


def test_the_index_memo_keeps_references_and_sees_their_bytes_change(base, tmp_path):
    (base / "metadata.jsonl").write_text(JSONL)
    files = [base / "metadata.jsonl", *(base / "img").iterdir(), *(base / "ref").iterdir()]
    _age(*files)
    config = _config(base, tmp_path)
    first = index_data_set(config)
    assert not first.from_memo and first.hashed == 3  # target and both references, once each
    again = index_data_set(config)
    assert again.from_memo and again.keys == first.keys
    assert [r.references for r in again.rows] == [r.references for r in first.rows]
    (base / "ref" / "b.png").write_bytes(_png((9, 9, 9), (6, 8)))
    _age(base / "ref" / "b.png")
    changed = index_data_set(config)
    assert not changed.from_memo
    assert changed.keys[0] == first.keys[0] and changed.keys[1] != first.keys[1]
    with (base / "metadata.jsonl").open("a") as handle:  # an appended row parses alone
        handle.write('{"image": "img/t.png", "prompt": "three", "edit_image": "ref/b.png"}\n')
    _age(base / "metadata.jsonl")
    grown = index_data_set(config)
    assert grown.grown == 1 and grown.rows[2].references == ("ref/b.png",)
    assert index_data_set(config).rows[2].references == ("ref/b.png",)


def test_references_on_an_fsspec_url(tmp_path):
    fs = fsspec.filesystem("memory")
    fs.pipe({"/refs/img/t.png": _png(), "/refs/ref/a.png": _png((0, 255, 0))})
    fs.pipe(
        "/refs/metadata.jsonl",
        b'{"image": "img/t.png", "prompt": "a", "edit_image": "ref/a.png"}\n',
    )
    source = DataSource("memory://refs")
    (row,) = load_metadata(source)
    assert row_key(row, source) == sample_key(_png(), "a", references=[_png((0, 255, 0))])
    (image,) = load_references(row, source, ReferenceImages(), (16, 32))
    assert image.shape == (3, 16, 32) and float(image[1].mean()) == pytest.approx(1.0)
    fs.pipe(
        "/refs/metadata.jsonl",
        b'{"image": "img/t.png", "prompt": "a", "edit_image": "ref/zz.png"}\n',
    )
    with pytest.raises(
        DataError, match=r"row 1 \(edit_image\): image file memory://refs/ref/zz.png"
    ):
        load_metadata(source)


def test_a_family_sizes_references_as_it_states(base):
    (base / "metadata.csv").write_text(CSV)
    row = load_metadata(base)[1]
    same = load_references(row, base, ReferenceImages(most=2), (32, 48))
    assert [tuple(t.shape) for t in same] == [(3, 32, 48), (3, 32, 48)]
    own = load_references(row, base, ReferenceImages(most=2, max_pixels=64 * 64), (32, 48))
    assert [tuple(t.shape) for t in own] == [(3, 48, 64), (3, 64, 48)]  # areas <= 64 * 64


def test_an_undecodable_reference_names_row_and_file_and_is_recorded_without_its_path(base):
    (base / "ref" / "bad.png").write_bytes(b"not a png")
    (base / "metadata.csv").write_text("image,prompt,edit_image\nimg/t.png,one,ref/bad.png\n")
    (row,) = load_metadata(base)
    with pytest.raises(DataError, match=r"^metadata.csv row 2: .*ref/bad.png") as caught:
        load_references(row, base, ReferenceImages(), (16, 16))
    source = DataSource(str(base))

    class Store:
        def write_record(self, folder, key, value):
            self.value = value

    store = Store()
    reason = undecodable.record(store, "k", row, caught.value, source)
    assert "ref/bad.png" not in reason and undecodable.REFERENCE % 0 in reason
    index = type("Index", (), {"keys": ["k"], "rows": [row], "source": source})()
    ((line, message),) = undecodable.skipped_rows(index, {"k": reason})
    assert line == 2 and message.startswith("metadata.csv row 2: ") and "ref/bad.png" in message


def test_rows_that_do_not_fit_the_family_are_refused_in_one_line(base):
    (base / "metadata.csv").write_text(CSV)
    rows = load_metadata(base)
    with pytest.raises(
        DataError,
        match=(
            r"^metadata.csv row 2 has 'edit_image', metadata.csv row 3 has 'edit_image': the flux "
            r"family takes no reference images; set pipeline.name to a family that does "
            r"\('flux_kontext'\)"
        ),
    ):
        check_reference_rows(rows, None, "flux", lambda: ["flux_kontext"])
    with pytest.raises(
        DataError, match=r"^metadata.csv row 3 has 2 reference images: the k family takes at most 1"
    ):
        check_reference_rows(rows, ReferenceImages(), "k", list)
    check_reference_rows(rows, ReferenceImages(most=2), "k", list)
    (base / "metadata.csv").write_text("image,prompt\nimg/t.png,one\n")
    plain = load_metadata(base)
    with pytest.raises(
        DataError,
        match=r"^metadata.csv row 2 has no 'edit_image': the k family trains on a reference",
    ):
        check_reference_rows(plain, ReferenceImages(), "k", list)
    check_reference_rows(plain, ReferenceImages(required=False), "k", list)
    check_reference_rows(plain, None, "flux", list)


def test_references_on_s3_are_listed_keyed_and_found_missing(tmp_path, s3_bucket):
    url, options = s3_bucket
    source = DataSource(url, options)
    source.fs.pipe(
        {
            source.path("img/t.png"): _png(),
            source.path("ref/a.png"): _png((0, 255, 0)),
            source.path("metadata.csv"): b"image,prompt,edit_image\nimg/t.png,one,ref/a.png\n",
        }
    )
    config = config_from_dict(
        {
            "data": {
                "base_path": url,
                "storage_options": {"endpoint_url": options["client_kwargs"]["endpoint_url"]},
            },
            "cache": {"url": str(tmp_path / "cache")},
        }
    )
    built = index_data_set(config, use_memo=False)
    assert built.keys == [sample_key(_png(), "one", references=[_png((0, 255, 0))])]
    assert built.rows[0].references == ("ref/a.png",)
    source.fs.rm(source.path("ref/a.png"))
    with pytest.raises(
        DataError,
        match=r"^metadata.csv row 2 \(edit_image\): image file s3://.*ref/a.png not found",
    ):
        index_data_set(config, use_memo=False)
