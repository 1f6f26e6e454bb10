"""DiffSynth-format data sets: loading, every bad-data error, skipping, content-based keys, and
images of every mode decoded to the right pixels (or refused by name)."""

import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
import torch
from PIL import Image

from splitstage.data import dataset as data_module
from splitstage.data import images
from splitstage.data.dataset import (
    DataError,
    decode_image,
    image_to_tensor,
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


# -- images: every mode decodes to the right pixels or is refused by name -----------------------


def _encode(img, fmt, **kwargs):
    buffer = io.BytesIO()
    img.save(buffer, fmt, **kwargs)
    return buffer.getvalue()


def _chunk(kind, data):
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bytes(width, height, depth=8, colour=2, raw=b""):
    """A hand-built PNG: IHDR claims width x height; IDAT holds `raw` (may be short)."""
    header = struct.pack(">IIBBBBB", width, height, depth, colour, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", zlib.compress(raw))
        + _chunk(b"IEND", b"")
    )


def _one_image(base, name, data):
    """A data set of one row whose image file holds `data`; returns (row, base)."""
    (base / name).write_bytes(data)
    _csv(base, f"image,prompt\n{name},a caption\n")
    return load_metadata(base)[0], base


def _tensor(tmp_path, name, data, size=None):
    row, base = _one_image(tmp_path, name, data)
    return load_sample(row, base, size=size or Image.open(io.BytesIO(data)).size[::-1])["image"]


def test_16bit_png_maps_full_range_with_full_precision(tmp_path):
    values = np.array([[0, 32768, 65535, 256], [257, 1000, 1001, 65534]], dtype=np.uint16)
    data = _encode(Image.fromarray(values), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    image = _tensor(tmp_path, "gray16.png", data)
    assert image.shape == (3, 2, 4) and image.dtype == torch.float32
    expected = torch.from_numpy(values.astype(np.float32) / 65535 * 2 - 1)
    assert torch.allclose(image[0], expected, atol=1e-6) and torch.equal(image[0], image[2])
    assert abs(image[0, 0, 1].item()) < 1e-4  # mid-gray is ~0.0, not clipped to white
    assert image[0, 0, 3] < image[0, 1, 0] and image[0, 1, 1] < image[0, 1, 2]  # not 8-bit
    resized = _tensor(tmp_path, "gray16.png", data, size=8)
    assert resized.shape == (3, 8, 8) and resized.min() >= -1 and resized.max() <= 1
    assert len(torch.unique(resized)) > 8  # resized in float, not through 256 levels
    row = load_metadata(tmp_path)[0]
    rgb8 = decode_image(data, row, tmp_path)  # the 8-bit API rounds, with the right scaling
    assert rgb8.mode == "RGB" and rgb8.getpixel((1, 0)) == (128, 128, 128)


@pytest.mark.parametrize(
    ("mode", "value", "expected"),
    [("I;16B", 65535, 1.0), ("I;16", 0, -1.0), ("I", 32768, 0.0), ("F", 0.25, -0.5)],
)
def test_16bit_32bit_and_float_tiffs_in_range(tmp_path, mode, value, expected):
    image = _tensor(tmp_path, "x.tif", _encode(Image.new(mode, (3, 2), value), "TIFF"))
    assert torch.allclose(image, torch.full((3, 2, 3), expected), atol=1e-4)


@pytest.mark.parametrize(
    ("mode", "value", "match"),
    [
        ("I", 100000, r"integer image \(mode I\) with values 100000..100000, outside .*0..65535"),
        ("I", -5, r"mode I\) with values -5..-5"),
        ("F", 200.0, r"float image \(mode F\) with values 200..200, outside \[0, 1\]"),
        ("F", -0.5, r"mode F\) with values -0.5..-0.5"),
        ("F", float("nan"), r"float image \(mode F\) with NaN"),
    ],
)
def test_images_of_unknown_range_are_refused(tmp_path, mode, value, match):
    row, base = _one_image(tmp_path, "x.tif", _encode(Image.new(mode, (3, 2), value), "TIFF"))
    full = rf"metadata.csv row 2: image file .*x.tif .*{match}.*re-export it as an 8- or 16-bit PNG"
    with pytest.raises(DataError, match=full):
        load_sample(row, base)
    with pytest.raises(DataError, match=full):
        load_metadata(base, check_images=True)
    rows, skipped = load_metadata(base, skip_bad_rows=True, check_images=True)
    assert rows == [] and [s.line for s in skipped] == [2]


def test_transparency_is_composited_onto_white(tmp_path):
    palette = Image.new("P", (2, 2), 0)
    palette.putpalette([255, 0, 0, 0, 0, 255])
    cases = {
        "rgba.png": (_encode(Image.new("RGBA", (2, 2), (255, 0, 0, 0)), "PNG"), [1, 1, 1]),
        "half.png": (_encode(Image.new("RGBA", (2, 2), (0, 0, 0, 128)), "PNG"), [0, 0, 0]),
        "la.png": (_encode(Image.new("LA", (2, 2), (0, 0)), "PNG"), [1, 1, 1]),
        "p.png": (_encode(palette, "PNG", transparency=0), [1, 1, 1]),
        "opaque.png": (_encode(palette, "PNG"), [1, -1, -1]),
        "rgba.webp": (
            _encode(Image.new("RGBA", (2, 2), (0, 0, 0, 0)), "WEBP", lossless=True),
            [1] * 3,
        ),
        "trns16.png": (_encode(Image.new("I;16", (2, 2), 7), "PNG", transparency=7), [1, 1, 1]),
    }
    for name, (data, rgb) in cases.items():
        pixel = _tensor(tmp_path, name, data)[:, 0, 0]
        assert torch.allclose(pixel, torch.tensor(rgb, dtype=torch.float32), atol=0.01), name


def test_exif_orientation_is_applied(tmp_path):
    stored = Image.new("RGB", (8, 4), (0, 0, 0))
    stored.paste((255, 255, 255), (0, 0, 4, 4))  # left half white, as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to view"
    data = _encode(stored, "JPEG", exif=exif, quality=100)
    row, base = _one_image(tmp_path, "photo.jpg", data)
    upright = decode_image(data, row, base)
    assert upright.size == (4, 8)  # portrait, as a viewer shows it
    assert upright.getpixel((1, 1)) > (240,) * 3 and upright.getpixel((1, 6)) < (15,) * 3
    image = load_sample(row, base, size=(8, 4))["image"]
    assert image[:, :3].min() > 0.9 and image[:, 5:].max() < -0.9  # white on top


def test_cmyk_palette_bilevel_and_first_frame(tmp_path):
    red, blue = Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    cases = {
        "cmyk.jpg": _encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95),
        "anim.gif": _encode(red, "GIF", save_all=True, append_images=[blue]),
        "anim.png": _encode(red, "PNG", save_all=True, append_images=[blue]),
        "pages.tif": _encode(red, "TIFF", save_all=True, append_images=[blue]),
    }
    for name, data in cases.items():
        pixel = _tensor(tmp_path, name, data)[:, 0, 0]
        assert torch.allclose(pixel, torch.tensor([1.0, -1.0, -1.0]), atol=0.03), name
    white = _tensor(tmp_path, "bits.png", _encode(Image.new("1", (2, 2), 1), "PNG"))
    assert torch.equal(white, torch.ones(3, 2, 2))
    assert image_to_tensor(Image.new("L", (2, 2), 255)).shape == (3, 2, 2)  # any mode accepted


def test_16bit_colour_png_is_read_at_8_bits_and_said(tmp_path, caplog, monkeypatch):
    monkeypatch.setattr(images, "_warned_16bit_colour", False)
    raw = b"".join(b"\0" + struct.pack(">HHH", 65535, 32768, 0) * 2 for _ in range(2))
    with caplog.at_level("WARNING", logger="splitstage.data.images"):
        image = _tensor(tmp_path, "rgb16.png", png_bytes(2, 2, depth=16, raw=raw))
        _tensor(tmp_path, "rgb16.png", png_bytes(2, 2, depth=16, raw=raw))
    assert torch.allclose(image[:, 0, 0], torch.tensor([1.0, 1 / 255, -1.0]), atol=1e-4)
    said = [r.message for r in caplog.records if "16-bit colour" in r.message]
    assert len(said) == 1 and "rgb16.png" in said[0] and "8 bits a channel" in said[0]


@pytest.mark.parametrize(("width", "height"), [(100000, 100000), (10000, 10000)])
def test_decompression_bombs_are_refused(tmp_path, width, height):
    data = png_bytes(width, height)  # ~60 bytes; Pillow raises above 2x the limit, warns above 1x
    assert len(data) < 100
    row, base = _one_image(tmp_path, "bomb.png", data)
    claimed = f"{width * height:,} pixels"
    match = (
        rf"metadata.csv row 2: image file .*bomb.png claims {claimed} in its header, over the "
        rf"limit of {Image.MAX_IMAGE_PIXELS:,} \(PIL.Image.MAX_IMAGE_PIXELS"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning escapes either
        with pytest.raises(DataError, match=match):
            load_sample(row, base)
        with pytest.raises(DataError, match=match):
            decode_image(data, row, base)
    rows, skipped = load_metadata(base, skip_bad_rows=True, check_images=True)
    assert rows == [] and "claims" in skipped[0].reason


@pytest.mark.parametrize(
    ("name", "data", "match"),
    [
        ("empty.png", png_bytes(0, 5), r"is corrupt or not an image \(unknown image format\)"),
        ("lab.tif", _encode(Image.new("LAB", (2, 2)), "TIFF"), r"is in LAB colour"),
        (
            "exif.jpg",
            _encode(Image.new("RGB", (4, 4)), "JPEG", exif=b"Exif\0\0MM\0\x2a\0\0\0\x08\0\x05"),
            r"has corrupt EXIF data .*orientation is unknown",
        ),
        ("cut.jpg", _encode(Image.new("RGB", (64, 64)), "JPEG")[:300], r"is corrupt"),
        ("x.eps", _encode(Image.new("RGB", (4, 4)), "EPS"), r"is corrupt .*unknown image format"),
        ("short.png", png_bytes(4, 4, raw=b"\0" * 5), r"is corrupt"),
    ],
)
def test_unusable_images_name_row_and_file(tmp_path, name, data, match):
    row, base = _one_image(tmp_path, name, data)
    with pytest.raises(DataError, match=rf"metadata.csv row 2: image file .*{name} {match}"):
        load_sample(row, base)


def test_oversized_files_and_unusable_paths(tmp_path, monkeypatch):
    _png(tmp_path / "big.png", (1, 2, 3))
    monkeypatch.setattr(images, "MAX_IMAGE_FILE_BYTES", 10)
    row, base = _one_image(tmp_path, "big.png", (tmp_path / "big.png").read_bytes())
    with pytest.raises(DataError, match=r"row 2: image file .*big.png is \d+ bytes, over the 10"):
        read_image_bytes(row, base)
    _csv(tmp_path, f"image,prompt\n{'x' * 5000}.png,long\n")
    with pytest.raises(DataError, match=r"metadata.csv row 2: image path .* is unusable"):
        load_metadata(tmp_path)


# -- metadata files: encodings, JSON shapes and types, quoting, folders, empty files ------------


def test_metadata_that_is_not_utf8_names_the_line(base):
    good = "".join(f"img/a.png,caption {i}\n" for i in range(600))  # past any read chunk
    (base / "metadata.csv").write_bytes(f"image,prompt\n{good}".encode() + b"img/a.png,caf\xe9\n")
    with pytest.raises(
        DataError, match=r"metadata.csv line 602: not UTF-8 text \(byte 0xe9 at column 14\)"
    ):
        load_metadata(base)
    (base / "metadata.csv").unlink()
    (base / "metadata.jsonl").write_bytes(b'{"image": "img/a.png", "prompt": "caf\xe9"}\n')
    with pytest.raises(
        DataError, match=r"metadata.jsonl line 1: not UTF-8 .*save the file as UTF-8"
    ):
        load_metadata(base, skip_bad_rows=True)  # how the file was saved: not a row problem
    (base / "metadata.jsonl").write_bytes(png_bytes(4, 4))  # binary junk
    with pytest.raises(DataError, match=r"metadata.jsonl line 1: not UTF-8 text \(byte 0x89"):
        load_metadata(base)
    (base / "metadata.jsonl").write_bytes("image,prompt\n".encode("utf-16"))
    with pytest.raises(DataError, match=r"metadata.jsonl is UTF-16 text; save it as UTF-8"):
        load_metadata(base)
    (base / "metadata.jsonl").write_bytes(b'{"image": "img/a.png"}\n{"prompt": "x\0"}\n')
    with pytest.raises(DataError, match=r"metadata.jsonl line 2: NUL byte"):
        load_metadata(base)
    (base / "metadata.jsonl").unlink()
    (base / "metadata.csv").write_bytes(
        b"\xef\xbb\xbfimage,prompt\r\nimg/a.png,\xc3\xa9t\xc3\xa9\r\n"
    )
    assert [r.prompt for r in load_metadata(base)] == ["\u00e9t\u00e9"]  # UTF-8 BOM and CRLF fine


def test_csv_with_nul_bytes(base):
    (base / "metadata.csv").write_bytes(b"image,prompt\nimg/a.png,ok\nimg/b.png,b\x00ad\n")
    with pytest.raises(DataError, match=r"metadata.csv line 3: NUL byte; .*save it as UTF-8"):
        load_metadata(base)


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("[" * 100000, r"row 2: JSON nested too deeply"),
        ('{"image": "img/a.png", "prompt": {"a": ' * 5000 + "1" + "}" * 5000, "nested too deeply"),
        (
            '{"image": "img/a.png", "prompt": 3}',
            r"row 2: 'prompt' must be text, got a number \(3\)",
        ),
        ('{"image": "img/a.png", "prompt": ["a"]}', r"'prompt' must be text, got a list"),
        ('{"image": "img/a.png", "prompt": null}', r"row 2: empty 'prompt'"),
        ('{"image": "img/a.png", "prompt": true}', r"'prompt' must be text, got true/false"),
        ('{"image": 7, "prompt": "x"}', r"row 2: 'image' must be a path string, got a number"),
        ('{"image": ["img/a.png"], "prompt": "x"}', r"'image' must be a path string, got a list"),
        ('{"image": null, "prompt": "x"}', r"row 2: empty 'image' field"),
        ('{"image": "img/a.png", "prompt": "x", "prompt": "y"}', r"key 'prompt' appears twice"),
        ('{"image": "img/a.png", "prompt": "x", "n": 1' + "0" * 5000 + "}", r"not usable JSON"),
        ('{"image": "img/a.png", "prompt": "bad \\ud800"}', r"row 2: .*unpaired surrogate"),
        ("3", r"row 2: expected a JSON object .*got a number \(3\)"),
        ('"img/a.png"', r"expected a JSON object .*got text"),
    ],
)
def test_jsonl_bad_lines_are_row_errors(base, line, match):
    _jsonl(
        base, [{"image": "img/a.png", "prompt": "ok"}, line, {"image": "img/b.png", "prompt": "b"}]
    )
    with pytest.raises(DataError, match=rf"metadata.jsonl {match}" if "row" in match else match):
        load_metadata(base)
    rows, skipped = load_metadata(base, skip_bad_rows=True)
    assert [r.line for r in rows] == [1, 3] and [s.line for s in skipped] == [2]


