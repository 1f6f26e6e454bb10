"""Rows whose image does not decode under data.skip_bad_rows: named, recorded, not decoded again."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

import splitstage.tasks.stage1.preprocess as stage1
from splitstage.data.index import index_data_set
from splitstage.pipelines.demo.family import DemoFamily
from splitstage.tasks.job_plan import make_plan, open_cache
from splitstage.tasks.stage1 import undecodable
from splitstage.tasks.stage1.preprocess import preprocess, preprocess_shard
from splitstage.tasks.stage1.preprocess_report import snapshot, summarize_preprocess
from tests.helpers import preprocess_job
from tests.helpers.preprocess_job import make_config

assets = preprocess_job.assets  # the shared module-scoped fixture

pytestmark = pytest.mark.slow


def skipping_job(assets: Path, tmp: Path) -> tuple[object, Path, bytes, list[str]]:
    """A job with skip_bad_rows whose row 4 (CSV line 4) image is truncated: config, image,
    its good bytes and the metadata lines."""
    config = make_config(assets, tmp, data={"skip_bad_rows": True})
    lines = (Path(config.data.base_path) / "metadata.csv").read_text().splitlines()
    image = Path(config.data.base_path) / lines[3].split(",", 1)[0]
    good = image.read_bytes()
    image.write_bytes(good[:60])
    return config, image, good, lines


def records(config) -> dict[str, dict]:
    cache = Path(config.cache.url)
    return {p.stem: json.loads(p.read_text()) for p in cache.rglob("undecodable/*.json")}


def no_pool_no_models(m: pytest.MonkeyPatch) -> None:
    """Make starting a worker pool or loading a stage-1 model's weights fail."""
    m.setattr(stage1, "ProcessPoolExecutor", None)
    real = DemoFamily.build_model

    def refuse(self, name, device, **kw):
        if not kw.get("meta"):  # the job's checks build models on meta (no weights): allowed
            raise AssertionError("a stage-1 model was loaded")
        return real(self, name, device, **kw)

    m.setattr(DemoFamily, "build_model", refuse)


def test_the_row_is_named_recorded_and_a_rerun_starts_no_worker(assets, tmp_path, monkeypatch):
    config, image, good, lines = skipping_job(assets, tmp_path)
    first = preprocess(config, workers=2, progress=False)
    assert (first.samples, first.computed, first.skipped, first.workers) == (24, 23, 1, 2)
    ((line, why),) = first.skipped_rows
    assert line == 4 and why.startswith(f"metadata.csv row 4: image file {image} is corrupt")
    assert first.skipped_lines() == [f"skipped (data.skip_bad_rows) {why}"]
    (key,) = records(config)
    assert records(config)[key]["decoder"] == undecodable.DECODER
    assert list(open_cache(make_plan(config)).read_manifest()["undecodable"]) == [key]
    with monkeypatch.context() as m:
        no_pool_no_models(m)
        again = preprocess(config, workers=2, progress=False)
        assert (again.workers, again.computed, again.reused, again.skipped) == (0, 0, 23, 1)
        assert again.skipped_rows == first.skipped_rows
        one = preprocess(config, workers=1, progress=False)  # one in-process worker: no model
        assert (one.computed, one.reused, one.skipped) == (0, 23, 1)
        # the row moves to the end of the file: the message names the row it is on now
        rows = [lines[0], *lines[1:3], *lines[4:], lines[3]]
        (Path(config.data.base_path) / "metadata.csv").write_text("\n".join(rows) + "\n")
        moved = preprocess(config, workers=2, progress=False)
        assert moved.skipped_rows == [(25, why.replace("row 4:", "row 25:"))]
    # the same bytes under another name: named by the path they have now
    image.rename(image.with_name("renamed.png"))
    rows[-1] = rows[-1].replace(image.name, "renamed.png")
    (Path(config.data.base_path) / "metadata.csv").write_text("\n".join(rows) + "\n")
    with monkeypatch.context() as m:
        no_pool_no_models(m)
        renamed = preprocess(config, workers=2, progress=False)
    assert renamed.skipped_rows == [
        (25, moved.skipped_rows[0][1].replace(image.name, "renamed.png"))
    ]
    image.with_name("renamed.png").write_bytes(good)  # fixed: other bytes, a new sample
    fixed = preprocess(config, workers=2, progress=False)
    assert (fixed.computed, fixed.skipped, fixed.skipped_rows) == (1, 0, [])
    assert list(records(config)) == [key]  # kept: those bytes stay undecodable


def test_a_newer_decoder_or_verify_tries_the_row_again(assets, tmp_path, monkeypatch):
    config, image, _good, _lines = skipping_job(assets, tmp_path)
    preprocess(config, workers=1, progress=False)
    loads: list[str] = []
    real = DemoFamily.load_sample
    monkeypatch.setattr(
        DemoFamily,
        "load_sample",
        lambda self, row, base: loads.append(row.image) or real(self, row, base),
    )
    assert preprocess(config, workers=1, progress=False).skipped == 1 and loads == []
    with monkeypatch.context() as m:
        m.setattr(undecodable, "DECODER", "a newer Pillow")
        assert preprocess(config, workers=1, progress=False).skipped == 1
    assert loads == [image.relative_to(config.data.base_path).as_posix()]
    assert [r["decoder"] for r in records(config).values()] == ["a newer Pillow"]
    # this decoder's record is gone now: the row is tried again, then recorded again
    assert preprocess(config, workers=1, progress=False).skipped == 1 and len(loads) == 2
    verified = preprocess(config, workers=1, progress=False, verify=True)
    assert verified.skipped == 1 and len(loads) == 3  # --verify tries it although recorded
    assert [r["decoder"] for r in records(config).values()] == [undecodable.DECODER]
    good = next(p for p in image.parent.iterdir() if p != image)  # a decoder that copes with it
    bad_row = image.relative_to(config.data.base_path).as_posix()

    def decodes(self, row, base):
        if row.image == bad_row:
            row = dataclasses.replace(row, image=good.relative_to(config.data.base_path).as_posix())
        return real(self, row, base)

    with monkeypatch.context() as m:
        m.setattr(undecodable, "DECODER", "a Pillow that decodes it")
        m.setattr(DemoFamily, "load_sample", decodes)
        now = preprocess(config, workers=1, progress=False)
    assert (now.computed, now.skipped, now.skipped_rows) == (1, 0, [])
    assert records(config) == {}  # cached now: its record is gone


def test_shards_run_elsewhere_leave_the_rows_for_the_coordinator(assets, tmp_path):
    config, _image, _good, _lines = skipping_job(assets, tmp_path)
    plan, data = make_plan(config), index_data_set(config)
    before = snapshot(open_cache(plan))
    for shard in range(2):  # as `preprocess/gpu` runs do: no report reaches the coordinator
        preprocess_shard(config, shard, 2, plan=plan, data=data, progress=False)
    report = summarize_preprocess(plan, data, None, before, workers=2)
    assert (report.computed, report.skipped, [r[0] for r in report.skipped_rows]) == (23, 1, [4])
    assert len(open_cache(plan).read_manifest()["undecodable"]) == 1
