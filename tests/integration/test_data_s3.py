"""Data sets in a bucket (real S3 endpoint: moto server on loopback): two preprocessing workers
that share no disk, a rerun after objects were added, edited and deleted, and credentials from a
saved Prefect block (prefect-aws) instead of the environment."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from splitstage.config.job import config_from_dict
from splitstage.data.dataset import sample_key
from splitstage.data.hash_memo import FOLDER
from splitstage.data.index import index_data_set
from tests.helpers.data_s3_job import data_s3_config

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]


def _png(seed: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (seed * 7 % 256, seed * 13 % 256, 40)).save(out, "PNG")
    return out.getvalue()


def upload(fs, root: str, images: dict[str, bytes], prompts: dict[str, str]) -> None:
    """Images and their metadata.csv under `root`, in one batched put."""
    lines = ["image,prompt", *(f"{name},{prompts[name]}" for name in sorted(prompts))]
    files = {f"{root}/{name}": data for name, data in images.items()}
    files[f"{root}/metadata.csv"] = ("\n".join(lines) + "\n").encode()
    fs.pipe(files)


def _toml(config: dict) -> str:
    lines = []
    for group, values in config.items():
        if group == "models":
            for name, model in values.items():
                lines.append(f"[models.{name}]")
                lines += [f"{k} = {json.dumps(v)}" for k, v in model.items()]
            continue
        lines.append(f"[{group}]")
        for key, value in values.items():
            if isinstance(value, dict):
                inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in value.items())
                lines.append(f"{key} = {{{inner}}}")
            else:
                lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines) + "\n"


def _run_shards(config_file: Path, tmp_path: Path, num: int) -> list[dict]:
    """`splitstage preprocess --shard i/num --json` in separate processes and folders, at once."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "SPLITSTAGE_PREPROCESS_THREADS": "1"}
    env["PYTHONPATH"] = str(ROOT)
    procs = []
    for i in range(num):
        cwd = tmp_path / f"worker{i}"  # each worker's own disk: nothing of the data set on it
        cwd.mkdir(exist_ok=True)
        command = [sys.executable, "-m", "splitstage.cli", "preprocess", str(config_file)]
        procs.append(
            subprocess.Popen(
                [*command, "--shard", f"{i}/{num}", "--json"],
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    reports = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        reports.append(json.loads(out))
    for i in range(num):
        assert not any(p.is_file() for p in (tmp_path / f"worker{i}").rglob("*"))
    return reports


def test_two_workers_without_shared_disk_and_a_rerun_after_changes(
    s3_bucket, s3_endpoint, demo_weights, tmp_path, monkeypatch
):
    import s3fs

    from splitstage.tasks.stage1.preprocess import preprocess

    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    images = {f"img/{i:02d}.png": _png(i) for i in range(10)}
    prompts = {name: f"digit {i}" for i, name in enumerate(sorted(images))}
    upload(fs, "bucket/prefix/data", images, prompts)
    config = data_s3_config(tmp_path, demo_weights, url, s3_endpoint)
    config_file = tmp_path / "job.toml"
    config_file.write_text(_toml(config))
    parsed = config_from_dict(config)
    keys = {sample_key(images[n], prompts[n], {}) for n in images}

    first = _run_shards(config_file, tmp_path, 2)
    assert sum(r["computed"] for r in first) == 10 and sum(r["reused"] for r in first) == 0
    index = index_data_set(parsed)  # the workers left the memos in the bucket: nothing is read
    assert (index.hashed, index.memo_hits, set(index.keys)) == (0, 10, keys)
    assert index.from_memo  # nor parsed: rows and keys from the index memo (ETags: no tick)
    assert fs.ls(f"bucket/prefix/cache/{FOLDER}")

    # add two, edit one image and one caption, delete one
    fs.rm("bucket/prefix/data/img/09.png")
    del images["img/09.png"], prompts["img/09.png"]
    images["img/00.png"] = _png(100)
    prompts["img/01.png"] = "digit one edited"
    images.update({"img/10.png": _png(10), "img/11.png": _png(11)})
    prompts.update({"img/10.png": "digit 10", "img/11.png": "digit 11"})
    upload(
        fs,
        "bucket/prefix/data",
        {k: images[k] for k in ("img/00.png", "img/10.png", "img/11.png")},
        prompts,
    )
    new_keys = {sample_key(images[n], prompts[n], {}) for n in images}
    index = index_data_set(parsed)
    assert (index.hashed, index.memo_hits) == (3, 8)  # the new and edited images only
    assert not index.from_memo
    assert set(index.keys) == new_keys

    second = _run_shards(config_file, tmp_path, 2)
    changed = len(new_keys - keys)  # 2 added, 1 image edited, 1 caption edited
    assert changed == 4
    assert sum(r["computed"] for r in second) == changed
    assert sum(r["reused"] for r in second) == len(new_keys) - changed
    monkeypatch.chdir(tmp_path)
    final = preprocess(parsed, progress=False)  # the coordinator: all cached, writes the manifest
    assert (final.computed, final.reused) == (0, len(new_keys))
    from splitstage.tasks.job_plan import make_plan, open_cache

    manifest = open_cache(make_plan(parsed)).read_manifest()
    assert set(manifest["samples"]) == new_keys  # stage 2's sample set: the deleted one is gone

    # a night's new rows appended to the metadata: only they are parsed, read and keyed
    assert index_data_set(parsed).from_memo
    meta = "bucket/prefix/data/metadata.csv"
    fs.pipe({"bucket/prefix/data/img/12.png": _png(12), meta: fs.cat(meta) + b"img/12.png,d12\n"})
    grown = index_data_set(parsed)
    assert (grown.grown, grown.hashed) == (1, 1) and not grown.from_memo
    assert set(grown.keys) == new_keys | {sample_key(_png(12), "d12", {})}
    assert grown.keys == index_data_set(parsed, use_memo=False).keys


@pytest.mark.usefixtures("prefect_harness")
def test_credentials_from_a_prefect_block_read_data_and_write_cache(
    s3_auth, s3_endpoint, demo_weights, tmp_path, monkeypatch, caplog
):
    import s3fs
    from prefect_aws import AwsCredentials
    from prefect_aws.client_parameters import AwsClientParameters

    from splitstage.storage.credentials import forget_blocks
    from splitstage.tasks.stage1.preprocess import preprocess

    url, opts = s3_auth
    writer = opts("writer")
    fs = s3fs.S3FileSystem(**writer)
    images = {f"img/{i}.png": _png(i) for i in range(4)}
    upload(fs, "bucket/prefix/data", images, {n: f"p {n}" for n in images})
    AwsCredentials(
        aws_access_key_id=writer["key"],
        aws_secret_access_key=writer["secret"],
        aws_client_parameters=AwsClientParameters(endpoint_url=s3_endpoint),
    ).save("splitstage-test", overwrite=True)
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)  # only the block may supply credentials now
    forget_blocks()
    s3fs.S3FileSystem.clear_instance_cache()
    block = "aws-credentials/splitstage-test"
    config = data_s3_config(tmp_path, demo_weights, url, None, credentials_block=block)
    config["cache"]["credentials_block"] = block
    parsed = config_from_dict(config)
    monkeypatch.chdir(tmp_path)
    caplog.set_level("DEBUG")
    report = preprocess(parsed, progress=False)
    assert (report.samples, report.computed) == (4, 4)
    assert fs.ls(f"bucket/prefix/cache/{report.cache_key}/index")
    index = index_data_set(parsed)
    assert (index.hashed, index.memo_hits) == (0, 4)
    shown = [repr(parsed), parsed.model_dump_json(), repr(index.source), caplog.text]
    assert not [s for s in shown if writer["secret"] in s]


def test_folders_listed_one_by_one_see_every_row_and_a_missing_file_appearing(
    s3_bucket, s3_endpoint, demo_weights, tmp_path
):
    """Object stores list the folders rows name, concurrently: rows in several folders are all
    found, and a row skipped as missing (in a folder of its own) is noticed when its file
    appears, by the index memo's check as by the full build."""
    import s3fs

    url, options = s3_bucket
    fs = s3fs.S3FileSystem(**options)
    images = {f"f{i % 3}/{i}.png": _png(i) for i in range(60)}  # 3 folders x 20 files
    prompts = {name: f"digit {i}" for i, name in enumerate(sorted(images))}
    prompts["late/x.png"] = "not there yet"
    upload(fs, "bucket/prefix/data", images, prompts)
    parsed = config_from_dict(
        data_s3_config(tmp_path, demo_weights, url, s3_endpoint, skip_bad_rows=True)
    )
    first = index_data_set(parsed)
    assert len(first.keys) == 60 and len(first.skipped) == 1
    assert index_data_set(parsed).from_memo
    fs.pipe({"bucket/prefix/data/late/x.png": _png(99)})
    got = index_data_set(parsed)
    assert not got.from_memo and len(got.keys) == 61 and not got.skipped
    assert got.keys == index_data_set(parsed, use_memo=False).keys


def test_which_folders_are_listed_one_by_one():
    from splitstage.data.source import _folders_to_list

    many = [f"a/{i}.png" for i in range(40)] + [f"a/b/{i}.png" for i in range(40)]
    assert _folders_to_list(many) == ["a"]  # a/b is listed with a
    assert _folders_to_list([f"d{i}/x.png" for i in range(10)]) is None  # a folder per file
    assert _folders_to_list(["x.png", *many]) is None  # files at the base: the whole prefix
    assert _folders_to_list(["../up/x.png"] * 40) is None
    assert _folders_to_list(None) is None
    assert _folders_to_list(["only/one.png"]) == ["only"]
