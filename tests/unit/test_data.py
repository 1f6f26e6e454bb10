"""DiffSynth-format data sets: loading, every bad-data error, skipping, content-based keys."""

import json

import pytest
import torch
from PIL import Image

from splitstage.pipelines.data import (
    DataError,
    load_metadata,
    load_sample,
    read_image_bytes,
    row_key,
    sample_key,
    sample_keys,
)


def _png(path, color, size=(16, 16)):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)


def _csv(base, text):
    (base / "metadata.csv").write_text(text)
    return base


def _jsonl(base, records):
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    (base / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return base


@pytest.fixture
def base(tmp_path):
    _png(tmp_path / "img" / "a.png", (255, 0, 0))
    _png(tmp_path / "img" / "b.png", (0, 0, 255), size=(32, 16))
    return tmp_path


def test_csv_rows_extras_and_sample(base):
    _csv(base, 'image,prompt,style\nimg/a.png,a red square,flat\n\nimg/b.png,"blue, wide",glossy\n')
    rows = load_metadata(base)
    assert [(r.line, r.image, r.prompt, r.extras) for r in rows] == [
        (2, "img/a.png", "a red square", {"style": "flat"}),
        (4, "img/b.png", "blue, wide", {"style": "glossy"}),  # blank line 3 counts
    ]
    sample = load_sample(rows[1], base, size=8)
    assert sample["image"].shape == (3, 8, 8) and sample["image"].dtype == torch.float32
    assert sample["image"][2].min() == 1.0 and sample["image"][0].max() == -1.0  # blue in [-1,1]
    assert (sample["prompt"], sample["height"], sample["width"], sample["style"]) == (
        "blue, wide",
        8,
        8,
        "glossy",
    )


def test_jsonl_rows_and_explicit_path(base):
    _jsonl(
        base,
        [
            {"image": "img/a.png", "prompt": "red", "seed": 3},
            "",
            {"image": "img/b.png", "prompt": "blue"},
        ],
    )
    rows = load_metadata(base, base / "metadata.jsonl")
    assert [(r.line, r.extras) for r in rows] == [(1, {"seed": 3}), (3, {})]
    assert load_sample(rows[0], base, size=(16, 8))["image"].shape == (3, 16, 8)


@pytest.mark.parametrize(
    "kind, content, match",
    [
        (
            "csv",
            "image,prompt\nimg/a.png,ok\nimg/missing.png,gone\n",
            r"metadata.csv row 3: image file .*missing.png not found",
        ),
        (
            "csv",
            "image,prompt\nimg/a.png,ok\nimg/b.png,  \n",
            r"metadata.csv row 3: empty 'prompt' for image 'img/b.png'",
        ),
        (
            "csv",
            "file_name,text\nimg/a.png,ok\n",
            r"metadata.csv row 1 \(header\): missing column\(s\) 'image', 'prompt'; "
            r"columns found: 'file_name', 'text'",
        ),
        ("csv", "image,prompt\nimg/a.png,ok,extra\n", r"metadata.csv row 2: more cells"),
        (
            "jsonl",
            [{"image": "img/a.png", "prompt": "ok"}, '{"image": "img/b.png", prompt}'],
            r"metadata.jsonl row 2: not valid JSON",
        ),
        (
            "jsonl",
            [{"image": "img/a.png", "prompt": "ok"}, {"image": "img/b.png", "text": "x"}],
            r"metadata.jsonl row 2: missing column\(s\) 'prompt'; columns found: 'image', 'text'",
        ),
        ("jsonl", ['["img/a.png", "ok"]'], r"metadata.jsonl row 1: expected a JSON object"),
    ],
)
def test_bad_rows_name_row_and_file(base, kind, content, match):
    _csv(base, content) if kind == "csv" else _jsonl(base, content)
    with pytest.raises(DataError, match=match):
        load_metadata(base)


def test_corrupt_image_names_row_and_file(base):
    (base / "img" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    _csv(base, "image,prompt\nimg/a.png,ok\nimg/bad.png,broken\n")
    rows = load_metadata(base)  # existence only; decoding happens in load_sample
    with pytest.raises(DataError, match=r"metadata.csv row 3: image file .*bad.png is corrupt"):
        load_sample(rows[1], base)
    with pytest.raises(DataError, match=r"row 3: image file .*bad.png is corrupt"):
        load_metadata(base, check_images=True)


def test_bad_metadata_files(base):
    with pytest.raises(DataError, match="no metadata.csv or metadata.jsonl"):
        load_metadata(base)
    (base / "meta.txt").write_text("image,prompt\n")
    with pytest.raises(DataError, match=r"meta.txt is not .csv or .jsonl"):
        load_metadata(base, base / "meta.txt")
    _csv(base, "image,prompt\n")
    _jsonl(base, [])
    with pytest.raises(DataError, match="both metadata.csv and metadata.jsonl"):
        load_metadata(base)
    with pytest.raises(DataError, match="does not exist"):
        load_metadata(base / "nope")


def test_skip_bad_rows_reports_counts(base):
    (base / "img" / "bad.png").write_bytes(b"garbage")
    _jsonl(
        base,
        [
            {"image": "img/a.png", "prompt": "red"},
            "{broken",
            {"image": "img/nope.png", "prompt": "x"},
            {"image": "img/b.png", "prompt": ""},
            {"image": "img/bad.png", "prompt": "corrupt"},
            {"image": "img/b.png", "prompt": "blue"},
        ],
    )
    rows, skipped = load_metadata(base, skip_bad_rows=True, check_images=True)
    assert [r.line for r in rows] == [1, 6]
    assert [s.line for s in skipped] == [2, 3, 4, 5]
    assert all(f"row {s.line}:" in s.reason for s in skipped)
    rows, skipped = load_metadata(base, skip_bad_rows=True)  # corrupt file not decoded here
    assert len(rows) == 3 and len(skipped) == 3


def test_sample_keys_follow_content_not_paths(base, tmp_path_factory):
    _csv(base, "image,prompt,style\nimg/a.png,red,flat\nimg/b.png,blue,glossy\n")
    keys = sample_keys(load_metadata(base), base)
    assert len(set(keys)) == 2 and all(len(k) == 64 for k in keys)

    moved = tmp_path_factory.mktemp("moved")  # renamed files, reordered rows, columns swapped
    (moved / "x").mkdir()
    (moved / "x" / "first.png").write_bytes((base / "img" / "b.png").read_bytes())
    (moved / "x" / "second.png").write_bytes((base / "img" / "a.png").read_bytes())
    _csv(moved, "style,prompt,image\nglossy,blue,x/first.png\nflat,red,x/second.png\n")
    assert sample_keys(load_metadata(moved), moved) == keys[::-1]

    rows = load_metadata(moved)
    _png(moved / "x" / "second.png", (254, 0, 0))  # edit the image: key changes
    assert row_key(rows[1], moved) != keys[0]
    data = read_image_bytes(rows[0], moved)
    assert sample_key(data, "blue", {"style": "glossy"}) == keys[1]
    assert sample_key(data, "blue!", {"style": "glossy"}) != keys[1]
    assert sample_key(data, "blue", {"style": "matte"}) != keys[1]
    assert sample_key(data, "blue", {"a": 1, "b": 2}) == sample_key(data, "blue", {"b": 2, "a": 1})
