"""A damaged or partial cache is repaired by the documented commands, through the real CLI.

Each case damages a real cache of the demo pipeline (12 digits, the tiny text encoder, shards of 4
samples) on disk or on S3: a shard deleted, truncated or with a byte flipped, an index entry
garbled or deleted, a sample in two shards of which one is damaged, an entry with other params,
bit rot that keeps the file's time, an index entry whose shapes lie, a garbage manifest. Then it
runs the fix the README gives and checks that exactly the damaged shard's samples were computed
again, that the damage was reported, and that `splitstage cache verify` says OK.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from splitstage.cli import main
from splitstage.config.job import load_config
from splitstage.data.digits import write_digits_dataset
from splitstage.data.hash_memo import FOLDER
from splitstage.pipelines.demo.weight_files import build_demo_weights
from splitstage.tasks.job_plan import make_plan, open_cache

pytestmark = pytest.mark.slow


def config_text(root: Path, url: str, extra: str = "") -> str:
    """The tiny job as TOML: its data and weights under `root`, its cache at `url`."""
    return (
        f'[models.vae]\nweights = "{root}/weights/vae.safetensors"\n'
        f'[models.dit]\nweights = "{root}/weights/dit.safetensors"\n'
        '[models.text_encoder]\nbuilder = "tiny"\n'
        '[trainable]\nlora_base_model = "dit"\n'
        f'[data]\nbase_path = "{root}/data"\n'
        '[preprocess]\nbatch_size = 4\ndevice = "cpu"\n'
        f'[cache]\nurl = "{url}"\nshard_samples = 4\n{extra}'
    )


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """Data, weights and one complete cache (3 shards of 4 samples), written once."""
    root = tmp_path_factory.mktemp("repair")
    write_digits_dataset(root / "data", limit=12)
    build_demo_weights(root / "weights")
    (root / "job.toml").write_text(config_text(root, f"{root}/cache"))
    assert main(["preprocess", str(root / "job.toml"), "--json"]) == 0
    return root


@pytest.fixture
def job(golden, tmp_path, capsys) -> tuple[Path, Path]:
    """A job whose cache is a copy of the golden one (file times kept): (config, cache folder)."""
    capsys.readouterr()
    shutil.copytree(golden / "cache", tmp_path / "cache")
    toml = tmp_path / "job.toml"
    toml.write_text(config_text(golden, f"{tmp_path}/cache"))
    found = (tmp_path / "cache").iterdir()  # the cache key's folder, not the data memo's
    return toml, next(p for p in found if p.name != FOLDER)


def preprocess(toml: Path, capsys) -> dict:
    """`splitstage preprocess CONFIG --json`: its report."""
    assert main(["preprocess", str(toml), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def verify(toml: Path, capsys) -> tuple[int, str]:
    """`splitstage cache verify CONFIG`: exit code and output."""
    code = main(["cache", "verify", str(toml)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def keys_of(index: Path) -> set[str]:
    """The sample keys an index entry lists."""
    return set(json.loads(index.read_text())["samples"])


def written_since(cache: Path, since: float) -> set[str]:
    """Sample keys of the index entries written after `since` (what a rerun computed)."""
    fresh = [p for p in cache.glob("index/*.json") if p.stat().st_mtime > since]
    return set().union(*(keys_of(p) for p in fresh))


def flip(path: Path) -> None:
    """Flip one byte in the tensor data, in place (same size)."""
    data = bytearray(path.read_bytes())
    data[len(data) - 9] ^= 0x40
    path.write_bytes(bytes(data))


DAMAGE = {  # name -> (damage(shard, index), damaged entries moved to quarantine/)
    "shard deleted": (lambda shard, index: shard.unlink(), 1),
    "shard truncated": (lambda shard, index: shard.write_bytes(shard.read_bytes()[:999]), 1),
    "byte flipped": (lambda shard, index: flip(shard), 1),
    "index entry garbled": (lambda shard, index: index.write_bytes(b'{"format": 1, "sh'), 1),
    "index entry not an entry": (lambda shard, index: index.write_text("[]"), 1),
    "index entry deleted": (lambda shard, index: index.unlink(), 0),  # an orphan: recomputed
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_rerun_recomputes_exactly_the_damaged_shard(damage, job, capsys):
    toml, cache = job
    shard = sorted(cache.glob("shards/*.safetensors"))[1]
    index = cache / "index" / f"{shard.stem}.json"
    lost = keys_of(index)
    time.sleep(0.05)  # a damage comes after the commit
    start = time.time()
    hurt, damaged = DAMAGE[damage]
    hurt(shard, index)
    report = preprocess(toml, capsys)
    assert (report["computed"], report["reused"], report["samples"]) == (4, 8, 12), report
    assert (report["damaged"], report["repaired"]) == (damaged, 4), report
    assert written_since(cache, start) == lost  # exactly the lost samples, nothing else
    if damaged:
        assert report["quarantined"] == [f"{cache}/index/{shard.stem}.json"]
        assert (cache / "quarantine" / f"{shard.stem}.problem.txt").exists()
    code, out = verify(toml, capsys)
    assert code == 0 and ": OK" in out, out
    assert preprocess(toml, capsys)["computed"] == 0


def test_two_workers_move_each_damaged_entry_aside_once(job, capsys):
    toml, cache = job
    shards = sorted(cache.glob("shards/*.safetensors"))
    shards[0].unlink()
    (cache / "index" / f"{shards[2].stem}.json").write_text("{")
    assert main(["preprocess", str(toml), "--json", "--workers", "2"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["computed"], report["damaged"], report["repaired"]) == (8, 2, 8), report
    assert len(report["quarantined"]) == 2 and report["workers"] == 2
    assert verify(toml, capsys)[0] == 0


def test_deleted_index_entry_is_named_by_verify_against_the_manifest(job, capsys):
    toml, cache = job
    index = sorted(cache.glob("index/*.json"))[0]
    index.unlink()
    code, out = verify(toml, capsys)
    assert code == 1 and "INCOMPLETE" in out and "missing 4 of the 12 samples" in out, out
    assert f"orphan {cache}/shards/{index.stem}.safetensors" in out
    assert f"run `splitstage preprocess {toml}`" in out
    assert preprocess(toml, capsys)["computed"] == 4
    assert verify(toml, capsys)[0] == 0


def test_a_good_copy_in_another_shard_keeps_the_sample(job, capsys):
    toml, cache = job
    store = open_cache(make_plan(load_config(str(toml))))
    shard = sorted(cache.glob("shards/*.safetensors"))[0]
    key = sorted(keys_of(cache / "index" / f"{shard.stem}.json"))[0]
    store.write_shard({key: store.read_samples([key])[key]})  # the sample in a second shard
    time.sleep(0.05)
    shard.write_bytes(shard.read_bytes()[:999])
    report = preprocess(toml, capsys)
    assert (report["computed"], report["repaired"], report["damaged"]) == (3, 3, 1), report
    assert verify(toml, capsys)[0] == 0


def test_an_entry_with_other_params_is_moved_aside(job, capsys):
    toml, cache = job
    config = load_config(str(toml))
    store = open_cache(make_plan(config))
    key = sorted(store.committed_keys())[0]
    odd = store.write_shard({key: {"input_latents": torch.zeros(4, 8, 8)}})  # params of old code
    code, out = verify(toml, capsys)
    assert code == 1 and "with params ['input_latents']" in out, out
    assert not (cache / "index" / f"{odd.shard_id}.json").exists()  # verify moved it aside
    assert (cache / "quarantine" / f"{odd.shard_id}.json").exists()
    assert verify(toml, capsys)[0] == 0
    store.write_shard({key: {"input_latents": torch.zeros(4, 8, 8)}})
    report = preprocess(toml, capsys)  # the rerun finds it from the index alone
    assert (report["damaged"], report["computed"]) == (1, 0), report
    assert verify(toml, capsys)[0] == 0


@pytest.mark.parametrize("damage", ["bit rot keeping the file time", "index entry shapes lie"])
def test_damage_a_listing_cannot_see_is_repaired_by_verify_then_preprocess(damage, job, capsys):
    toml, cache = job
    shard = sorted(cache.glob("shards/*.safetensors"))[2]
    index = cache / "index" / f"{shard.stem}.json"
    if damage.startswith("bit rot"):
        stat = shard.stat()
        flip(shard)
        os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        says = "fails its checksum"
    else:
        entry = json.loads(index.read_text())
        spec = entry["specs"][next(iter(entry["samples"].values()))]["input_latents"]
        spec["shape"] = spec["shape"][::-1] + [1]
        index.write_text(json.dumps(entry))
        says = "disagrees with its index entry"
    assert preprocess(toml, capsys)["computed"] == 0  # only a full read can tell
    code, out = verify(toml, capsys)
    assert code == 1 and says in out and "DAMAGED" in out, out
    assert f"moved 1 damaged index entries (and their shards) to {cache}/quarantine/" in out
    assert f"run `splitstage preprocess {toml}` to recompute their 4 samples" in out
    assert preprocess(toml, capsys)["computed"] == 4
    code, out = verify(toml, capsys)
    assert code == 0 and ": OK" in out, out


def test_a_garbage_manifest_is_named_and_rewritten(job, capsys):
    toml, cache = job
    (cache / "manifest.json").write_text('{"samples": 12}')
    code, out = verify(toml, capsys)
    assert code == 1 and "manifest.json is not a splitstage manifest" in out, out
    assert preprocess(toml, capsys)["computed"] == 0
    assert verify(toml, capsys)[0] == 0


def test_a_cache_never_written_is_no_sample_and_no_traceback(golden, tmp_path, capsys):
    toml = tmp_path / "job.toml"
    cases = {  # cache.url -> what the error says
        f"{tmp_path}/no/such/folder": "the folder cache.url",
        f"{tmp_path}": "nothing was written under this cache key",
    }
    for url, says in cases.items():
        toml.write_text(config_text(golden, url))
        for action in ("stats", "verify"):
            assert main(["cache", action, str(toml)]) == 2
            err = capsys.readouterr().err
            assert err.startswith("splitstage: error: cache ") and err.count("\n") == 1, err
            assert "holds no samples" in err and says in err and "Traceback" not in err
            assert f"run `splitstage preprocess {toml}`" in err


def test_an_index_folder_deleted_is_no_sample_then_recomputed(job, capsys):
    toml, cache = job
    shutil.rmtree(cache / "index")
    assert main(["cache", "verify", str(toml)]) == 2
    err = capsys.readouterr().err
    assert "holds no samples (no index entries; the manifest lists 12; 3 shard files" in err
    assert preprocess(toml, capsys)["computed"] == 12
    assert verify(toml, capsys)[0] == 0


def test_a_deleted_shard_on_s3_is_recomputed(golden, tmp_path, s3_bucket, monkeypatch, capsys):
    url, options = s3_bucket
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", options["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", options["secret"])
    endpoint = options["client_kwargs"]["endpoint_url"]
    extra = f'storage_options = {{endpoint_url = "{endpoint}"}}\n'
    toml = tmp_path / "job.toml"
    toml.write_text(config_text(golden, url, extra))
    assert main(["cache", "verify", str(toml)]) == 2
    assert "holds no samples" in capsys.readouterr().err
    assert preprocess(toml, capsys)["computed"] == 12
    config = load_config(str(toml))
    store = open_cache(make_plan(config))
    victim = sorted(store.fs.ls(f"{store.root}/shards"))[0]
    store.fs.rm_file(victim)
    assert main(["preprocess", str(toml)]) == 0
    line = capsys.readouterr().out
    assert "12 samples, 4 computed, 8 reused" in line, line
    moved = f"1 damaged shard(s) moved to {store.url}/quarantine/"
    assert f"repaired the cache: 4 lost samples computed again, {moved}" in line, line
    code, out = verify(toml, capsys)
    assert code == 0 and ": OK" in out, out
    toml.write_text(config_text(golden, "s3://no-such-bucket/cache", extra))
    assert main(["cache", "stats", str(toml)]) == 2
    err = capsys.readouterr().err
    assert "bucket 'no-such-bucket' does not exist" in err and err.count("\n") == 1, err
