"""Video rows in every metadata format (csv, jsonl, parquet; `video` next to or instead of
`image`), their messages, and their sample keys: the whole file's hash, read in pieces."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from splitstage.config.job import config_from_dict
from splitstage.data import dataset, index
from splitstage.data.dataset import (
    DataError,
    Row,
    file_digest,
    load_metadata,
    sample_key,
    sample_keys,
)
from splitstage.data.index import index_data_set
from splitstage.data.source import DataSource


@pytest.fixture
def base(tmp_path: Path) -> Path:
    """A data set folder with a tiny image and two 'videos' (hashing never decodes them)."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(b"png bytes")
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips" / "a.mp4").write_bytes(b"mp4 bytes a")
    (tmp_path / "clips" / "b.mkv").write_bytes(b"mkv bytes b")
    return tmp_path


def test_csv_and_parquet_accept_a_video_column(base):
    (base / "metadata.csv").write_text("video,prompt\nclips/a.mp4,one\nclips/b.mkv,two\n")
    rows = load_metadata(base)
    assert [(r.image, r.extras) for r in rows] == [("clips/a.mp4", {}), ("clips/b.mkv", {})]
    (base / "metadata.csv").unlink()
    table = pa.table({"video": ["clips/a.mp4"], "prompt": ["one"], "score": [2]})
    pq.write_table(table, base / "metadata.parquet")
    (row,) = load_metadata(base)
    assert (row.image, row.extras) == ("clips/a.mp4", {"score": 2})


