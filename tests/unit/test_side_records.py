"""Side records of a cache store: atomic JSON records in a folder, read back with one listing."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from splitstage.tasks.cache.store import CacheStore


@pytest.mark.parametrize("where", ["local", "memory"])
def test_records_round_trip_and_a_garbage_one_is_left_out(where, tmp_path: Path, caplog) -> None:
    url = str(tmp_path / "cache") if where == "local" else f"memory://side-{tmp_path.name}"
    store = CacheStore(url, "key1")
    assert store.read_records("notes") == {}  # no folder yet
    store.write_record("notes", "a1", {"reason": "x"})
    store.write_record("notes", "b2", {"reason": "y"})
    store.write_record("notes", "a1", {"reason": "z"})  # replaced
    store.fs.pipe_file(f"{store.root}/notes/c3.json", b"{not json")
    with caplog.at_level(logging.WARNING):
        assert store.read_records("notes") == {"a1": {"reason": "z"}, "b2": {"reason": "y"}}
    assert "c3.json: not a JSON object" in caplog.text
    store.remove_records("notes", ["a1", "gone"])  # one already absent is fine
    assert set(store.read_records("notes")) == {"b2"}
    if where == "local":
        assert sorted(p.name for p in (tmp_path / "cache/key1/notes").iterdir()) == [
            "b2.json",
            "c3.json",
        ]  # no temp files left behind


def test_a_record_name_that_could_escape_its_folder_is_refused(tmp_path: Path) -> None:
    store = CacheStore(str(tmp_path), "key1")
    with pytest.raises(ValueError, match="is not a valid name"):
        store.write_record("notes", "../escape", {})