def test_jsonl_line_too_long(base, monkeypatch):
    monkeypatch.setattr(data_module, "MAX_LINE_CHARS", 100)
    _jsonl(
        base, [{"image": "img/a.png", "prompt": "x" * 200}, {"image": "img/b.png", "prompt": "b"}]
    )
    with pytest.raises(
        DataError, match=r"metadata.jsonl row 1: line is 2\d\d characters, over the limit of 100"
    ):
        load_metadata(base)
    assert [r.line for r in load_metadata(base, skip_bad_rows=True)[0]] == [2]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            'image,prompt\nimg/a.png,ok\nimg/b.png,"never closed\nimg/a.png,swallowed\n',
            r"metadata.csv row 3: a quote \(\"\) opened here is never closed",
        ),
        ('image,prompt\nimg/a.png,"quoted" tail\n', r"row 2: text after a closing quote"),
        ("image,prompt\nimg/a.png," + "x" * 200000 + "\n", r"row 2: a cell is longer than 131,072"),
        (
            "image,prompt,prompt\nimg/a.png,a,b\n",
            r"row 1 \(header\): column\(s\) 'prompt' appear more",
        ),
        ("", r"metadata file .*metadata.csv is empty"),
        (" \n\n", r"is empty"),
        ("image,prompt\n", r"metadata file .*metadata.csv has no rows"),
    ],
)
def test_csv_quoting_columns_and_empty_files(base, text, match):
    _csv(base, text)
    with pytest.raises(DataError, match=match):
        load_metadata(base, skip_bad_rows=True)  # file-level: raised even when skipping rows


def test_metadata_that_is_a_folder(base):
    (base / "metadata.csv").mkdir()
    with pytest.raises(DataError, match=r"metadata.csv is a folder, not a file"):
        load_metadata(base)
    with pytest.raises(DataError, match=r"metadata file .*metadata.csv is a folder"):
        load_metadata(base, base / "metadata.csv")
    (base / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataError, match=r"empty.jsonl is empty"):
        load_metadata(base, base / "empty.jsonl")