def test_image_and_video_columns_together_one_file_a_row(base):
    """A header may have both columns (mixed data sets); each row fills exactly one."""
    text = "image,video,prompt\nimg/a.png,,an image\n  ,clips/a.mp4,a clip\n"
    (base / "metadata.csv").write_text(text)
    rows = load_metadata(base)
    assert [(r.image, r.extras) for r in rows] == [("img/a.png", {}), ("clips/a.mp4", {})]
    keys = sample_keys(rows, base)
    (base / "metadata.csv").write_text("video,prompt\nclips/a.mp4,a clip\n")
    assert sample_keys(load_metadata(base), base) == keys[1:]  # the empty column is no field
    (base / "metadata.csv").write_text(text + "img/a.png,clips/a.mp4,both\n")
    with pytest.raises(DataError) as both:
        load_metadata(base)
    assert str(both.value) == (
        "metadata.csv row 4: both 'image' ('img/a.png') and 'video' ('clips/a.mp4') are set; "
        "a row names one file: keep one, or split it into two rows"
    )
    (base / "metadata.csv").write_text(text + ",,neither\n")
    with pytest.raises(DataError, match=r"^metadata.csv row 4: neither 'image' nor 'video' is set"):
        load_metadata(base)
    lines = [{"image": "img/a.png", "video": "clips/a.mp4", "prompt": "x"}]
    (base / "metadata.csv").unlink()
    (base / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(DataError, match=r"^metadata.jsonl row 1: both 'image'"):
        load_metadata(base)


@pytest.mark.parametrize(
    "content, match",
    [
        (
            "video,prompt\nclips/gone.mp4,x\n",
            r"^metadata.csv row 2: video file .*gone.mp4 not found",
        ),
        ("video,prompt\nclips/a.mp4,  \n", r"^metadata.csv row 2: empty 'prompt' for video 'c"),
        ("video,prompt\n,x\n", r"^metadata.csv row 2: empty 'video' field; give the video path"),
        (
            "video,prompt\nhttp://x/a.mp4,x\n",
            r"^metadata.csv row 2: video 'http://x/a.mp4' is a URL",
        ),
        ("file,prompt\na.mp4,x\n", r"missing column\(s\) 'image'; .*'image' \(or 'video'\)"),
    ],
)
def test_messages_of_video_rows_say_video(base, content, match):
    (base / "metadata.csv").write_text(content)
    with pytest.raises(DataError, match=match):
        load_metadata(base)


def test_parquet_video_column_must_hold_strings(base):
    pq.write_table(pa.table({"video": [3], "prompt": ["x"]}), base / "metadata.parquet")
    with pytest.raises(DataError, match=r"column 'video' is int64, not strings; store the video"):
        load_metadata(base)


class _Counted:
    """A real file object whose reads are recorded (sizes asked, bytes given)."""

    def __init__(self, handle, sizes: list[int]):
        self._handle, self._sizes = handle, sizes

    def readinto(self, buffer) -> int:
        count = self._handle.readinto(buffer)
        self._sizes.append(count)
        return count

    def read(self, size: int = -1) -> bytes:
        data = self._handle.read(size)
        self._sizes.append(len(data))
        return data

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._handle.close()


def _big_video(path: Path, size: int) -> bytes:
    """A file of `size` pseudo-random bytes named like a video (hashing never decodes it)."""
    block = hashlib.sha256(b"seed").digest() * (1 << 15)  # 1 MiB
    data = (block * (size // len(block) + 1))[:size]
    path.write_bytes(data)
    return data


def test_a_long_video_is_hashed_in_pieces_and_keyed_by_the_whole_file(tmp_path, monkeypatch):
    """The data index hashes a 40 MiB video through a real file object in HASH_BLOCK reads,
    never holding it whole (peak traced memory under half the file), and its key is the whole
    file's; files up to STREAM_ABOVE are still read whole."""
    data = tmp_path / "data"
    data.mkdir()
    whole = _big_video(data / "long.mp4", 40 << 20)
    digest = hashlib.sha256(whole).digest()
    del whole
    (data / "short.mp4").write_bytes(b"a short clip")
    lines = [{"video": "long.mp4", "prompt": "long"}, {"video": "short.mp4", "prompt": "short"}]
    (data / "metadata.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    sizes: list[int] = []
    real_open = open
    monkeypatch.setattr(
        dataset, "open", lambda *a, **k: _Counted(real_open(*a, **k), sizes), raising=False
    )
    config = config_from_dict({"data": {"base_path": str(data)}, "cache": {"url": str(tmp_path)}})
    tracemalloc.start()
    try:
        built = index_data_set(config, use_memo=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 20 << 20, peak  # the file is 40 MiB; one 8 MiB buffer is held
    assert max(sizes) == dataset.HASH_BLOCK and sum(sizes) == 40 << 20  # the long one only
    assert len(sizes) == 40 // 8 + 1  # five full pieces, then the empty read that ends it
    long_row = next(r for r in built.rows if r.image == "long.mp4")
    assert built.keys[built.rows.index(long_row)] == dataset.sample_key_of_digest(digest, "long")
    assert built.keys[1] == sample_key(b"a short clip", "short")
    assert dataset.row_key(long_row, data) == built.keys[0]


def test_a_video_over_the_image_size_limit_is_not_refused(tmp_path, monkeypatch):
    """The 1 GiB limit for one image does not apply to videos (a long video is seeked)."""
    data = tmp_path / "data"
    data.mkdir()
    _big_video(data / "v.mp4", 3 << 20)
    (data / "i.png").write_bytes(b"x" * (3 << 20))
    (data / "metadata.csv").write_text("image,prompt\nv.mp4,clip\ni.png,image\n")
    monkeypatch.setattr(index, "check_file_size", _limit(2 << 20))
    config = config_from_dict(
        {"data": {"base_path": str(data), "skip_bad_rows": True}, "cache": {"url": str(tmp_path)}}
    )
    built = index_data_set(config, use_memo=False)
    assert [r.image for r in built.rows] == ["v.mp4"]
    assert built.skipped == [(3, "metadata.csv row 3: image file is over 2097152 bytes")]


def _limit(limit: int):
    def check(where: str, path, size: int) -> None:
        if size > limit:
            raise DataError(f"{where}: image file is over {limit} bytes")

    return check


def test_a_long_video_on_s3_is_hashed_in_ranged_pieces(tmp_path, s3_bucket, monkeypatch):
    """On object storage the same: pieces of HASH_BLOCK bytes, each a ranged read, and the key
    of the whole file (HASH_BLOCK and STREAM_ABOVE made small to keep the test small)."""
    url, options = s3_bucket
    endpoint = options["client_kwargs"]["endpoint_url"]
    monkeypatch.setattr(dataset, "HASH_BLOCK", 1 << 20)
    monkeypatch.setattr(index, "STREAM_ABOVE", 2 << 20)
    whole = _big_video(tmp_path / "long.mp4", (5 << 20) + 123)
    source = DataSource(url, options)
    source.fs.put(str(tmp_path / "long.mp4"), source.path("clips/long.mp4"))
    source.fs.pipe(source.path("metadata.csv"), b"video,prompt\nclips/long.mp4,long\n")
    sizes: list[int] = []
    real_open = type(source.fs).open
    monkeypatch.setattr(
        type(source.fs), "open", lambda fs, *a, **k: _Counted(real_open(fs, *a, **k), sizes)
    )
    config = config_from_dict(
        {
            "data": {"base_path": url, "storage_options": {"endpoint_url": endpoint}},
            "cache": {"url": str(tmp_path / "cache")},
        }
    )
    built = index_data_set(config, use_memo=False)
    assert built.keys == [sample_key(whole, "long")]
    assert max(sizes) == 1 << 20 and sum(sizes) == len(whole) and len(sizes) == 7
    row = Row(line=2, image="clips/gone.mp4", prompt="x", source="metadata.csv")
    with pytest.raises(DataError, match=r"^metadata.csv row 2: cannot read video file s3://"):
        file_digest(row, source)


def test_file_digest_equals_the_whole_files_hash(base):
    row = Row(line=2, image="clips/a.mp4", prompt="x")
    assert file_digest(row, base) == hashlib.sha256(b"mp4 bytes a").digest()
    os.remove(base / "clips" / "a.mp4")
    with pytest.raises(DataError, match=r"^metadata row 2: cannot read video file .*a.mp4"):
        file_digest(row, base)


def test_indexing_and_checking_rows_imports_no_torch():
    """Listing, keying and checking rows of images and videos needs no torch (it is imported
    where frames become tensors): the launcher and `validate` stay light."""
    code = (
        "import sys; import splitstage.data.index, splitstage.data.clips; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
