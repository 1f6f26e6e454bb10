"""The index build shows its hashing: a bar (on a terminal, or when asked) and reports for the
dashboard, after each chunk of images read; nothing when the memos know every image."""

from __future__ import annotations

import os

import pytest

from splitstage.config.job import config_from_dict
from splitstage.data import index as data_index
from splitstage.data.digits import write_digits_dataset
from splitstage.data.index import Shown, index_data_set


@pytest.fixture
def config(tmp_path, monkeypatch):
    monkeypatch.setattr(data_index, "READ_CHUNK", 2)
    write_digits_dataset(tmp_path / "data", limit=5)
    for path in (tmp_path / "data").rglob("*"):  # older than the memo's trust margin
        os.utime(path, (1e9, 1e9))
    return config_from_dict(
        {"data": {"base_path": str(tmp_path / "data")}, "cache": {"url": str(tmp_path / "c")}}
    )


def test_reports_follow_each_chunk_and_stop_when_the_memo_knows_every_image(config):
    reports: list[tuple[int, int]] = []
    shown = Shown(bar=False, report=lambda done, total: reports.append((done, total)))
    index_data_set(config, shown=shown)
    assert reports == [(2, 5), (4, 5), (5, 5)]
    reports.clear()
    index_data_set(config, shown=shown)
    assert reports == []  # nothing hashed: no report


def test_the_bar_shows_when_asked_and_from_its_minimum(config, capsys, monkeypatch):
    index_data_set(config, use_memo=False, shown=Shown(bar=True))
    assert "hash images" not in capsys.readouterr().err  # 5 images: under PROGRESS_MIN
    monkeypatch.setattr(data_index, "PROGRESS_MIN", 5)
    index_data_set(config, use_memo=False, shown=Shown(bar=True))
    err = capsys.readouterr().err
    assert "hash images" in err and "5/5" in err
    index_data_set(config, use_memo=False, shown=Shown(bar=False))
    assert "hash images" not in capsys.readouterr().err
