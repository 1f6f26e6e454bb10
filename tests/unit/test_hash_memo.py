"""The (path, size, mtime) -> content-hash memo: used only while a file is unchanged, never trusted
within the mtime tick of its listing, ignored (one warning) and rebuilt when corrupt."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
from PIL import Image

from splitstage.config.job import config_from_dict
from splitstage.data import hash_memo
from splitstage.data.dataset import load_metadata, sample_keys
from splitstage.data.hash_memo import FOLDER, HashMemo
from splitstage.data.index import index_data_set
from splitstage.data.index_memo import SUFFIX
from splitstage.storage.parquet_columns import ColumnFile, write_columns


def hash_memo_file(config) -> Path:
    """The hash memo's file (not the index memo beside it: listing order is the file system's)."""
    folder = Path(config.cache.url) / FOLDER
    return next(p for p in folder.glob("*" + hash_memo.SUFFIX) if not p.name.endswith(SUFFIX))


def _age(path: Path, seconds: float = 60) -> None:
    """Set a file's mtime `seconds` in the past (older than the memo's trust margin)."""
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def _image(path: Path, color: tuple[int, int, int], age: float | None = 60) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)
    if age is not None:
        _age(path, age)


@pytest.fixture
def job(tmp_path):
    data = tmp_path / "data"
    for i in range(4):
        _image(data / "img" / f"{i}.png", (i * 40, 10, 10))
    lines = ["image,prompt", *(f"img/{i}.png,picture {i}" for i in range(4))]
    (data / "metadata.csv").write_text("\n".join(lines) + "\n")
    config = config_from_dict(
        {"data": {"base_path": str(data)}, "cache": {"url": str(tmp_path / "cache")}}
    )
    return config, data


def _truth(data: Path) -> list[str]:
    """Keys computed from the bytes, without any memo."""
    return sample_keys(load_metadata(data), data)


def test_rerun_reads_no_image_and_gives_the_same_keys(job):
    config, data = job
    first = index_data_set(config)
    assert (first.hashed, first.memo_hits) == (4, 0)
    again = index_data_set(config)
    assert (again.hashed, again.memo_hits) == (0, 4)
    assert again.keys == first.keys == _truth(data)


def test_edited_file_is_hashed_again_even_with_the_same_size(job):
    config, data = job
    index_data_set(config)
    target = data / "img" / "2.png"
    size = target.stat().st_size
    _image(target, (1, 2, 250))  # new pixels, aged: only its mtime tells it changed
    assert target.stat().st_size == size
    again = index_data_set(config)
    assert (again.hashed, again.memo_hits) == (1, 3)
    assert again.keys == _truth(data)


def test_stale_entry_with_forged_version_is_not_used(job, monkeypatch):
    """A memo entry whose recorded (size, mtime) differs from the listing is never used, and
    one that matches is: the memo is keyed by exactly what the listing sees."""
    config, data = job
    index_data_set(config)
    memo_file = hash_memo_file(config)
    memo = HashMemo.decode(memo_file.read_bytes(), str(data))
    st = (data / "img" / "0.png").stat()
    assert memo.lookup("img/0.png", st.st_size, st.st_mtime_ns) is not None
    assert memo.lookup("img/0.png", st.st_size, st.st_mtime_ns + 1) is None
    assert memo.lookup("img/0.png", st.st_size + 1, st.st_mtime_ns) is None
    assert memo.lookup("img/9.png", st.st_size, st.st_mtime_ns) is None


def test_files_within_the_mtime_tick_are_never_memoized(job):
    config, data = job
    _image(data / "img" / "3.png", (9, 9, 9), age=None)  # written just now
    first = index_data_set(config)
    assert first.hashed == 4
    second = index_data_set(config)  # the fresh file is not trusted: hashed again
    assert (second.hashed, second.memo_hits) == (1, 3)
    target = data / "img" / "3.png"
    stat = target.stat()
    _image(target, (200, 9, 9), age=None)  # same size, rewritten within the same tick
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    third = index_data_set(config)
    assert third.keys == _truth(data)  # the new bytes, not the first hash of that mtime
    assert third.hashed == 1


def test_corrupt_memo_is_ignored_with_one_warning_and_rebuilt(job, caplog):
    config, data = job
    index_data_set(config)
    memo_file = hash_memo_file(config)
    memo_file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with caplog.at_level(logging.WARNING, logger=hash_memo.__name__):
        index = index_data_set(config)
    warnings = [r for r in caplog.records if r.name == hash_memo.__name__]
    assert len(warnings) == 1 and "unusable" in warnings[0].getMessage()
    assert (index.hashed, index.keys) == (4, _truth(data))
    assert index_data_set(config).memo_hits == 4  # rebuilt


@pytest.mark.parametrize("damage", ["truncate", "other data set", "count"])
def test_damaged_memos_never_give_a_key(job, caplog, damage):
    config, data = job
    index_data_set(config)
    memo_file = hash_memo_file(config)
    raw = memo_file.read_bytes()
    listing = hash_memo.Listing({"img/0.png": (1, 5)}, time.time_ns(), True)
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "other data set":
        raw = HashMemo.encode(listing, {"img/0.png": b"x" * 32}, "/elsewhere")
    else:  # the same columns under a count they disagree with
        memo = ColumnFile(raw)
        raw = write_columns(memo.columns(), {**memo.meta, "count": "3"})
    memo_file.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger=hash_memo.__name__):
        index = index_data_set(config)
    assert index.hashed == 4 and index.keys == _truth(data)
    assert len([r for r in caplog.records if r.name == hash_memo.__name__]) == 1


def test_lost_memo_only_costs_time(job):
    config, data = job
    index_data_set(config)
    for path in (Path(config.cache.url) / FOLDER).iterdir():
        path.unlink()
    index = index_data_set(config)
    assert (index.hashed, index.keys) == (4, _truth(data))


def test_large_memo_round_trips_exactly():
    """Many entries in many folders survive encode/decode (its speed at 10^6 entries is
    measured in bench/bench_data_index.py, not asserted here)."""
    n = 20_000
    files = {f"d{i // 1000}/{i}.png": (300 + i % 7, 10**18 + i) for i in range(n)}
    listing = hash_memo.Listing(files, 2 * 10**18, True)
    digests = {p: i.to_bytes(32, "little") for i, p in enumerate(files)}
    memo = HashMemo.decode(HashMemo.encode(listing, digests, "/d"), "/d")
    assert len(memo) == n
    assert all(memo.lookup(p, *files[p]) == digests[p] for p in list(files)[::997])


def test_a_flipped_byte_fails_the_page_checksum_one_warning_and_a_rehash(job, caplog):
    config, data = job
    index_data_set(config)
    memo_file = hash_memo_file(config)
    raw = memo_file.read_bytes()
    at = raw.index(b"img/2.png")
    memo_file.write_bytes(raw[:at] + b"img/3" + raw[at + 5 :])  # another path, same length
    for path in (Path(config.cache.url) / FOLDER).glob("*" + SUFFIX):
        path.unlink()  # the index memo would give the keys without the hash memo
    with caplog.at_level(logging.WARNING, logger=hash_memo.__name__):
        index = index_data_set(config)
    warnings = [r for r in caplog.records if r.name == hash_memo.__name__]
    assert len(warnings) == 1 and "CRC" in warnings[0].getMessage()
    assert (index.hashed, index.keys) == (4, _truth(data))
    assert index_data_set(config).memo_hits == 4  # rebuilt


def test_a_memo_of_the_old_format_is_left_alone_and_rebuilt(job, caplog):
    config, data = job
    index_data_set(config)
    memo_file = hash_memo_file(config)
    old = memo_file.with_suffix(".safetensors")
    old.write_bytes(b"a hash memo of the safetensors format")
    for path in (Path(config.cache.url) / FOLDER).glob("*.parquet"):
        path.unlink()  # as before the change: only the old file is there
    with caplog.at_level(logging.WARNING, logger=hash_memo.__name__):
        index = index_data_set(config)
    assert not [r for r in caplog.records if r.name == hash_memo.__name__]  # not even read
    assert (index.hashed, index.keys) == (4, _truth(data))
    assert hash_memo_file(config).exists() and old.read_bytes().startswith(b"a hash memo")
    for path in (Path(config.cache.url) / FOLDER).glob("*" + SUFFIX):
        path.unlink()
    again = index_data_set(config)  # from the new hash memo
    assert (again.hashed, again.memo_hits) == (0, 4)
