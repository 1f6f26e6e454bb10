"""A run's `metrics.jsonl`: appended by rank 0, never truncated, so every launch's records stay.

Each launch adds one start line (`{"start": update, "of": total}`) and one line per update. A
resumed launch repeats the updates after its checkpoint; `read_metrics` gives the run's record:
the latest line of each update, in update order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from splitstage.storage.files import storage_errors

METRICS_FILE = "metrics.jsonl"


def append_metrics(run_dir: Path, record: dict[str, Any]) -> None:
    """Append one JSON line (a line is written whole: one write of one short string); a full
    disk is named as such."""
    path = Path(run_dir) / METRICS_FILE
    with storage_errors(str(path), "append metrics to"):
        path.parent.mkdir(parents=True, exist_ok=True)  # deleted mid-run: the records go on
        with path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")


def write_result(run_dir: Path, result: dict[str, Any]) -> None:
    """The run's result.json, written atomically (the launcher reads it as 'the ranks finished')."""
    path = Path(run_dir) / "result.json"
    with storage_errors(str(path), "write the result to"):
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text(json.dumps(result, indent=2))
        partial.replace(path)


def _records(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole line of the file (a torn last line, from a launch killed mid-write, left out)."""
    path = Path(run_dir) / METRICS_FILE
    records = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The latest record of each update, in update order."""
    latest = {int(r["update"]): r for r in _records(run_dir) if "update" in r}
    return [latest[update] for update in sorted(latest)]


def launches(run_dir: Path) -> list[dict[str, Any]]:
    """The start line of every launch of the run, oldest first."""
    return [record for record in _records(run_dir) if "start" in record]
