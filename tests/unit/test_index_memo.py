"""The index memo: a rerun with nothing changed restores rows and keys without parsing or
hashing, and any change that could alter the result (an image, the metadata, a missing file
appearing, a setting, the memo itself) falls back to the full build, which is the truth."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from splitstage.config.job import config_from_dict
from splitstage.data import file_stats, index_memo, metadata_files
from splitstage.data.dataset import DataError
from splitstage.data.hash_memo import FOLDER
from splitstage.data.index import index_data_set
from splitstage.storage import parquet_columns


def _age(path: Path, seconds: float = 60) -> None:
    stamp = time.time() - seconds
    os.utime(path, (stamp, stamp))


def _image(path: Path, color: tuple[int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 8), color).save(path)
    _age(path)


def _metadata(data: Path, lines: list[str], name: str = "metadata.csv") -> None:
    (data / name).write_text("\n".join(lines) + "\n")
    _age(data / name)


def _config(tmp_path: Path, data: Path, **extra):
    return config_from_dict(
        {"data": {"base_path": str(data), **extra}, "cache": {"url": str(tmp_path / "cache")}}
    )


@pytest.fixture
def job(tmp_path):
    data = tmp_path / "data"
    for i in range(6):
        _image(data / "img" / f"{i}.png", (i * 40, 10, 10))
    _image(data / "img" / "copy.png", (0, 10, 10))  # same bytes as 0.png: a duplicate
    rows = ["image,prompt,style", *(f"img/{i}.png,picture {i},s{i}" for i in range(6))]
    rows += ["img/copy.png,picture 0,s0", "img/gone.png,missing one,s9"]
    _metadata(data, rows)
    return _config(tmp_path, data, skip_bad_rows=True), data


def _truth(config):
    return index_data_set(config, use_memo=False)


def _same(got, want) -> None:
    assert got.keys == want.keys
    assert list(got.rows) == list(want.rows)
    assert got.skipped == want.skipped and got.duplicates == want.duplicates


def test_rerun_restores_everything_without_parsing_or_hashing(job, monkeypatch):
    config, _ = job
    first = index_data_set(config)
    assert not first.from_memo and first.duplicates == 1 and len(first.skipped) == 1
    assert any((Path(config.cache.url) / FOLDER).glob("*" + index_memo.SUFFIX))

    def no_parsing(*args, **kwargs):
        raise AssertionError("the metadata was parsed again")

    with monkeypatch.context() as patch:
        patch.setattr(metadata_files, "records", no_parsing)
        again = index_data_set(config)
    assert again.from_memo and (again.hashed, again.memo_hits) == (0, first.hashed)
    _same(again, first)
    _same(again, _truth(config))
    assert again.rows[-1] == first.rows[-1] and again.rows[1:3] == first.rows[1:3]


@pytest.mark.parametrize(
    "change",
    [
        "edit image same size",
        "delete image",
        "missing file appears",
        "edit caption",
        "duplicate edited",
        "limit",
        "skip_bad_rows",
        "memo corrupt",
        "memo byte flipped",
    ],
)
def test_every_change_falls_back_to_the_full_build(job, tmp_path, change, caplog):
    config, data = job
    index_data_set(config)
    assert index_data_set(config).from_memo
    if change == "edit image same size":
        target = data / "img" / "2.png"
        size = target.stat().st_size
        _image(target, (1, 2, 250))
        _age(target, 30)
        assert target.stat().st_size == size
    elif change == "delete image":
        (data / "img" / "3.png").unlink()
    elif change == "missing file appears":
        _image(data / "img" / "gone.png", (5, 5, 5))
    elif change == "edit caption":
        text = (data / "metadata.csv").read_text().replace("picture 4", "picture four")
        _metadata(data, text.splitlines())
    elif change == "duplicate edited":
        _image(data / "img" / "copy.png", (0, 99, 10))
    elif change == "limit":
        config = _config(tmp_path, data, skip_bad_rows=True, limit=3)
    elif change == "skip_bad_rows":
        (data / "img" / "gone.png").write_bytes(b"")  # so that strict mode has no missing row
        _age(data / "img" / "gone.png")
        index_data_set(config)
        config = _config(tmp_path, data, skip_bad_rows=False)
    elif change == "memo corrupt":
        memo = next((Path(config.cache.url) / FOLDER).glob("*" + index_memo.SUFFIX))
        memo.write_bytes(memo.read_bytes()[:-40])
    else:  # a prompt changed inside the memo (same length): its key would then be wrong
        memo = next((Path(config.cache.url) / FOLDER).glob("*" + index_memo.SUFFIX))
        raw = memo.read_bytes()
        assert raw.count(b"picture 4") == 1
        memo.write_bytes(raw.replace(b"picture 4", b"picture 5"))
    with caplog.at_level(logging.WARNING):
        got = index_data_set(config)
    assert not got.from_memo
    _same(got, _truth(config))
    warned = [r for r in caplog.records if "index memo" in r.getMessage()]
    assert len(warned) == (1 if change.startswith("memo") else 0)
    assert index_data_set(config).from_memo  # the full build kept a new memo


def test_fresh_files_are_not_trusted(job):
    """A metadata file or image written within the mtime tick of the listing is never
    memoized: a same-size rewrite within that tick would not show in its stat."""
    config, data = job
    (data / "metadata.csv").write_text((data / "metadata.csv").read_text())  # fresh mtime
    index_data_set(config)
    assert not index_data_set(config).from_memo
    _age(data / "metadata.csv")
    Image.new("RGB", (8, 8), (7, 7, 7)).save(data / "img" / "1.png")  # fresh image
    index_data_set(config)
    assert not index_data_set(config).from_memo


def test_jsonl_extras_round_trip_and_odd_text_is_never_memoized(tmp_path):
    data = tmp_path / "data"
    _image(data / "a.png", (1, 2, 3))
    _image(data / "b.png", (3, 2, 1))
    rows = [
        {
            "image": "a.png",
            "prompt": "a \u00e9 caf\u00e9",
            "meta": {"k": [1, 2.5, None], "t": True},
        },
        {"image": "b.png", "prompt": "b", "n": 3},
    ]
    _metadata(data, [json.dumps(r) for r in rows], "metadata.jsonl")
    config = _config(tmp_path, data)
    first = index_data_set(config)
    again = index_data_set(config)
    assert again.from_memo
    _same(again, first)
    assert again.rows[0].extras == {"meta": {"k": [1, 2.5, None], "t": True}}
    rows[1]["prompt"] = "with a NUL \u0000 inside"  # NUL-joined columns cannot hold it
    _metadata(data, [json.dumps(r) for r in rows], "metadata.jsonl")
    index_data_set(config)
    got = index_data_set(config)
    assert not got.from_memo
    _same(got, _truth(config))


def _joined(rels: list[str]) -> bytes:
    return "\0".join(rels).encode()


def _tree(root: Path, count: int) -> list[str]:
    rels = [f"d{i % 3}/{i}.bin" for i in range(count)]
    for rel in rels:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x" * (len(rel) % 5))
    return sorted(rels)


CHECK_PATHS = {  # how the check runs: SPLITSTAGE_STAT_PROCESSES
    "in process": "1",
    "2 child processes": "2",
    "3 child processes": "3",
}


def _check_path(monkeypatch, name: str) -> None:
    monkeypatch.setenv("SPLITSTAGE_STAT_PROCESSES", CHECK_PATHS[name])
    assert file_stats.stat_processes(1000) == int(CHECK_PATHS[name])


@pytest.mark.parametrize("path", sorted(CHECK_PATHS))
def test_changed_files_finds_every_kind_of_change(tmp_path, monkeypatch, path):
    _check_path(monkeypatch, path)
    rels = _tree(tmp_path, 40)
    stats = [os.stat(tmp_path / r) for r in rels]
    sizes = np.array([s.st_size for s in stats], dtype=np.int64)
    mtimes = np.array([s.st_mtime_ns for s in stats], dtype=np.int64)
    assert file_stats.changed_files(str(tmp_path), _joined(rels), sizes, mtimes) == []
    (tmp_path / rels[3]).write_bytes(b"longer than before")  # size
    os.utime(tmp_path / rels[10], ns=(stats[10].st_atime_ns, stats[10].st_mtime_ns + 1))  # mtime
    (tmp_path / rels[20]).unlink()  # gone
    (tmp_path / rels[25]).unlink()
    (tmp_path / rels[25]).mkdir()  # a folder where a file was
    (tmp_path / "top.bin").write_bytes(b"xy")  # a file at the root, after a folder's files
    (tmp_path / "d2" / "link.bin").symlink_to(tmp_path / rels[0])  # followed, as os.stat does
    extra = ["d2/link.bin", "no/such/folder/x.bin", "top.bin", "d0/0.bin/not-a-folder"]
    rels_bad = [*rels, *extra]
    target = os.stat(tmp_path / rels[0])
    sizes_bad = np.append(sizes, [target.st_size, 1, 2, 1])
    mtimes_bad = np.append(
        mtimes, [target.st_mtime_ns, 1, os.stat(tmp_path / "top.bin").st_mtime_ns, 1]
    )
    got = file_stats.changed_files(str(tmp_path), _joined(rels_bad), sizes_bad, mtimes_bad)
    assert got == [3, 10, 20, 25, 41, 43]  # the link and the root file are as recorded


def test_child_check_agrees_with_the_in_process_one_on_odd_names(tmp_path, monkeypatch):
    """Names that travel to the children as bytes: non-ASCII, spaces, deep and one-level."""
    rels = sorted(["a/é ü.png", "a/b/c/d/deep.png", "flat.png", "a/b/x y.png", "ü/ß.png"])
    for rel in rels:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(rel.encode())
    stats = [os.stat(tmp_path / r) for r in rels]
    sizes = np.array([s.st_size for s in stats], dtype=np.int64)
    mtimes = np.array([s.st_mtime_ns for s in stats], dtype=np.int64)
    mtimes[2] += 1
    answers = {}
    for path in ("2 child processes", "in process"):
        _check_path(monkeypatch, path)
        answers[path] = file_stats.changed_files(str(tmp_path), _joined(rels), sizes, mtimes)
    assert answers == {path: [2] for path in answers}


def test_a_failing_child_falls_back_to_checking_in_process(tmp_path, monkeypatch, caplog):
    _check_path(monkeypatch, "2 child processes")
    rels = _tree(tmp_path, 10)
    sizes = np.array([os.stat(tmp_path / r).st_size for r in rels], dtype=np.int64)
    mtimes = np.array([os.stat(tmp_path / r).st_mtime_ns + 1 for r in rels], dtype=np.int64)
    monkeypatch.setattr(file_stats.sys, "executable", str(tmp_path / "no-python"))
    with caplog.at_level(logging.WARNING, logger=file_stats.__name__):
        got = file_stats.changed_files(str(tmp_path), _joined(rels), sizes, mtimes)
    assert got == list(range(10))
    assert len(caplog.records) == 1 and "checking here" in caplog.records[0].getMessage()


@pytest.mark.parametrize("path", sorted(CHECK_PATHS))
def test_a_missing_root_means_every_file_changed(tmp_path, monkeypatch, path):
    """A data set folder removed since the memo: every file is gone, by either path."""
    _check_path(monkeypatch, path)
    sizes, mtimes = np.array([1, 2], np.int64), np.array([1, 2], np.int64)
    got = file_stats.changed_files(str(tmp_path / "gone"), _joined(["a", "b/c"]), sizes, mtimes)
    assert got == [0, 1]


def test_restored_index_travels_to_worker_processes(job):
    """The preprocess coordinator hands its DataIndex to spawned workers: the memo's rows
    survive the trip (as joined bytes) and give the same rows there."""
    import pickle

    config, _ = job
    first = index_data_set(config)
    again = index_data_set(config)
    assert again.from_memo
    travelled = pickle.loads(pickle.dumps(again))
    assert list(travelled.rows) == list(first.rows) and travelled.keys == first.keys


# -- rows appended: only the new lines are parsed ---------------------------------------------
def _append(data: Path, lines: list[str], name: str = "metadata.csv", age: bool = True) -> None:
    with open(data / name, "a") as fh:
        fh.write("\n".join(lines) + "\n")
    if age:
        _age(data / name)


@pytest.mark.parametrize(
    "added",
    [
        ["img/6.png,picture 6,s6", "img/7.png,picture 7,s7"],
        ["img/copy2.png,picture 0,s0", "img/6.png,picture 6,s6"],  # a duplicate of row 2
        ['img/6.png,"a, quoted caption",s6', "", "img/gone2.png,never there,s1"],  # blank, missing
        ["img/6.png,picture 6", "img/7.png,too,many,cells"],  # a bad row, skipped
    ],
)
def test_appended_csv_rows_are_all_that_is_parsed(job, added, monkeypatch):
    config, data = job
    for i in (6, 7):
        _image(data / "img" / f"{i}.png", (i * 30, 1, 1))
    _image(data / "img" / "copy2.png", (0, 10, 10))  # the bytes of 0.png
    index_data_set(config)
    _append(data, added, age=False)  # just written: its memo entry waits for the next run
    seen = []
    real = metadata_files.records

    def counted(payload, *args, **kwargs):
        seen.append(payload.count(b"\n"))
        return real(payload, *args, **kwargs)

    monkeypatch.setattr(metadata_files, "records", counted)
    got = index_data_set(config)
    assert got.grown == len([a for a in added if a]) and not got.from_memo
    assert seen == [len(added) + 1]  # the header line and the appended lines, nothing else
    _same(got, _truth(config))
    _age(data / "metadata.csv")
    again = index_data_set(config)  # the metadata aged: a memo of the whole file is kept
    _same(again, _truth(config))
    assert index_data_set(config).from_memo


def test_appended_jsonl_lines_keep_their_line_numbers(tmp_path):
    data = tmp_path / "data"
    for i in range(3):
        _image(data / f"{i}.png", (i, 2, 3))
    rows = [json.dumps({"image": f"{i}.png", "prompt": f"p {i}", "n": i}) for i in range(2)]
    _metadata(data, rows, "metadata.jsonl")
    config = _config(tmp_path, data, skip_bad_rows=True)
    index_data_set(config)
    _append(data, ["{not json", json.dumps({"image": "2.png", "prompt": "p 2"})], "metadata.jsonl")
    got = index_data_set(config)
    assert got.grown == 2
    _same(got, _truth(config))
    assert got.skipped[0][0] == 3 and "row 3" in got.skipped[0][1]


@pytest.mark.parametrize(
    "change",
    [
        "old image edited",
        "old line edited",
        "unclosed quote appended",
        "not utf-8 appended",
        "crlf file",
    ],
)
def test_growth_that_cannot_be_trusted_is_the_full_build(job, change):
    config, data = job
    _image(data / "img" / "6.png", (99, 1, 1))
    if change == "crlf file":
        text = (data / "metadata.csv").read_text()
        (data / "metadata.csv").write_bytes(text.replace("\n", "\r\n").encode())
        _age(data / "metadata.csv")
    index_data_set(config)
    if change == "old image edited":
        _image(data / "img" / "1.png", (1, 99, 1))
        _age(data / "img" / "1.png", 30)
    elif change == "old line edited":
        text = (data / "metadata.csv").read_text().replace("picture 1", "picture X")
        _metadata(data, text.splitlines())
    if change == "unclosed quote appended":
        _append(data, ['img/6.png,"never closed,s6'])
    elif change == "not utf-8 appended":
        with open(data / "metadata.csv", "ab") as fh:
            fh.write(b"img/6.png,caf\xe9,s6\n")
        _age(data / "metadata.csv")
    else:
        _append(data, ["img/6.png,picture 6,s6"])
    if change.endswith("appended"):
        with pytest.raises(DataError) as error:
            index_data_set(config)
        with pytest.raises(DataError) as truth:
            _truth(config)
        assert str(error.value) == str(truth.value)  # numbered as in the whole file
        return
    got = index_data_set(config)
    assert got.grown == 0
    _same(got, _truth(config))


def test_columns_round_trip_through_parquet_in_pieces(monkeypatch):
    """A column longer than a piece spans several Parquet rows; an empty one has one empty."""
    monkeypatch.setattr(parquet_columns, "PIECE", 7)
    tensors = {
        "files": np.frombuffer("a/ü.png\0b.png\0c".encode(), np.uint8),
        "absent": np.frombuffer(b"", np.uint8),
        "keys": np.arange(96, dtype=np.uint8).reshape(3, 32),
        "sizes": np.array([1, 2**40, -3], np.int64),
        "lines": np.array([], np.int64),
    }
    meta = {"format": index_memo.FORMAT, "rules": "r", "data_url": "d", "rows": "3"}
    rows = pq.read_table(pa.BufferReader(parquet_columns.write_columns(tensors, meta))).to_pylist()
    raw = tensors["files"].tobytes()
    assert [r["piece"] for r in rows if r["column"] == "files"] == [raw[:7], raw[7:14], raw[14:]]
    assert [r["piece"] for r in rows if r["column"] == "absent"] == [b""]
    fs = fsspec.filesystem("memory")
    fs.pipe_file("/memo.parquet", parquet_columns.write_columns(tensors, meta))
    got = index_memo.load(fs, "/memo.parquet", "memo", data_url="d", rules="r")
    assert got is not None and got[0] == meta and sorted(got[1]) == sorted(tensors)
    for name, column in tensors.items():
        assert got[1][name].dtype == column.dtype and np.array_equal(got[1][name], column)


def test_a_memo_of_the_old_format_is_left_alone_and_rebuilt(job):
    config, _ = job
    folder = Path(config.cache.url) / FOLDER
    index_data_set(config)
    memo = next(folder.glob("*" + index_memo.SUFFIX))
    old = memo.with_name(memo.name.removesuffix(index_memo.SUFFIX) + ".index.safetensors")
    old.write_bytes(b"an index memo of the safetensors format")
    memo.unlink()
    assert not index_data_set(config).from_memo
    assert index_data_set(config).from_memo and old.read_bytes().startswith(b"an index")
