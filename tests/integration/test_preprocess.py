"""Stage 1 end to end on real files: incremental, worker-count independent, crash-safe, S3.

Tiny digits subset and the tiny text encoder; the real one is exercised by the demo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from splitstage.data.dataset import DataError
from splitstage.data.index import index_data_set
from splitstage.pipelines.demo.family import DemoFamily
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.cache.store import CacheStore
from splitstage.tasks.job_plan import make_plan, open_cache
from splitstage.tasks.stage1.preprocess import preprocess
from tests.helpers import preprocess_job
from tests.helpers.preprocess_job import make_config

pytestmark = pytest.mark.slow  # starts servers or processes (docs/tests.md)

assets = preprocess_job.assets  # the shared module-scoped fixture

ROOT = Path(__file__).resolve().parents[2]


def cached(config) -> dict:
    """Every cached sample of the job's cache."""
    store = open_cache(make_plan(config))
    return store.read_samples(sorted(store.committed_keys()))


def assert_index_from_snapshot(config, monkeypatch, samples: int = 24) -> None:
    """A fresh store loads the index from the coordinator's snapshot: it reads no index entry."""
    reads: list[str] = []
    real = CacheStore._scan
    with monkeypatch.context() as m:
        m.setattr(CacheStore, "_scan", lambda self, paths: reads.extend(paths) or real(self, paths))
        assert len(open_cache(make_plan(config)).key_table()) == samples
    assert reads == []


def test_rerun_computes_nothing_and_only_boundary_params_are_stored(assets, tmp_path, monkeypatch):
    config = make_config(assets, tmp_path)
    first = preprocess(config, workers=1, progress=False)
    assert_index_from_snapshot(config, monkeypatch)
    again = preprocess(config, workers=1, progress=False)
    assert_index_from_snapshot(config, monkeypatch)
    assert (first.computed, first.reused, first.shards_written) == (24, 0, 3)
    assert (again.computed, again.reused, again.bytes_written) == (0, 24, 0)
    sample = next(iter(cached(config).values()))
    assert set(sample) == set(make_plan(config).split.boundary_params)
    assert sample["input_latents"].shape == (4, 8, 8)


def test_worker_count_does_not_change_the_cache(assets, tmp_path):
    one = make_config(assets, tmp_path / "one")
    two = make_config(assets, tmp_path / "two")
    preprocess(one, workers=1, progress=False)
    report = preprocess(two, workers=2, progress=False)
    assert report.computed == 24 and report.workers == 2
    assert make_plan(one).cache_key == make_plan(two).cache_key
    a, b = cached(one), cached(two)
    assert a.keys() == b.keys()
    for key in a:
        for param, value in a[key].items():
            assert torch.equal(value, b[key][param]), (key, param)


