"""The bad-input catalogue for data content: images and metadata files that Pillow or the csv/json
readers would turn into tracebacks or wrong pixels. Each case runs the real CLI entry point
(`splitstage preprocess CONFIG`) and must print ONE line naming the row and file, exit 2.
"""

from __future__ import annotations

import json
import shutil
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers import catalogue
from tests.helpers.catalogue import check_one_line, config_text, run_cli

assets = catalogue.assets  # the shared module-scoped fixture

pytestmark = pytest.mark.slow


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def bomb_png(width: int = 100000, height: int = 100000) -> bytes:
    """A ~60-byte PNG whose header claims width x height RGB pixels."""
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"")
    return (
        b"\x89PNG\r\n\x1a\n"
        + _chunk(b"IHDR", header)
        + _chunk(b"IDAT", idat)
        + _chunk(b"IEND", b"")
    )


def copy_data(assets: Path, tmp: Path) -> tuple[Path, list[str]]:
    """A copy of the tiny digits data set and its metadata.csv lines."""
    data = tmp / "data"
    shutil.copytree(assets / "data", data)
    return data, (data / "metadata.csv").read_text().splitlines()


def first_image(lines: list[str]) -> str:
    return lines[1].split(",", 1)[0]


def bomb(data: Path, lines: list[str]) -> None:
    (data / first_image(lines)).write_bytes(bomb_png())


def latin1_metadata(data: Path, lines: list[str]) -> None:
    extra = f"{first_image(lines)},un caf\xe9 \xe9crit \xe0 la main\n".encode("latin-1")
    (data / "metadata.csv").write_bytes("\n".join(lines).encode() + b"\n" + extra)


def nested_jsonl(data: Path, lines: list[str]) -> None:
    (data / "metadata.csv").unlink()
    records = [json.dumps(dict(zip(("image", "prompt"), line.split(",", 1)))) for line in lines[1:]]
    records.insert(1, "[" * 100000)
    (data / "metadata.jsonl").write_text("\n".join(records) + "\n")


def float_out_of_range(data: Path, lines: list[str]) -> None:
    Image.new("F", (64, 64), 200.0).save(data / "images" / "hdr.tif")
    lines[2] = "images/hdr.tif," + lines[2].split(",", 1)[1]
    (data / "metadata.csv").write_text("\n".join(lines) + "\n")


def video_row_for_images(data: Path, lines: list[str]) -> None:
    from tests.helpers.video_files import write_video

    write_video(data / "clips" / "a.mp4", 3)
    lines[2] = "clips/a.mp4," + lines[2].split(",", 1)[1]
    (data / "metadata.csv").write_text("\n".join(lines) + "\n")


def video_named_as_image(data: Path, lines: list[str]) -> None:
    from tests.helpers.video_files import write_video

    flv = write_video(data / "clip.flv", 3, codec="flv")
    shutil.move(flv, data / first_image(lines))


CASES = {
    "decompression bomb": (
        bomb,
        ["metadata.csv row 2", "00000.png", "claims 10,000,000,000 pixels", "89,478,485"],
    ),
    "metadata not UTF-8": (latin1_metadata, ["metadata.csv line 8", "not UTF-8", "byte 0xe9"]),
    "deeply nested JSONL": (nested_jsonl, ["metadata.jsonl row 2", "nested too deeply"]),
    "video rows for an image family": (
        video_row_for_images,
        ["metadata.csv row 3 (clips/a.mp4): video files, but the 'demo' family trains on images"],
    ),
    "a video under an image's name": (
        video_named_as_image,
        ["metadata.csv row 2", "00000.png is a video (FLV (Flash Video), 'flv'), not an image"],
    ),
    "float image out of range": (
        float_out_of_range,
        ["metadata.csv row 3", "hdr.tif", "mode F", "outside [0, 1]", "16-bit PNG"],
    ),
}


def job(assets: Path, tmp: Path, data: Path, skip: bool = False) -> Path:
    text = config_text(assets, data=data).replace(f"{assets}/cache", f"{tmp}/cache")
    if skip:
        text = text.replace("[data]\n", "[data]\nskip_bad_rows = true\n")
    path = tmp / "job.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_data_content_prints_one_line(case, assets, tmp_path, capsys):
    breaks, needles = CASES[case]
    data, lines = copy_data(assets, tmp_path)
    breaks(data, lines)
    check_one_line(*run_cli(["preprocess", str(job(assets, tmp_path, data))], capsys), *needles)


def test_video_rows_for_an_image_family_are_refused_by_validate(assets, tmp_path, capsys):
    data, lines = copy_data(assets, tmp_path)
    video_row_for_images(data, lines)
    code, err = run_cli(["validate", str(job(assets, tmp_path, data))], capsys)
    check_one_line(code, err, "metadata.csv row 3 (clips/a.mp4)", "video rows train with 'wan'")


def check_skipped_named(code: int, err: str, *needles: str) -> None:
    """Exit 0, and one warning naming the skipped row and why (and no traceback)."""
    assert code == 0 and "Traceback" not in err, err
    warnings = [line for line in err.split("\n") if line.startswith("splitstage: warning: ")]
    assert len(warnings) == 1, err
    for needle in ("skipped (data.skip_bad_rows)", *needles):
        assert needle in warnings[0], f"{needle!r} not in {warnings[0]!r}"


def test_skip_bad_rows_skips_a_nested_line(assets, tmp_path, capsys):
    data, lines = copy_data(assets, tmp_path)
    nested_jsonl(data, lines)
    code, err = run_cli(["preprocess", str(job(assets, tmp_path, data, skip=True))], capsys)
    check_skipped_named(code, err, "metadata.jsonl row 2", "nested too deeply")


def test_skip_bad_rows_skips_a_bomb(assets, tmp_path, capsys):
    data, lines = copy_data(assets, tmp_path)
    bomb(data, lines)
    code, err = run_cli(["preprocess", str(job(assets, tmp_path, data, skip=True))], capsys)
    check_skipped_named(code, err, "metadata.csv row 2", "pixels")


def test_16bit_png_data_set_preprocesses(assets, tmp_path, capsys):
    data, lines = copy_data(assets, tmp_path)
    for line in lines[1:]:
        path = data / first_image([lines[0], line])
        gray = np.asarray(Image.open(path).convert("L"), dtype=np.uint16) * 257  # 0..65535
        Image.fromarray(gray).save(path)
        assert Image.open(path).mode == "I;16"
    code, err = run_cli(["preprocess", str(job(assets, tmp_path, data))], capsys)
    assert code == 0, err
    assert "Traceback" not in err and "16-bit colour" not in err