def test_a_rerun_with_all_cached_starts_no_worker_and_damage_still_does(
    assets, tmp_path, monkeypatch
):
    import splitstage.tasks.stage1.preprocess as stage1

    config = make_config(assets, tmp_path)
    preprocess(config, workers=1, progress=False)
    with monkeypatch.context() as m:  # the coordinator's check answers: no pool is made
        m.setattr(stage1, "ProcessPoolExecutor", None)
        again = preprocess(config, workers=2, progress=False)
    assert (again.computed, again.reused, again.workers, again.damaged) == (0, 24, 0, 0)
    assert "(all cached: no worker started)" in again.line()
    shard = sorted((tmp_path / "cache").rglob("shards/*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # rewritten in place after its index entry, same size: only sha256 tells
    shard.write_bytes(bytes(data))
    later = os.stat(shard).st_mtime + 5
    os.utime(shard, (later, later))
    fixed = preprocess(config, workers=2, progress=False)
    assert (fixed.workers, fixed.damaged, fixed.repaired, fixed.computed) == (2, 1, 8, 8)
    assert preprocess(config, workers=2, progress=False).workers == 0


def test_stage_one_never_builds_the_denoiser(assets, tmp_path, monkeypatch):
    built = []
    real = DemoFamily.build_model

    def spy(self, name, device, **kw):
        if not kw.get("meta"):  # the job's checks build every model on meta (no weights)
            built.append(name)
        return real(self, name, device, **kw)

    monkeypatch.setattr(DemoFamily, "build_model", spy)
    preprocess(make_config(assets, tmp_path), workers=1, progress=False)
    assert sorted(built) == ["text_encoder", "vae"]


def test_the_report_says_the_stage_one_memory(assets, tmp_path, monkeypatch):
    """Each worker reports (MiB) its resident memory before the models were built, the stage-1
    models' own size (their tensors' bytes) and its peak; the run reports the largest worker."""
    built = []
    real = DemoFamily.build_model

    def spy(self, name, device, **kw):
        model = real(self, name, device, **kw)
        if not kw.get("meta"):  # the job's checks build every model on meta (no weights)
            built.append(model)
        return model

    monkeypatch.setattr(DemoFamily, "build_model", spy)
    config = make_config(assets, tmp_path)
    report = preprocess(config, workers=1, progress=False)
    tensors = {id(t): t for m in built for t in [*m.parameters(), *m.buffers()]}
    own = sum(t.numel() * t.element_size() for t in tensors.values()) / 2**20
    memory = report.memory
    assert memory["models_mb"] == pytest.approx(own) and own > 0
    assert 0 < memory["before_models_mb"] < memory["peak_rss_mb"]
    again = preprocess(config, workers=1, progress=False)  # all cached: no model, no figure
    assert again.memory == {}


def test_killed_worker_then_rerun_completes_without_recomputing_commits(assets, tmp_path):
    config = make_config(assets, tmp_path)
    config_path = tmp_path / "job.json"
    config_path.write_text(config.model_dump_json())
    script = (
        "import sys; from splitstage.config.job import SplitstageConfig; "
        "from splitstage.tasks.stage1.preprocess import preprocess; "
        "preprocess(SplitstageConfig.model_validate_json(open(sys.argv[1]).read()), "
        "workers=1, progress=False)"
    )
    env = {**os.environ, "SPLITSTAGE_FAULT_KILL_AFTER_SHARDS": "1", "PYTHONPATH": str(ROOT)}
    killed = subprocess.run([sys.executable, "-c", script, str(config_path)], env=env)
    assert killed.returncode == -9
    store = open_cache(make_plan(config))
    committed = store.committed_keys()
    assert len(committed) == 8  # one shard committed before the kill
    shard_files = {p: os.stat(p).st_mtime_ns for p in Path(store.root).glob("shards/*")}
    report = preprocess(config, workers=1, progress=False)
    assert (report.computed, report.reused) == (16, 8)
    for path, mtime in shard_files.items():
        assert os.stat(path).st_mtime_ns == mtime  # committed shards were not rewritten
    store.refresh()
    stats = store.stats()
    assert stats.samples == 24 and stats.duplicates == 0
    assert store.read_manifest()["report"]["computed"] == 16


def test_renamed_files_reuse_the_cache_and_an_edited_image_is_recomputed(assets, tmp_path):
    config = make_config(assets, tmp_path)
    preprocess(config, workers=1, progress=False)
    data = Path(config.data.base_path)
    lines = (data / "metadata.csv").read_text().splitlines()
    header, rows = lines[0], lines[1:]
    renamed = []
    for row in reversed(rows):  # reorder and rename every file
        image, prompt = row.split(",", 1)
        new = image.replace(".png", "-renamed.png")
        (data / image).rename(data / new)
        renamed.append(f"{new},{prompt}")
    (data / "metadata.csv").write_text("\n".join([header, *renamed]) + "\n")
    assert preprocess(config, workers=1, progress=False).computed == 0
    first_image = data / renamed[0].split(",", 1)[0]
    Image.new("RGB", (64, 64), (255, 0, 0)).save(first_image)
    assert preprocess(config, workers=1, progress=False).computed == 1


def test_cache_key_follows_v2_and_stage1_models_only(assets, tmp_path):
    base = make_config(assets, tmp_path)
    key = make_plan(base).cache_key
    assert make_plan(make_config(assets, tmp_path, preprocess={"workers": 4})).cache_key == key
    assert make_plan(make_config(assets, tmp_path, train={"batch_size": 2})).cache_key == key
    text = make_config(assets, tmp_path, trainable={"full": ["text_encoder"]})
    assert make_plan(text).cache_key != key  # PromptEmbedder moved to V1
    size = make_config(assets, tmp_path, pipeline={"max_prompt_length": 8})
    assert make_plan(size).cache_key != key
    other_vae = tmp_path / "vae2.safetensors"
    build_demo_weights(tmp_path / "w2", seed=5)
    shutil.copy(tmp_path / "w2/vae.safetensors", other_vae)
    changed = make_config(assets, tmp_path, models={"vae": {"weights": str(other_vae)}})
    assert make_plan(changed).cache_key != key


def test_missing_image_names_the_row_or_is_skipped_and_counted(assets, tmp_path):
    config = make_config(assets, tmp_path)
    data = Path(config.data.base_path)
    victim = (data / "metadata.csv").read_text().splitlines()[3].split(",", 1)[0]
    (data / victim).unlink()
    with pytest.raises(DataError, match=r"metadata.csv row 4: image file .*00002.png not found"):
        index_data_set(config)
    skipping = make_config(assets, tmp_path, data={"skip_bad_rows": True})
    report = preprocess(skipping, workers=1, progress=False)
    assert (report.samples, report.skipped, report.computed) == (23, 1, 23)


def test_cache_on_s3(assets, tmp_path, s3_bucket, monkeypatch):
    url, options = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    endpoint = options["client_kwargs"]["endpoint_url"]
    config = make_config(
        assets, tmp_path, cache={"url": url, "storage_options": {"endpoint_url": endpoint}}
    )
    assert preprocess(config, workers=2, progress=False).computed == 24
    assert_index_from_snapshot(config, monkeypatch)  # stamps from S3 listings (ETags)
    reads: list[str] = []
    real = CacheStore._scan
    with monkeypatch.context() as m:  # the rerun's cache check: from the snapshot too
        m.setattr(CacheStore, "_scan", lambda self, paths: reads.extend(paths) or real(self, paths))
        assert preprocess(config, workers=1, progress=False).computed == 0
    assert reads == []
    assert len(cached(config)) == 24


def test_cli_preprocess_json_and_bad_config_exit_code(assets, tmp_path):
    config = make_config(assets, tmp_path)
    toml = tmp_path / "job.toml"
    toml.write_text(
        f"""[models.vae]\nweights = "{config.models["vae"].weights}"\n"""
        f"""[models.dit]\nweights = "{config.models["dit"].weights}"\n"""
        """[models.text_encoder]\nbuilder = "tiny"\n[trainable]\nlora_base_model = "dit"\n"""
        f"""[data]\nbase_path = "{config.data.base_path}"\n"""
        f"""[cache]\nurl = "{config.cache.url}"\n"""
    )
    cli = [sys.executable, "-m", "splitstage.cli"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [*cli, "preprocess", str(toml), "--json"], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["computed"] == 24
    line = subprocess.run(
        [*cli, "preprocess", str(toml), "--shard", "1/2"], capture_output=True, text=True, env=env
    )
    assert line.returncode == 0 and "0 computed" in line.stdout
    toml.write_text(toml.read_text() + "[preprocess]\nworkerz = 2\n")
    bad = subprocess.run([*cli, "preprocess", str(toml)], capture_output=True, text=True, env=env)
    assert bad.returncode == 2
    assert "preprocess.workerz: unknown field" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_cache_stats_and_verify_name_a_damaged_shard(assets, tmp_path, capsys):
    from splitstage.cli import main

    config = make_config(assets, tmp_path)
    preprocess(config, workers=1, progress=False)
    toml = tmp_path / "job.toml"
    toml.write_text(
        f"""[models.vae]\nweights = "{config.models["vae"].weights}"\n"""
        f"""[models.dit]\nweights = "{config.models["dit"].weights}"\n"""
        """[models.text_encoder]\nbuilder = "tiny"\n[trainable]\nlora_base_model = "dit"\n"""
        f"""[data]\nbase_path = "{config.data.base_path}"\n"""
        f"""[cache]\nurl = "{config.cache.url}"\nshard_samples = 8\n"""
    )
    assert main(["cache", "stats", str(toml)]) == 0
    assert json.loads(capsys.readouterr().out)["samples"] == 24
    assert main(["cache", "verify", str(toml)]) == 0
    assert "OK" in capsys.readouterr().out
    store = open_cache(make_plan(config))
    shard = sorted(Path(store.root).glob("shards/*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert main(["cache", "verify", str(toml)]) == 1
    assert shard.name in capsys.readouterr().out
